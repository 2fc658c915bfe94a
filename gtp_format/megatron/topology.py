"""The parallel layout and the optimizer format of a genuine megatron-core checkpoint, from the checkpoint.

megatron-core writes no manifest. What it does write fixes most of the topology, and this module
reads it back, metadata first (checked against megatron-core 0.19.2, ``fixtures/megatron``):

* **TP and PP**: ``rng_state/shard_<pp>.<tp>_<PP>.<TP>`` is one ShardedObject per (pp, tp) rank,
  so its global shape *is* (PP, TP). Without it: TP = the number of vocab parts of
  ``embedding.word_embeddings.weight``, PP = the ``dp_group_idx`` count / TP.
* **virtual pipeline stages** (VPP, interleaved 1F1B): which ranks wrote which layer. The stacked
  keys keep global layer numbers; without VPP a stage wrote one ascending run of layers, with
  VPP ``v`` every stage wrote ``v`` runs, interleaved over the stages (PP2 x VPP2, 4 layers:
  stage 0 layers 0 and 2, stage 1 layers 1 and 3; ``fixtures/megatron/pair_vpp_pp2_dp2_dp_reshardable``).
  Each run is one model chunk (:func:`model_chunks`); ``args.virtual_pipeline_model_parallel_size``
  must agree where recorded.
* **world size**: the ``__<rank>_0.distcp`` files (every rank writes one), so DP x CP = world /
  (TP x PP).
* **DP, CP, EP** cannot be told apart by keys: megatron-core's distributed optimizer shards over
  the dp x cp group and stores one key set for it (no CP in the key, which is why it never
  aliases). ``common_state``'s ``args`` record them (``context_parallel_size``,
  ``data_parallel_size``, ``expert_model_parallel_size``); it is decoded as inert records
  (:mod:`gtp_format.reader.inert_object`, a ~2 KiB byte object, nothing run). Where ``args`` lack
  a size, EP comes from the expert optimizer's ``dp_group_idx`` count (``chained_1``) / (TP x PP),
  and CP stays unknown ("dp x cp = 4").
* **the optimizer format**: ``common_state``'s ``content_metadata.distrib_optim_sharding_type``
  where recorded, else the key pattern: bucket keys (dp_reshardable), ``optimizer.state.*``
  tensors (fully_reshardable or fully_sharded_model_space), ``param_state`` byte objects
  (dp_zero_gather_scatter).

**Folding is never inferred.** megatron-core does not fold CP into the weight-sharding group;
only this project's runtime does, and it records that in its manifest. A CP size given on the
command line is therefore a CP size, not a declaration of folding, for a megatron-core
checkpoint; ``--folded`` declares it explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gtp_format.errors import ChunkError, FormatError
from gtp_format.model import BYTES, TENSOR, Checkpoint
from gtp_format.names import SHARDED_OBJECT_RE, parse_optimizer_key, writer_rank

MEGATRON_FORMATS = ("dp_reshardable", "fully_reshardable", "dp_zero_gather_scatter", "fully_sharded_model_space")
COMMON_STATE = "common_state"
RNG_STATE = "rng_state"
MAX_COMMON_STATE_BYTES = 1 << 20  # megatron's is 2 KiB; a larger one is not decoded (its sizes stay unknown)
_ARGS = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
         "vpp": "virtual_pipeline_model_parallel_size",
         "cp": "context_parallel_size", "dp": "data_parallel_size", "ep": "expert_model_parallel_size"}


@dataclass
class MegatronTopology:
    """What the checkpoint itself says of the run that wrote it; ``None`` where it does not say."""

    world: int | None = None
    tp: int | None = None
    pp: int | None = None
    vpp: int | None = None  # model chunks per pipeline stage (virtual pipeline stages); 1 without them
    dp: int | None = None
    cp: int | None = None
    ep: int | None = None
    etp: int | None = None  # expert TP: the parts each (layer, expert) of an expert key is stored in
    dp_cp: int | None = None  # the distributed optimizer's group (dense params): dp x cp
    format: str | None = None
    sources: dict[str, str] = field(default_factory=dict)  # size -> where it was read
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        def size(name: str) -> str:
            value = getattr(self, name)
            return f"{name}{value}" if value is not None else f"{name}?"

        parts = [size(n) for n in ("tp", "pp", "cp", "dp")]
        if self.vpp is not None and self.vpp > 1:
            parts.insert(2, f"vpp{self.vpp}")
        if self.ep is not None and self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.etp is not None and self.etp != self.tp:
            parts.append(f"etp{self.etp}")
        text = " ".join(parts)
        if (self.cp is None or self.dp is None) and self.dp_cp is not None:
            text += f" (dp x cp = {self.dp_cp})"
        world = f", world {self.world}" if self.world is not None else ""
        return f"{text}{world}, megatron-core, not folded (from the checkpoint: {', '.join(self._where())})"

    def _where(self) -> list[str]:
        seen: list[str] = []
        for src in self.sources.values():
            if src not in seen:
                seen.append(src)
        return seen or ["keys"]

    def to_dict(self) -> dict[str, Any]:
        return {"world": self.world, "tp": self.tp, "pp": self.pp, "vpp": self.vpp, "cp": self.cp, "dp": self.dp,
                "ep": self.ep, "etp": self.etp, "dp_cp": self.dp_cp, "format": self.format, "folded": False,
                "sources": dict(self.sources), "notes": list(self.notes)}


def _expert_tp(ckpt: Checkpoint, notes: list[str]) -> int | None:
    """Expert TP from the stacked expert keys (``decoder.layers.mlp.experts.experts.*``, shape
    ``(layers, experts, ...)``): megatron-core stores each (layer, expert) in expert-TP equal parts
    (:func:`gtp_format.megatron.keys.expert_split`, the count the view lays experts out by),
    the largest over the keys (a bias is never split). Why not TP: megatron-core's expert TP defaults
    to TP but is its own flag, and a checkpoint resharded to expert TP 1 at TP 2 has expert-optimizer
    groups PP x EP x 1, not PP x EP x TP. Keys not in that layout leave it unknown, with a note."""
    from gtp_format.megatron.keys import expert_keys, expert_split

    parts = set()
    keys = expert_keys(ckpt)
    fc2 = [k for k in keys if k.endswith("linear_fc2.weight")]
    # a gated linear_fc1 (--swiglu) holds a gate and an up chunk per part: linear_fc2.weight (row split,
    # never gated) gives the expert TP alone where stored
    for key in fc2 or keys:
        try:
            parts.add(expert_split(ckpt, key, FormatError)[1])
        except FormatError as e:
            notes.append(f"expert TP unknown: {e}")
            return None
    return max(parts) if parts else None


def model_chunks(layer_stage: dict[int, int], pp: int) -> tuple[int, dict[int, int]]:
    """(model chunks per stage, layer -> its chunk on its stage) from the stage that wrote each layer.

    Each maximal run of consecutive layers written by one stage is one model chunk, and the runs
    must visit the stages in order, ``pp`` at a time: ``0, 1, .., pp-1`` once without virtual
    pipeline stages, ``vpp`` times with them (megatron-core's ``get_transformer_layer_offset``:
    chunk ``v`` of stage ``p`` follows chunk ``v`` of stage ``p - 1``). Anything else (a stage out of
    turn, a chunk without layers) is ``ValueError`` with the stage order, for a one-line refusal.
    """
    runs: list[list[int]] = []  # per run: stage, first layer, last layer
    for layer in sorted(layer_stage):
        stage = layer_stage[layer]
        if runs and runs[-1][0] == stage and runs[-1][2] + 1 == layer:
            runs[-1][2] = layer
        else:
            runs.append([stage, layer, layer])
    order = [r[0] for r in runs]
    if not runs or len(runs) % pp or any(stage != i % pp for i, stage in enumerate(order)):
        raise ValueError(f"the layers' pipeline stages run {order[:16]}, neither ascending over {pp} stages nor "
                         f"interleaved over them (virtual pipeline stages)")
    return len(runs) // pp, {layer: i // pp for i, (_, a, z) in enumerate(runs) for layer in range(a, z + 1)}


def _written_layer_stages(ckpt: Checkpoint, pp: int, world: int) -> dict[int, int] | None:
    """Layer -> the pipeline stage whose ranks wrote it, from one stacked key's chunks (rank order
    tp-cp-ep-dp-pp: stage = rank // (world / PP)); ``None`` where the files do not say."""
    key = next((k for k, e in ckpt.entries.items() if e.kind == TENSOR and k.startswith("decoder.layers.")
                and ".experts." not in k and e.chunks and e.shape), None)
    if key is None or world % pp:
        return None
    out: dict[int, int] = {}
    for c in ckpt.entries[key].chunks:
        r = writer_rank(c.storage.file if c.storage else None)
        if not c.offsets or c.sizes[0] != 1 or r is None or r >= world:
            return None
        if out.setdefault(c.offsets[0], r // (world // pp)) != r // (world // pp):
            return None
    return out


def _object_base(key: str) -> tuple[str, tuple[int, ...], tuple[int, ...]] | None:
    m = SHARDED_OBJECT_RE.match(key)
    if m is None:
        return None
    try:
        offset = tuple(int(x) for x in m.group("offset").split("."))
        shape = tuple(int(x) for x in m.group("shape").split("."))
    except ValueError:
        return None
    return m.group("key"), offset, shape


def is_megatron_core(ckpt: Checkpoint) -> bool:
    """No manifest of ours, and the byte objects only megatron-core's save writes (common/rng state)."""
    if ckpt.manifest is not None:
        return False
    for key, e in ckpt.entries.items():
        if e.kind == BYTES:
            base = _object_base(key)
            if base is not None and base[0] in (COMMON_STATE, RNG_STATE):
                return True
    return False


def common_state(ckpt: Checkpoint) -> dict[str, Any] | None:
    """The decoded ``common_state`` dict (inert records), or ``None`` if absent, too large or undecodable."""
    from gtp_format.reader.inert_object import load_record

    keys = [k for k, e in ckpt.entries.items() if e.kind == BYTES and (_object_base(k) or ("",))[0] == COMMON_STATE]
    if len(keys) != 1:
        return None
    entry = ckpt.entries[keys[0]]
    if not entry.chunks or entry.stored_bytes > MAX_COMMON_STATE_BYTES:
        return None
    try:
        obj = load_record(ckpt, entry)
    except (ChunkError, FormatError):
        return None
    if isinstance(obj, list) and len(obj) == 1:
        obj = obj[0]  # the ShardedObject wrapper
    return obj if isinstance(obj, dict) else None


def args_sizes(state: dict[str, Any] | None) -> dict[str, int]:
    from gtp_format.reader.inert_object import InertObject

    args = state.get("args") if state else None
    fields = args.fields() if isinstance(args, InertObject) else args if isinstance(args, dict) else {}
    out = {}
    for short, name in _ARGS.items():
        value = fields.get(name)
        if type(value) is int and 0 < value <= 1 << 20:
            out[short] = value
    return out


def _recorded_format(state: dict[str, Any] | None) -> str | None:
    meta = state.get("content_metadata") if state else None
    value = meta.get("distrib_optim_sharding_type") if isinstance(meta, dict) else None
    return value if value in MEGATRON_FORMATS else None


def key_format(ckpt: Checkpoint) -> str | None:
    """The optimizer format the keys show (``fully_reshardable`` also stands for fully_sharded_model_space)."""
    for key, e in ckpt.entries.items():
        if e.kind == TENSOR and parse_optimizer_key(key) is not None:
            return "dp_reshardable"
    if any(e.kind == TENSOR and ".optimizer.state." in f".{k}" for k, e in ckpt.entries.items()):
        return "fully_reshardable"
    if any(e.kind == BYTES and (_object_base(k) or ("",))[0].endswith(".param_state") for k, e in ckpt.entries.items()):
        return "dp_zero_gather_scatter"
    return None


def derive(ckpt: Checkpoint, *, read_common_state: bool = True) -> MegatronTopology:
    """Everything :class:`MegatronTopology` holds, from keys, shapes, files and (optionally) common_state."""
    topo = MegatronTopology()
    ranks = {writer_rank(name) for name in ckpt.data_files}
    ranks.discard(None)
    # `ckpt export --to fully_reshardable` writes whole tensors in row blocks, files by worker and no
    # rng_state: its file names and chunks say how it was written, not the run; common_state's args do.
    exported = not any(e.kind == BYTES and k.startswith(f"{RNG_STATE}/") for k, e in ckpt.entries.items()) \
        and key_format(ckpt) == "fully_reshardable"
    if ranks and not exported:
        topo.world = max(r for r in ranks if r is not None) + 1
        topo.sources["world"] = "data file names"
    for key, e in ckpt.entries.items():
        base = _object_base(key) if e.kind == BYTES else None
        if base is not None and base[0] == RNG_STATE and len(base[2]) == 2:
            topo.pp, topo.tp = base[2]
            topo.sources["tp"] = topo.sources["pp"] = "rng_state shape"
            break
    opts = [o for k, e in ckpt.entries.items() if e.kind == TENSOR and (o := parse_optimizer_key(k)) is not None]
    prefixes = sorted({o.prefix for o in opts})
    if topo.tp is None and not exported:
        emb = ckpt.entries.get("embedding.word_embeddings.weight")
        if emb is not None and emb.chunks:
            topo.tp = len({c.offsets[0] for c in emb.chunks})
            topo.sources["tp"] = "embedding vocab parts"
    if topo.pp is None and topo.tp and prefixes:
        n = len({o.dp_group_idx for o in opts if o.prefix == prefixes[0]})
        if n % topo.tp == 0:
            topo.pp = n // topo.tp
            topo.sources["pp"] = "dp_group_idx count / tp"
    state = common_state(ckpt) if read_common_state else None
    recorded = args_sizes(state)
    for short, value in recorded.items():
        mine = getattr(topo, short)
        if mine is not None and mine != value:
            topo.notes.append(f"common_state args say {_ARGS[short]}={value} but the keys give {mine}; using the keys")
            continue
        setattr(topo, short, value)
        topo.sources.setdefault(short, "common_state args")
    if topo.world and topo.tp and topo.pp and topo.world % (topo.tp * topo.pp) == 0:
        topo.dp_cp = topo.world // (topo.tp * topo.pp)
        if topo.cp is not None and topo.dp is None and topo.dp_cp % topo.cp == 0:
            topo.dp = topo.dp_cp // topo.cp
        if topo.dp is not None and topo.cp is None and topo.dp_cp % topo.dp == 0:
            topo.cp = topo.dp_cp // topo.dp
        if topo.dp is not None and topo.cp is not None and topo.dp * topo.cp != topo.dp_cp:
            topo.notes.append(f"common_state args give dp {topo.dp} x cp {topo.cp}, but world {topo.world} / "
                              f"(tp {topo.tp} x pp {topo.pp}) = {topo.dp_cp}")
    stages = _written_layer_stages(ckpt, topo.pp, topo.world) if topo.pp and topo.world and not exported else None
    if stages:
        try:
            vpp = model_chunks(stages, topo.pp)[0]
        except ValueError as e:
            topo.notes.append(f"{e}; the virtual pipeline size is unknown")
        else:
            if topo.vpp not in (None, vpp):
                topo.notes.append(f"common_state args say virtual_pipeline_model_parallel_size={topo.vpp} but the "
                                  f"layers' writers give {vpp} model chunks per stage; using the layers")
            topo.vpp = vpp
            topo.sources["vpp"] = "the ranks that wrote each layer"
    if topo.vpp is None and topo.pp == 1:
        topo.vpp = 1
    topo.etp = _expert_tp(ckpt, topo.notes)
    if topo.etp is not None:
        topo.sources["etp"] = "chunks per (layer, expert) of the expert keys"
    etp = topo.etp or topo.tp
    if topo.ep is None and len(prefixes) > 1 and topo.pp and etp:
        n = len({o.dp_group_idx for o in opts if o.prefix == prefixes[-1]})
        if n % (etp * topo.pp) == 0:  # the expert optimizer's groups: PP x EP x expert TP
            topo.ep = n // (etp * topo.pp)
            topo.sources["ep"] = "expert optimizer dp_group_idx count"
    if topo.ep is None and not any(".experts." in k for k in ckpt.entries):
        topo.ep = 1
    topo.format = _recorded_format(state) or key_format(ckpt)
    if _recorded_format(state):
        topo.sources["format"] = "common_state content_metadata"
    return topo
