"""One rank's training state and step: model, optimizer, the batch it sees, the step itself."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.profiler import record_function

from gtp_format.layout import topology as topo
from gtp_format.layout.buckets import DEFAULT_BUCKET_SIZE
from gtp_format.layout.config import ModelConfig, ParallelConfig
from gtp_format.lineage import Parent
from gtp_runtime.context_parallel import cp_positions, split_for_cp
from gtp_runtime.data import lane_slice
from gtp_runtime.data.source import DataConfig, DataSource, RecordedData, open_source
from gtp_runtime.groups import Groups, build_groups
from gtp_runtime.lr_schedule import LRConfig, LRScheduler
from gtp_runtime.model import GPTModel, is_gtp_dense
from gtp_runtime.muon import DistributedMuon, MuonConfig
from gtp_runtime.optimizer import AdamConfig, DistributedAdam, StepStats


@dataclass
class TrainConfig:
    par: ParallelConfig
    model: ModelConfig
    adam: AdamConfig = field(default_factory=AdamConfig)
    optimizer: str = "adam"
    """``"adam"`` (AdamW for every param) or ``"muon"`` (Muon for the linears, AdamW for the rest)."""
    muon: MuonConfig = field(default_factory=MuonConfig)
    micro_batch: int = 2
    bucket_size: int = DEFAULT_BUCKET_SIZE
    param_dtype: torch.dtype = torch.float32
    prefetch: bool = True
    """Start the next GTP weight's all-gather while the current GEMM runs."""
    overlap_grad_reduce: bool = True
    """Finish weight-gradient reduce-scatters at the optimizer step instead of inside backward, and
    start each gradient bucket's reduction during backward as soon as its last gradient is final."""
    fused: str | None = None
    """Fused element-wise regions: ``"compile"`` (torch.compile on CUDA) or ``"liger"``; see
    :mod:`gtp_runtime.fused`. ``None`` keeps the unfused layers."""
    data: DataConfig = field(default_factory=DataConfig)
    lr: LRConfig | None = None
    """The schedule; ``None``: constant at ``adam.lr`` (what every run did before schedules)."""

    @property
    def lanes(self) -> int:
        """Data lanes: every (gtp_remat, dp) pair sees distinct sequences."""
        return self.par.gtp_remat * self.par.dp

    @property
    def global_batch_size(self) -> int:
        return self.lanes * self.micro_batch


@dataclass
class StepResult:
    step: int
    loss: float
    grad_norm: float
    num_zeros: int
    seconds: float
    lr: float = 0.0


