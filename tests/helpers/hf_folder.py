"""A small Hugging Face Arcee folder, as ``save_pretrained`` writes it, built without transformers:
the names and shapes of transformers' ``ArceeForCausalLM`` (2 layers, hidden 32), random fp32 weights,
and its ``config.json`` (fields overridable, to make hostile ones)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

HF_CONFIG = {"architectures": ["ArceeForCausalLM"], "model_type": "arcee", "hidden_act": "gelu", "hidden_size": 32,
             "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
             "head_dim": 8, "max_position_embeddings": 16, "rms_norm_eps": 1e-05, "vocab_size": 96,
             "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "tie_word_embeddings": False,
             "attention_bias": False, "mlp_bias": False}


def hf_folder(root: Path, **over: object) -> Path:
    """Write the folder at ``root`` (created); ``over``: config.json fields to replace."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    h, f, v = 32, 48, 96
    shapes = {"lm_head.weight": (v, h), "model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f)})
        shapes.update({p + f"self_attn.{n}_proj.weight": (h, h) for n in "qkvo"})
    root.mkdir(parents=True)
    save_file({k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}, root / "model.safetensors",
              metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps({**HF_CONFIG, **over}))
    return root
