"""Topology-invariant initialisation: every full weight comes from a seed derived from its name.

Megatron seeds each shard with its folded rank, which gives distinct shards but a model that
depends on the topology. **[our choice]** We generate the *full* tensor from
``hash(seed, name)`` and let each rank take its slice, so tp1/cp1 and tp2/cp2/g2 folded build the
same model bit for bit, shards of one weight are distinct slices of it, and the fp32 reference can
be built from the very same function.
"""

from __future__ import annotations

import hashlib
import math

import torch


def name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def full_init(name: str, shape: tuple[int, ...], seed: int, num_layers: int,
              device: torch.device | str | None = None) -> torch.Tensor:
    """The full fp32 value of parameter ``name`` at initialisation.

    The generator lives on ``device`` (a GPU run initialises billions of elements in
    milliseconds instead of on the CPU); values are identical for every topology on one device
    type, which is what parity needs: the reference is built on the same device.
    """
    device = torch.device(device or "cpu")
    if name.endswith("layernorm.weight"):
        return torch.ones(shape, device=device)
    gen = torch.Generator(device=device).manual_seed(name_seed(seed, name))
    std = 0.02
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        std = 0.02 / math.sqrt(2.0 * num_layers)  # scaled init of output projections (GPT-2)
    return torch.randn(shape, generator=gen, device=device) * std
