"""NCCL on 2 GPUs: bf16 gradient parity against the fp32 reference (unfused, and with the fused
regions compiled by torch.compile or run by Liger-Kernel), fused against unfused losses, and a
bit-exact checkpoint round-trip and resume with .cp_rank_{i} keys. Skipped where fewer than 2 CUDA devices exist
(CI has none); run on the lent GPU machine with ``pytest -m gpu``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from test_checkpoint import SMALL, _final_tensors, _train

from gtp_format.names import parse_optimizer_key

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

# bf16 params: each weight and activation carries ~3 significant digits, so the step-1 gradients
# and the losses are compared at 3e-2 of each tensor's scale. Params after Adam get 0.15: Adam's
# first steps move every element by about +-lr whatever its gradient's size, so an element whose
# tiny gradient flips sign under bf16 rounding moves 2*lr the other way (2e-3 against weights of
# scale ~0.02). Measured on H200: 0.067 of the scale at worst.
BF16 = ["--bf16", "--device", "cuda", "--reference-tol", "3e-2", "--reference-param-tol", "0.15"]


TOPOLOGIES = {"cp2-fold-g1": ["--cp", "2", "--fold-cp"], "dp2": ["--dp", "2"]}
CASES = [pytest.param(t, f, id=f"{t}-{f or 'unfused'}") for t in TOPOLOGIES for f in (None, "compile")]
CASES.append(pytest.param("cp2-fold-g1", "liger", id="cp2-fold-g1-liger"))


@pytest.mark.parametrize(("topology", "fused"), CASES)
def test_bf16_parity_two_gpus(tmp_path: Path, topology: str, fused: str | None) -> None:
    if fused == "liger":
        pytest.importorskip("liger_kernel")
    extra = ["--fused", fused or "none"]  # no flag on CUDA would be the compiled default
    r = _train(["--nproc-per-node", "2", *TOPOLOGIES[topology], *BF16, *extra, "--steps", "3", "--check-reference",
                "--log-json", str(tmp_path / "log.json")])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads((tmp_path / "log.json").read_text())["rows"]
    assert all(abs(x["zeros"] - x["ref_zeros"]) <= 0.01 * x["ref_zeros"] for x in rows)
    assert all(abs(x["loss"] - x["ref_loss"]) <= 3e-2 * x["ref_loss"] for x in rows)


# Muon on bf16 params: the momentum, Newton-Schulz and master weights are fp32, but the gradients
# come from bf16 GEMMs, and NS multiplies a small singular direction by up to 3.4445**5, so the
# params after Muon steps get the CPU bf16 case's 0.25 of each tensor's scale.
MUON_BF16 = [*BF16[:-1], "0.25", "--optimizer", "muon"]


@pytest.mark.parametrize("topology", ["cp2-fold-g1", "dp2"])
def test_bf16_muon_parity_two_gpus(tmp_path: Path, topology: str) -> None:
    """Muon over NCCL (two all_to_all per step, NS on the owner GPU) against the fp32 Muon reference."""
    r = _train(["--nproc-per-node", "2", *TOPOLOGIES[topology], *MUON_BF16, "--steps", "3", "--check-reference",
                "--log-json", str(tmp_path / "log.json")])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads((tmp_path / "log.json").read_text())["rows"]
    assert all(abs(x["zeros"] - x["ref_zeros"]) <= 0.01 * x["ref_zeros"] for x in rows)
    assert all(abs(x["loss"] - x["ref_loss"]) <= 3e-2 * x["ref_loss"] for x in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_muon_train_step_updates_with_muon(tmp_path: Path) -> None:
    """The training step (``train_step``, no reference check) updates with Muon on CUDA.

    Its device-side fast path is AdamW's; Muon's update takes the clip factor on the host, so a
    Muon run that went through it would silently train with AdamW. The losses of a plain Muon run
    must follow the parity path's (which calls ``step_after_reduce`` itself) much more closely than
    an AdamW run's do."""
    small = ["--hidden", "256", "--ffn-hidden", "512", "--num-heads", "4", "--seq-length", "256",
             "--vocab-size", "1024"]
    runs = {"muon": ["--optimizer", "muon"], "muon-parity": [*MUON_BF16[2:], "--check-reference"],
            "adam": []}
    logs = {}
    for name, extra in runs.items():
        r = _train(["--nproc-per-node", "2", "--cp", "2", "--fold-cp", "--bf16", "--device", "cuda", "--steps", "4",
                    *small, *extra, "--log-json", str(tmp_path / f"{name}.json")])
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        logs[name] = [row["loss"] for row in json.loads((tmp_path / f"{name}.json").read_text())["rows"]]
    same = max(abs(a - b) for a, b in zip(logs["muon"], logs["muon-parity"], strict=True))
    other = max(abs(a - b) for a, b in zip(logs["adam"], logs["muon-parity"], strict=True))
    assert same <= 1e-3 * abs(logs["muon"][0])
    assert other > 10 * max(same, 1e-6)


