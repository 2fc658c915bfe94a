"""Each command parses the source's ``gtp_manifest.json`` exactly once, and gates it once.

Why: ``ckpt reshard`` used to locate the folder twice, parse the manifest three times (a lenient
read in ``open_checkpoint``, then two strict ones), and ``--load``, migrate and verify-roundtrip
each parsed it again after ``open_checkpoint``. Every parse is a chance for two readings of one
file; the strict verdict now comes from the one parse (:attr:`Manifest.strict_error`).

The count is taken by wrapping :func:`gtp_format.manifest.parse_manifest` wherever a module holds
it, so it holds whichever module calls the parser. Parses of other files (migrate's self-check of
the copy it built) are counted apart: only SRC's manifest must be read once.
"""

from __future__ import annotations

import shutil
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import launcher_cases as lc
import pytest
from cli_helpers import cli

import gtp_format.manifest as manifest_module
from gtp_format.names import MANIFEST_FILE

ROOT = Path(__file__).resolve().parents[2]
FOLD = ROOT / "fixtures" / "gtp" / "fold_cp2_g2_dp2"
ALIASED = ROOT / "fixtures" / "gtp" / "aliased_cp2_g2_dp2"
ITER = "iter_0000002"

pytestmark = pytest.mark.skipif(not (FOLD / ITER).is_dir() or not (ALIASED / ITER).is_dir(),
                                reason="run python fixtures/make_fixtures.py to generate fixtures/gtp")


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Manifest path (resolved) -> how many times it was parsed while the test ran."""
    import gtp_format.reader.checkpoint  # noqa: F401  # every module that binds the parser, imported first

    original = manifest_module.parse_manifest
    seen: Counter[str] = Counter()

    def counting(obj: Any, source: str, strict: bool = True) -> Any:
        seen[str(Path(source).resolve())] += 1
        return original(obj, source, strict=strict)

    monkeypatch.setattr(manifest_module, "parse_manifest", counting)
    for module in list(sys.modules.values()):
        if module is not None and getattr(module, "parse_manifest", None) is original:
            monkeypatch.setattr(module, "parse_manifest", counting)
    return seen


def _copy(tmp_path: Path, src: Path) -> Path:
    dst = tmp_path / "src"
    shutil.copytree(src, dst)
    return dst


def _of(run: Path) -> str:
    return str((run / ITER / MANIFEST_FILE).resolve())


CASES: dict[str, Callable[[Path, Path], list[str]]] = {
    "inspect": lambda src, tmp: ["inspect", str(src)],
    "verify": lambda src, tmp: ["verify", str(src)],
    "reshard": lambda src, tmp: ["reshard", str(src), str(tmp / "out"), "--dp", "1"],
}


@pytest.mark.parametrize("command", sorted(CASES))
def test_a_command_parses_the_manifest_once(command: str, tmp_path: Path, parses: Counter[str]) -> None:
    src = _copy(tmp_path, FOLD)
    r = cli(*CASES[command](src, tmp_path))
    assert r.exit_code == 0, r.stderr
    assert parses[_of(src)] == 1, dict(parses)


def test_migrate_aliased_parses_the_source_manifest_once(tmp_path: Path, parses: Counter[str]) -> None:
    src = _copy(tmp_path, ALIASED)
    r = cli("migrate-aliased", str(src), str(tmp_path / "migrated"), "--reset-lost-moments")
    assert r.exit_code == 0, r.stderr
    assert parses[_of(src)] == 1, dict(parses)
    assert sum(parses.values()) == 2, dict(parses)  # and the copy's, once, by its self-check


def test_a_runtime_load_parses_the_manifest_once(tmp_path: Path, parses: Counter[str]) -> None:
    """The launcher's pre-spawn check of ``--load`` (each rank repeats it in its own process)."""
    from gtp_runtime.checkpoint.verified import preflight
    from gtp_runtime.train import build_parser, resolve

    src = _copy(tmp_path, FOLD)
    args = build_parser().parse_args([a.replace("{ckpt}", str(src)) for a in lc.LOAD_REFUSED])
    cfg, _ = resolve(args, None)
    assert preflight(args.load, cfg, args.optimizer_sharding) == src / ITER
    assert parses[_of(src)] == 1, dict(parses)
