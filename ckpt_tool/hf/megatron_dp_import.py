"""``--sharding dp_reshardable``: the imported model laid out in the distributed optimizer's buckets at the target.

The layout is the one ``ckpt reshard`` writes for a megatron-core target
(:func:`ckpt_tool.copying.megatron_plan.plan_megatron`: megatron-core's bucket rules per stage, TP
splits of the GPT local spec, each chunk in the file of the rank that would have written it), run
over a per-parameter view of the HF folder instead of a source checkpoint: one
:class:`~gtp_format.views.records.ParamView` per megatron-core parameter, in megatron-core's module
order (:data:`gtp_format.megatron.keys.LAYER`), whose "full tensor" is read from the HF rows
(:class:`.megatron_model.MegatronParam`).

One difference from a resharded source: a gated ``linear_fc1`` (``--swiglu``) at TP > 1. Each TP rank
holds its gate rows then its up rows (``[gate_t; up_t]``), not a contiguous block of the global
``[gate; up]``. The view's full tensor is therefore ``[gate_0; up_0; gate_1; up_1; ...]``, so the plan's
contiguous TP split gives each rank's optimizer slice its own rows in megatron-core's order, and the
plan's model-weight chunks of such a parameter are cut into their gate and up runs at the global
``[gate; up]`` rows megatron-core's checkpoint stores (in the same rank's file).

MoE at EP 1 with expert TP = TP (:func:`.megatron_fresh.experts_in_dense`): the experts are dense parameters
of the one optimizer, after each layer's router (and before its shared expert), expert by expert, split over
TP as the dense MLP (a gated expert ``linear_fc1`` viewed as ``[gate_t; up_t]`` per rank, like the dense one);
elsewhere they are the chained expert optimizer's (``chained_1.``), laid out by the planner's expert rules.

The byte objects: ``per_bucket_numel[_unpadded]`` per model-parallel rank (the plan's numels,
pickled by :func:`ckpt_tool.copying.megatron_blobs.numel_blob`), the param groups per rank
(:func:`.megatron_fresh.optimizer_object`) and ``common_state`` (:func:`.megatron_fresh.common_state`).
Layout without ``--overlap-grad-reduce`` (one bucket per buffer): a run with it splits large stage-0
buffers into ``--ddp-bucket-size`` buckets and loads ``fully_reshardable`` instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ckpt_tool.copying import WEIGHT_STATE
from ckpt_tool.copying.megatron_blobs import numel_blob
from ckpt_tool.copying.megatron_plan import plan_megatron
from ckpt_tool.copying.plan import OutChunk
from ckpt_tool.hf.megatron_fresh import EXPERT_PREFIX, experts_in_dense, optimizer_object, torch_object
from ckpt_tool.hf.megatron_model import EXPERT_KEY, HFMegatron, MegatronParam
from gtp_format.layout.shard import ShardSpec
from gtp_format.megatron.keys import EXPERT, HEAD, LAYER, TAIL
from gtp_format.names import OPT_PREFIX
from gtp_format.views.records import Holder, KeyRef, ParamView

MODULE_OF = {key: module for module, key in LAYER}  # checkpoint key -> megatron-core module name


@dataclass
class _Entry:
    shape: tuple[int, ...]


@dataclass
class _Ckpt:
    entries: dict[str, _Entry]


@dataclass
class HFSource:
    """What :func:`plan_megatron` reads of a source: its root, per-parameter views and key shapes."""

    root: str
    views: dict[str, ParamView]
    ckpt: _Ckpt
    manifest: None = None  # megatron-core's layout, as a genuine megatron-core source has (no gtp manifest)
    # a gated linear_fc1's view already orders each TP rank's rows as [gate_t; up_t] (module docstring), so
    # the planner splits it in TP parts, not in the 2 x TP gate and up parts of a stored megatron-core key
    glu_rows_by_rank: bool = True


def module_name(p: MegatronParam) -> str:
    """megatron-core's module parameter name (``decoder.layers.0.input_layernorm.weight``), the view's name."""
    if p.layer is None:
        return p.key
    if p.expert is not None:  # the name megatron_moe's views give an expert parameter (global expert index)
        return f"decoder.layers.{p.layer}.mlp.experts.{p.expert}.{p.key[len(EXPERT_KEY):]}"
    key = p.key[len("decoder.layers."):]
    return f"decoder.layers.{p.layer}.{MODULE_OF[key]}"


def gated_rows(p: MegatronParam, tp: int, gated: bool, dense_experts: bool = False) -> int | None:
    """The TP block of a gated ``linear_fc1`` parameter (its rows are permuted per TP rank), else None;
    ``dense_experts``: an expert's too (split over TP as the dense MLP's)."""
    fc1 = p.key.startswith(("decoder.layers.mlp.linear_fc1.", "decoder.layers.mlp.shared_experts.linear_fc1.")) or \
        (dense_experts and p.key.startswith(EXPERT_KEY + "linear_fc1."))
    if gated and tp > 1 and fc1 and "layer_norm" not in p.key:
        return p.shape[0] // 2 // tp
    return None


def view_rows(p: MegatronParam, block: int | None, a: int, b: int, state: int | None = None,
              out: np.ndarray | None = None) -> np.ndarray:
    """Rows ``[a, b)`` of the view's full tensor (``state``: of its carried optimizer state): the parameter's,
    or for a gated fc1 at TP > 1 the ``[gate_0; up_0; gate_1; up_1; ...]`` order; read into ``out`` if given
    (C-contiguous, their shape and :meth:`.megatron_model.MegatronParam.rows_dtype`), which is returned."""
    if out is None:
        out = np.empty((b - a, *p.shape[1:]), dtype=p.rows_dtype(state))
    for at, start, n in view_pieces(p, block, a, b):
        p.read_rows_into(start, start + n, out[at:at + n], state)
    return out


def view_pieces(p: MegatronParam, block: int | None, a: int, b: int) -> list[tuple[int, int, int]]:
    """Rows ``[a, b)`` of the view as runs of the parameter's own rows: ``(row in the result, first row, rows)``."""
    if block is None:
        return [(0, a, b - a)]
    ffn = p.shape[0] // 2
    out, r = [], a
    while r < b:
        t, q = divmod(r, 2 * block)
        start = t * block + q if q < block else ffn + t * block + (q - block)
        n = min(b - r, block - q % block)
        out.append((r - a, start, n))
        r += n
    return out


