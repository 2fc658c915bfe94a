"""``--load`` of a damaged checkpoint: refused through the reader and checks of ``ckpt verify``.

Each case damages a copy of fixtures/gtp/fold_cp2_g2_dp2 the way a hostile or broken checkpoint
would. Before, the runtime read ``.metadata`` with its own reader: a storage path with ``..`` or an
absolute one loaded tensors from outside the folder and trained on them (exit 0), and a truncated
file or a missing key failed only on the ranks, after they had started. Now the launcher refuses in
its own process with the line ``ckpt verify`` gives, and no rank starts (the launcher makes its
work folder, ``gtp-train-*`` under TMPDIR, just before it starts ranks; there must be none). ``load_checkpoint``
itself refuses the same way on every rank.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import launcher_cases as lc
import pytest
from cli_helpers import cli, rewrite_metadata
from dist_harness import run_ranks

from gtp_format.layout.config import ModelConfig, ParallelConfig

FIXTURE = lc.REPO / "fixtures" / "gtp" / "fold_cp2_g2_dp2"
ITER = "iter_0000002"


def _first_model_key(md: object) -> str:
    return sorted(k for k in md.state_dict_metadata if not k.startswith("optimizer."))[0]  # type: ignore[attr-defined]


def _storage_path(new: Callable[[Path], str]) -> Callable[[Path], None]:
    """Point every chunk stored in __1_0.distcp at ``new(folder)``, where a copy of it sits."""

    def damage(folder: Path) -> None:
        target = new(folder)
        shutil.copy(folder / "__1_0.distcp", (folder / target).resolve())

        def edit(md: object) -> None:
            for info in md.storage_data.values():  # type: ignore[attr-defined]
                if info.relative_path == "__1_0.distcp":
                    info.relative_path = target

        rewrite_metadata(folder, edit)

    return damage


def _symlink_out(folder: Path) -> None:
    outside = folder.parent.parent / "elsewhere.distcp"
    shutil.move(folder / "__0_0.distcp", outside)
    (folder / "__0_0.distcp").symlink_to(outside)


def _truncate(folder: Path) -> None:
    path = folder / "__3_0.distcp"
    os.truncate(path, path.stat().st_size // 2)


def _drop_key(folder: Path) -> None:
    def edit(md: object) -> None:
        key = _first_model_key(md)
        del md.state_dict_metadata[key]  # type: ignore[attr-defined]
        for index in [i for i in md.storage_data if i.fqn == key]:  # type: ignore[attr-defined]
            del md.storage_data[index]  # type: ignore[attr-defined]

    rewrite_metadata(folder, edit)


# name -> (damage, words the one line must contain)
CASES: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    "dotdot-storage-path": (_storage_path(lambda f: "../stolen.distcp"), ("'../stolen.distcp'", "'..'")),
    "absolute-storage-path": (_storage_path(lambda f: str(f.parent / "abs.distcp")), ("abs.distcp", "absolute")),
    "symlink-out-of-folder": (_symlink_out, ("__0_0.distcp",)),
    "truncated-data-file": (_truncate, ("__3_0.distcp", "past the end")),
    "missing-key": (_drop_key, ("missing from the metadata",)),
}


def _damaged(tmp_path: Path, name: str) -> Path:
    run = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, run)
    CASES[name][0](run / ITER)
    return run


@pytest.mark.parametrize("name", sorted(CASES))
def test_launcher_refuses_before_any_rank_starts(tmp_path: Path, name: str) -> None:
    run = _damaged(tmp_path, name)
    ranks_tmp = tmp_path / "tmp"
    ranks_tmp.mkdir()
    argv = [a.replace("{ckpt}", str(run)) for a in lc.LOAD_REFUSED]
    p = subprocess.run([*lc.LAUNCHER, *argv], cwd=lc.REPO, env={**lc.env(), "TMPDIR": str(ranks_tmp)},
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-3000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: verify failed: "), p.stderr[-3000:]
    for needle in CASES[name][1]:
        assert needle in lines[0], (needle, lines[0])
    assert p.stdout == "", "no rank may start (rank 0 prints a header first)"
    assert not list(ranks_tmp.glob("gtp-train-*")), "the launcher made its work folder: ranks were started"
    # The same reason as `ckpt verify`, word for word.
    verdict = cli("verify", run)
    assert verdict.exit_code == 1
    assert verdict.stderr.strip() == "ckpt: error: " + lines[0].removeprefix("error: ")


def _load_error(path: str) -> str:
    from gtp_runtime.checkpoint.io import CheckpointError, load_checkpoint
    from gtp_runtime.training import TrainConfig, Trainer

    model = ModelConfig(hidden=32, num_layers=2, num_heads=4, ffn_hidden=64, seq_length=16, vocab_size=128)
    t = Trainer(TrainConfig(par=ParallelConfig(cp=2, gtp_remat=2, dp=1, fold_cp=True), model=model, micro_batch=1,
                            bucket_size=4000))
    try:
        load_checkpoint(t, path)
    except CheckpointError as e:
        return str(e)
    return "loaded"


@pytest.mark.slow
def test_load_checkpoint_refuses_on_every_rank(tmp_path: Path) -> None:
    """The library path (no launcher parent): every rank refuses before it reads a data file."""
    run = _damaged(tmp_path, "dotdot-storage-path")
    (run / "stolen.distcp").chmod(0)  # were it opened, the error would be a permission error
    errors = run_ranks(4, _load_error, str(run))
    assert len(set(errors)) == 1 and errors[0].startswith("verify failed: ") and "'..'" in errors[0], errors


def test_launcher_still_loads_the_undamaged_copy_offline() -> None:
    """The refusals above are about the damage: the same flags pass the pre-spawn checks on the original."""
    from gtp_runtime.checkpoint.verified import preflight
    from gtp_runtime.train import build_parser, resolve

    args = build_parser().parse_args([a.replace("{ckpt}", str(FIXTURE)) for a in lc.LOAD_REFUSED])
    cfg, world = resolve(args, None)
    assert world == 8 and preflight(args.load, cfg, args.optimizer_sharding) == FIXTURE / ITER


def test_python_m_train_imports_no_cli() -> None:
    code = ("import sys, gtp_runtime.train, gtp_runtime.checkpoint.io, gtp_runtime.launch; "
            "print(sorted(m for m in sys.modules if m.startswith('ckpt_tool')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=lc.REPO, env=lc.env(), capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]
