"""What the ranks of ``verify-roundtrip`` run: module-level functions, pickled by name.

Test-only: ``GTP_ROUNDTRIP_CORRUPT=<rank>`` adds 1.0 to one real (non-padding) optimizer element
of that rank right after the load, so that tests can prove a difference is found and named.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gtp_runtime.training import TrainConfig, Trainer

CORRUPT_ENV = "GTP_ROUNDTRIP_CORRUPT"


def corrupt_after_load(trainer: Trainer) -> None:
    """The test-only corruption of ``GTP_ROUNDTRIP_CORRUPT=<rank>`` (see the module docstring)."""
    import torch.distributed as dist

    from gtp_runtime.roundtrip import first_param_element

    spec = os.environ.get(CORRUPT_ENV, "")
    if spec.strip().isdigit() and int(spec) == dist.get_rank():
        _, tensor, index = first_param_element(trainer)
        tensor[index] += 1.0


def save_job(cfg: TrainConfig, root: str, dump_dir: str, steps: int, more: int, layout: str) -> str:
    from gtp_runtime.roundtrip import save_phase
    from gtp_runtime.training import Trainer

    return str(save_phase(Trainer(cfg), root, steps, more, layout, dump_dir))


def resume_job(cfg: TrainConfig, root: str, dump_dir: str) -> dict[str, Any]:
    from gtp_runtime.roundtrip import resume_phase
    from gtp_runtime.training import Trainer

    return resume_phase(Trainer(cfg), root, dump_dir, after_load=corrupt_after_load)


def resave_job(cfg: TrainConfig, src: str, root: str, layout: str) -> str:
    from gtp_runtime.roundtrip import resave
    from gtp_runtime.training import Trainer

    return str(resave(Trainer(cfg), src, root, layout, after_load=corrupt_after_load))
