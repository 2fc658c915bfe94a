"""``ckpt plan``: a resume rehearsal. Whether a load at a target topology works, and what each rank reads.

Before any GPU is allocated: from the checkpoint's metadata alone, say whether loading it at
``tp x pp x cp x dp (x ep)`` works as is, needs ``ckpt reshard`` (the exact command), or cannot
work (why); and, where it works as is, which keys and stored chunks every rank reads, its bytes,
its peak host memory and the load time at a read bandwidth.

What a rank reads follows how this project's runtime loads (``gtp_runtime/checkpoint/io.py``):
each rank asks DCP for the boxes it holds at the target topology (its weight shard of every
parameter, its DP slice of every optimizer bucket key of its model-parallel position, and the
``per_bucket_numel_unpadded`` tensor of its ``dp_group_idx``), and its reader decodes every stored chunk
that overlaps one of those boxes once, whole, and frees it before the next. So the bytes of a rank
are the stored lengths of the distinct chunks its boxes overlap; its peak host memory is what it
loads into (the boxes) plus its largest chunk. The boxes come from the same layout functions the
runtime builds its buffers with (:mod:`gtp_format.layout`), and a test compares the prediction
with the bytes a real ``--load`` on gloo ranks reads.

megatron-core checkpoints: the verdict only (megatron-core's own loader decides what it reads); a
dense ``dp_reshardable`` one at another topology gets the ``ckpt reshard`` command that writes it
for that topology (:mod:`ckpt_tool.reshard.megatron_dp`). The virtual pipeline size (``--vpp``,
model chunks per stage) is part of the topology: each chunk has its own optimizer buffers.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from gtp_format.errors import FormatError
from gtp_format.layout import topology as topo
from gtp_format.layout.boxes import overlaps
from gtp_format.layout.config import ConfigError, ParallelConfig, target_world_problem
from gtp_format.layout.params import buffer_layouts
from gtp_format.layout.schema import param_shard_spec
from gtp_format.manifest import Manifest
from gtp_format.model import Checkpoint, Entry
from gtp_format.names import STATES, per_bucket_numel_key

AS_IS, RESHARD, IMPOSSIBLE = "works_as_is", "needs_reshard", "impossible"


@dataclass
class RankReads:
    rank: int
    keys: int = 0
    chunks: int = 0
    bytes: int = 0
    load_bytes: int = 0  # what the rank's state tensors hold once loaded (the boxes)
    largest_chunk: int = 0

    @property
    def peak_host_bytes(self) -> int:
        return self.load_bytes + self.largest_chunk


@dataclass
class LoadPlan:
    verdict: str
    reason: str
    source: dict[str, Any]
    target: dict[str, Any]
    commands: list[str] = field(default_factory=list)
    ranks: list[RankReads] = field(default_factory=list)
    rank_keys: dict[int, list[str]] = field(default_factory=dict)


class _Boxes:
    """The stored chunks of one key, sorted on dim 0, to find those a box overlaps."""

    def __init__(self, entry: Entry) -> None:
        self.entry = entry
        self.chunks = sorted(entry.chunks, key=lambda c: c.offsets[0] if c.offsets else 0)
        self.starts = [c.offsets[0] if c.offsets else 0 for c in self.chunks]
        self.longest = max((c.sizes[0] for c in self.chunks if c.sizes), default=0)

    def overlapping(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> list[int]:
        if not offsets:
            return list(range(len(self.chunks)))
        lo = bisect.bisect_left(self.starts, offsets[0] - self.longest + 1)
        hi = bisect.bisect_left(self.starts, offsets[0] + sizes[0])
        out = []
        for i in range(lo, hi):
            c = self.chunks[i]
            if overlaps((offsets, sizes), (c.offsets, c.sizes)):
                out.append(i)
        return out


def _target_par(src: ParallelConfig, tp: int, cp: int, dp: int, gtp_remat: int | None) -> ParallelConfig:
    return ParallelConfig(tp=tp, cp=cp, gtp_remat=gtp_remat or src.gtp_remat, dp=dp, fold_cp=src.fold_cp,
                          expert_gtp_remat=src.expert_gtp_remat)


def plan_ours(ckpt: Checkpoint, manifest: Manifest, tp: int, pp: int, cp: int, dp: int, ep: int | None,
              gtp_remat: int | None, src_arg: str, vpp: int = 1) -> LoadPlan:
    """The plan for a checkpoint of this project's runtime (it has a manifest)."""
    par, model = manifest.topology, manifest.model
    if par is None or model is None or manifest.buffers is None:
        raise FormatError(f"{ckpt.root}: the manifest has no topology, model or bucket layout; a plan needs them")
    tgt = _target_par(par, tp, cp, dp, gtp_remat)
    source, target = par.to_dict(), {**tgt.to_dict(), "pp": pp}
    too_big = target_world_problem({"--tp": tgt.tp, "--pp": pp, "--cp": tgt.cp, "--gtp-remat": tgt.gtp_remat,
                                    "--dp": tgt.dp}, ckpt.model_elements())
    if too_big is not None:  # before any rank's reads are listed
        return LoadPlan(IMPOSSIBLE, too_big, source, target)
    if pp != 1 or vpp != 1:
        return LoadPlan(IMPOSSIBLE, "gtp_runtime has no pipeline parallelism (nor virtual pipeline stages): its "
                        "checkpoints load at PP 1 only",
                        source, target)
    if ep not in (None, 1):
        return LoadPlan(IMPOSSIBLE, "gtp_runtime shards experts over --expert-gtp-remat, not expert parallelism; "
                        "drop --ep", source, target)
    try:
        tgt.validate(num_experts=model.num_experts)
        model.validate(tgt)
    except ConfigError as e:
        return LoadPlan(IMPOSSIBLE, f"the model does not fit {tgt.describe()}: {e}", source, target)
    changed = [k for k in ("tp", "cp", "gtp_remat") if getattr(par, k) != getattr(tgt, k)]
    if changed:
        cmd = (f"ckpt reshard {src_arg} DST --tp {tgt.tp} --cp {tgt.cp} --gtp-remat {tgt.gtp_remat} --dp {tgt.dp} "
               + ("--fold-cp" if tgt.fold_cp else "--no-fold-cp"))
        return LoadPlan(RESHARD, f"dp_reshardable loads over a new DP only; {', '.join(changed)} changed",
                        source, target, [cmd, f"python -m gtp_runtime.train --nproc-per-node {tgt.world_size} "
                                              f"... --load DST"])
    plan = LoadPlan(AS_IS, "same TP/CP/GTP_remat" + ("" if par.dp == tgt.dp else f"; DP {par.dp} -> {tgt.dp} "
                    "is resharded by the load itself"), source, target)
    _rank_reads(ckpt, manifest, tgt, plan)
    return plan


