"""The expert half of a megatron-core MoE checkpoint's per-parameter view (``SequentialMLP``, EP).

With experts, ``get_megatron_optimizer`` returns a ``ChainedOptimizer`` of a dense and an expert
``DistributedOptimizer``, so every optimizer key gets ``chained_{i}.``: ``chained_0`` holds the
dense parameters (the router among them) exactly as :mod:`gtp_format.megatron.view` lays them out, and
``chained_1`` one buffer per expert-parallel rank, under ``dp_group_idx`` = that rank (TP 1, PP 1;
the expert DP group shards it). An EP rank holds experts ``ep_rank * E/EP + j`` for ``j <
E/EP``, laid out by the same rules (reverse module order, 64-aligned starts): per layer, per
local expert, ``linear_fc1.weight``, ``linear_fc1.bias``, ``linear_fc2.weight``,
``linear_fc2.bias``. The stacked keys ``decoder.layers.mlp.experts.experts.*`` have two leading
axes (layer, expert) and one chunk per (layer, expert). Checked against megatron-core 0.19.2's
``moe_ep2_dp4_dp_reshardable`` and ``pair_moe_ep2_dp_reshardable`` fixtures and, with PP 2 (each
stage's expert buffer under ``dp_group_idx = pp_rank * EP + ep_rank``, holding its own layers'
experts), ``moe_pp2_ep2_dp_reshardable`` (``tests/cli/test_megatron_view.py``).

Expert TP > 1 (``pair_moe_tp2_etp2_dp_reshardable``, TP2 x expert TP2 x EP2): each (layer, expert)
is stored in ETP equal chunks, ``linear_fc1`` split along its output axis (column) and
``linear_fc2.weight`` along its input axis (row), and the expert buffers are keyed by the rank in
the expert tensor-model-pipeline group, ``dp_group_idx = pp_rank * EP * ETP + ep_rank * ETP +
etp_rank``; each holds its part of its experts, so an expert parameter has one holder per
expert-TP rank. ETP is read from the chunks (:func:`expert_split`), never assumed.

The view names an expert parameter ``decoder.layers.<l>.mlp.experts.<e>.<linear_fc1.weight>``
with the global expert index ``e`` (megatron's modules say ``local_experts.<j>``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gtp_format.errors import FormatError
from gtp_format.layout.shard import ShardSpec
from gtp_format.megatron.glu import glu_holders
from gtp_format.megatron.keys import EXPERT, EXPERT_PREFIX, expert_keys, expert_split
from gtp_format.model import Checkpoint
from gtp_format.views.records import Holder, KeyRef, ParamView

ALIGN = 64


def expert_views(ckpt: Checkpoint, opts: dict, prefix: str, layers: int, refuse: Callable[[str], FormatError],
                 layer_stage: dict[int, int] | None = None, pp: int = 1, gated: bool = False,
                 layer_chunk: dict[int, int] | None = None,
                 ) -> tuple[dict[str, Any], list[tuple[str, int, int, int, int, int]]]:
    """Views of every expert parameter and the placed slices (name, dp_group_idx, gbuf, bucket, start, end).

    ``layer_chunk`` (virtual pipeline stages): each layer's model chunk within its stage. Every chunk has its own
    DDP and so its own expert buffer, and the expert optimizer numbers them chunk after chunk as the dense one does:
    ``gbuf_idx`` = the chunk (``fixtures/megatron/pair_mixtral_vpp_pp2_dp_reshardable``: PP2 x VPP2 x EP2).

    With PP > 1 the expert optimizer's ``dp_group_idx`` is ``pp_rank * EP + ep_rank`` (its rank in
    the expert model-parallel group, rank order tp-cp-ep-dp-pp), and a stage's buffer holds the
    experts of its own layers (``layer_stage``: the dense view's stage of each layer).

    ``gated`` (``--swiglu``): an expert's ``linear_fc1`` is stored as a gate and an up chunk per
    expert-TP part (megatron-core's ``apply_swiglu_sharded_factory`` on each expert's sharded tensor,
    split over the expert TP group), so its chunk count is twice the expert TP, a part's numel is
    what a column split over expert TP gives, and the part's two holders are
    :func:`gtp_format.megatron.glu.glu_holders` over expert TP.
    """
    keys = {s: EXPERT_PREFIX + s for s in EXPERT if EXPERT_PREFIX + s in ckpt.entries}
    unknown = sorted(set(expert_keys(ckpt)) - set(keys.values()))
    if unknown:
        raise refuse(f"expert key {unknown[0]!r} is not a SequentialMLP expert parameter")
    shapes = {s: ckpt.entries[k].shape or () for s, k in keys.items()}
    if any(len(sh) < 3 or sh[0] != layers for sh in shapes.values()) or len({sh[1] for sh in shapes.values()}) != 1:
        raise refuse("expert keys disagree on (layers, experts)")
    n_exp = next(iter(shapes.values()))[1]
    ranks = sorted({o.dp_group_idx for o in opts.values()})
    if ranks != list(range(len(ranks))) or len(ranks) % pp:
        raise refuse(f"the expert optimizer has dp_group_idx {ranks[:8]}, not PP {pp} x EP x expert TP ranks")
    stage_of = layer_stage or {layer: 0 for layer in range(layers)}
    modes = {s: expert_split(ckpt, k, refuse) for s, k in keys.items()}
    for s in ("linear_fc1.weight", "linear_fc1.bias") if gated else ():
        if s in modes and modes[s][0] == "column" and modes[s][1] % 2 == 0:
            half = modes[s][1] // 2  # gate and up chunks of each expert-TP part
            modes[s] = ("column" if half > 1 else None, half)
    etps = {n for _, n in modes.values() if n > 1} or {1}
    if len(etps) != 1 or len(ranks) % (pp * next(iter(etps))):
        raise refuse(f"expert keys are split in {sorted(etps)} parts, not one expert TP size dividing the expert "
                     f"optimizer's {len(ranks)} dp_group_idx values over PP {pp}")
    etp = etps.pop()
    ep = len(ranks) // (pp * etp)
    if n_exp % ep:
        raise refuse(f"EP {ep} does not divide {n_exp} experts")
    chunk_of = layer_chunk or {layer: 0 for layer in range(layers)}
    chunks = max(chunk_of.values(), default=0) + 1
    dtags = {o.dtype for o in opts.values()}
    if len(dtags) != 1 or {o.gbuf_idx for o in opts.values()} != set(range(chunks)):
        raise refuse(f"the expert optimizer's gradient buffers are not one per model chunk ({chunks}) of one dtype")
    dtag = dtags.pop()
    numel = {(o.dp_group_idx, o.gbuf_idx, o.bucket_idx): (ckpt.entries[k].shape or (0,))[0]
             for k, o in opts.items() if o.state == "param"}
    per = n_exp // ep
    placed: list[tuple[str, int, int, int, int, int]] = []
    info: dict[str, tuple[str, int, tuple[int, ...], int, str]] = {}
    for r, g in ((r, g) for r in ranks for g in range(chunks)):
        names = []
        stage, rest = divmod(r, ep * etp)
        ep_rank = rest // etp  # expert model-parallel rank: etp fastest, then ep, then pp (rank order tp-ep-dp-pp)
        for layer in (ln for ln in range(layers) if stage_of.get(ln) == stage and chunk_of.get(ln, 0) == g):
            for j in range(per):
                for s in EXPERT:
                    if s in keys:
                        name = f"decoder.layers.{layer}.mlp.experts.{ep_rank * per + j}.{s}"
                        names.append(name)
                        info[name] = (keys[s], layer, shapes[s][2:], ep_rank * per + j, s)
        b, pos = 0, 0
        for name in reversed(names):
            n = 1
            for d in ShardSpec(info[name][2], modes[info[name][4]][0], etp, 0, None, 1, 0, 1).local_shape:
                n *= d
            start = -(-pos // ALIGN) * ALIGN
            have = numel.get((r, g, b))
            if have is None or start + n > have:
                raise refuse(f"{name} does not fit bucket {b} of gbuf_idx_{g} of EP rank {r} ({have} elements "
                             "unpadded)")
            placed.append((name, r, g, b, start, start + n))
            pos = start + n
            if pos == have:
                b, pos = b + 1, 0
        if pos or b != len({bb for (rr, gg, bb) in numel if (rr, gg) == (r, g)}):
            raise refuse(f"the experts of EP rank {r} do not fill the buckets of its gbuf_idx_{g}")
    pdt = dtag.strip("()").split(",")[0].strip()
    views: dict[str, Any] = {}
    holders: dict[str, list[Holder]] = {}
    for name, r, gbuf, bucket, start, _ in reversed(placed):
        key, layer, full, expert, s = info[name]
        mode = modes[s][0]
        spec = ShardSpec(full, mode, etp, r % etp if mode else 0, None, 1, 0, 1)
        ref = KeyRef(r, gbuf, dtag, bucket, None, numel[(r, gbuf, bucket)], prefix)
        if gated and mode == "column" and s.startswith("linear_fc1."):  # its gate and up halves, two chunks
            holders.setdefault(name, []).extend(glu_holders(full, etp, r % etp, ref, start))
        else:
            holders.setdefault(name, []).append(Holder(ref, start, spec, (), mode is not None or r % etp == 0))
        first = holders[name][0]
        views[name] = ParamView(name, full, full, mode, None, True, gbuf, first.ref.bucket_idx, first.start, pdt,
                                tuple(sorted(holders[name], key=lambda h: h.ref.dp_group_idx)), weight_key=key,
                                layer=layer, expert=expert)
    order = [f"decoder.layers.{layer}.mlp.experts.{e}.{s}" for layer in range(layers) for e in range(n_exp)
             for s in EXPERT]
    return {name: views[name] for name in order if name in views}, placed
