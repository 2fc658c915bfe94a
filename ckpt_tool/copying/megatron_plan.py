"""The target of a megatron-core ``dp_reshardable`` checkpoint at another TP x PP x DP x CP (x EP x expert TP):
every chunk each target rank would have written, planned from a per-parameter view.

Shared by ``ckpt reshard`` (:mod:`ckpt_tool.reshard.megatron_dp`: the view is a megatron-core checkpoint's)
and ``ckpt import --to megatron-core`` (:mod:`ckpt_tool.hf.megatron_dp_import`: the view is a Hugging Face
folder's), so it lives in the copy kernel below both: megatron-core's bucket rules at the target
(:mod:`gtp_format.megatron.layout`), the TP splits of the GPT local spec, layers split over the stages, and
each target bucket's fp32 master / ``exp_avg`` / ``exp_avg_sq`` slices as chunks copied from the source's
bits (:func:`ckpt_tool.copying.plan.holder_chunks`), alignment gaps as zeros.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ckpt_tool.copying import WEIGHT_STATE
from ckpt_tool.copying.plan import FP32, OutChunk, dtype_of, gaps, holder_chunks, row_blocks
from ckpt_tool.copying.source import Source
from gtp_format.errors import FormatError
from gtp_format.layout.shard import ShardSpec
from gtp_format.megatron.glu import glu_holders
from gtp_format.megatron.keys import BUFFERS, EXPERT, GATED, HEAD
from gtp_format.megatron.layout import (
    Bucket,
    Slot,
    TargetParam,
    buffers_of,
    chunk_of_layer,
    lay_out_stage,
    stage_counts,
    stage_of_layer,
    tp_mode_of,
    uneven_split,
)
from gtp_format.names import OPT_PREFIX, STATES
from gtp_format.views.records import Holder, KeyRef, ParamView, full_box

OUTPUT = "output_layer.weight"
CHAINED = ("chained_0." + OPT_PREFIX, "chained_1." + OPT_PREFIX)  # MoE: the dense and the expert optimizer


def experts_dense(tp: int, ep: int, etp: int) -> bool:
    """Whether megatron-core keeps a MoE model's experts in the dense buffers and the one dense optimizer at the
    target: EP 1 with expert TP = TP builds them with the dense process groups (``use_expert_pgs`` false, so
    ``allreduce`` stays true; ``pair_mixtral_tp2_ep1``, ``pair_qwen2moe_tp2_ep1``); elsewhere they have the chained
    expert optimizer's buffers."""
    return ep == 1 and etp == tp


def _expert_view(v: ParamView) -> bool:
    """One of a MoE layer's experts, wherever the source keeps it (the expert optimizer's buffers, or the dense
    ones at EP 1 with expert TP = TP)."""
    return v.expert is not None


def for_target(source: Source, dense: bool) -> Source:
    """``source`` with its experts' views marked as the target lays them out: dense parameters (``dense``:
    :func:`experts_dense`) or the expert optimizer's. Where they are read from stays the source's (their holders)."""
    views = {n: replace(v, is_expert=not dense) if _expert_view(v) and v.is_expert == dense else v
             for n, v in source.views.items()}
    return replace(source, views=views) if views != source.views else source
SPLIT_FLAGS = ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers")


def _spec(view: ParamView, mode: str | None, tp: int, t: int) -> ShardSpec:
    return ShardSpec(view.full_shape, mode, tp, t if mode else 0, None, 1, 0, 1)


def _parts(view: ParamView, mode: str | None, tp: int, t: int, gated: bool) -> list[tuple[int, ShardSpec]]:
    """(offset in TP rank ``t``'s slice, place in the full tensor) of each piece of a parameter's slice: one
    piece, or a gated ``linear_fc1``'s gate and up halves (:func:`gtp_format.megatron.glu.glu_holders`): the
    dense MLP's and the shared experts' over TP, an expert's over expert TP (``tp`` is then the expert TP)."""
    fc1 = view.name.endswith(GATED) or (_expert_view(view) and view.name.endswith((".linear_fc1.weight",
                                                                                     ".linear_fc1.bias")))
    if gated and mode == "column" and fc1:
        return [(h.start, h.spec) for h in glu_holders(view.full_shape, tp, t, None, 0)]  # type: ignore[arg-type]
    return [(0, _spec(view, mode, tp, t))]


