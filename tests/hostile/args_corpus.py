"""Crafted megatron-core checkpoints whose ``common_state`` args lie about the model they hold.

Each case is a copy of a committed fixture (written by megatron-core 0.19.2) whose ``args`` get a
few fields set or changed: heads that do not divide, a query-group count that disagrees with
``linear_qkv``, more layers than the stacked keys store, a normalization or position-embedding name
megatron-core does not know, two activations at once. The tensors are left as they are. The
new ``common_state`` is the fixture's own state (decoded as inert records, never unpickled) with
the args edited, pickled as ``torch.save`` pickles a tensor-free object (protocol 2) into a blob of
the fixture's records (:func:`gtp_format.writer.torch_blob.object_blob`); the data file holding it
and ``.metadata`` are rewritten through :func:`gtp_format.writer.dcp_metadata.metadata_bytes`.
"""

from __future__ import annotations

import argparse
import os
import pickle
from pathlib import Path
from typing import Any

from gtp_format.megatron.topology import common_state
from gtp_format.model import TENSOR
from gtp_format.reader.checkpoint import open_checkpoint
from gtp_format.reader.chunks import chunk_bytes
from gtp_format.reader.inert_object import InertObject
from gtp_format.reader.zip_blob import ViewReader, small_record, zip_records
from gtp_format.writer.dcp_metadata import metadata_bytes
from gtp_format.writer.torch_blob import object_blob

MEGATRON = Path(__file__).resolve().parents[2] / "fixtures" / "megatron"
COMMON = "common_state/shard_0_1"

# name -> (fixture, args set on top of the fixture's, words the refusal names); VIEW_ONLY: refused by the
# commands that lay parameters out (inspect --params, reshard), not by the description alone
ARGS_CASES: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    "heads_not_dividing_hidden": ("pair_tp2_dp2_dp_reshardable", {"num_attention_heads": 3},
                                  ("num_attention_heads=3", "linear_qkv")),
    "heads_disagree_with_proj": ("pair_tp2_dp2_dp_reshardable", {"num_attention_heads": 8, "kv_channels": 8},
                                 ("num_attention_heads=8", "linear_proj.weight")),
    "groups_not_dividing_heads": ("pair_tp2_dp2_dp_reshardable",
                                  {"group_query_attention": True, "num_query_groups": 3},
                                  ("num_query_groups=3", "linear_qkv")),
    "groups_disagree_with_qkv": ("pair_tp2_dp2_dp_reshardable",
                                 {"group_query_attention": True, "num_query_groups": 2},
                                 ("num_query_groups=2", "linear_qkv.weight", "stores 96")),
    "layers_beyond_stored": ("pair_pp2_dp2_dp_reshardable", {"num_layers": 2**40},
                             ("num_layers=1099511627776", "stores 2 layers")),
    "first_stage_beyond_stored": ("pair_pp2_dp2_dp_reshardable", {"decoder_first_pipeline_num_layers": 7},
                                  ("decoder_first_pipeline_num_layers=7", "stacked keys")),
    "unknown_normalization": ("pair_tp2_dp2_dp_reshardable", {"normalization": "FooNorm"},
                              ("normalization='FooNorm'",)),
    "unknown_position_embedding": ("pair_tp2_dp2_dp_reshardable", {"position_embedding_type": "spiral"},
                                   ("position_embedding_type='spiral'",)),
    "two_activations": ("pair_tp2_dp2_dp_reshardable", {"swiglu": True, "squared_relu": True},
                        ("swiglu and squared_relu", "linear_fc1")),
    "swiglu_on_a_plain_mlp": ("pair_tp2_dp2_dp_reshardable", {"swiglu": True},
                              ("--swiglu", "linear_fc1.weight", "stores 64")),
    "ffn_disagrees": ("pair_tp2_dp2_dp_reshardable", {"ffn_hidden_size": 48}, ("ffn_hidden_size=48", "linear_fc2")),
    "vocab_disagrees": ("pair_tp2_dp2_dp_reshardable", {"padded_vocab_size": 256},
                        ("padded_vocab_size=256", "word_embeddings")),
    "experts_disagree": ("pair_moe_ep2_dp_reshardable", {"num_experts": 8}, ("num_experts=8", "experts")),
    "rmsnorm_with_layernorm_bias": ("pair_tp2_dp2_dp_reshardable", {"normalization": "RMSNorm"},
                                    ("normalization='RMSNorm'", "final_layernorm.bias")),
    # not caught by the description alone (it needs the ranks that wrote each layer): the view refuses it
    "first_stage_disagrees_with_writers": ("pair_uneven_pp2_dp_reshardable", {"decoder_first_pipeline_num_layers": 2},
                                           ("decoder_first_pipeline_num_layers=2", "[1, 2] layers")),
    # TEGroupedMLP's buffer order: no shape shows it (fc1 and fc2 hold as many elements here), the args do
    "te_grouped_experts": ("pair_moe_ep2_dp_reshardable", {"moe_grouped_gemm": True,
                                                            "transformer_impl": "transformer_engine"},
                           ("TEGroupedMLP", "--moe-grouped-gemm", "--dist-ckpt-optim-fully-reshardable")),
    "heads_a_string": ("pair_tp2_dp2_dp_reshardable", {"num_attention_heads": "four"},
                       ("num_attention_heads='four'",)),
    # --rope-scaling-factor divides the low frequencies: a string, a negative or a zero factor is no model
    "rope_scaling_factor_a_string": ("pair_llama3_rope_tp2_dp_reshardable", {"rope_scaling_factor": "x"},
                                     ("rope_scaling_factor='x'", "not a positive number")),
    "rope_scaling_factor_negative": ("pair_llama3_rope_tp2_dp_reshardable", {"rope_scaling_factor": -1.0},
                                     ("rope_scaling_factor=-1.0", "not a positive number")),
    "rope_scaling_factor_zero": ("pair_llama3_rope_tp2_dp_reshardable", {"rope_scaling_factor": 0.0},
                                 ("rope_scaling_factor=0.0",)),
    "use_rope_scaling_a_string": ("pair_llama3_rope_tp2_dp_reshardable", {"use_rope_scaling": "yes"},
                                  ("use_rope_scaling='yes'", "not a bool")),
}


