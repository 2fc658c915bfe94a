"""dp_reshardable checkpoints on real gloo ranks: rank-distinct round-trips, the aliasing
regression, DP resharding, resume equivalence, PyTorch's own reader, refusals."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_harness import run_ranks

from gtp_format import work
from gtp_format.layout.config import ModelConfig, ParallelConfig
from gtp_format.names import LATEST_FILE, parse_optimizer_key
from gtp_runtime.checkpoint.io import CheckpointError, load_checkpoint, save_checkpoint
from gtp_runtime.checkpoint.state import optimizer_state
from gtp_runtime.training import TrainConfig, Trainer

MODEL = ModelConfig(hidden=32, num_layers=2, num_heads=4, ffn_hidden=64, seq_length=16)


def _trainer(par: ParallelConfig, bucket_size: int = 3000, model: ModelConfig = MODEL) -> Trainer:
    return Trainer(TrainConfig(par=par, model=model, micro_batch=1, bucket_size=bucket_size))


def _fill_rank_distinct(trainer: Trainer, salt: float) -> None:
    """Give every optimizer state element a value unique to (rank, state, position)."""
    rank = dist.get_rank()
    for states in trainer.optimizer.state:
        for si, st in enumerate(states):
            for k, (_, t) in enumerate(st.tensors().items()):
                t.copy_(torch.arange(t.numel(), dtype=torch.float32) * 1e-3 + rank * 1000 + k * 100 + si + salt)


def _save_distinct(par: ParallelConfig, root: str, layout: str, aliased: bool) -> None:
    t = _trainer(par)
    _fill_rank_distinct(t, 0.5)
    t.iteration = 3
    save_checkpoint(t, root, layout=layout, aliased=aliased)


def _load_distinct(par: ParallelConfig, root: str) -> int:
    """Load into fresh state; return how many state elements differ from what this rank wrote."""
    t = _trainer(par)
    load_checkpoint(t, root)
    got = [x.clone() for states in t.optimizer.state for st in states for x in st.tensors().values()]
    _fill_rank_distinct(t, 0.5)
    want = [x for states in t.optimizer.state for st in states for x in st.tensors().values()]
    return sum(int((g.view(torch.int32) != w.view(torch.int32)).sum()) for g, w in zip(got, want))


def _load_prefix_style(par: ParallelConfig, root: str) -> int:
    """Read an aliased checkpoint as the pre-fix loader did (unsuffixed keys) and count bad elements."""
    from gtp_runtime.checkpoint.dcp_chunks import ChunkLoadPlanner

    t = _trainer(par)
    sd = optimizer_state(t.optimizer, t.groups, aliased=True)
    dcp.load(sd, storage_reader=dcp.FileSystemReader(Path(root) / "iter_0000003"), planner=ChunkLoadPlanner())
    got = [x.clone() for states in t.optimizer.state for st in states for x in st.tensors().values()]
    _fill_rank_distinct(t, 0.5)
    want = [x for states in t.optimizer.state for st in states for x in st.tensors().values()]
    return sum(int((g != w).sum()) for g, w in zip(got, want))


ROUNDTRIP = [
    pytest.param(ParallelConfig(cp=2, gtp_remat=2, dp=2, fold_cp=True), "torch_dist", id="8r-cp2-g2-dp2-fold"),
    pytest.param(ParallelConfig(cp=2, gtp_remat=2, dp=2, fold_cp=True), "safetensors", id="8r-fold-safetensors"),
    pytest.param(ParallelConfig(cp=2, gtp_remat=2, dp=2), "torch_dist", id="8r-nofold"),
    pytest.param(ParallelConfig(tp=2, cp=2, fold_cp=True), "torch_dist", id="4r-tp2-cp2-fold"),
]


@pytest.mark.slow
@pytest.mark.parametrize("par,layout", ROUNDTRIP)
def test_rank_distinct_roundtrip(tmp_path: Path, par: ParallelConfig, layout: str) -> None:
    run_ranks(par.world_size, _save_distinct, par, str(tmp_path), layout, False)
    bad = run_ranks(par.world_size, _load_distinct, par, str(tmp_path))
    assert bad == [0] * par.world_size, f"ranks got someone else's optimizer state: {bad}"
    meta = dcp.FileSystemReader(tmp_path / "iter_0000003").read_metadata() if layout == "torch_dist" else None
    if meta is not None and par.fold_cp:
        folded = [k for k in meta.state_dict_metadata if (p := parse_optimizer_key(k)) and p.cp_rank is not None]
        assert folded and {parse_optimizer_key(k).cp_rank for k in folded} == set(range(par.cp))


@pytest.mark.slow
def test_prefix_writer_loses_cp_peer_state(tmp_path: Path) -> None:
    """The regression this project exists for: without .cp_rank_{i}, CP peers alias and lose state."""
    par = ParallelConfig(cp=2, gtp_remat=2, dp=2, fold_cp=True)
    run_ranks(par.world_size, _save_distinct, par, str(tmp_path), "torch_dist", True)
    bad = run_ranks(par.world_size, _load_prefix_style, par, str(tmp_path))
    # Each folded chunk survived from one CP peer only (DCP picks per chunk), so the peers that lost
    # it read foreign values: at least one of every CP pair is hit.
    assert sum(1 for b in bad if b > 0) >= par.world_size // 2, bad
    with pytest.raises(AssertionError, match="aliased"):
        run_ranks(par.world_size, _load_distinct, par, str(tmp_path))


def _per_param_state(par: ParallelConfig, root: str, save: bool, steps_after: int) -> dict:
    """Per-parameter (master, exp_avg, exp_avg_sq), keyed by (name, global offset): after two steps
    and a save (``save=True``), or after loading ``root``."""
    from gtp_runtime.collectives import all_gather_dim0

    t = _trainer(par)
    if save:
        for _ in range(2):
            t.train_step()
        save_checkpoint(t, root, layout="torch_dist")
    else:
        load_checkpoint(t, root)
    out = {}
    for buf, states in zip(t.optimizer.buffers, t.optimizer.state):
        for b, st in zip(buf.buckets, states):
            full = {k: all_gather_dim0(v.clone(), buf.dp_group) for k, v in st.tensors().items()}
            for s in b.slots:
                key = (s.name, s.param.spec.global_offset)
                out[key] = {k: v[s.start - b.start : s.end - b.start].clone() for k, v in full.items()}
    for _ in range(steps_after):
        t.train_step()  # resharded state keeps training
    return out


@pytest.mark.slow
def test_dp_reshard_fold(tmp_path: Path) -> None:
    saved = run_ranks(4, _per_param_state, ParallelConfig(cp=2, dp=2, fold_cp=True), str(tmp_path), True, 0)
    reference: dict = {}
    for r in saved:
        reference.update(r)
    for dp in (1, 4):
        par = ParallelConfig(cp=2, dp=dp, fold_cp=True)
        loaded = run_ranks(par.world_size, _per_param_state, par, str(tmp_path), False, 1)
        merged: dict = {}
        for r in loaded:
            merged.update(r)
        assert merged.keys() == reference.keys()
        for key, states in reference.items():
            for name, value in states.items():
                assert torch.equal(merged[key][name], value), (dp, key, name)


def _expect_error(par: ParallelConfig, root: str, model: ModelConfig) -> str:
    t = _trainer(par, model=model)
    try:
        load_checkpoint(t, root)
    except CheckpointError as e:
        return str(e)
    return "no error"


@pytest.mark.slow
def test_load_refuses_topology_and_model_changes(tmp_path: Path) -> None:
    run_ranks(4, _save_distinct, ParallelConfig(cp=2, dp=2, fold_cp=True), str(tmp_path), "torch_dist", False)
    msgs = run_ranks(4, _expect_error, ParallelConfig(cp=2, dp=2), str(tmp_path), MODEL)
    assert "fold_cp: saved True now False" in msgs[0]
    msgs = run_ranks(4, _expect_error, ParallelConfig(cp=4, fold_cp=True), str(tmp_path), MODEL)
    assert "cp: saved 2 now 4" in msgs[0]
    other = ModelConfig(hidden=64, num_layers=2, num_heads=4, ffn_hidden=64, seq_length=16)
    msgs = run_ranks(4, _expect_error, ParallelConfig(cp=2, dp=2, fold_cp=True), str(tmp_path), other)
    assert "hidden: saved 32 now 64" in msgs[0]


def _train(argv: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "gtp_runtime.train", *argv], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)


SMALL = ["--hidden", "32", "--ffn-hidden", "64", "--seq-length", "16", "--micro-batch", "1"]


def _final_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist checkpoint, read back with PyTorch's own reader (no_dist)."""
    meta = dcp.FileSystemReader(folder).read_metadata()
    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    return sd


