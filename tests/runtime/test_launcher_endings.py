"""Every ending of the launcher says what happened (issue 27): a ``--load`` already at or past
``--steps``, at another topology (naming the ``ckpt reshard`` command), or of a megatron-core
checkpoint (naming the route in). All are decided before any rank starts."""

from __future__ import annotations

import subprocess

import launcher_cases as lc

FIXTURE = lc.REPO / "fixtures" / "gtp" / "fold_cp2_g2_dp2"  # iteration 2
MEGATRON = lc.REPO / "fixtures" / "megatron" / "tp2_dp2_dp_reshardable"


def _launch(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([*lc.LAUNCHER, *argv], cwd=lc.REPO, env=lc.env(), capture_output=True, text=True,
                          timeout=300)


def test_load_at_or_past_steps_says_so_and_exits_0() -> None:
    for steps in ("2", "1"):
        p = _launch(*lc.FIXTURE_MODEL, "--steps", steps, "--load", str(FIXTURE))
        assert p.returncode == 0, p.stderr
        assert f"is at iteration 2, already at or past --steps (--train-iters) {steps}" in p.stdout, p.stdout
        assert "pass --steps N with N > 2" in p.stdout and "step " not in p.stdout and p.stderr == ""


def test_load_at_another_topology_names_the_reshard_command() -> None:
    model = list(lc.FIXTURE_MODEL)
    i = model.index("--cp")
    model[i + 1] = "1"
    model.remove("--fold-cp")
    model[model.index("--dp") + 1] = "4"
    p = _launch(*model, "--steps", "3", "--load", str(FIXTURE))
    assert p.returncode == 2, (p.stdout, p.stderr)
    line = p.stderr.strip()
    assert len(line.splitlines()) == 1 and "cp: saved 2 now 1" in line, line
    assert f"ckpt reshard {FIXTURE / 'iter_0000002'} NEW --tp 1 --cp 1 --gtp-remat 2 --no-fold-cp" in line, line
    assert "--dp 4, then --load NEW" in line and "'ckpt plan'" in line and p.stdout == ""


def test_load_of_a_megatron_checkpoint_names_the_route_in() -> None:
    p = _launch("--nproc-per-node", "4", "--tp", "2", "--dp", "2", "--steps", "3", "--load", str(MEGATRON))
    assert p.returncode == 2, (p.stdout, p.stderr)
    line = p.stderr.strip()
    assert len(line.splitlines()) == 1 and "not a gtp_runtime checkpoint" in line, line
    assert "'ckpt export SRC HF --to hf'" in line and "'ckpt import HF DST --from hf'" in line, line