def _rank_reads(ckpt: Checkpoint, manifest: Manifest, par: ParallelConfig, plan: LoadPlan) -> None:
    from gtp_format.views.ours import dp_members, instances
    from gtp_format.views.records import KeyRef

    assert manifest.model is not None
    bucket_size = manifest.bucket_size or 40_000_000
    buffers = buffer_layouts(manifest.model, par, bucket_size, manifest.param_dtype)
    grid = topo.Topology(par)
    boxes: dict[str, _Boxes] = {}
    wanted: list[dict[str, list[tuple[tuple[int, ...], tuple[int, ...], int]]]] = [
        {} for _ in range(par.world_size)]

    def want(rank: int, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], itemsize: int) -> None:
        if key not in ckpt.entries:
            raise FormatError(f"{ckpt.root}: the load at {par.describe()} reads {key}, which is not stored; "
                              "run 'ckpt verify'")
        wanted[rank].setdefault(key, []).append((offsets, sizes, itemsize))

    for buf in buffers:
        for inst in instances(buf, par):
            members = dp_members(par, buf.dp_group_kind, inst.anchor)
            for b in buf.buckets:
                ref = KeyRef(inst.dp_group_idx, buf.gbuf_idx, buf.dtype, b.bucket_idx, inst.cp_rank, b.numel_unpadded)
                n = b.numel // len(members)
                for i, m in enumerate(members):
                    a, z = i * n, min((i + 1) * n, b.numel_unpadded)
                    for state in STATES:
                        want(m, ref.key(state), (a,), (max(0, z - a),), 4)
            for m in members:  # the load reads _unpadded only: padded sizes depend on the DP size
                k = per_bucket_numel_key(inst.dp_group_idx, True)
                e = ckpt.entries.get(k)
                if e is not None and e.shape is not None and k not in wanted[m]:
                    want(m, k, (0,) * len(e.shape), e.shape, e.itemsize)
        for b in buf.buckets:
            for p in b.params:
                itemsize = ckpt.entries[p.name].itemsize if p.name in ckpt.entries else 0
                for r in range(par.world_size):
                    c = grid.coords(r)
                    shard = {topo.WEIGHT: grid.weight_group_rank(r), topo.EXPERT_GTP: c.expert_gtp}.get(
                        p.shard_kind or "", 0)
                    spec = param_shard_spec(p, par, c.tp if p.tp_mode else 0, shard)
                    want(r, p.name, spec.global_offset, spec.local_shape, itemsize)
    for rank, keys in enumerate(wanted):
        rr = RankReads(rank, keys=len(keys))
        for key, reqs in keys.items():
            bx = boxes.get(key) or boxes.setdefault(key, _Boxes(ckpt.entries[key]))
            seen: set[int] = set()
            for offsets, sizes, itemsize in reqs:
                n = 1
                for s in sizes:
                    n *= s
                rr.load_bytes += n * itemsize
                seen.update(bx.overlapping(offsets, sizes) if offsets else range(len(bx.chunks)))
            for i in seen:
                st = bx.chunks[i].storage
                length = st.length if st is not None else 0
                rr.bytes += length
                rr.largest_chunk = max(rr.largest_chunk, length)
            rr.chunks += len(seen)
        plan.ranks.append(rr)
        plan.rank_keys[rank] = sorted(keys)