def test_batched_and_kept_weight_gathers_train_like_single_ones(tmp_path: Path) -> None:
    """Folded weight gathers started 4 at a time (one coalesced NCCL call, GTP_GATHER_BATCH=4), or
    the last 4 kept from forward to backward (GTP_KEEP_LAST=4), give the same losses as one
    gather per use."""
    logs = {}
    for name, env in {"plain": {}, "batch": {"GTP_GATHER_BATCH": "4"}, "keep": {"GTP_KEEP_LAST": "4"}}.items():
        r = _train(["--nproc-per-node", "2", "--cp", "2", "--fold-cp", "--bf16", "--device", "cuda", "--steps", "3",
                    "--hidden", "256", "--ffn-hidden", "512", "--num-heads", "4", "--seq-length", "256",
                    "--vocab-size", "1024", "--log-json", str(tmp_path / f"{name}.json")], env=env)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        logs[name] = [row["loss"] for row in json.loads((tmp_path / f"{name}.json").read_text())["rows"]]
    for name in ("batch", "keep"):
        assert max(abs(a - b) for a, b in zip(logs["plain"], logs[name], strict=True)) <= 1e-5 * abs(logs["plain"][0])


def test_compiled_regions_match_unfused_bf16(tmp_path: Path) -> None:
    """The compiled fused path trains like the unfused one: same losses and grad norms at bf16
    tolerance, step by step (a wrong fused gradient shows in the losses from step 2 on)."""
    logs = {}
    for name, extra in {"unfused": ["--fused", "none"], "fused": ["--fused", "compile"]}.items():
        r = _train(["--nproc-per-node", "2", "--cp", "2", "--fold-cp", "--bf16", "--device", "cuda", "--steps", "4",
                    "--hidden", "256", "--ffn-hidden", "512", "--num-heads", "4", "--seq-length", "256",
                    "--vocab-size", "1024", *extra, "--log-json", str(tmp_path / f"{name}.json")])
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        logs[name] = json.loads((tmp_path / f"{name}.json").read_text())["rows"]
    for a, b in zip(logs["unfused"], logs["fused"], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-2 * abs(a["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 5e-2 * abs(a["grad_norm"])


def test_nccl_roundtrip_and_resume_bit_exact(tmp_path: Path) -> None:
    args = ["--nproc-per-node", "2", "--cp", "2", "--fold-cp", "--bf16", "--device", "cuda", *SMALL]
    a, b = tmp_path / "a", tmp_path / "b"
    assert _train([*args, "--steps", "4", "--save", str(a), "--log-json", str(tmp_path / "a.json")]).returncode == 0
    assert _train([*args, "--steps", "2", "--save", str(b)]).returncode == 0
    r = _train([*args, "--steps", "4", "--load", str(b), "--save", str(b), "--log-json", str(tmp_path / "b.json")])
    assert r.returncode == 0, r.stderr[-3000:]
    full = json.loads((tmp_path / "a.json").read_text())["rows"]
    resumed = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert [x["loss"] for x in full[2:]] == [x["loss"] for x in resumed]
    ta, tb = _final_tensors(a / "iter_0000004"), _final_tensors(b / "iter_0000004")
    assert ta.keys() == tb.keys()
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    keys = dcp.FileSystemReader(b / "iter_0000004").read_metadata().state_dict_metadata
    cps = {p.cp_rank for k in keys if (p := parse_optimizer_key(k)) and p.cp_rank is not None}
    assert cps == {0, 1}



def _cp_attention_rank(seq: int) -> dict[str, float]:
    """One of 2 NCCL ranks: cuDNN CP attention of this rank's tokens against fp64 causal attention
    of the whole sequence (same seed on both ranks); relative errors of out, dq, dk, dv."""
    import torch.distributed as dist

    from gtp_runtime.context_parallel import cp_positions, use_cudnn
    from gtp_runtime.cp_cudnn import CudnnCPAttention
    from gtp_runtime.groups import Group

    rank = dist.get_rank()
    torch.manual_seed(0)
    full = [torch.randn(1, seq, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    q, k, v, dout = full
    pos = cp_positions(seq, 2, rank, device=torch.device("cuda"))
    local = [t[:, pos].clone().requires_grad_() for t in (q, k, v)]
    assert use_cudnn(local[0])
    out = CudnnCPAttention.apply(*local, Group("cp", [0, 1], dist.group.WORLD, rank))
    out.backward(dout[:, pos])
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in ref_in), is_causal=True).transpose(1, 2)
    ref.backward(dout.double())
    errs = {}
    for name, got, want in zip(("out", "dq", "dk", "dv"), [out, *(t.grad for t in local)],
                               [ref, *(t.grad for t in ref_in)]):
        w = want[:, pos]
        errs[name] = ((got.double() - w).norm() / w.norm()).item()
    return errs


def test_cudnn_cp_attention_matches_fp64_reference() -> None:
    """cp2 attention on cuDNN blocks (log-sum-exp merge, blockwise backward, collectives overlapped
    with the diagonal blocks) against causal attention of the whole sequence, on both ranks."""
    from gtp_runtime.launch import run_local_ranks

    for errs in run_local_ranks(2, _cp_attention_rank, (2048,), tag="cp_cudnn", backend="nccl"):
        assert all(e < 2e-2 for e in errs.values()), errs