class Trainer:
    def __init__(self, cfg: TrainConfig, groups: Groups | None = None, device: torch.device | None = None) -> None:
        cfg.par.validate(dist.get_world_size(), cfg.model.num_experts)
        cfg.model.validate(cfg.par)
        self.cfg = cfg
        self.device = device or torch.device("cpu")
        self.groups = groups or build_groups(cfg.par)
        self.model = GPTModel(cfg.model, cfg.par, self.groups, dtype=cfg.param_dtype, device=self.device,
                              prefetch=cfg.prefetch, overlap_grad_reduce=cfg.overlap_grad_reduce, fused=cfg.fused)
        if cfg.optimizer == "muon":
            self.optimizer: DistributedAdam = DistributedMuon(self.model, self.groups, cfg.adam, cfg.muon,
                                                              cfg.bucket_size)
        elif cfg.optimizer == "adam":
            self.optimizer = DistributedAdam(self.model, self.groups, cfg.adam, cfg.bucket_size)
        else:
            raise ValueError(f"unknown optimizer {cfg.optimizer!r}; use 'adam' or 'muon'")
        self.iteration = 0
        self.consumed_train_samples = 0
        """Megatron's data position: the next step reads samples from here on."""
        self.run_id: str | None = None
        """Lineage (:mod:`gtp_format.lineage`): made at the run's first save, carried over by a load."""
        self.lineage_parent: Parent | None = None
        """The checkpoint this run was loaded from (None: a fresh run)."""
        self.scheduler = LRScheduler(cfg.lr or LRConfig(max_lr=cfg.adam.lr))
        self._data: DataSource | RecordedData | None = None

    @property
    def data(self) -> DataSource | RecordedData:
        """Opened on first use: checkpoint-only users of a Trainer never touch the corpus (and a
        config carrying a checkpoint's recorded fingerprint never opens a file at all)."""
        if self._data is None:
            m = self.cfg.model
            self._data = open_source(self.cfg.data, m.seq_length, m.vocab_size, m.seed)
        return self._data

    @property
    def lane(self) -> int:
        c = self.groups.coords
        return c.gtp + self.cfg.par.gtp_remat * c.dp

    def local_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's tokens, labels and global positions for ``step`` (1-based)."""
        return self.split_local(*self.global_batch(step))

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and labels ``[global_batch_size, seq_length]`` of ``step`` (1-based, >= the next one)."""
        gbs = self.cfg.global_batch_size
        return self.data.train_batch(self.consumed_train_samples + (step - self.iteration - 1) * gbs, gbs)

    def split_local(self, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's lane of a global batch, cut for CP, with global positions.

        On CUDA the batch goes through pinned memory without blocking and the positions are built
        on the device: a pageable copy waits for the GPU to finish the previous step's optimizer
        first, and on 2 x H200 the three copies were one of four host syncs a step. The values are
        the CPU path's (the same corpus windows and the same positions).
        """
        m = self.cfg.model
        sl = lane_slice(self.lane, self.cfg.micro_batch)
        cp = self.groups[topo.CP]
        if self.device.type == "cuda":
            # The CP split runs on the GPU too: on the H200 hosts a CPU index of 8192 tokens took
            # 9-14 ms (two a step, while the GPU waited).
            tokens, labels = (t[sl].pin_memory().to(self.device, non_blocking=True) for t in (tokens, labels))
            pos = cp_positions(m.seq_length, cp.size, cp.rank, device=self.device)
            return tokens[:, pos], labels[:, pos], pos
        tokens, labels = split_for_cp(tokens[sl], cp.size, cp.rank), split_for_cp(labels[sl], cp.size, cp.rank)
        pos = cp_positions(m.seq_length, cp.size, cp.rank)
        return tokens.to(self.device), labels.to(self.device), pos.to(self.device)

    def forward_backward(self, step: int) -> float:
        """Forward and backward of one step; returns the global mean loss."""
        return self._forward_backward(step).item()

    def _forward_backward(self, step: int) -> torch.Tensor:
        """Forward and backward; the global mean loss as a device scalar (no host sync).

        The ``record_function`` labels name the phases in a profiler trace (bench_gpu.py reads
        them to say in which phase the GPU sat idle); they cost nothing without a profiler.
        """
        with record_function("zero_grad+batch"):
            self.optimizer.zero_grad()
            tokens, labels, pos = self.local_batch(step)
        with record_function("forward"):
            loss = self.model(tokens, labels, pos)
        with record_function("backward"):
            loss.backward()
            reported = loss.detach().float().clone()
            dist.all_reduce(reported, op=dist.ReduceOp.AVG, group=self.groups[topo.REPLICATED].handle)
            return reported

    def train_step(self) -> StepResult:
        """One step. On CUDA the host waits for the GPU once, for the loss and the grad statistics,
        while the optimizer's kernels are still queued (see :meth:`DistributedAdam.step`)."""
        t0 = time.perf_counter()
        step = self.iteration + 1
        loss = self._forward_backward(step)
        lr = self.optimizer.lr = self.scheduler.get_lr()
        with record_function("optimizer"):
            stats: StepStats = self.optimizer.step(loss)
        self.end_step(step)
        assert stats.loss is not None
        return StepResult(step, stats.loss, stats.grad_norm, stats.num_zeros, time.perf_counter() - t0, lr)

    def end_step(self, step: int) -> None:
        """Advance iteration, schedule and data position after the update of ``step``."""
        self.iteration = step
        self.scheduler.step()
        self.consumed_train_samples += self.cfg.global_batch_size

    @torch.no_grad()
    def evaluate(self, iters: int) -> float:
        """Mean loss over the first ``iters`` validation batches (the same ones every time)."""
        total = 0.0
        for i in range(iters):
            tokens, labels, pos = self.split_local(*self.data.valid_batch(i, self.cfg.global_batch_size))
            loss = self.model(tokens, labels, pos).detach().float().clone()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.groups[topo.REPLICATED].handle)
            total += loss.item()
        return total / iters

    def dense_weight_grad_bytes(self) -> int:
        """Bytes this rank holds for dense GTP weights and their gradients (the folding target)."""
        total = 0
        for p in self.model.parameters():
            if is_gtp_dense(p):
                total += p.numel() * p.element_size() + p.main_grad.numel() * p.main_grad.element_size()
        return total