@pytest.mark.slow
def test_resume_is_bit_exact_and_pytorch_reads_it(tmp_path: Path) -> None:
    topo_args = ["--nproc-per-node", "8", "--cp", "2", "--gtp-remat", "2", "--dp", "2", "--fold-cp", *SMALL]
    a, b = tmp_path / "a", tmp_path / "b"
    r = _train([*topo_args, "--steps", "4", "--save", str(a), "--log-json", str(tmp_path / "a.json")])
    assert r.returncode == 0, r.stderr[-2000:]
    r = _train([*topo_args, "--steps", "2", "--save", str(b)])
    assert r.returncode == 0, r.stderr[-2000:]
    r = _train([*topo_args, "--steps", "4", "--load", str(b), "--save", str(b), "--log-json", str(tmp_path / "b.json")])
    assert r.returncode == 0, r.stderr[-2000:]
    full = json.loads((tmp_path / "a.json").read_text())["rows"]
    resumed = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert [x["loss"] for x in full[2:]] == [x["loss"] for x in resumed]
    assert [x["grad_norm"] for x in full[2:]] == [x["grad_norm"] for x in resumed]
    ta, tb = _final_tensors(a / "iter_0000004"), _final_tensors(b / "iter_0000004")
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k
    assert (b / LATEST_FILE).read_text().strip() == "4"


