"""CPU binding of local ranks: each rank's host thread on CPUs no other local rank uses.

Why: on 2 x H200 (32 vCPUs, folded cp2) the step is host-bound in forward, and a profiled step
showed rank 1's host ops taking 1.4-1.5x rank 0's time for the same calls (``cudaLaunchKernel``
9.3 against 6.7 us), so rank 0 spent about 20 ms a step waiting for rank 1 inside all-gathers,
which the trace counts as exposed communication. Unbound, the scheduler may put both main threads,
their NCCL proxy threads and compile workers on the same cores. torchrun's ``--numa-binding`` and
Megatron's launch scripts (``numactl``) bind for the same reason.

Binding takes the CPUs the process may use, prefers those the GPU's PCI device lists as local
(``/sys/bus/pci/devices/<bus id>/local_cpulist``), and gives each local rank an equal, disjoint
share of them; it is skipped (returns None) where there are fewer CPUs than ranks.
"""

from __future__ import annotations

import os


def parse_cpulist(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]`` (the kernel's cpulist format)."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def gpu_local_cpus(pci_bus_id: str) -> list[int]:
    """CPUs the kernel lists as local to a PCI device (empty if unknown)."""
    bus = pci_bus_id.lower()
    try:
        with open(f"/sys/bus/pci/devices/{bus}/local_cpulist") as f:
            return parse_cpulist(f.read())
    except (OSError, ValueError):
        return []


def share(cpus: list[int], local_rank: int, local_world: int) -> list[int]:
    """Local rank ``local_rank``'s equal, disjoint slice of ``cpus`` (sorted)."""
    cpus = sorted(cpus)
    n = len(cpus) // local_world
    return cpus[local_rank * n : (local_rank + 1) * n]


def pci_bus_ids(n: int) -> list[str] | None:
    """``dddd:bb:dd.0`` of CUDA devices ``0..n-1``, or None where torch does not report them."""
    import torch

    out = []
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        try:
            out.append(f"{int(p.pci_domain_id):04x}:{int(p.pci_bus_id):02x}:{int(p.pci_device_id):02x}.0")
        except (AttributeError, TypeError, ValueError):
            return None
    return out


def bind_rank(local_rank: int, local_world: int, bus_ids: list[str] | None = None) -> list[int] | None:
    """Bind this process to its share of CPUs; the CPUs, or None where binding was skipped.

    ``bus_ids`` are the local ranks' GPUs (:func:`pci_bus_ids`): ranks whose GPUs list the same
    local CPUs share those; otherwise all allowed CPUs are shared out.
    """
    allowed = sorted(os.sched_getaffinity(0))
    pool, peers, me = allowed, list(range(local_world)), local_rank
    if bus_ids:
        near = [[c for c in gpu_local_cpus(b) if c in allowed] for b in bus_ids]
        if all(near) and len(near) == local_world:
            peers = [r for r in range(local_world) if near[r] == near[local_rank]]
            pool, me = near[local_rank], peers.index(local_rank)
    mine = share(pool, me, len(peers))
    if not mine:
        return None
    os.sched_setaffinity(0, mine)
    return mine
