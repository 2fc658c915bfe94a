"""What the keys of a checkpoint mean: weights, optimizer buckets, folded buffers, aliasing.

Key names are parsed only through :mod:`gtp_format.names`, the single definition of
the format. The topology comes from the manifest's ``topology`` (gtp_runtime writes the
ParallelConfig fields there), from a genuine megatron-core checkpoint itself
(:mod:`gtp_format.megatron.topology`; megatron-core never folds, so there ``--cp-size`` is only a
CP size and ``--folded`` declares folding), or from ``--cp-size``: on a checkpoint that is neither
(a pre-manifest save of our runtime) ``--cp-size N`` with N > 1 declares the checkpoint folded
with that CP degree, since only folded buffers depend on CP in their keys.

Aliasing (domain reference, section 5): keys of folded buffers must carry the CP rank, or CP
peers write the same key and offset and DCP silently keeps one copy. A key does not say whether
its buffer folded; the manifest's ``buffers`` list does (``excludes_cp`` per ``gbuf_idx``, as
gtp_runtime writes it). The rules, first match wins:

* the manifest names the buffer: a cp-less key of a buffer with ``excludes_cp`` in a checkpoint
  with CP > 1 is aliased (an error); a cp_rank key of a buffer without it is inconsistent;
* a cp-less key in a buffer (``dp_group_idx``, ``gbuf_idx``) that also has cp_rank keys is an
  error: one buffer cannot be both folded and not;
* in a checkpoint declared folded with CP > 1 and no cp_rank key at all, every optimizer key is
  aliased (an error): the writer predates the fix;
* in a folded checkpoint that has cp_rank keys, a cp-less buffer is most likely an unfolded one
  (expert buffers, replicated params) but could be an aliased dense one: a warning.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gtp_format.layout.config import ParallelConfig
from gtp_format.layout.topology import Topology
from gtp_format.manifest import Manifest
from gtp_format.model import BYTES, TENSOR, Checkpoint, Entry, Problem
from gtp_format.names import (
    OptimizerKey,
    parse_optimizer_key,
    parse_per_bucket_numel_key,
    writer_rank,
)

if TYPE_CHECKING:
    from gtp_format.megatron.topology import MegatronTopology

MODEL = "model"
OPTIMIZER = "optimizer"
BUCKET_NUMEL = "per_bucket_numel"
OBJECT = "object"
FULL_STATE_PREFIX = "optimizer.state."  # fully_reshardable / fully_sharded_model_space: one key per param state

MANIFEST_TOPOLOGY_KEY = "topology"


@dataclass(frozen=True)
class KeyClass:
    category: str
    opt: OptimizerKey | None = None
    pbn: tuple[str, int, bool] | None = None  # (prefix, dp_group_idx, unpadded)


def classify(entry: Entry) -> KeyClass:
    """Category of one key: optimizer bucket state, per_bucket_numel object, other object, weight."""
    opt = parse_optimizer_key(entry.key)
    if opt is not None and entry.kind == TENSOR:
        return KeyClass(OPTIMIZER, opt=opt)
    pbn = parse_per_bucket_numel_key(entry.key)
    if pbn is not None:
        return KeyClass(BUCKET_NUMEL, pbn=pbn)
    return KeyClass(OBJECT if entry.kind == BYTES else MODEL)


def classify_all(ckpt: Checkpoint) -> dict[str, KeyClass]:
    return {k: classify(e) for k, e in ckpt.entries.items()}


@dataclass
class TopologyView:
    """The parallel layout a checkpoint was written with, as far as we know it."""

    par: ParallelConfig | None = None
    cp: int | None = None
    folded: bool | None = None
    source: str = "none"
    folded_gbufs: dict[int, bool] = field(default_factory=dict)  # gbuf_idx -> excludes_cp, from the manifest
    notes: list[Problem] = field(default_factory=list)
    megatron: MegatronTopology | None = None  # derived from a genuine megatron-core checkpoint

    def describe(self) -> str:
        if self.megatron is not None:
            return self.megatron.describe()
        if self.par is not None:
            return f"{self.par.describe()} (from {self.source})"
        if self.cp is not None:
            return f"cp={self.cp}, {'folded' if self.folded else 'not folded'} (from {self.source})"
        return "unknown (no manifest topology; --cp-size N declares folded buffers saved with CP=N)"


def topology_view(manifest: Manifest | None, cp_size: int | None, *, ckpt: Checkpoint | None = None,
                  folded: bool = False) -> TopologyView:
    """Combine the manifest topology with ``--cp-size`` (which wins, with a note on conflict).

    Folding is declared only by our manifest, by ``--cp-size`` on a checkpoint that is neither ours
    nor megatron-core's (a pre-manifest save of our runtime), or by ``folded``. A genuine
    megatron-core checkpoint (``ckpt`` given, see :mod:`gtp_format.megatron.topology`) takes its
    topology from itself; there ``--cp-size`` is only a CP size: megatron-core never folds CP, and
    reading it as folding raised a false aliasing alarm on every megatron CP > 1 checkpoint.
    """
    view = TopologyView(folded_gbufs={b.gbuf_idx: b.excludes_cp for b in (manifest.buffers or ())} if manifest else {})
    par = manifest.topology if manifest is not None else None
    if par is not None:
        view.par, view.cp, view.folded, view.source = par, par.cp, par.fold_cp and par.cp > 1, "manifest"
    if ckpt is not None and manifest is None and not folded:
        from gtp_format.megatron.topology import derive, is_megatron_core

        if is_megatron_core(ckpt):
            meg = derive(ckpt)
            view.megatron, view.cp, view.folded, view.source = meg, meg.cp, False, "checkpoint (megatron-core)"
            view.notes += [Problem("warning", "topology", n) for n in meg.notes]
            if cp_size is not None:
                if meg.cp is not None and meg.cp != cp_size:
                    view.notes.append(Problem("warning", "topology", f"--cp-size {cp_size} but the checkpoint records "
                                              f"cp={meg.cp} ({meg.sources.get('cp', 'keys')}); using {meg.cp}"))
                else:
                    view.cp = cp_size
                    view.notes.append(Problem("info", "topology", f"--cp-size {cp_size} taken as the CP size only: "
                                              "megatron-core does not fold CP, so it declares no folding (pass "
                                              "--folded to declare it)"))
            return view
    if cp_size is not None:
        if par is not None and par.cp != cp_size:
            view.notes.append(Problem("warning", "topology", f"manifest says cp={par.cp} but --cp-size "
                                      f"{cp_size} was given; using {cp_size} and ignoring the manifest ranks"))
            view.par = None
        view.cp, view.folded = cp_size, cp_size > 1
        view.source = "--cp-size" if view.par is None else "manifest and --cp-size"
        if folded:
            view.source += " --folded"
    elif folded:
        view.notes.append(Problem("warning", "topology", "--folded needs --cp-size N (the CP degree it was saved "
                                  "with); nothing was declared"))
    return view


@dataclass(frozen=True)
class Survivor:
    """The one copy DCP kept of an aliased key's chunk, and who wrote it."""

    chunk: int
    offsets: tuple[int, ...]
    file: str | None
    rank: int | None
    cp_rank: int | None


