"""Weights-only views of a megatron-core checkpoint whose optimizer state is not ``dp_reshardable``.

A weights export needs the model keys only, and megatron-core stores those at their global shapes
whatever the optimizer sharding (``fully_reshardable``, ``dp_zero_gather_scatter``, no optimizer at
all): DCP assembles any box of a global tensor from its TP/PP chunks. So each module parameter
becomes a :class:`~gtp_format.views.records.ParamView` with one primary holder that spans the whole
tensor (no TP part, no GTP shard, no padding), and the ordinary read path
(:meth:`.source.Source.read_full_box`) serves its boxes. The module order and key names are
megatron-core's GPT (local spec), shared with the ``dp_reshardable`` view (:mod:`gtp_format.megatron.view`).

A ``fully_reshardable`` save stores the optimizer state the same way: one key per parameter and state,
``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>``, at the model key's global shape (the stacked
layer and expert axes included) in fp32, assembled by DCP from every rank's chunks whatever the topology
(checked on every ``fixtures/megatron/*_fully_reshardable``). So the same views serve ``export --to hf
--optimizer`` of such a save (:func:`full_state_views`): a state's box is the weight's box in the state's key
(:attr:`.source.Source.full_states`), and the fp32 values are the ones the ``dp_reshardable`` save of the same
state holds in its buckets. ``--to fully_reshardable`` and ``reshard`` still need ``dp_reshardable`` keys.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ckpt_tool.copying import WEIGHT_STATE
from gtp_format.errors import FormatError
from gtp_format.layout.shard import ShardSpec
from gtp_format.megatron.keys import EXPERT, EXPERT_PREFIX, HEAD, expert_keys
from gtp_format.megatron.view import check_stored, module_params
from gtp_format.model import TENSOR, Checkpoint
from gtp_format.names import STATES
from gtp_format.views.records import Holder, KeyRef, ParamView

_EXPERT_ORDER = {s: i for i, s in enumerate(EXPERT)}


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
    # layer by layer, expert by expert, each expert's parameters in module order: the order of the dp_reshardable
    # view (gtp_format.megatron.moe), so that both saves of one state export the same files
    keys = sorted(expert_keys(ckpt), key=lambda k: (_EXPERT_ORDER.get(k[len(EXPERT_PREFIX):], len(EXPERT)), k))
    made: list[tuple[str, int, int, tuple[int, ...], str]] = []
    for key in keys:
        e = ckpt.entries[key]
        if e.shape is None or e.dtype is None or len(e.shape) < 3:
            raise FormatError(f"{ckpt.root}: expert key {key} has shape {e.shape}, not (layers, experts, ...)")
        check_stored(ckpt, e.shape[0] * e.shape[1], f"(layer, expert) pairs of {key}")  # one view each, below
        made.append((key, e.shape[0], e.shape[1], tuple(e.shape[2:]), str(e.dtype)))
    pairs = sorted({(layer, ex) for _, layers, experts, _, _ in made for layer in range(layers)
                    for ex in range(experts)})
    for layer, ex in pairs:
        for key, layers, experts, full, dtype in made:
            if layer >= layers or ex >= experts:
                continue
            spec = ShardSpec(full, None, 1, 0, None, 1, 0, 1)
            holder = Holder(KeyRef(0, 0, "", 0, None, 0), 0, spec, (), True)
            name = f"decoder.layers.{layer}.mlp.experts.{ex}.{key[len(EXPERT_PREFIX):]}"
            out[name] = ParamView(name, full, full, None, None, True, 0, 0, 0, dtype, (holder,),
                                  weight_key=key, layer=layer, expert=ex)
    return out


FULL_STATE = "optimizer.state."  # fully_reshardable's per-parameter optimizer keys


def full_state_key(state: str, key: str) -> str:
    """megatron-core's ``fully_reshardable`` key of one state of the parameter stored under model key ``key``."""
    return f"{FULL_STATE}{state}.{key}"


def full_state_views(ckpt: Checkpoint) -> dict[str, ParamView]:
    """:func:`weight_views` of a ``fully_reshardable`` save, each parameter's optimizer states checked first: every
    state key present, a tensor, fp32 and at its model key's shape, else refused in one line naming the key
    (a state read at the weight's box of a key of another shape would be other elements, or out of bounds)."""
    views = weight_views(ckpt)
    for key in dict.fromkeys(v.model_key for v in views.values()):
        model = ckpt.entries[key]
        for state in STATES:
            k = full_state_key(state, key)
            e = ckpt.entries.get(k)
            got = "missing" if e is None else "not a tensor" if e.kind != TENSOR else \
                f"{list(e.shape or ())} {e.dtype.name if e.dtype else '?'}"
            if e is None or e.kind != TENSOR or e.shape != model.shape or e.dtype is None or e.dtype.name != "float32":
                raise FormatError(f"{ckpt.root}: fully_reshardable optimizer key {k!r} is {got}, but its parameter "
                                  f"{key} implies {list(model.shape or ())} float32; export without --optimizer")
    return views


def _rounded_bits(master: np.ndarray, dtype: str) -> np.ndarray:
    """The stored bits of fp32 ``master`` rounded to the weight's dtype (round to nearest even, as torch's copy
    of a master into a bf16 / fp16 weight rounds)."""
    if dtype.endswith("bfloat16"):
        u = master.astype("<f4").view(np.uint32).astype(np.uint64)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    if dtype.endswith("float16"):
        return master.astype(np.float16).view(np.uint16)
    return master.astype("<f4").view(np.uint32)


def check_tied_masters(source: Any) -> None:
    """Refuse a ``fully_reshardable`` save whose tied word embeddings' fp32 master does not round to the model
    weight (its first and last rows are read: two rows, whatever the vocabulary).

    Why: megatron-core 0.19.2's ``fully_reshardable`` save of tied embeddings at PP > 1 (the last stage holds the
    output layer as a replica) writes their ``optimizer.state.*`` values one alignment (64 elements) late, ending
    in zeros (``fixtures/megatron/pair_pp2_dp2_dp_reshardable_fully_reshardable``, ``pair_pp4``,
    ``pair_uneven_pp2``; the ``dp_reshardable`` save of the same state is right). Exported as stored, a resumed
    run would copy that master over its embeddings at its first step."""
    view = source.views.get(HEAD[0])
    if view is None or "output_layer.weight" in source.ckpt.entries or not view.full_shape:
        return
    rows, rest = view.full_shape[0], tuple(view.full_shape[1:])
    for r in dict.fromkeys((0, rows - 1)):
        box = ((r, *(0,) * len(rest)), (1, *rest))
        master = source.read_full_box(view, "param", *box).view("<f4")
        weight = source.read_full_box(view, WEIGHT_STATE, *box)
        want = _rounded_bits(master, view.param_dtype).reshape(-1)
        real = ~np.isnan(master.reshape(-1))  # a NaN's payload may round otherwise: not compared
        if not np.array_equal(want[real], weight.reshape(-1).view(want.dtype)[real]):
            raise FormatError(f"{source.root}: fully_reshardable optimizer key "
                              f"{full_state_key('param', HEAD[0])!r} does not round to the model weight {HEAD[0]} "
                              f"(row {r}): megatron-core 0.19.2 writes tied embeddings' state 64 elements late in "
                              "fully_reshardable saves at PP > 1; export the dp_reshardable save of the run, or "
                              "without --optimizer")