def _modes(source: Source, tp: int) -> dict[str, str | None]:
    """Each parameter's TP split: megatron's GPT table, checked against the source where its TP shows it."""
    out: dict[str, str | None] = {}
    src_tp = max(h.spec.tp_size for v in source.views.values() for h in v.holders
                 if not v.name.endswith(GATED) and not _expert_view(v))  # gated halves: 2 x TP holders
    gated = _gated(source)
    for v in source.views.values():
        if v.is_expert:
            out[v.name] = None  # expert TP 1 (the view refuses split expert keys)
            continue
        mode = tp_mode_of(v.name)  # an expert in the target's dense buffers: split as the dense MLP
        seen = v.tp_mode if src_tp > 1 and not _expert_view(v) else mode  # (the source's expert TP may differ)
        if (seen is None) != (mode is None):
            raise FormatError(f"{source.root}: {v.name} is {'split' if seen else 'not split'} over TP {src_tp} in "
                              "the checkpoint, unlike megatron-core's GPT (local spec); reshard of this model is not "
                              "supported")
        if mode is not None:
            axis = 1 if mode == "row" else 0
            fc1 = v.name.endswith(GATED) or (_expert_view(v) and ".linear_fc1." in v.name)
            parts = 2 * tp if fc1 and gated else tp  # gate and up halves split alike
            if len(v.full_shape) <= axis or v.full_shape[axis] % parts:
                raise FormatError(f"{source.root}: {v.name} {list(v.full_shape)} does not split over TP {tp} "
                                  f"(dimension {axis}); pick a TP that divides it")
        out[v.name] = mode
    return out