def _layers(ckpt: Checkpoint) -> int | None:
    """The stacked layer keys' layer count (their leading dimension), if they agree."""
    counts = {e.shape[0] for k, e in ckpt.entries.items()
              if e.kind == "tensor" and k.startswith("decoder.layers.") and e.shape}
    return counts.pop() if len(counts) == 1 else None


def _reshard_command(src_arg: str, tp: int, pp: int, cp: int, dp: int, experts: tuple[int, int] | None,
                     split: tuple[int | None, int | None] = (None, None)) -> str:
    """The ``ckpt reshard`` line for the target, every size named: with experts, ``--ep`` and ``--etp``
    too, so that what reshard does never rests on its own defaults (the source's EP where ``--ep`` is
    left out), which are not this plan's (megatron-core's: EP 1, expert TP = TP)."""
    line = f"ckpt reshard {src_arg} DST --tp {tp} --pp {pp} --cp {cp} --dp {dp}"
    line += "".join(f" --decoder-{end}-pipeline-num-layers {n}" for end, n in zip(("first", "last"), split)
                    if n is not None)
    return line + (f" --ep {experts[0]} --etp {experts[1]}" if experts else "")


def _split_problem(ckpt: Checkpoint, layers: int | None, pp: int, src_pp: int | None,
                   split: tuple[int | None, int | None]) -> tuple[str | None, bool]:
    """(why the target split ``--decoder-first/last-pipeline-num-layers`` cannot be, or None; whether it
    differs from the source's), by megatron-core's rules (:func:`gtp_format.megatron.layout.stage_counts`)."""
    from gtp_format.megatron.args import describe_model
    from gtp_format.megatron.layout import stage_counts

    if split == (None, None) or layers is None:
        return None, False
    try:
        want = stage_counts(layers, pp, *split)
    except ValueError as e:
        given = " ".join(f"--decoder-{end}-pipeline-num-layers {n}" for end, n in zip(("first", "last"), split)
                         if n is not None)
        return f"{given}: {e} (the checkpoint has {layers} layers)", True
    model = describe_model(ckpt)
    try:
        have = stage_counts(layers, src_pp or 1, model.first_stage_layers, model.last_stage_layers)
    except ValueError:
        return None, True
    return None, have != want