@dataclass(frozen=True)
class AliasFinding:
    """One optimizer key that lost CP peers' state: what verify reports and what DCP kept."""

    key: str
    severity: str
    reason: str
    survivors: tuple[Survivor, ...]

    def kept_summary(self) -> str:
        """Who wrote the copies DCP kept: ``"5 chunks kept: 3 from rank 1 (cp_rank 1), 2 from rank 2 ..."``."""
        writers = Counter(f"rank {'?' if s.rank is None else s.rank}"
                          + ("" if s.cp_rank is None else f" (cp_rank {s.cp_rank})") for s in self.survivors)
        parts = [f"{n} from {who}" for who, n in sorted(writers.items())]
        return (f"{len(self.survivors)} chunks kept: " + ", ".join(parts)) if parts else "no chunk kept"


@dataclass
class AliasReport:
    status: str  # ok | aliased | possibly_aliased | not_folded | unknown | no_optimizer | inconsistent
    message: str
    aliased: list[AliasFinding] = field(default_factory=list)


def _survivors(entry: Entry, topo: TopologyView) -> tuple[Survivor, ...]:
    grid = Topology(topo.par) if topo.par is not None else None
    out = []
    for c in entry.chunks:
        file = c.storage.file if c.storage else None
        rank = writer_rank(file)
        cp = grid.coords(rank).cp if grid is not None and rank is not None and rank < grid.world_size else None
        out.append(Survivor(c.index, c.offsets, file, rank, cp))
    return tuple(out)


