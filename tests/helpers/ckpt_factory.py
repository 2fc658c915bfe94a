"""Build the small, real DCP checkpoints the CLI tests read.

Run as a script (``python tests/helpers/ckpt_factory.py OUT``): four gloo CPU ranks save with
``torch.distributed.checkpoint`` the way Megatron's ``dp_reshardable`` optimizer does, with
``ShardedTensor._init_from_local_shards_and_global_metadata`` and 1-D shards at chosen offsets.
Topology: TP=1, CP=2, GTP_remat=1, DP=2, fold_cp, so ``rank = cp + 2*dp``; the folded weight group
is the CP group and a folded buffer's DP group is the plain dp group.

It runs in its own process (the test session must not fork after using torch), ranks are forked
rather than spawned (four fresh torch imports cost ~15 s on two cores), and the process group
rendezvous through a file store, so no TCP port has to be found free.

The value formulas below are imported by the tests to check what ``show`` and ``diff`` read.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import warnings
import zlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gtp_format.names import (  # noqa: E402
    LATEST_FILE,
    MANIFEST_FILE,
    MEGATRON_METADATA_FILE,
    STATES,
    dtype_tag,
    iter_dir_name,
    optimizer_key,
    per_bucket_numel_key,
)

WORLD, TP, CP, DP = 4, 1, 2, 2
ITERATION = 10
TOPOLOGY = {"tp": TP, "cp": CP, "gtp_remat": 1, "dp": DP, "fold_cp": True}

QKV = "decoder.layers.0.self_attention.linear_qkv.weight"
QKV_SHAPE = (16, 8)
NORM = "decoder.final_layernorm.weight"
DTAG = dtype_tag(torch.bfloat16, torch.float32)
UNPADDED, PADDED = 22, 24
# (global start, length) per DP rank: params with padding between them, as Megatron lays a bucket out.
OPT_CHUNKS = {0: [(0, 5), (5, 4), (9, 3)], 1: [(12, 5), (17, 1), (18, 4)]}
ST_OPT_CHUNKS = {0: [(0, 11)], 1: [(11, 11)]}  # safetensors keeps one chunk per rank and key
PBN = per_bucket_numel_key(0, unpadded=False) + "/shard_0_1"
PBN_UNPADDED = per_bucket_numel_key(0, unpadded=True) + "/shard_0_1"
# The bucket those chunks cut: params A..D, a padding gap at [17, 18), DP padding at [22, 24).
BUFFER = {"gbuf_idx": 0, "dtype": DTAG, "param_dtype": "torch.bfloat16", "grad_dtype": "torch.float32",
          "is_expert": False, "excludes_cp": True, "dp_group_kind": "dp", "dp_size": DP,
          "buckets": [{"bucket_idx": 0, "numel": PADDED, "numel_unpadded": UNPADDED, "params": [
              {"name": f"param_{n}", "start": s, "end": e, "valid_numel": e - s, "local_shape": [e - s],
               "full_shape": [e - s], "global_shape": [e - s], "tp_mode": None, "shard_kind": None,
               "shard_size": 1, "align": 1} for n, s, e in (("a", 0, 5), ("b", 5, 9), ("c", 9, 17), ("d", 18, 22))]}]}
CHANGED_STATE, CHANGED_CP, CHANGED_INDEX = "exp_avg", 1, 3  # the element good2 sets to NaN


def opt_key(state: str, cp: int | None) -> str:
    return optimizer_key(0, 0, DTAG, 0, state, cp)


def qkv_values() -> torch.Tensor:
    return (torch.arange(QKV_SHAPE[0] * QKV_SHAPE[1], dtype=torch.float32) / 10).reshape(QKV_SHAPE)


def norm_values() -> torch.Tensor:
    return (torch.arange(8) + 1).to(torch.bfloat16)


def opt_values(state: str, cp: int) -> torch.Tensor:
    return 1000.0 * cp + 100.0 * STATES.index(state) + torch.arange(UNPADDED, dtype=torch.float32)


def _sharded(local: list[tuple[torch.Tensor, list[int]]], layout: list[tuple[int, list[int], list[int]]],
             size: tuple[int, ...], rank: int):
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    metas = [ShardMetadata(off, sizes, f"rank:{r}/cpu") for r, off, sizes in layout]
    shards = [Shard(t, ShardMetadata(off, list(t.shape), f"rank:{rank}/cpu")) for t, off in local]
    md = ShardedTensorMetadata(shards_metadata=metas, size=torch.Size(size),
                               tensor_properties=TensorProperties(dtype=local[0][0].dtype if local else torch.float32))
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, sharded_tensor_metadata=md)


def _bytes(obj: object) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def state_dict(rank: int, *, suffix: bool, chunks: dict[int, list[tuple[int, int]]], bytes_objects: bool,
               nan: bool = False) -> dict[str, object]:
    cp, dp = rank % CP, rank // CP
    sd: dict[str, object] = {NORM: norm_values()}
    rows = QKV_SHAPE[0] // CP
    if dp == 0:  # the folded weight's writer is dp rank 0 of each folded (= cp) group
        layout = [(r, [r * rows, 0], [rows, QKV_SHAPE[1]]) for r in range(CP)]
        sd[QKV] = _sharded([(qkv_values()[cp * rows:(cp + 1) * rows].clone(), [cp * rows, 0])], layout, QKV_SHAPE, rank)
    for state in STATES:
        full = opt_values(state, cp)
        if nan and state == CHANGED_STATE and cp == CHANGED_CP:
            full[CHANGED_INDEX] = float("nan")
        # DP rank d writes the chunks of d; without the suffix its CP peer writes the same key and offsets
        layout = [(cp + CP * d, [s], [n]) for d, spans in chunks.items() for s, n in spans]
        local = [(full[s:s + n].clone(), [s]) for s, n in chunks[dp]]
        sd[opt_key(state, cp if suffix else None)] = _sharded(local, layout, (UNPADDED,), rank)
    if bytes_objects:
        sd[PBN] = _bytes([[{(torch.bfloat16, torch.float32): [PADDED]}]])
        sd[PBN_UNPADDED] = _bytes([[{(torch.bfloat16, torch.float32): [UNPADDED]}]])
    return sd


def _write_side_files(run: Path, folder: Path, backend: str = "torch_dist") -> None:
    """Marker, Megatron's metadata.json and a manifest shaped like gtp_runtime's (the parts ckpt reads)."""
    (run / LATEST_FILE).write_text(str(ITERATION))
    (folder / MEGATRON_METADATA_FILE).write_text(json.dumps({"sharded_backend": backend, "sharded_backend_version": 1}))
    files = {}
    for p in sorted(folder.iterdir()):
        if p.name.endswith((".distcp", ".safetensors")):
            files[p.name] = {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        elif p.name in (".metadata", "index.json"):
            files[p.name] = {"size": p.stat().st_size, "crc32": f"{zlib.crc32(p.read_bytes()):08x}"}
    doc = {"format": "gtp-ckpt", "format_version": 1, "iteration": ITERATION, "topology": TOPOLOGY,
           "model": {}, "param_dtype": "torch.bfloat16", "optimizer": {"type": "adamw", "step": ITERATION},
           "buffers": [BUFFER], "files": files}
    (folder / MANIFEST_FILE).write_text(json.dumps(doc, indent=1))


def write_gtp_safetensors(run: Path) -> None:
    """This project's safetensors layout (gtp_runtime.checkpoint.safetensors_storage), written directly.

    Same tensors and writer election as ``good``; per_bucket_numel as int64 tensors, as gtp_runtime
    stores them.
    """
    from safetensors.torch import save_file

    from gtp_runtime.checkpoint.safetensors_storage import INDEX_FILE, INDEX_VERSION, tensor_name

    folder = run / iter_dir_name(ITERATION)
    folder.mkdir(parents=True)
    per_rank: dict[int, dict[str, torch.Tensor]] = {}
    keys: dict[str, dict] = {}

    def add(key: str, shape: tuple[int, ...], rank: int, offsets: tuple[int, ...], t: torch.Tensor) -> None:
        name, file = tensor_name(key, offsets), f"__{rank}_0.safetensors"
        per_rank.setdefault(rank, {})[name] = t.contiguous()
        spec = keys.setdefault(key, {"dtype": str(t.dtype), "shape": list(shape), "chunks": []})
        spec["chunks"].append({"offsets": list(offsets), "sizes": list(t.shape), "file": file, "name": name})

    add(NORM, (8,), 0, (0,), norm_values())
    rows = QKV_SHAPE[0] // CP
    for cp in range(CP):
        add(QKV, QKV_SHAPE, cp, (cp * rows, 0), qkv_values()[cp * rows:(cp + 1) * rows])
    for rank in range(WORLD):
        cp, dp = rank % CP, rank // CP
        for state in STATES:
            for s, n in OPT_CHUNKS[dp]:
                add(opt_key(state, cp), (UNPADDED,), rank, (s,), opt_values(state, cp)[s:s + n])
    add(per_bucket_numel_key(0, unpadded=False), (1,), 0, (0,), torch.tensor([PADDED]))
    add(per_bucket_numel_key(0, unpadded=True), (1,), 0, (0,), torch.tensor([UNPADDED]))
    for rank, tensors in per_rank.items():
        save_file(tensors, str(folder / f"__{rank}_0.safetensors"), metadata={"format": "gtp-ckpt-chunks"})
    (folder / INDEX_FILE).write_text(json.dumps({"version": INDEX_VERSION, "keys": keys}))
    _write_side_files(run, folder, backend="gtp_safetensors")


def _megatron_like_planner():
    """DCP's default planner, but byte objects are stored as given, as Megatron's MCoreSavePlanner does.

    (The default planner ``torch.save``-s the ``io.BytesIO`` once more; the ``aliased`` checkpoint
    keeps that form so both are covered.)
    """
    from torch.distributed.checkpoint import DefaultSavePlanner

    class Planner(DefaultSavePlanner):
        def transform_object(self, write_item, object):  # noqa: A002 - DCP's parameter name
            return object

    return Planner()


def _worker(rank: int, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    warnings.filterwarnings("ignore")
    base = Path(out)
    dist.init_process_group("gloo", init_method=f"file://{base / '.store'}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    saves = {
        "good": (dict(suffix=True, chunks=OPT_CHUNKS, bytes_objects=True), _megatron_like_planner()),
        "good2": (dict(suffix=True, chunks=OPT_CHUNKS, bytes_objects=True, nan=True), _megatron_like_planner()),
        "aliased": (dict(suffix=False, chunks=OPT_CHUNKS, bytes_objects=True), None),
    }
    for name, (kw, planner) in saves.items():
        folder = base / name / iter_dir_name(ITERATION)
        dcp.save(state_dict(rank, **kw), checkpoint_id=str(folder), planner=planner)
        dist.barrier()
        if rank == 0:
            _write_side_files(base / name, folder)
    for name, chunks in (("st", ST_OPT_CHUNKS), ("st_lossy", OPT_CHUNKS)):
        folder = base / name
        sd = state_dict(rank, suffix=True, chunks=chunks, bytes_objects=False)
        dcp.save(sd, storage_writer=HuggingFaceStorageWriter(str(folder), save_distributed=True))
        dist.barrier()
    dist.destroy_process_group()


def build(out: Path) -> None:
    import torch.multiprocessing as mp

    out.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_worker, args=(str(out),), nprocs=WORLD, start_method="fork")
    (out / ".store").unlink(missing_ok=True)
    write_gtp_safetensors(out / "gtst")
    (out / "DONE").write_text("ok")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    build(Path(sys.argv[1]))
