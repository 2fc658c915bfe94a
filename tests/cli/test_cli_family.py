"""One CLI family: ``ckpt``, ``gtp-train`` and ``gtp-data`` as entry points, ``--version`` and ``-h``
everywhere, a top-level help naming every command, examples in every help, one spelling of
``--keys``/``--ignore``, and option errors in plain words."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_tool import cli
from gtp_format import __version__

REPO = Path(__file__).resolve().parents[2]
FOLD = REPO / "fixtures" / "gtp" / "fold_cp2_g2_dp2"


def _run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.run(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_entry_points_resolve_and_share_one_version() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    scripts = project["project"]["scripts"]
    assert set(scripts) == {"ckpt", "gtp-train", "gtp-data"}
    for target in scripts.values():
        module, _, name = target.partition(":")
        assert callable(getattr(importlib.import_module(module), name)), target
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "gtp_format.__version__"}


@pytest.mark.parametrize("argv", [["-m", "gtp_runtime.train"], ["-m", "gtp_runtime.data"], ["-m", "ckpt_tool.cli"]])
def test_version_everywhere(argv: list[str]) -> None:
    p = subprocess.run([sys.executable, *argv, "--version"], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0 and p.stdout.strip().endswith(__version__), (p.stdout, p.stderr)


def test_top_level_help_names_every_command(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = _run(capsys, "-h")
    assert code == 0
    names = cli.command_names()
    assert {"reshard", "export", "verify-roundtrip"} <= set(names)
    description = " ".join(out.split())
    for name in names:
        assert name in description.split("Commands:")[1], name


@pytest.mark.parametrize("command", cli.command_names())
def test_every_command_takes_h_and_shows_examples(capsys: pytest.CaptureFixture, command: str) -> None:
    code, out, _ = _run(capsys, command, "-h")
    assert code == 0 and "Examples" in out, out[-500:]
    flag_lines = [line for line in out.splitlines() if "--help" not in line and "<bool>" in line]
    assert not flag_lines, f"an on/off flag shows a value: {flag_lines}"


def test_choices_show_in_metavars(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    # Wide enough that rich does not cut the metavar column: at 80 columns its width depends on the
    # longest option name (--etp's long form cut "torch_dist|safete" to "torch_dist|safet").
    monkeypatch.setenv("COLUMNS", "200")
    _, reshard, _ = _run(capsys, "reshard", "-h")
    _, export, _ = _run(capsys, "export", "-h")
    assert "torch_dist|safetensors" in reshard and "hf|fully_reshardable|torch" in export


def test_keys_and_ignore_are_one_option_everywhere() -> None:
    import typer.main

    command = typer.main.get_command(cli.app)
    seen = {}
    for name in ("inspect", "diff", "verify-roundtrip"):
        params = {p.name: p for p in command.commands[name].params}  # type: ignore[attr-defined]
        for opt in ("keys", "ignore"):
            p = params[opt]
            seen.setdefault(opt, (p.multiple, p.help, p.metavar))
            assert (p.multiple, p.help, p.metavar) == seen[opt], (name, opt)
            assert p.multiple


def test_inspect_keys_repeatable_with_ignore(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = _run(capsys, "inspect", str(FOLD), "--keys", "*exp_avg*", "--keys", "*exp_avg_sq*", "--ignore",
                        "*exp_avg_sq*", "--format", "json")
    doc = json.loads(out)
    keys = [r["key"] for r in doc["optimizer"]]
    assert code == 0 and keys and all("exp_avg" in k and "exp_avg_sq" not in k for k in keys)


@pytest.mark.parametrize(("argv", "words"), [
    (["inspect", str(FOLD), "--cp-size", "0"], "'--cp-size': must be at least 1"),
    (["inspect", str(FOLD), "--cp-size", "x"], "'--cp-size': must be a whole number"),
    (["verify", str(FOLD), "--workers", "99"], "'--workers': must be at most 64"),
    (["diff", str(FOLD), str(FOLD), "--rtol", "abc"], "'--rtol': must be a number"),
    (["inspect", str(FOLD), "--format", "xml"], "'xml' is not one of"),
])
def test_option_errors_in_plain_words(capsys: pytest.CaptureFixture, argv: list[str], words: str) -> None:
    code, _, err = _run(capsys, *argv)
    assert code == 2 and words in err, err
    assert "Input should" not in err and "Value error" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("value", [-5, 0, 0.5, 1, 3, 64, 65, 99])
@pytest.mark.parametrize("lo,hi,open_lo,open_hi", [(1, 64, False, False), (1, None, False, False),
                                                    (None, 64, False, False), (0, None, True, False),
                                                    (None, 1, False, True), (0, 5, True, False)])
def test_click_ranges_in_plain_words(value: float, lo: float | None, hi: float | None, open_lo: bool,
                                     open_hi: bool) -> None:
    """click's range messages (typer without pydantic) name the bound the value breaks, as brute force says."""
    from ckpt_tool.cli import plain_words

    left = "" if lo is None else f"{lo}{'<' if open_lo else '<='}"
    right = "" if hi is None else f"{'<' if open_hi else '<='}{hi}"
    if lo is not None and hi is None:  # click writes a lone lower bound after x: x>=1, x>0
        left, right = "", f"{'>' if open_lo else '>='}{lo}"
    below = lo is not None and (value < lo or (open_lo and value == lo))
    above = hi is not None and (value > hi or (open_hi and value == hi))
    if not (below or above):
        return  # click would not complain
    got = plain_words(f"Invalid value for '--n': {value} is not in the range {left}x{right}.")
    want = (f"must be more than {lo}" if open_lo else f"must be at least {lo}") if below else \
        (f"must be less than {hi}" if open_hi else f"must be at most {hi}")
    assert got == f"Invalid value for '--n': {want}", got
