"""Weights-only views of a megatron-core checkpoint whose optimizer state is not ``dp_reshardable``.

A weights export needs the model keys only, and megatron-core stores those at their global shapes
whatever the optimizer sharding (``fully_reshardable``, ``dp_zero_gather_scatter``, no optimizer at
all): DCP assembles any box of a global tensor from its TP/PP chunks. So each module parameter
becomes a :class:`~gtp_format.views.records.ParamView` with one primary holder that spans the whole
tensor (no TP part, no GTP shard, no padding), and the ordinary read path
(:meth:`.source.Source.read_full_box`) serves its boxes. The module order and key names are
megatron-core's GPT (local spec), shared with the ``dp_reshardable`` view (:mod:`gtp_format.megatron.view`).
Optimizer states are not in these views: ``--optimizer`` and ``--to fully_reshardable`` still need
``dp_reshardable`` keys.
"""

from __future__ import annotations

from gtp_format.errors import FormatError
from gtp_format.layout.shard import ShardSpec
from gtp_format.megatron.keys import EXPERT_PREFIX, expert_keys
from gtp_format.megatron.view import check_stored, module_params
from gtp_format.model import Checkpoint
from gtp_format.views.records import Holder, KeyRef, ParamView


def weight_views(ckpt: Checkpoint) -> dict[str, ParamView]:
    """One whole-tensor view per module parameter (refuses, in one line, keys that are not the GPT's).

    MoE: each expert parameter too, read from its stacked (layer, expert) key and named as the
    megatron-core MoE view names it (``decoder.layers.<l>.mlp.experts.<e>.<param>``).
    :func:`module_params` lists the dense GPT's parameters only, and before this the experts were
    left out without a word (found exporting the MoE EP2 fixture ``--to hf --names megatron``: 24
    params written, no expert).
    """
    out: dict[str, ParamView] = {}
    for name, key, layer in module_params(ckpt):
        e = ckpt.entries[key]
        assert e.shape is not None and e.dtype is not None
        full = e.shape[1:] if layer is not None else e.shape
        spec = ShardSpec(full, None, 1, 0, None, 1, 0, 1)
        ref = KeyRef(0, 0, "", 0, None, 0)  # never read: a weight box reads the model key
        holder = Holder(ref, 0, spec, (), True)
        out[name] = ParamView(name, full, full, None, None, False, 0, 0, 0, str(e.dtype), (holder,),
                              weight_key=None if key == name else key, layer=layer)
    for key in expert_keys(ckpt):
        e = ckpt.entries[key]
        if e.shape is None or e.dtype is None or len(e.shape) < 3:
            raise FormatError(f"{ckpt.root}: expert key {key} has shape {e.shape}, not (layers, experts, ...)")
        layers, experts, full = e.shape[0], e.shape[1], tuple(e.shape[2:])
        check_stored(ckpt, layers * experts, f"(layer, expert) pairs of {key}")  # one view each, below
        spec = ShardSpec(full, None, 1, 0, None, 1, 0, 1)
        holder = Holder(KeyRef(0, 0, "", 0, None, 0), 0, spec, (), True)
        param = key[len(EXPERT_PREFIX):]
        for layer in range(layers):
            for ex in range(experts):
                name = f"decoder.layers.{layer}.mlp.experts.{ex}.{param}"
                out[name] = ParamView(name, full, full, None, None, True, 0, 0, 0, str(e.dtype), (holder,),
                                      weight_key=key, layer=layer, expert=ex)
    return out