def _global_rows(c: OutChunk, pb: tuple[MegatronParam, int | None]) -> list[OutChunk]:
    """A model-weight chunk of the plan at the parameter's own rows: as it is, or, for a gated fc1 at
    TP > 1 (view rows ``[gate_t; up_t]``), cut into its gate and up runs at their global rows."""
    p, block = pb
    if block is None or c.box is None:
        return [c]
    (a, *ro), (n, *rs) = c.box
    ffn, out, r = p.shape[0] // 2, [], a
    while r < a + n:
        t, q = divmod(r, 2 * block)
        start = t * block + q if q < block else ffn + t * block + (q - block)
        m = min(a + n - r, block - q % block)
        lead = c.offsets[:len(c.offsets) - len(c.box[0])]
        out.append(OutChunk(c.key, (*lead, start, *ro), (*(1,) * len(lead), m, *rs), c.dtype, "model:" + c.param
                            if c.param else None, WEIGHT_STATE, ((start, *ro), (m, *rs))))
        r += m
    return out


def plan_dp_reshardable(hf: HFMegatron, tp: int, pp: int, dp: int, max_bytes: int, lr: float, min_lr: float,
                        ep: int = 1, etp: int = 1, step: float = 0.0, carried: dict[str, Any] | None = None,
                        vpp: int = 1) -> tuple[dict[int, list[OutChunk]], dict[str, Any], dict[str, bytes],
                                               dict[str, tuple[MegatronParam, int | None]]]:
    """(chunks per rank, key shapes, the per-rank byte objects, view name -> (parameter, TP block)); ``vpp``:
    virtual pipeline stages, one set of buffers per model chunk (:func:`plan_megatron`)."""
    dtag = f"(torch.{hf.dtype.name}, torch.float32)"  # megatron-core's key tag (param dtype, grad dtype)
    gated = bool(hf.args["swiglu"])
    views: dict[str, ParamView] = {}
    entries: dict[str, _Entry] = {}
    by_view: dict[str, tuple[MegatronParam, int | None]] = {}
    layers = hf.num_layers
    rank = {m: i for i, (m, _) in enumerate(LAYER)}
    tail = {k: i for i, k in enumerate(TAIL)}

    dense_experts = experts_in_dense(hf.num_experts, tp, ep, etp)
    chained = hf.num_experts > 0 and not dense_experts
    dense_prefix = ("chained_0." if chained else "") + OPT_PREFIX
    expert_prefix = EXPERT_PREFIX + OPT_PREFIX
    router = rank["mlp.router.bias"]  # the router's last parameter: the dense experts follow it

    def order(p: MegatronParam) -> tuple[int, int, int, int]:  # megatron-core's module order: the buckets follow it
        # after the router, expert by expert, before a shared expert (pair_mixtral_tp2_ep1, pair_qwen2moe_tp2_ep1)
        if p.expert is not None and dense_experts:
            return 1, p.layer or 0, router, 1 + p.expert * len(EXPERT) + EXPERT.index(p.key[len(EXPERT_KEY):])
        if p.expert is not None:  # the expert optimizer's own buffers: the planner orders them
            return 3, p.layer or 0, p.expert, 0
        if p.layer is not None:
            return 1, p.layer, rank[module_name(p).split(".", 3)[3]], 0
        return (2, tail[p.key], 0, 0) if p.key in tail else (0, HEAD.index(p.key), 0, 0)

    for p in sorted(hf.params, key=order):
        name = module_name(p)
        spec = ShardSpec(p.shape, None, 1, 0, None, 1, 0, 1)
        expert = p.expert is not None and not dense_experts
        holder = Holder(KeyRef(0, 0, dtag, 0, None, 0, expert_prefix if expert else dense_prefix), 0, spec, (), True)
        views[name] = ParamView(name, p.shape, p.shape, None, None, expert, 0, 0, 0, f"torch.{hf.dtype.name}",
                                (holder,), weight_key=p.key if p.layer is not None else None, layer=p.layer,
                                expert=p.expert)
        entries[p.key] = _Entry((layers, *((hf.num_experts,) if p.expert is not None else ()), *p.shape)
                                if p.layer is not None else p.shape)
        by_view[name] = (p, gated_rows(p, tp, gated, dense_experts))
    files, shapes, numels = plan_megatron(HFSource(str(hf.root), views, _Ckpt(entries)), tp, pp, dp, None,
                                          max_bytes, ep, etp, vpp=vpp)
    for rank, chunks in files.items():  # a gated fc1's model key: its global [gate; up] rows, not the view's
        files[rank] = [g for c in chunks for g in (_global_rows(c, by_view[c.param]) if c.param is not None
                                                     and c.state == WEIGHT_STATE else [c])]
    objects: dict[str, bytes] = {}
    template = torch_object([[]])
    for prefix, ranks in numels.items():
        groups = optimizer_object(lr, min_lr, prefix == expert_prefix, step, carried)
        for n, bufs in sorted(ranks.items()):
            base = f"{prefix}.dp_group_idx_{n}"
            for i, what in enumerate(("per_bucket_numel", "per_bucket_numel_unpadded")):
                objects[f"{base}.{what}/shard_0_1"] = numel_blob(str(hf.root), f"{base}.{what}", template,
                                                                 [(d, nums[i]) for d, *nums in bufs])
            objects[f"{base}.optimizer/shard_0_1"] = groups
    return files, shapes, objects, by_view