VIEW_ONLY = {"first_stage_disagrees_with_writers", "te_grouped_experts"}


def _plain(value: Any) -> Any:
    """The inert record as the plain value it stands for (args as an ``argparse.Namespace``)."""
    if isinstance(value, InertObject):
        return argparse.Namespace(**{k: _plain(v) for k, v in value.fields().items()})
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def set_args(it: Path, changes: dict[str, Any]) -> None:
    """Rewrite the ``iter_*`` folder ``it`` so that its ``common_state`` args carry ``changes``."""
    ckpt = open_checkpoint(it)
    state = _plain(common_state(ckpt))
    for name, value in changes.items():
        setattr(state["args"], name, value)
    entry = ckpt.entries[COMMON]
    old = bytes(chunk_bytes(ckpt, entry, entry.chunks[0]))
    reader = ViewReader(memoryview(old))
    records = sorted(zip_records(reader).values(), key=lambda r: r.header_offset)
    named = [(r.name, small_record(reader, r)) for r in records]
    prefix = next(n for n, _ in named if n.endswith("data.pkl"))[: -len("data.pkl")]
    pkl = pickle.dumps([state], protocol=2)
    blob = object_blob(prefix, [(n[len(prefix):], pkl if n.endswith("data.pkl") else d) for n, d in named])
    file = entry.chunks[0].storage.file
    raw = (it / file).read_bytes()
    placed = []
    for f in sorted(ckpt.data_files):
        items = sorted(((c.storage.offset, c.storage.length, e, c) for e in ckpt.entries.values() for c in e.chunks
                        if c.storage is not None and c.storage.file == f), key=lambda x: x[0])
        out = bytearray()
        for off, length, e, c in items:
            if e.key == COMMON:
                continue
            placed.append((f, e.key, c.offsets if e.kind == TENSOR else None, c.sizes if e.kind == TENSOR else None,
                           off if f != file else len(out), length))
            if f == file:
                out += raw[off:off + length]
        if f == file:
            placed.append((f, COMMON, None, None, len(out), len(blob)))
            out += blob
            tmp = it / (f + ".new")
            tmp.write_bytes(out)
            os.replace(tmp, it / f)
    shapes = {k: (e.shape, e.dtype) for k, e in ckpt.entries.items() if e.kind == TENSOR}
    objects = [k for k, e in ckpt.entries.items() if e.kind != TENSOR]
    (it / ".metadata").write_bytes(metadata_bytes(shapes, placed, objects))
