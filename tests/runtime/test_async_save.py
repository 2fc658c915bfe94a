"""``--async-save`` on real gloo ranks: the same checkpoint as a sync save, a bit-exact resume,
staging that does not grow, a rank killed mid-write, and save failures as one line (issue 22 class 12)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import launcher_cases as lc
import pytest
import torch
import torch.distributed as dist
from cli_helpers import cli
from dist_harness import run_ranks
from torch.distributed.checkpoint.api import CheckpointException
from typer.testing import Result

from gtp_format.layout.config import ModelConfig, ParallelConfig
from gtp_format.names import LATEST_FILE
from gtp_format.sizes import parse_size
from gtp_runtime.checkpoint.async_save import AsyncCheckpointer
from gtp_runtime.checkpoint.errors import CheckpointError
from gtp_runtime.checkpoint.io import load_checkpoint
from gtp_runtime.last_resort import root_cause
from gtp_runtime.training import TrainConfig, Trainer

SMALL = ["--hidden", "32", "--ffn-hidden", "64", "--seq-length", "16", "--micro-batch", "1"]
TOPO = ["--nproc-per-node", "4", "--cp", "2", "--dp", "2", "--fold-cp", *SMALL]
MODEL = ModelConfig(hidden=32, num_layers=2, num_heads=4, ffn_hidden=64, seq_length=16)


def _train(argv: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gtp_runtime.train", *argv], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)


def _verify(folder: Path) -> Result:
    return cli("verify", "--data", str(folder))


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "gtp_manifest.json").read_text())


def _data_files(files: dict) -> dict:
    return {k: v for k, v in files.items() if k.endswith(".distcp")}


def _errors(stderr: str) -> list[str]:
    return [x for x in stderr.splitlines() if x.strip()]


@pytest.mark.slow
def test_async_checkpoint_is_the_sync_format_and_resumes_bit_exact(tmp_path: Path) -> None:
    sync, asy = tmp_path / "sync", tmp_path / "async"
    r = _train([*TOPO, "--steps", "4", "--save-interval", "2", "--save", str(sync),
                "--log-json", str(tmp_path / "s.json")])
    assert r.returncode == 0, r.stderr[-2000:]
    r = _train([*TOPO, "--steps", "4", "--save-interval", "2", "--save", str(asy), "--async-save"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "in the background" in r.stdout and f"saved {asy / 'iter_0000004'}" in r.stdout
    for it in ("iter_0000002", "iter_0000004"):
        a, b = sync / it, asy / it
        assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
        ma, mb = _manifest(a), _manifest(b)
        # every data file byte-identical (same size and CRC-32C); .metadata differs only in DCP's save id
        fa, fb = ma.pop("files"), mb.pop("files")
        assert fa.keys() == fb.keys()
        assert _data_files(fa) == _data_files(fb)
        # lineage: two runs (two run ids), the same root hash, digests, iteration and data position
        la, lb = ma.pop("lineage"), mb.pop("lineage")
        assert la.pop("run_id") != lb.pop("run_id") and la["root_hash"] is not None
        assert la == lb
        assert ma == mb
        v = _verify(b)
        assert v.exit_code == 0 and "OK:" in v.stdout, v.stdout + v.stderr
    assert (asy / LATEST_FILE).read_text().strip() == "4"
    assert not [p for p in asy.iterdir() if p.name.startswith(".")], "no work folder left behind"
    # resume the async checkpoint of iteration 2 (asynchronously again) and compare with the uninterrupted run
    r = _train([*TOPO, "--steps", "4", "--load", str(asy / "iter_0000002"), "--save", str(tmp_path / "resumed"),
                *lc.ASYNC_SAVE, "--log-json", str(tmp_path / "r.json")])
    assert r.returncode == 0, r.stderr[-2000:]
    full = json.loads((tmp_path / "s.json").read_text())["rows"]
    resumed = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [(x["loss"], x["grad_norm"]) for x in full[2:]] == [(x["loss"], x["grad_norm"]) for x in resumed]
    fa = _manifest(sync / "iter_0000004")["files"]
    fr = _manifest(tmp_path / "resumed" / "iter_0000004")["files"]
    assert _data_files(fa) == _data_files(fr)


def _five_saves(root: str) -> dict:
    """Save five times, training between saves: staging bytes and buffers must stay the same."""
    t = Trainer(TrainConfig(par=ParallelConfig(cp=2, fold_cp=True), model=MODEL, micro_batch=1, bucket_size=3000))
    saver = AsyncCheckpointer()
    sizes, ptrs = [], []
    for _ in range(5):
        t.train_step()
        saver.save(t, root)
        sizes.append(saver.staging.nbytes)
        ptrs.append(sorted(x.data_ptr() for c in saver.staging._bufs.values() for x in c.chunks.values()))
    saver.close()
    want = {k: x.clone() for k, x in t.model.state_dict().items()}
    fresh = Trainer(TrainConfig(par=ParallelConfig(cp=2, fold_cp=True), model=MODEL, micro_batch=1, bucket_size=3000))
    load_checkpoint(fresh, root)
    same = all(torch.equal(want[k], x) for k, x in fresh.model.state_dict().items())
    ckpt_bytes = sum(x.numel() * x.element_size() for c in saver.staging._bufs.values() for x in c.chunks.values())
    return {"sizes": sizes, "same_ptrs": all(p == ptrs[0] for p in ptrs), "loaded_same": same,
            "iteration": fresh.iteration, "ckpt_bytes": ckpt_bytes}


def test_staging_is_allocated_once_and_does_not_grow(tmp_path: Path) -> None:
    res = run_ranks(2, _five_saves, str(tmp_path))
    for r in res:
        assert r["sizes"] == [r["sizes"][0]] * 5 and r["sizes"][0] == r["ckpt_bytes"] > 0
        assert r["same_ptrs"], "the same buffers are reused by every save"
        assert r["loaded_same"] and r["iteration"] == 5
    assert (tmp_path / LATEST_FILE).read_text().strip() == "5"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"iter_000000{i}" for i in range(1, 6)] + [LATEST_FILE]


def _prepared(root: str) -> dict:
    """``prepare`` (what the launcher calls before training) allocates what every later save reuses."""
    t = Trainer(TrainConfig(par=ParallelConfig(cp=2, fold_cp=True), model=MODEL, micro_batch=1, bucket_size=3000))
    saver = AsyncCheckpointer()
    saver.prepare(t)
    reserved = saver.staging.nbytes
    ptrs = sorted(x.data_ptr() for c in saver.staging._bufs.values() for x in c.chunks.values())
    same = []
    for _ in range(2):
        t.train_step()
        saver.save(t, root)
        same.append(sorted(x.data_ptr() for c in saver.staging._bufs.values() for x in c.chunks.values()) == ptrs)
    saver.close()
    return {"reserved": reserved, "after": saver.staging.nbytes, "same": same}


def test_prepare_reserves_the_staging_every_save_reuses(tmp_path: Path) -> None:
    for r in run_ranks(2, _prepared, str(tmp_path)):
        assert r["reserved"] > 0 and r["after"] == r["reserved"] and r["same"] == [True, True]
    assert (tmp_path / LATEST_FILE).read_text().strip() == "2"


def _over_budget(root: str) -> str:
    t = Trainer(TrainConfig(par=ParallelConfig(dp=2), model=MODEL, micro_batch=1))
    try:
        AsyncCheckpointer(staging_bytes=1 << 10).save(t, root)
    except CheckpointError as e:
        return str(e)
    return "saved"


def test_staging_budget_is_refused_on_every_rank_before_writing(tmp_path: Path) -> None:
    msgs = run_ranks(2, _over_budget, str(tmp_path))
    assert all("--async-save-staging 1024 bytes" in m for m in msgs), msgs
    assert not any(tmp_path.iterdir()), "a refused save leaves nothing"


def test_parse_size() -> None:
    assert parse_size("1024") == 1024 and parse_size("24GiB") == 24 << 30 and parse_size("1.5MiB") == 3 << 19
    assert parse_size("25GB") == 25 * 10**9  # the same reading as ckpt's size options (HF's units)
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")


@pytest.fixture(scope="module")
def first_save(tmp_path_factory: pytest.TempPathFactory) -> Callable[[list[str], Path], None]:
    """Iteration 1, saved once per save mode (sync, ``--async-save``) and copied into each fault test's
    folder: the six fault tests below all began with this same one-step run of four ranks, into an empty
    folder, and a copy of its result is what each of them had (no path is stored in a checkpoint)."""
    made: dict[tuple[str, ...], Path] = {}

    def into(flags: list[str], dst: Path) -> None:
        if tuple(flags) not in made:
            out = tmp_path_factory.mktemp("first_save") / "run"
            r = _train([*TOPO, "--steps", "1", "--save", str(out), *flags])
            assert r.returncode == 0, r.stderr[-2000:]
            made[tuple(flags)] = out
        shutil.copytree(made[tuple(flags)], dst, dirs_exist_ok=True)

    return into


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["--async-save", None])
def test_rank_killed_during_write_keeps_previous(tmp_path: Path, mode: str | None, first_save) -> None:
    flags = [mode] if mode else []
    first_save(flags, tmp_path)
    r = _train([*TOPO, "--steps", "3", "--load", str(tmp_path), "--save", str(tmp_path), *flags],
               env={"GTP_FAULT_INJECT": "during_write:1"})
    assert r.returncode != 0
    assert "exited with code 17" in r.stderr, r.stderr[-2000:]
    if mode:
        assert "step    3" in r.stdout, "training went on while the background write ran"
    assert (tmp_path / LATEST_FILE).read_text().strip() == "1"
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["iter_0000001", LATEST_FILE]
    v = _verify(tmp_path)
    assert v.exit_code == 0 and "iter_0000001" in v.stdout, v.stdout + v.stderr
    for half in tmp_path.glob(".tmp.*"):  # the half-written folder is no checkpoint, even when named directly
        assert _verify(half).exit_code != 0
    r = _train([*TOPO, "--steps", "2", "--load", str(tmp_path)])
    assert r.returncode == 0 and "iteration 1" in r.stdout, r.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("fault,cause", [("during_write:1:enospc", "No space left on device"),
                                         ("during_write:0:rmtree", "No such file or directory")])
@pytest.mark.parametrize("mode", ["--async-save", None])
def test_save_failure_is_one_line_naming_the_folder(tmp_path: Path, fault: str, cause: str, mode: str | None,
                                                   first_save) -> None:
    flags = [mode] if mode else []
    first_save(flags, tmp_path)
    r = _train([*TOPO, "--steps", "2", "--load", str(tmp_path), "--save", str(tmp_path), *flags],
               env={"GTP_FAULT_INJECT": fault})
    assert r.returncode == 1, r.stderr[-2000:]
    lines = _errors(r.stderr)
    assert len(lines) == 1, r.stderr[-3000:]
    assert str(tmp_path / "iter_0000002") in lines[0] and cause in lines[0], lines[0]
    assert "latest checkpoint is still iteration 1" in lines[0] and len(lines[0]) < 600, lines[0]
    assert (tmp_path / LATEST_FILE).read_text().strip() == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", LATEST_FILE], "work folder removed"
    r = _train([*TOPO, "--steps", "2", "--load", str(tmp_path), "--save", str(tmp_path), *flags])
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / LATEST_FILE).read_text().strip() == "2"


def test_root_cause_unwraps_dcp_pairs() -> None:
    """DCP stores ``(exception, traceback)`` per rank; the one line must show the first rank's exception."""
    inner = OSError(28, "No space left on device", "/ckpt/.tmp.iter_0000002.ab/__1_0.distcp")
    e = CheckpointException("save", {3: (RuntimeError("peer"), None), 1: (inner, None)})
    assert root_cause(e) is inner
    assert root_cause(CheckpointException("save", {0: inner})) is inner
    assert root_cause(inner) is inner


def _cuda_stage() -> dict:
    from gtp_runtime.checkpoint.dcp_chunks import Chunks
    from gtp_runtime.checkpoint.staging import Staging

    torch.cuda.set_device(0)
    src = torch.randn(1 << 20, device="cuda")
    c = Chunks((2 << 20,), torch.float32)
    c.add((0,), src)
    staging = Staging()
    first = staging.stage({"w": c}, dist.group.WORLD)["w"].chunks[(0,)]
    ok1 = first.is_pinned() and torch.equal(first, src.cpu())
    src.mul_(3.0)  # the training step after the save returns
    second = staging.stage({"w": c}, dist.group.WORLD)["w"].chunks[(0,)]
    return {"pinned_exact": ok1, "reused": second.data_ptr() == first.data_ptr(),
            "exact_again": torch.equal(second, src.cpu())}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_staging_is_pinned_reused_and_exact() -> None:
    (r,) = run_ranks(1, _cuda_stage)
    assert r == {"pinned_exact": True, "reused": True, "exact_again": True}
