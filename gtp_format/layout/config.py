"""Parallel and model configuration, with the validation every launch goes through.

Each check raises :class:`ConfigError` with one line that says what to change. The checks live
here, not in the launcher, so the library, the launcher and the ``ckpt`` CLI refuse the same
shapes with the same words (upstream, NVIDIA/Megatron-LM#6886 as reviewed, validated a flag in one entry point and
not another).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

MAX_TARGET_WORLD = 1 << 20
"""The most ranks a target topology of ``ckpt reshard``, ``ckpt import`` and ``ckpt plan`` may have.

Why: those plan a shard (and, for megatron-core's layout, a data file) per target rank, so the plan
grows with the world the flags ask for, not with what SRC stores: ``--dp 4611686018427387904`` planned
until memory ran out (``MemoryError`` after 11-27 s under a 3-4 GB limit, an OOM kill without one).
1,048,576 ranks is ten times the largest training runs reported (about 10^5 GPUs)."""


class ConfigError(ValueError):
    """A configuration that cannot run. The message is one line and names the fix."""


def target_world_problem(sizes: dict[str, int], elements: int | None = None, what: str = "SRC") -> str | None:
    """Why the target topology of ``sizes`` (flag name -> size; their product is the world) is too big
    to plan, or None: over :data:`MAX_TARGET_WORLD`, or over ``elements``, the model's elements in
    the source (its weight keys' numel; the reader checks them against the stored chunks).

    A target is bounded by the data: the distributed optimizer splits every parameter element over
    the ranks (TP x PP x the DP group), so a world larger than the elements there are leaves some rank
    holding nothing, and that is not a plan. (``plan`` of a 100 KB
    source at a world just under 2^20 answered ``needs_reshard``, and that reshard took 1.2 GB and
    120 s.)"""
    world = math.prod(sizes.values())
    shown = " x ".join(f"{k} {v}" for k, v in sizes.items())
    if world > MAX_TARGET_WORLD:
        return (f"the target world {shown} = {world} ranks is over {MAX_TARGET_WORLD} (ten times the largest runs "
                "reported); pick smaller sizes")
    if elements is not None and world > max(1, elements):
        return (f"the target world {shown} = {world} ranks is more than the {elements} model elements {what} "
                "stores: some rank would hold nothing; pick smaller sizes")
    return None


@dataclass(frozen=True)
class ParallelConfig:
    """Sizes of the dense grid ``tp x cp x gtp_remat x dp`` and the expert grid.

    ``dp`` is the replicate degree: ranks that hold identical weight shards. The expert grid has
    no CP axis: ``world = tp x expert_gtp_remat x expert_dp``, so dense CP ranks are expert
    data-parallel ranks.
    """

    tp: int = 1
    cp: int = 1
    gtp_remat: int = 1
    dp: int = 1
    fold_cp: bool = False
    expert_gtp_remat: int = 1
    average_in_collective: bool = False

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.gtp_remat * self.dp

    @property
    def weight_group_size(self) -> int:
        """Size of the group a dense GTP weight is sharded over."""
        return self.cp * self.gtp_remat if self.fold_cp else self.gtp_remat

    @property
    def dense_gtp_active(self) -> bool:
        """True when dense weights are sharded at all.

        Folding alone makes dense GTP active: at ``gtp_remat == 1`` with ``fold_cp`` the weight
        group is the CP group. Upstream's validation (NVIDIA/Megatron-LM#6886, as reviewed) looked at ``gtp_remat > 1``
        only and missed exactly this shape.
        """
        return self.weight_group_size > 1

    @property
    def expert_dp(self) -> int:
        return self.world_size // (self.tp * self.expert_gtp_remat)

    def validate(self, world_size: int | None = None, num_experts: int = 0) -> None:
        for name in ("tp", "cp", "gtp_remat", "dp", "expert_gtp_remat"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if world_size is not None and world_size != self.world_size:
            raise ConfigError(
                f"world size {world_size} != tp*cp*gtp_remat*dp = {self.tp}*{self.cp}*{self.gtp_remat}*"
                f"{self.dp} = {self.world_size}; change the sizes or launch {self.world_size} ranks"
            )
        if self.fold_cp and self.cp == 1:
            raise ConfigError("--fold-cp needs --cp > 1 (there is no CP axis to fold); drop --fold-cp")
        if self.average_in_collective and (self.dense_gtp_active or self.expert_gtp_remat > 1):
            why = (
                "fold_cp at gtp_remat=1 shards dense weights over the CP group"
                if self.gtp_remat == 1 and self.fold_cp
                else "GTP_remat is active"
            )
            raise ConfigError(
                f"--average-in-collective is not supported with GTP_remat ({why}): the weight-gradient "
                "reduce-scatter already averages over the weight group; drop --average-in-collective"
            )
        if num_experts and (self.world_size // self.tp) % self.expert_gtp_remat:
            raise ConfigError(
                f"--expert-gtp-remat {self.expert_gtp_remat} must divide world/tp = "
                f"{self.world_size // self.tp}; pick a divisor"
            )

    def describe(self) -> str:
        fold = "fold" if self.fold_cp else "nofold"
        return f"tp{self.tp}-cp{self.cp}-g{self.gtp_remat}-dp{self.dp}-{fold}"

    def to_dict(self) -> dict[str, int | bool]:
        return dataclasses.asdict(self)


def infer_dp(tp: int, cp: int, gtp_remat: int, world: int | None) -> int:
    """The replicate degree when ``--dp`` is left out: ``world / (tp*cp*gtp_remat)`` (``world`` None:
    one rank per cell, dp 1). A zero size gives 1, so that :meth:`ParallelConfig.validate` names it.
    The launcher and ``ckpt verify-roundtrip`` both size their runs with it."""
    base = tp * cp * gtp_remat
    if base == 0:
        return 1
    n = world or base
    if n % base:
        raise ConfigError(f"world size {n} is not a multiple of tp*cp*gtp_remat = {base}; pass --dp")
    return n // base


@dataclass(frozen=True)
class ModelConfig:
    """A small Megatron-style GPT. Sizes are per full model (before any sharding)."""

    vocab_size: int = 256
    hidden: int = 64
    num_layers: int = 2
    num_heads: int = 4
    ffn_hidden: int = 128
    seq_length: int = 32
    num_experts: int = 0
    moe_topk: int = 1
    moe_every: int = 2
    """With experts, layers ``i`` where ``i % moe_every == moe_every - 1`` use a MoE MLP."""
    gtp_align: int = 16
    """dim 0 of a GTP weight is padded to a multiple of ``gtp_align * group_size`` (Megatron: 16)."""
    seed: int = 1234
    norm_eps: float = 1e-5

    def validate(self, par: ParallelConfig) -> None:
        for name in ("vocab_size", "hidden", "num_layers", "num_heads", "ffn_hidden", "seq_length", "gtp_align"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.num_experts < 0:
            raise ConfigError(f"--num-experts must be 0 (dense) or positive, got {self.num_experts}")
        if self.hidden % self.num_heads:
            raise ConfigError(f"--hidden {self.hidden} must be a multiple of --num-heads {self.num_heads}")
        if self.num_heads % par.tp:
            raise ConfigError(f"--num-heads {self.num_heads} must be a multiple of --tp {par.tp}")
        if self.ffn_hidden % par.tp:
            raise ConfigError(f"--ffn-hidden {self.ffn_hidden} must be a multiple of --tp {par.tp}")
        if self.vocab_size % par.tp:
            raise ConfigError(f"--vocab-size {self.vocab_size} must be a multiple of --tp {par.tp}")
        if self.seq_length % (2 * par.cp):
            raise ConfigError(
                f"--seq-length {self.seq_length} must be a multiple of 2*cp = {2 * par.cp} "
                "(causal load balancing cuts each sequence into 2*cp chunks)"
            )
        if self.num_experts and not 1 <= self.moe_topk <= self.num_experts:
            raise ConfigError(f"--moe-topk {self.moe_topk} must be in 1..{self.num_experts}")

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer % self.moe_every == self.moe_every - 1

    def to_dict(self) -> dict[str, int | float]:
        return dataclasses.asdict(self)


def check_buffer_cp_degrees(buffer_name: str, degrees: set[int]) -> int:
    """Return the single CP degree of a buffer's params, or refuse a mix.

    The gradient divisor is per buffer; a buffer whose params disagree on it cannot be scaled
    right. The review of the upstream CP-folding PR (NVIDIA/Megatron-LM#6886) caught a silent ``max()`` over such a set.
    """
    if len(degrees) != 1:
        raise ConfigError(
            f"buffer {buffer_name} mixes params with CP-excluded divisors {sorted(degrees)}; "
            "put params with different fold settings in different buffers"
        )
    return next(iter(degrees))