def plan_megatron(ckpt: Checkpoint, tp: int, pp: int, cp: int, dp: int, ep: int | None, src_arg: str,
                  etp: int | None = None, vpp: int = 1,
                  split: tuple[int | None, int | None] = (None, None)) -> LoadPlan:
    """The verdict for a genuine megatron-core checkpoint, from the topology it records.

    ``vpp``: the target's model chunks per stage (virtual pipeline stages; 1 = none). A
    ``dp_reshardable`` optimizer keeps one buffer per model chunk, so a load at another virtual
    size is another bucket layout, never "works as is"; ``ckpt reshard`` writes one chunk per stage.
    ``split``: the target's ``--decoder-first/last-pipeline-num-layers`` (None: not given, reshard's default:
    the source's split where PP stays, else even), checked against the layer count.
    """
    from gtp_format.megatron.topology import derive

    meg = derive(ckpt)
    source = meg.to_dict()
    target = {"tp": tp, "pp": pp, "vpp": vpp, "cp": cp, "dp": dp, "ep": ep or 1, "etp": etp or tp,
              "decoder_first_pipeline_num_layers": split[0], "decoder_last_pipeline_num_layers": split[1]}
    too_big = target_world_problem({"--tp": tp, "--pp": pp, "--cp": cp, "--dp": dp}, ckpt.model_elements())
    if too_big is not None:
        return LoadPlan(IMPOSSIBLE, too_big, source, target)
    export = f"ckpt export {src_arg} DST --to fully_reshardable"
    layers = _layers(ckpt)
    bad_split, other_split = _split_problem(ckpt, layers, pp, meg.pp, split)
    if bad_split is not None:
        return LoadPlan(IMPOSSIBLE, bad_split, source, target)
    if vpp > 1 and (pp == 1 or (layers is not None and layers % (pp * vpp))):
        return LoadPlan(IMPOSSIBLE, f"virtual pipeline size {vpp} needs PP > 1 and the {layers} layers split evenly "
                        f"over PP {pp} x {vpp} model chunks (megatron-core's interleaved schedule)", source, target)
    moe = any(".experts." in k for k in ckpt.entries)
    if meg.format in ("fully_reshardable", "fully_sharded_model_space"):
        return LoadPlan(AS_IS, f"{meg.format}: megatron-core loads it at any TP/PP/DP and virtual pipeline size "
                        "(0.19.2 with torch's AdamW needs its KeyError 'step' worked around)", source, target)
    if meg.format != "dp_reshardable":
        return LoadPlan(IMPOSSIBLE, f"{meg.format or 'this optimizer format'}: ckpt cannot convert it; load it at "
                        "its own topology with megatron-core", source, target)
    etp = etp or tp  # megatron-core's default expert TP: the TP size
    same = all(getattr(meg, k) is None or getattr(meg, k) == v
               for k, v in (("tp", tp), ("pp", pp), ("ep", ep or 1), ("etp", etp if moe else None))) and not other_split
    if meg.vpp != vpp:  # unknown (None) is not the same either: each model chunk has buffers of its own
        was = f"virtual pipeline size {meg.vpp}" if meg.vpp else "a virtual pipeline size the checkpoint does not show"
        why = (f"{was} -> {vpp}: megatron-core's dp_reshardable optimizer keeps one buffer per model chunk (gbuf_idx), "
               "so its load at another virtual size finds other bucket keys")
        if vpp > 1:
            return LoadPlan(RESHARD, f"{why}; ckpt reshard writes one model chunk per stage only, and the "
                            "fully_reshardable export loads at any virtual size", source, target, [export])
        reshard = _reshard_command(src_arg, tp, pp, cp, dp, (ep or 1, etp or tp) if moe else None, split)
        return LoadPlan(RESHARD, f"{why}; ckpt reshard writes the dp_reshardable checkpoint of one model chunk per "
                        "stage, or export to fully_reshardable", source, target, [reshard, export])
    if same and meg.dp_cp is not None and meg.dp_cp == dp * cp:
        return LoadPlan(AS_IS, "same TP/PP/EP, virtual pipeline size and dp x cp optimizer group", source, target)
    if vpp > 1:
        return LoadPlan(RESHARD, f"virtual pipeline size {vpp} at another TP/PP/DP x CP: megatron-core's "
                        "dp_reshardable load refuses another layout of its buckets ('Global shape mismatch'), and "
                        "ckpt reshard writes one model chunk per stage only; the fully_reshardable export loads at "
                        "any topology", source, target, [export])
    biases = any(k.startswith("decoder.layers.mlp.experts.") and k.endswith(".bias") for k in ckpt.entries)
    why_not = ("its experts have biases, which megatron-core allows only at expert TP 1 (pass --etp 1)"
               if moe and etp > 1 and biases else None)
    if why_not:  # the export loads at any topology
        return LoadPlan(RESHARD, "megatron-core's dp_reshardable load refuses another TP/PP/EP/DP x CP ('Global shape "
                        f"mismatch'), and {why_not}; its fully_reshardable export loads at any topology", source,
                        target, [export])
    reshard = _reshard_command(src_arg, tp, pp, cp, dp, (ep or 1, etp) if moe else None, split)
    why = (f"dp x cp {meg.dp_cp} -> {dp * cp}" if same else "another TP/PP/EP/expert TP or pipeline split")
    # EP 1 with expert TP = TP: one optimizer, the experts in the dense buffers; elsewhere the chained dense + expert
    # pair. megatron-core's fully_reshardable save keeps the source's structure, which its loader refuses on the
    # other side ("Expected 2 entries in state dict, but got 4"): across the two, the reshard alone
    one = not any(k.startswith("chained_") for k in ckpt.entries)
    if moe and one != ((ep or 1) == 1 and etp == tp):
        turn = "one optimizer -> the chained dense + expert pair" if one else "the chained pair -> one optimizer"
        return LoadPlan(RESHARD, f"{why}, and {turn} "
                        "(experts in the dense buffers at EP 1 with expert TP = TP): ckpt reshard writes the "
                        "dp_reshardable checkpoint megatron-core saves at the target; a fully_reshardable export keeps "
                        "the source's optimizer structure, which megatron-core's loader refuses there", source, target,
                        [reshard])
    return LoadPlan(RESHARD, f"{why}: megatron-core's dp_reshardable load refuses another layout of its buckets "
                    "('Global shape mismatch'); ckpt reshard writes the dp_reshardable checkpoint megatron-core saves "
                    "at the target (its loader takes it with no other flag), or export to fully_reshardable",
                    source, target, [reshard, export])
