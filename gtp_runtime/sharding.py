"""GTP_remat weight sharding on tensors: cutting shards, and the all-gather / reduce-scatter linear.

The shard arithmetic (which rows a rank holds) is :class:`gtp_format.layout.shard.ShardSpec`,
shared with ``ckpt``; this module applies it to tensors.

:class:`GTPLinearFn` is ZeRO-3 per weight: the full weight exists only inside the op. Forward
gathers it, uses it, drops it; backward gathers it again (the "remat") and reduce-scatters the
weight gradient. Saving only the shard is what makes the memory saving real.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gtp_format.layout.shard import ShardSpec
from gtp_format.numbers import NumberError, env_int
from gtp_runtime.collectives import all_gather_raw, reduce_scatter_raw
from gtp_runtime.groups import Group


def take_shard(spec: ShardSpec, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of the full tensor (zero rows where the shard is tail padding)."""
    tl = spec.tp_local_shape
    if spec.tp_mode in ("column", "vocab"):
        full = full[spec.tp_rank * tl[0] : (spec.tp_rank + 1) * tl[0]]
    elif spec.tp_mode == "row":
        full = full[:, spec.tp_rank * tl[1] : (spec.tp_rank + 1) * tl[1]]
    out = torch.zeros(spec.local_shape, dtype=full.dtype, device=full.device)
    start = spec.shard_start()
    out[: spec.valid_rows] = full[start : start + spec.valid_rows]
    return out


def drop_padding(spec: ShardSpec, gathered: torch.Tensor) -> torch.Tensor:
    """Drop the tail padding of a gathered (padded) TP-local weight."""
    return gathered[: spec.tp_local_shape[0]]