CRASH_ARGS = ["--nproc-per-node", "4", "--cp", "2", "--dp", "2", "--fold-cp", *SMALL]


@pytest.fixture(scope="module")
def first_save(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Iteration 1 of the crash tests' run, saved once: each crash test copies it into its own folder (they
    both began with this same one-step run into an empty folder; no path is stored in a checkpoint)."""
    out = tmp_path_factory.mktemp("first_save") / "run"
    r = _train([*CRASH_ARGS, "--steps", "1", "--save", str(out)])
    assert r.returncode == 0, r.stderr[-2000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("point,rank,expect_new_dir", [("after_write", 3, False), ("before_latest", 0, True)])
def test_crash_during_save_keeps_previous(tmp_path: Path, point: str, rank: int, expect_new_dir: bool,
                                          first_save: Path) -> None:
    args = CRASH_ARGS
    shutil.copytree(first_save, tmp_path, dirs_exist_ok=True)
    r = _train([*args, "--steps", "2", "--load", str(tmp_path), "--save", str(tmp_path)],
               env={"GTP_FAULT_INJECT": f"{point}:{rank}"})
    assert r.returncode != 0
    assert (tmp_path / LATEST_FILE).read_text().strip() == "1"
    assert (tmp_path / "iter_0000002").exists() == expect_new_dir
    r = _train([*args, "--steps", "2", "--load", str(tmp_path)])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "loaded" in r.stdout and "iteration 1" in r.stdout


@pytest.mark.parametrize("sharding", ["fully_reshardable", "dp_zero_gather_scatter"])
@pytest.mark.parametrize("mode", ["--save", "--load"])
def test_refused_shardings_name_dp_reshardable(tmp_path: Path, sharding: str, mode: str) -> None:
    r = _train(["--nproc-per-node", "2", "--cp", "2", "--fold-cp", *SMALL, "--steps", "1", mode, str(tmp_path),
                "--optimizer-sharding", sharding])
    assert r.returncode == 2
    line = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert line and "dp_reshardable" in line[0] and sharding in line[0], r.stderr[-1000:]
    assert not any(tmp_path.iterdir()), "a refused save must write nothing"


def test_refused_sharding_unfolded_is_clear(tmp_path: Path) -> None:
    r = _train(["--nproc-per-node", "2", "--dp", "2", *SMALL, "--steps", "1", "--save", str(tmp_path),
                "--optimizer-sharding", "fully_reshardable"])
    assert r.returncode == 2 and "use 'dp_reshardable'" in r.stderr


def test_runtime_load_refuses_code_in_metadata(tmp_path: Path) -> None:
    """--load of a crafted .metadata: refused before anything in it runs."""
    import pickle

    from gtp_runtime.checkpoint.errors import CheckpointError
    from gtp_runtime.checkpoint.verified import open_verified

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (exec, (f"open({str(marker)!r}, 'w').write('x')",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    (tmp_path / "__0_0.distcp").write_bytes(b"\0" * 64)
    with pytest.raises(CheckpointError, match="builtins.exec"):
        open_verified(tmp_path)  # what --load opens a checkpoint with, in the launcher and on every rank
    assert not marker.exists()


def test_runtime_reads_its_own_metadata_safely() -> None:
    from gtp_runtime.checkpoint.verified import open_verified

    folder = Path(__file__).parents[2] / "fixtures" / "gtp" / "fold_cp2_g2_dp2" / "iter_0000002"
    ckpt, manifest = open_verified(folder)
    assert any(".cp_rank_1" in k for k in ckpt.entries) and manifest.topology is not None


@pytest.mark.slow
def test_crash_while_replacing_the_latest_iteration_is_recovered(tmp_path: Path) -> None:
    """Issue 22 class 11: ``--load DIR/iter_1 --save DIR`` re-saves iteration 2, which ``latest`` names.

    Without ``renameat2`` the replace is two renames; rank 0 is killed between them
    (``GTP_FAULT_INJECT=mid_replace:0``), so ``iter_0000002`` is missing and its two complete copies
    are hidden. ``ckpt verify`` and ``--load`` then read the finished new copy, bit for bit the state
    the first run saved at iteration 2, and training goes on from it.
    """
    import os

    args = ["--nproc-per-node", "2", "--dp", "2", *SMALL]
    run = tmp_path / "run"
    r = _train([*args, "--steps", "1", "--save", str(run)])
    assert r.returncode == 0, r.stderr[-2000:]
    r = _train([*args, "--steps", "2", "--load", str(run), "--save", str(run)])
    assert r.returncode == 0, r.stderr[-2000:]
    original = _final_tensors(run / "iter_0000002")
    r = _train([*args, "--steps", "2", "--load", str(run / "iter_0000001"), "--save", str(run)],
               env={"GTP_FAULT_INJECT": "mid_replace:0", "GTP_NO_RENAMEAT2": "1"})
    assert r.returncode != 0
    assert (run / LATEST_FILE).read_text().strip() == "2" and not (run / "iter_0000002").exists()
    hidden = sorted(p for p in run.iterdir() if p.name.startswith("."))
    assert [p.name.split(".")[1] for p in hidden] == ["old", "tmp"], hidden
    new = hidden[1]
    resaved = _final_tensors(new)
    assert resaved.keys() == original.keys() and all(torch.equal(resaved[k], original[k]) for k in original)
    v = subprocess.run([sys.executable, "-m", "ckpt_tool.cli", "verify", str(run), "--data"], capture_output=True,
                       text=True, timeout=300, env={**os.environ})
    assert v.returncode == 0, v.stdout[-2000:] + v.stderr[-2000:]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    token = "cd" * 16  # a killed save's work folder: its owner in the name, its token inside (ownership proven)
    nonce = hashlib.sha256(token.encode()).hexdigest()[:6]
    stale = run / f".tmp.iter_0000009.w{work._host_id()}{work._boot_id()}-{dead.pid}-1-{nonce}"
    stale.mkdir()
    (stale / work.TOKEN_FILE).write_text(token + "\n")
    unowned = run / f".tmp.iter_0000008.w{work._host_id()}{work._boot_id()}-{dead.pid}-1-abcdef"  # named like one
    unowned.mkdir()
    r = _train([*args, "--steps", "3", "--load", str(run), "--save", str(run)])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "loaded" in r.stdout and "iteration 2" in r.stdout
    assert (run / LATEST_FILE).read_text().strip() == "3" and (run / "iter_0000003").is_dir()
    # the next save removed the dead writer's leftover, and kept the copies iter_0000002 still needs
    # and left a folder merely named like a dead writer's (no token proves the tool made it)
    assert not stale.exists() and unowned.is_dir()
    assert sorted(p for p in run.iterdir() if p.name.startswith(".")) == sorted([*hidden, unowned])