def source_stage_counts(source: Source) -> list[int]:
    """Layers per pipeline stage of the source, from the buffers that hold each layer's parameters
    (``dp_group_idx = stage x TP + tp_rank``; every layer parameter has one holder per TP rank)."""
    stage: dict[int, int] = {}
    for v in source.views.values():
        if v.layer is not None and not _expert_view(v) and v.holders:
            stage.setdefault(v.layer, v.holders[0].ref.dp_group_idx // len(v.holders))
    stages = max(stage.values(), default=-1) + 1
    return [sum(1 for s in stage.values() if s == i) for i in range(stages)]


Split = tuple[int | None, int | None]  # --decoder-first/last-pipeline-num-layers of the target (None: not given)


def target_split(source: Source, pp: int, split: Split | None = None) -> tuple[list[int], int | None, int | None]:
    """(layers per target stage, first, last): the split ``split`` names (Megatron's
    ``--decoder-first/last-pipeline-num-layers``, checked against the layer count by megatron-core's
    rules, :func:`gtp_format.megatron.layout.stage_counts`); without it the source's split where PP
    stays (an uneven one kept), else megatron-core's even split."""
    counts = source_stage_counts(source)
    n = sum(counts)
    if split is not None and split != (None, None):
        first, last = split
        try:
            return stage_counts(n, pp, first, last), first, last
        except ValueError as e:
            given = " ".join(f"{flag} {v}" for flag, v in zip(SPLIT_FLAGS, split) if v is not None)
            raise FormatError(f"{given}: {e} (the checkpoint has {n} layers); pick sizes that leave every other "
                              "stage the same number of layers, at least one") from None
    if len(counts) == pp:
        try:
            first, last = uneven_split(counts)
        except ValueError as e:
            raise FormatError(f"{source.root}: its pipeline {e}; reshard of this layout is not supported") from None
        return counts, first, last
    if n % pp:
        uneven = "" if len(set(counts)) == 1 else (f"; its {len(counts)} stages hold {counts} layers "
                                                   f"(--decoder-first-pipeline-num-layers), kept at PP {len(counts)}")
        raise FormatError(f"{source.root}: {n} layers do not split evenly over PP {pp} (megatron-core's default "
                          f"stage split){uneven}; pick a PP that divides them")
    return [n // pp] * pp, None, None


def layer_places(source: Source, pp: int, split: Split | None = None, vpp: int = 1) -> dict[int, tuple[int, int]]:
    """Each layer's (target stage, model chunk on it): :func:`target_split`'s stages, or with ``vpp`` virtual
    pipeline stages megatron-core's interleaved even split (:func:`gtp_format.megatron.layout.chunk_of_layer`)."""
    layers = {v.layer for v in source.views.values() if v.layer is not None}
    n = max(layers) + 1 if layers else 0
    if not n:
        return {}
    if vpp > 1:
        if n % (pp * vpp) or split not in (None, (None, None)):
            raise FormatError(f"{source.root}: {n} layers do not split evenly into --pp {pp} x --vpp {vpp} model "
                              "chunks (megatron-core's virtual pipeline split); pick sizes whose product divides them")
        return {layer: chunk_of_layer(layer, n, pp, vpp) for layer in range(n)}
    counts = target_split(source, pp, split)[0]
    return {layer: (stage_of_layer(layer, n, pp, counts), 0) for layer in range(n)}


def target_params(source: Source, tp: int, pp: int, split: Split | None = None, vpp: int = 1
                  ) -> list[list[TargetParam]]:
    """Each target stage's parameters in module order (the tied output layer last on the last stage), each with
    its model chunk (``vpp`` virtual pipeline stages: embeddings in the first stage's first chunk, the final norm
    and output layer in the last stage's last); ``split``: :func:`target_split`'s."""
    views = _module_order([v for v in source.views.values() if not v.is_expert])
    places = layer_places(source, pp, split, vpp)
    tied = OUTPUT not in source.views
    modes = _modes(source, tp)
    stages: list[list[TargetParam]] = [[] for _ in range(pp)]
    for v in views:
        stage, chunk = places[v.layer] if v.layer is not None else (0, 0) if v.name in HEAD else (pp - 1, vpp - 1)
        local = math.prod(_spec(v, modes[v.name], tp, 0).local_shape)
        stages[stage].append(TargetParam(v.name, v.name, stage, local, tied and pp > 1 and v.name == HEAD[0],
                                         v.holders[0].ref.dtype, chunk))
    if tied and pp > 1:  # the last stage's copy of the word embeddings: its own slot, the same state
        emb = stages[0][[p.name for p in stages[0]].index(HEAD[0])]
        stages[-1].append(TargetParam(OUTPUT, HEAD[0], pp - 1, emb.numel, True, emb.dtype, vpp - 1))
    return stages


def _module_order(views: list[ParamView]) -> list[ParamView]:
    """``views`` (dense parameters in module order, then any experts the target keeps in the dense buffers) with
    each layer's experts right after its router, expert by expert, ``linear_fc1`` then ``linear_fc2``: megatron-core's
    module order (router, experts, shared experts), which its buffers follow (``pair_qwen2moe_tp2_ep1``)."""
    experts = [v for v in views if _expert_view(v)]
    if not experts:
        return views
    rank = {s: i for i, s in enumerate(EXPERT)}
    by_layer: dict[int, list[ParamView]] = {}
    def key(v: ParamView) -> tuple[int, int, int]:
        return v.layer or 0, v.expert or 0, rank.get(v.name.split(".mlp.experts.", 1)[-1].split(".", 1)[-1], 0)

    for v in sorted(experts, key=key):
        by_layer.setdefault(v.layer or 0, []).append(v)
    dense = [v for v in views if not _expert_view(v)]
    last = {v.layer: i for i, v in enumerate(dense) if v.layer is not None and ".mlp.router." in v.name}
    if set(last) != set(by_layer):
        raise FormatError(f"the layers {sorted(set(by_layer) ^ set(last))[:4]} have experts but no router, or a "
                          "router but no experts; this layout is not megatron-core's MoE")
    out: list[ParamView] = []
    for i, v in enumerate(dense):
        out.append(v)
        if v.layer is not None and last.get(v.layer) == i:
            out += by_layer[v.layer]
    return out


def _source_bucket_size(source: Source) -> None:
    """``None`` when every source stage has one bucket besides a shared embedding's; else refused."""
    per_key: dict[tuple[str, int, int, int], set[str]] = {}
    for v in source.views.values():
        for h in v.holders:
            per_key.setdefault((h.ref.prefix, h.ref.dp_group_idx, h.ref.gbuf_idx, h.ref.bucket_idx), set()).add(v.name)
    plain: dict[tuple[str, int, int], int] = {}
    for (prefix, n, g, _b), names in per_key.items():
        if not names <= {HEAD[0], OUTPUT}:
            plain[prefix, n, g] = plain.get((prefix, n, g), 0) + 1
    if any(c > 1 for c in plain.values()):
        raise FormatError(f"{source.root}: its buffers are split into buckets (a run with overlap_grad_reduce); pass "
                          "--bucket-size as the target run's --ddp-bucket-size (megatron's default max(40000000, "
                          "1000000 x dp x cp))")


Numels = dict[int, list[tuple[str, list[int], list[int]]]]  # dp_group_idx -> per gbuf: (dtype tag, padded, unpadded)


def plan_megatron(source: Source, tp: int, pp: int, dp_cp: int, bucket_size: int | None, max_bytes: int,
                  ep: int = 1, etp: int = 1, split: Split | None = None, vpp: int = 1
                  ) -> tuple[dict[int, list[OutChunk]], dict[str, Any], dict[str, Numels]]:
    """(chunks per target rank, key -> (global shape, dtype), numels per prefix and dp_group_idx) of the target.

    ``vpp`` > 1 (virtual pipeline stages, the import's ``--vpp``): one set of buffers per model chunk, dense and
    expert, numbered chunk after chunk (``gbuf_idx``), as megatron-core's ``pair_vpp_pp2_dp2`` and
    ``pair_mixtral_vpp_pp2`` saves hold them; one bucket per buffer (no ``--overlap-grad-reduce``)."""
    if vpp > 1 and bucket_size is not None:
        raise FormatError(f"--vpp {vpp} with --bucket-size: only one bucket per model chunk's buffer is laid out")
    if bucket_size is None:
        _source_bucket_size(source)
    moe = any(_expert_view(v) for v in source.views.values())
    dense = experts_dense(tp, ep, etp)
    source = for_target(source, dense or not moe)
    if moe and dense:  # the expert checks (biases at expert TP > 1, ...) hold in the dense buffers too
        check_experts(source, [v for v in source.views.values() if _expert_view(v)], tp, dp_cp, ep, etp)
    # the target's optimizer prefixes: one optimizer, or MoE's chained dense + expert pair (whatever the source's)
    prefix = CHAINED[0] if moe and not dense else OPT_PREFIX
    first = replace(next(iter(source.views.values())).holders[0].ref, prefix=prefix)
    modes = _modes(source, tp)
    files: dict[int, list[OutChunk]] = {r: [] for r in range(tp * dp_cp * pp)}
    shapes: dict[str, Any] = {}
    numels: Numels = {}

    def rank(t: int, dc: int, stage: int) -> int:
        return t + tp * (dc + dp_cp * stage)

    stages = target_params(source, tp, pp, split, vpp)
    gated = _gated(source)
    for stage, params in enumerate(stages):
        for t in range(tp):
            numels[stage * tp + t] = []
        for gbuf, (dtag, members) in enumerate(buffers_of(params)):
            slots, buckets = lay_out_stage(members, stage, dp_cp, bucket_size)
            for t in range(tp):
                numels[stage * tp + t].append((dtag, [b.numel for b in buckets], [b.numel_unpadded for b in buckets]))
            _bucket_chunks(source, slots, buckets, modes, tp, replace(first, gbuf_idx=gbuf, dtype=dtag), max_bytes,
                           shapes, lambda t, off, b, s=stage: files[rank(t, off // (b.numel // dp_cp), s)].append,
                           gated)
        for p in params:
            if p.name != p.source:
                continue
            v = source.views[p.name]
            shapes[v.model_key] = (source.ckpt.entries[v.model_key].shape, dtype_of(v.param_dtype))
            for t in range(tp if modes[v.name] else 1):
                for _, spec in _parts(v, modes[v.name], tp, t, gated):
                    files[rank(t, 0, stage)].extend(_weight_chunks(v, spec, max_bytes))
    files[0].extend(buffer_chunks(source, shapes))
    out = {first.prefix: numels}
    experts = [v for v in source.views.values() if v.is_expert]
    if experts:
        out[CHAINED[1]] = _expert_chunks(source, experts, layer_places(source, pp, split, vpp), tp, pp, dp_cp, ep,
                                         etp, bucket_size, max_bytes, files, shapes)
    return files, shapes, out


def buffer_chunks(source: Source, shapes: dict[str, Any]) -> list[OutChunk]:
    """The model keys that are buffers, not parameters (:data:`gtp_format.megatron.keys.BUFFERS`: the MoE
    router's ``expert_bias``, fp32, no optimizer state), copied as stored: one chunk per layer, as
    megatron-core writes them (the same at any TP/PP/EP: the router is replicated)."""
    out: list[OutChunk] = []
    for key in BUFFERS:
        e = source.ckpt.entries.get(key)
        if e is None or e.kind != "tensor" or not e.shape or e.dtype is None:
            continue
        shapes[key] = (e.shape, e.dtype)
        out += [OutChunk(key, (layer, *(0,) * (len(e.shape) - 1)), (1, *e.shape[1:]), e.dtype, copy=True)
                for layer in range(e.shape[0])]
    return out


def _gated(source: Source) -> bool:
    """Whether the source's MLPs are gated (``--swiglu``; :func:`gtp_format.megatron.args.describe_model`)."""
    from gtp_format.megatron.args import describe_model

    if source.manifest is not None or getattr(source, "glu_rows_by_rank", False):
        return False
    return bool(describe_model(source.ckpt).gated_linear_unit)


def _expert_modes(source: Source, experts: list[ParamView], etp: int) -> dict[str, str | None]:
    """Each expert parameter's split over the target's expert TP (megatron-core's ``SequentialMLP``:
    ``linear_fc1`` column-parallel, ``linear_fc2.weight`` row-parallel, its bias replicated). A gated
    expert's ``linear_fc1`` (``--swiglu``) splits its gate and up halves alike (``2 x ETP`` parts)."""
    gated = _gated(source)
    if etp > 1 and any(v.name.endswith(".bias") for v in experts):
        raise FormatError(f"{source.root}: its MoE experts have biases, and megatron-core allows those only at "
                          "expert TP 1 ('Bias in Moe is only supported when ETP==1', transformer_config.py); pass "
                          "--etp 1")
    out: dict[str, str | None] = {}
    for v in experts:
        mode = "column" if ".linear_fc1." in v.name else "row" if v.name.endswith("linear_fc2.weight") else None
        axis = 1 if mode == "row" else 0
        parts = 2 * etp if gated and mode == "column" else etp  # gate and up halves split alike
        if etp > 1 and mode and v.full_shape[axis] % parts:
            raise FormatError(f"{source.root}: {v.name} {list(v.full_shape)} does not split over expert TP {etp} "
                              f"(dimension {axis}); pick an --etp that divides it")
        out[v.name] = mode if etp > 1 else None
    return out


def check_experts(source: Source, experts: list[ParamView], tp: int, dp_cp: int, ep: int,
                  etp: int) -> dict[str, str | None]:
    """Refuse (one line naming the flag) an EP x expert TP that megatron-core could not lay the experts out
    at; else each expert parameter's split (:func:`_expert_modes`). One check for reshard and ``ckpt plan``."""
    n_exp = 1 + max(v.expert or 0 for v in experts)
    if n_exp % ep:
        raise FormatError(f"{source.root}: --ep {ep} does not divide its {n_exp} experts; pick an EP that divides "
                          f"{n_exp}")
    if (dp_cp * tp) % (ep * etp):
        raise FormatError(f"{source.root}: --ep {ep} x expert TP (--etp) {etp} = {ep * etp} does not divide the "
                          f"{dp_cp * tp} ranks of a pipeline stage (tp {tp} x dp x cp {dp_cp}); pick an --etp "
                          "(and --ep) whose product divides them")
    return _expert_modes(source, experts, etp)  # at EP 1 with expert TP = TP: its checks of the TP split


def _expert_chunks(source: Source, experts: list[ParamView], places: dict[int, tuple[int, int]], tp: int, pp: int,
                   dp_cp: int, ep: int, etp: int, bucket_size: int | None, max_bytes: int,
                   files: dict[int, list[OutChunk]], shapes: dict[str, Any]) -> Numels:
    """The expert optimizer's buffers (megatron-core MoE): one per (stage, EP rank, expert-TP rank) under
    ``dp_group_idx = pp_rank * EP * ETP + ep_rank * ETP + etp_rank`` (the rank in the expert
    tensor-model-pipeline group; checked on ``pair_moe_tp2_etp2_dp_reshardable``), sharded over the
    expert DP group of ``tp x dp x cp / (EP x ETP)`` ranks (rank order within a stage: etp fastest,
    then ep, then expert DP), each holding its stage's layers' experts ``ep_rank * E/EP + j`` in
    module order (per layer, per local expert), each in its expert-TP part. ``places``: each layer's (stage,
    model chunk) (:func:`layer_places`); with virtual pipeline stages each model chunk has its own expert buffer,
    ``gbuf_idx`` = the chunk (``pair_mixtral_vpp_pp2_dp_reshardable``, the rule the view reads in
    :func:`gtp_format.megatron.moe.expert_views`)."""
    modes = check_experts(source, experts, tp, dp_cp, ep, etp)
    gated = _gated(source)
    n_exp = 1 + max(v.expert or 0 for v in experts)
    edp, per = dp_cp * tp // (ep * etp), n_exp // ep
    # the target's expert buffers, whichever buffer the source held them in (the dense one at EP 1 with expert TP =
    # TP, one per model chunk with virtual pipeline stages)
    ref0 = replace(experts[0].holders[0].ref, prefix=CHAINED[1])
    numels: Numels = {}
    by_name = {v.name: v for v in experts}
    chunks = sorted({c for _, c in places.values()})
    for stage, e, chunk in ((s, e, c) for s in range(pp) for e in range(ep) for c in chunks):
        names = [v.name for v in experts if v.layer is not None and places.get(v.layer) == (stage, chunk)
                 and (v.expert or 0) // per == e]
        names.sort(key=lambda n_: (by_name[n_].layer or 0, by_name[n_].expert or 0))
        params = [TargetParam(n_, n_, stage, math.prod(_spec(by_name[n_], modes[n_], etp, 0).local_shape))
                  for n_ in names]
        slots, buckets = lay_out_stage(params, stage, edp, bucket_size)
        for t in range(etp):
            n = (stage * ep + e) * etp + t
            numels.setdefault(n, []).append((ref0.dtype, [b.numel for b in buckets],
                                             [b.numel_unpadded for b in buckets]))
            refs = [KeyRef(n, chunk, ref0.dtype, b.index, None, b.numel_unpadded, ref0.prefix)
                    for b in buckets]
            used: dict[int, list[tuple[int, int]]] = {}

            def owner(off: int, b: Bucket, e: int = e, stage: int = stage, t: int = t) -> int:
                return stage * dp_cp * tp + t + etp * (e + ep * (off // (b.numel // edp)))

            for s in slots:
                v = by_name[s.param.name]
                for off, spec in _parts(v, modes[v.name], etp, t, gated):
                    h = Holder(refs[s.bucket], s.start + off, spec, (), True)
                    used.setdefault(s.bucket, []).append((h.start, h.start + h.numel))
                    for state in STATES:
                        for c in holder_chunks(v, h, state, max_bytes, math.prod(v.full_shape[1:])):
                            files[owner(c.offsets[0], buckets[s.bucket])].append(c)
                    shapes[v.model_key] = (source.ckpt.entries[v.model_key].shape, dtype_of(v.param_dtype))
                    if modes[v.name] or t == 0:
                        files[owner(0, buckets[s.bucket])].extend(_weight_chunks(v, spec, max_bytes))
            _gap_chunks(buckets, refs, used, max_bytes, shapes, lambda off, b: files[owner(off, b)].append)
    return numels


def _bucket_chunks(source: Source, slots: list[Slot], buckets: list[Bucket], modes: dict[str, str | None], tp: int,
                   first: KeyRef, max_bytes: int, shapes: dict[str, Any],
                   sink: Callable[[int, int, Bucket], Callable[[OutChunk], None]], gated: bool = False) -> None:
    """Every chunk of one stage's bucket keys: each slot's states from its source parameter, gaps zero."""
    for t in range(tp):
        refs = [KeyRef(b.stage * tp + t, first.gbuf_idx, first.dtype, b.index, None, b.numel_unpadded, first.prefix)
                for b in buckets]
        used: dict[int, list[tuple[int, int]]] = {}
        for s in slots:
            v = source.views[s.param.source]
            row = math.prod(v.full_shape[1:])
            for off, spec in _parts(v, modes[v.name], tp, t, gated):
                h = Holder(refs[s.bucket], s.start + off, spec, (), True)
                used.setdefault(s.bucket, []).append((h.start, h.start + h.numel))
                for state in STATES:
                    for c in holder_chunks(v, h, state, max_bytes, row):
                        sink(t, c.offsets[0], buckets[s.bucket])(c)
        _gap_chunks(buckets, refs, used, max_bytes, shapes, lambda off, b, t=t: sink(t, off, b))


def _gap_chunks(buckets: list[Bucket], refs: list[KeyRef], used: dict[int, list[tuple[int, int]]], max_bytes: int,
                shapes: dict[str, Any], sink: Callable[[int, Bucket], Callable[[OutChunk], None]]) -> None:
    """Each bucket key's shape, and its alignment gaps (no parameter's) as zero chunks."""
    step = max(1, max_bytes // FP32.itemsize)
    for b, ref in zip(buckets, refs):
        for state in STATES:
            shapes[ref.key(state)] = ((b.numel_unpadded,), FP32)
        for a, z in gaps(b.numel_unpadded, used.get(b.index, [])):
            for s0 in range(a, z, step):
                for state in STATES:
                    sink(s0, b)(OutChunk(ref.key(state), (s0,), (min(z, s0 + step) - s0,), FP32))


def _weight_chunks(v: ParamView, spec: ShardSpec, max_bytes: int) -> list[OutChunk]:
    """One TP part of a model weight in row blocks (one block per layer and part at megatron's sizes)."""
    dt = dtype_of(v.param_dtype)
    (o0, *orest), (n0, *nrest) = full_box(spec)
    lead, one = v.lead, (1,) * len(v.lead)
    return [OutChunk(v.model_key, (*lead, o0 + a, *orest), (*one, b - a, *nrest), dt, v.name, WEIGHT_STATE,
                     ((o0 + a, *orest), (b - a, *nrest)))
            for a, b in row_blocks(n0, math.prod(nrest), dt.itemsize, max_bytes)]
