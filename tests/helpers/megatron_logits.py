"""megatron-core's own forward on weights ``ckpt export --names megatron`` wrote (run by the megatron venv).

``python megatron_logits.py WEIGHTS.npz TOKENS.npy OUT.npy HEADS`` (WEIGHTS: the export's tensors as
fp32 arrays; the megatron venv has no safetensors) builds megatron-core's
``GPTModel`` with the local layer spec on one CPU gloo rank, in fp32, exactly as
``fixtures/megatron/make_megatron_fixtures.py`` configures the fixtures (its CPU shims included),
loads the exported weights by module name, and saves the logits of TOKENS (``[b, s]`` int64).
The test compares them with transformers' logits on the ``--names hf`` export of the same checkpoint.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "megatron"


def main(weights: str, tokens_file: str, out_file: str, heads: int) -> None:
    sys.path.insert(0, str(FIXTURES))
    import numpy as np
    import torch
    from make_megatron_fixtures import install_cpu_shims

    torch.set_num_threads(1)
    install_cpu_shims()
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    mpu.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    with np.load(weights) as z:
        w = {k: torch.from_numpy(z[k]) for k in z.files}
    layers = 1 + max(int(k.split(".")[2]) for k in w if k.startswith("decoder.layers."))
    vocab, hidden = w["embedding.word_embeddings.weight"].shape
    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, ffn_hidden_size=w["decoder.layers.0.mlp.linear_fc1.weight"].shape[0],
        num_attention_heads=heads, use_cpu_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0,
        attention_dropout=0.0, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                     max_sequence_length=w["embedding.position_embeddings.weight"].shape[0], pre_process=True,
                     post_process=True, share_embeddings_and_output_weights="output_layer.weight" not in w,
                     position_embedding_type="learned_absolute")
    missing, unexpected = model.load_state_dict(w, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    assert not missing and not unexpected, (missing, unexpected)
    model.eval()
    tokens = torch.from_numpy(np.load(tokens_file))
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        logits = model(tokens, positions, None)
    np.save(out_file, logits.float().numpy())
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