def _buffer(opt: OptimizerKey) -> tuple[str, int, int]:
    return opt.prefix, opt.dp_group_idx, opt.gbuf_idx


def aliasing(ckpt: Checkpoint, classes: dict[str, KeyClass], topo: TopologyView) -> AliasReport:
    """Which optimizer keys lost CP peers' data to DCP deduplication (see the module docstring)."""
    opts = {k: c.opt for k, c in classes.items() if c.opt is not None}
    if not opts:
        return AliasReport("no_optimizer", "no dp_reshardable optimizer keys")
    folded_buffers = {_buffer(o) for o in opts.values() if o.cp_rank is not None}
    cpless = [k for k, o in opts.items() if o.cp_rank is None]
    multi_cp = topo.cp is not None and topo.cp > 1
    found: list[AliasFinding] = []
    for key in cpless:
        opt = opts[key]
        declared = topo.folded_gbufs.get(opt.gbuf_idx)
        if declared is not None:
            if declared and multi_cp:
                reason = f"the manifest says gbuf_idx_{opt.gbuf_idx} is folded (excludes_cp) but the key has no cp_rank"
                found.append(AliasFinding(key, "error", reason, _survivors(ckpt.entries[key], topo)))
        elif _buffer(opt) in folded_buffers:
            reason = f"buffer gbuf_idx_{opt.gbuf_idx} has cp_rank keys, but this state has none"
            found.append(AliasFinding(key, "error", reason, _survivors(ckpt.entries[key], topo)))
        elif topo.folded and multi_cp:
            if folded_buffers:
                reason = (f"no cp_rank in a folded checkpoint (cp={topo.cp}): aliased unless gbuf_idx_"
                          f"{opt.gbuf_idx} is an unfolded (expert) buffer")
                found.append(AliasFinding(key, "warning", reason, _survivors(ckpt.entries[key], topo)))
            else:
                reason = f"no cp_rank in a folded checkpoint (cp={topo.cp}): CP peers wrote the same key"
                found.append(AliasFinding(key, "error", reason, _survivors(ckpt.entries[key], topo)))
    if any(a.severity == "error" for a in found):
        n = sum(a.severity == "error" for a in found)
        return AliasReport("aliased", f"{n} optimizer keys are aliased: CP peers' state was lost at save", found)
    if found:
        return AliasReport("possibly_aliased", f"{len(found)} cp-less optimizer keys in a folded checkpoint",
                           found)
    unfolded = sorted({o.gbuf_idx for o in opts.values() if o.cp_rank is not None
                       and topo.folded_gbufs.get(o.gbuf_idx) is False})
    if unfolded:
        return AliasReport("inconsistent", f"keys of gbuf_idx {unfolded} carry cp_rank but the manifest says those "
                           "buffers are not folded")
    if topo.folded is False and folded_buffers:
        return AliasReport("inconsistent", f"keys carry cp_rank but the topology ({topo.source}) is not folded")
    if topo.megatron is not None and not folded_buffers:
        return AliasReport("not_folded", "megatron-core checkpoint: megatron-core does not fold CP, its optimizer "
                           "keys hold the dp x cp group's shards and cannot alias")
    if folded_buffers:
        return AliasReport("ok", f"{len(folded_buffers)} folded buffers; their keys carry cp_rank")
    if topo.folded is False:
        return AliasReport("not_folded", "no folded buffers (topology is not folded)")
    return AliasReport("unknown", "no key carries cp_rank and the CP layout is unknown; pass --cp-size to check")