def wgrad_fp32(grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``grad_out^T @ x`` accumulated and returned in fp32 (bf16 inputs on CUDA stay bf16 GEMMs)."""
    g2 = grad_out.reshape(-1, grad_out.shape[-1])
    x2 = x.reshape(-1, x.shape[-1])
    if g2.is_cuda and g2.dtype != torch.float32:
        try:
            return torch.mm(g2.t(), x2, out_dtype=torch.float32)
        except (TypeError, RuntimeError):
            return (g2.t() @ x2).float()
    return g2.t().float() @ x2.float()


def accumulate_wgrad(out: torch.Tensor, grad_out: torch.Tensor, x: torch.Tensor) -> None:
    """``out += grad_out^T @ x`` with ``out`` fp32 (a ``main_grad`` view).

    On CUDA the sum is the GEMM's own epilogue (cuBLAS with beta=1 reads ``out``), so no fp32
    weight-gradient tensor is written and read back: on the H200 benchmark those copies and adds
    moved about 4 GB per layer. The CPU path keeps the separate product and add, bit for bit what
    it always computed (the fp32 reference and the bit-exact resume compare against it).
    """
    g2 = grad_out.reshape(-1, grad_out.shape[-1])
    x2 = x.reshape(-1, x.shape[-1])
    if g2.is_cuda:
        try:
            if g2.dtype == torch.float32:
                out.addmm_(g2.t(), x2)
            else:
                torch.addmm(out, g2.t(), x2, out_dtype=torch.float32, out=out)
            return
        except (TypeError, RuntimeError):
            pass
    out.add_(wgrad_fp32(grad_out, x))


# How many weights ahead :class:`GTPComm` starts all-gathers (forward and backward).
PREFETCH_DEPTH = 2
# How many weights one prefetch starts together (one coalesced NCCL call); 1: each on its own.
# GTP_GATHER_BATCH sets it for a run (read by each rank at import).
GATHER_BATCH_ENV, KEEP_LAST_ENV = "GTP_GATHER_BATCH", "GTP_KEEP_LAST"


def env_knobs() -> tuple[int, int]:
    """(GTP_GATHER_BATCH, GTP_KEEP_LAST), ASCII integers in range, or :class:`NumberError` naming the
    variable. The launcher calls it before any rank starts (``train.resolve``), so the module-level
    values below, read leniently at import, are never a value the launcher refused."""
    return env_int(GATHER_BATCH_ENV, 1, 1, 1 << 20), env_int(KEEP_LAST_ENV, 0, 0, 1 << 20)


def _lenient() -> tuple[int, int]:
    try:
        return env_knobs()
    except NumberError:
        return 1, 0


GATHER_BATCH = _lenient()[0]
# How many of the last weights in forward order keep their forward gather for backward instead
# of gathering again (GTP_KEEP_LAST sets it for a run). Backward starts with them right after
# forward ends, so keeping them costs memory only for that short stretch (torchtitan does not
# reshard its last block after forward for the same reason).
KEEP_LAST = _lenient()[1]


class _Batch:
    """The works of one coalesced start, waited for once by whichever of its weights comes first."""

    def __init__(self, works: list[Any]) -> None:
        self.works: list[Any] | None = works

    def wait(self) -> None:
        if self.works is not None:
            for w in self.works:
                w.wait()
            self.works = None


class GTPComm:
    """Schedules the collectives of every GTP weight of one model.

    * Prefetch: forward uses the weights in registration order and backward in reverse, so when
      weight ``i`` is gathered the gathers of the next ``PREFETCH_DEPTH`` weights (``i+1, i+2``
      forward, ``i-1, i-2`` backward) are started asynchronously; on NCCL they run on the
      communicator's stream while this GEMM runs.
    * Overlapped reduce-scatter: the weight-gradient reduce-scatter is started asynchronously and
      completed (and added into ``main_grad``) by :meth:`finish_grad_reduce`, which the optimizer
      calls before it touches the gradients.
    * Fresh gradients: after :meth:`mark_fresh` (the optimizer's ``zero_grad``) a weight's first
      reduce-scatter writes straight into its zeroed ``main_grad`` instead of into a temporary that
      is added afterwards (one fp32 pass over the shard less per weight).
    * ``on_grad_ready(shard)`` is called once a weight's ``main_grad`` holds its final value for
      the step, so the optimizer can start reducing a bucket while backward still runs.
    Every rank runs the same program, so every rank issues the same collectives in the same order.
    """

    def __init__(self, prefetch: bool = True, overlap_grad_reduce: bool = True) -> None:
        self.prefetch, self.overlap = prefetch, overlap_grad_reduce
        self.order: list[torch.Tensor] = []
        self._gathers: dict[int, tuple[torch.Tensor, Any]] = {}
        self._reduces: list[tuple[torch.Tensor | None, Any, torch.Tensor, torch.Tensor]] = []
        self._fresh: set[int] = set()
        self.on_grad_ready: Callable[[torch.Tensor], None] | None = None

    def register(self, shard: torch.Tensor, group: Group) -> None:
        shard.gtp_index = len(self.order)  # type: ignore[attr-defined]
        shard.gtp_group = group  # type: ignore[attr-defined]
        self.order.append(shard)

    def mark_fresh(self) -> None:
        """Every ``main_grad`` was just zeroed: the next reduce-scatter of each may overwrite it.

        Also drops gathers kept from a forward whose backward never ran (an evaluation): the
        shards may have changed since."""
        self._fresh = set(range(len(self.order)))
        for _, work in self._gathers.values():
            if work is not None:  # never leave a collective writing into a freed buffer
                work.wait()
        self._gathers.clear()

    def _ready(self, shard: torch.Tensor) -> None:
        if self.on_grad_ready is not None:
            self.on_grad_ready(shard)

    def _start_gather(self, shard: torch.Tensor, async_op: bool) -> tuple[torch.Tensor, Any]:
        group: Group = shard.gtp_group  # type: ignore[attr-defined]
        if group.size == 1:
            return shard, None
        out = torch.empty((group.size * shard.shape[0], *shard.shape[1:]), dtype=shard.dtype, device=shard.device)
        work = all_gather_raw(out, shard.detach().contiguous(), group=group.handle, async_op=async_op)
        return out, work

    def prefetch_neighbour(self, idx: int, step: int) -> None:
        """Start the gathers of the next ``PREFETCH_DEPTH`` weights in direction ``step``.

        Two ahead, not one: on 2 x H200 (folded cp2) the trace of a one-ahead step showed 7 ms
        of forward weight all-gathers with no kernel beside them (a collective waits for the
        compute stream at the point it is issued, and for SMs a GEMM holds), so the gather of a
        weight is issued one GEMM earlier. Measured only together with other changes (see
        docs/performance.md); the price is one more gathered weight alive at a time.

        With ``GATHER_BATCH`` > 1 a missing weight is started together with the next ones (up to
        ``GATHER_BATCH`` of the same group) in one coalesced call, so a layer's weights cost the
        host one collective instead of one each: a folded step issues 64 weight all-gathers, and
        a host-bound rank pays for each (see docs/performance.md, third round). The price is up
        to ``GATHER_BATCH + PREFETCH_DEPTH`` gathered weights alive at a time (tested).
        """
        if not self.prefetch:
            return
        ahead = [idx + a * step for a in range(1, PREFETCH_DEPTH + 1)]
        missing = [n for n in ahead if 0 <= n < len(self.order) and n not in self._gathers]
        if not missing:
            return
        if GATHER_BATCH <= 1:
            for n in missing:
                self._gathers[n] = self._start_gather(self.order[n], async_op=True)
            return
        group: Group = self.order[missing[0]].gtp_group  # type: ignore[attr-defined]
        batch = []
        for k in range(GATHER_BATCH):
            n = missing[0] + k * step
            if not 0 <= n < len(self.order) or n in self._gathers or self.order[n].gtp_group is not group:  # type: ignore[attr-defined]
                break
            batch.append(n)
        self._start_batch(batch, group)

    def _start_batch(self, batch: list[int], group: Group) -> None:
        """The gathers of ``batch`` (weights of one group), as one coalesced call on NCCL."""
        shards = [self.order[n] for n in batch]
        if group.size == 1 or shards[0].device.type != "cuda":  # gloo does not coalesce: one call each
            for n in batch:
                self._gathers[n] = self._start_gather(self.order[n], async_op=True)
            return
        # Inside the manager each call only queues its collective; the manager's work covers all.
        with dist._coalescing_manager(group=group.handle, device=shards[0].device, async_ops=True) as cm:
            outs = [self._start_gather(s, async_op=False)[0] for s in shards]
        work = _Batch(list(cm.works))
        for n, out in zip(batch, outs):
            self._gathers[n] = (out, work)

    def gather(self, shard: torch.Tensor, step: int, keep: bool = False) -> torch.Tensor:
        """The full (padded) weight of ``shard``; prefetches the neighbour ``step`` (+1 or -1) away.

        ``keep`` (a forward whose backward will run): one of the last ``KEEP_LAST`` weights stays
        gathered for its backward.
        """
        idx = shard.gtp_index  # type: ignore[attr-defined]
        out, work = self._gathers.pop(idx, None) or self._start_gather(shard, async_op=False)
        if work is not None:
            work.wait()
        if keep and step > 0 and idx >= len(self.order) - KEEP_LAST:
            self._gathers[idx] = (out, None)
        self.prefetch_neighbour(idx, step)
        return out

    def weight_grad(self, shard: torch.Tensor, grad_out: torch.Tensor, x: torch.Tensor,
                    rows: int) -> torch.Tensor | None:
        """Turn ``grad_out^T @ x`` (the TP-local weight gradient) into this rank's shard gradient.

        With a ``main_grad`` and a weight group of one the GEMM accumulates straight into it;
        otherwise the fp32 gradient goes through :meth:`reduce_scatter`.
        """
        group: Group = shard.gtp_group  # type: ignore[attr-defined]
        main_grad = getattr(shard, "main_grad", None)
        if group.size == 1 and main_grad is not None:
            accumulate_wgrad(main_grad[:rows], grad_out, x)
            self._ready(shard)
            return None
        padded = shard.shape[0] * group.size
        if rows == padded:
            grad_full = wgrad_fp32(grad_out, x)  # no padding rows: reduce the GEMM's output itself
        else:
            grad_full = torch.empty((padded, shard.shape[1]), dtype=torch.float32, device=shard.device)
            grad_full[:rows] = wgrad_fp32(grad_out, x)
            grad_full[rows:].zero_()
        return self.reduce_scatter(shard, grad_full)

    def reduce_scatter(self, shard: torch.Tensor, grad_full: torch.Tensor) -> torch.Tensor | None:
        """Average ``grad_full`` over the weight group into this rank's shard gradient.

        With a ``main_grad`` the result is added to it (now, or at :meth:`finish_grad_reduce` with
        overlap) and ``None`` is returned.
        """
        group: Group = shard.gtp_group  # type: ignore[attr-defined]
        main_grad = getattr(shard, "main_grad", None)
        if group.size == 1:
            if main_grad is None:
                return grad_full
            main_grad.add_(grad_full)
            self._ready(shard)
            return None
        idx = shard.gtp_index  # type: ignore[attr-defined]
        direct = main_grad is not None and idx in self._fresh
        self._fresh.discard(idx)
        out = main_grad if direct else torch.empty(
            (grad_full.shape[0] // group.size, *grad_full.shape[1:]), dtype=grad_full.dtype, device=grad_full.device)
        overlap = self.overlap and main_grad is not None
        work = reduce_scatter_raw(out, grad_full, op=dist.ReduceOp.AVG, group=group.handle, async_op=overlap)
        if main_grad is None:
            return out
        if overlap:
            self._reduces.append((None if direct else out, work, main_grad, shard))
            return None
        if not direct:
            main_grad.add_(out)
        self._ready(shard)
        return None

    def finish_grad_reduce(self) -> None:
        for out, work, main_grad, shard in self._reduces:
            work.wait()
            if out is not None:
                main_grad.add_(out)
            self._ready(shard)
        self._reduces.clear()


class GTPLinearFn(torch.autograd.Function):
    """``y = x @ W.T`` where ``W`` is gathered from its shards in forward and again in backward.

    Only the shard is saved for backward: the full weight exists only inside each GEMM, which is
    the ZeRO-3 memory saving. The weight gradient is reduce-scattered (averaged: the bucket divisor
    then only covers the buffer's DP group, see docs/training-step.md) and accumulated in fp32 into
    ``main_grad``, so a bf16 param never rounds its gradient to bf16 on the way.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shard: torch.Tensor, comm: GTPComm, rows: int) -> torch.Tensor:
        full = comm.gather(shard, +1, keep=any(ctx.needs_input_grad))[:rows]
        ctx.save_for_backward(x, shard)
        ctx.comm, ctx.rows = comm, rows
        return F.linear(x, full)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        x, shard = ctx.saved_tensors
        comm, rows = ctx.comm, ctx.rows
        grad_x = None
        full = comm.gather(shard, -1)[:rows]
        if ctx.needs_input_grad[0]:
            grad_x = grad_out @ full
        del full
        grad_shard = comm.weight_grad(shard, grad_out, x, rows)
        return grad_x, None if grad_shard is None else grad_shard.to(shard.dtype), None, None


def gtp_linear(x: torch.Tensor, shard: torch.Tensor, comm: GTPComm, rows: int) -> torch.Tensor:
    """Linear with a GTP-sharded weight; also used at group size 1 so that the fp32 gradient path
    is the same for every topology."""
    return GTPLinearFn.apply(x, shard, comm, rows)
