"""megatron-core's gated linear (``--swiglu``, ``--quick-geglu``) as a checkpoint stores it, TP rank by TP rank.

``linear_fc1`` of a gated MLP holds a gate and an up half. megatron-core
(``apply_swiglu_sharded_factory`` in ``megatron/core/transformer/mlp.py``) saves the two halves of
each TP rank's local ``[gate_t; up_t]`` as two chunks of the global tensor, at part ``t`` and part
``axis_frag + t`` of ``2 x axis_frag`` parts along the output axis, ``axis_frag`` being the number of
TP parts the parameter is split in: the TP size for the dense MLP and the shared experts, the expert
TP size for the experts (the same factory runs on each expert's sharded tensor, its offsets those of
the expert's TP group). One function lays out both.
"""

from __future__ import annotations

from gtp_format.layout.shard import ShardSpec
from gtp_format.views.records import Holder, KeyRef


def glu_holders(full: tuple[int, ...], tp: int, t: int, ref: KeyRef, start: int, primary: bool = True
                ) -> list[Holder]:
    """TP rank ``t``'s two holders of a gated ``linear_fc1`` (weight ``[2 x ffn, hidden]`` or bias).

    megatron-core (``apply_swiglu_sharded_factory``) stores the global tensor as ``[gate (all TP
    ranks); up (all TP ranks)]``: rank ``t`` writes its gate rows at ``t x ffn/tp`` and its up rows at
    ``ffn + t x ffn/tp``, while its local parameter and its buffer slice hold ``[gate_t; up_t]``. So the
    rank's slice is the column split of the full tensor into ``2 x tp`` parts taken twice: part ``t``
    at the slice's start, part ``tp + t`` right after it. Checked against the buffers of
    ``pair_swiglu_tp2`` and ``pair_llama_tp2_dp2`` (``expected.json``) and megatron-core's own
    ``fully_reshardable`` save of the same state.
    """
    gate = ShardSpec(full, "column", 2 * tp, t, None, 1, 0, 1)
    up = ShardSpec(full, "column", 2 * tp, tp + t, None, 1, 0, 1)
    half = 1
    for d in gate.local_shape:
        half *= d
    return [Holder(ref, start, gate, (), primary), Holder(ref, start + half, up, (), primary)]
