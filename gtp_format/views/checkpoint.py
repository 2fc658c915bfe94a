"""The per-parameter view of an opened checkpoint, whichever writer made it.

Ours carry a manifest with the bucket layout (:func:`gtp_format.views.ours.param_views`); a
genuine megatron-core checkpoint has none, and its layout is rebuilt from megatron-core's
bucketing rules (:func:`gtp_format.megatron.view.megatron_views`).
"""

from __future__ import annotations

from gtp_format.megatron.view import megatron_views
from gtp_format.model import Checkpoint
from gtp_format.views.ours import param_views
from gtp_format.views.records import ParamView


def param_views_of(ckpt: Checkpoint) -> dict[str, ParamView]:
    """The per-parameter view of an opened checkpoint: from its manifest (ours) or, without one,
    from megatron-core's bucketing rules (:mod:`gtp_format.megatron.view`)."""
    if ckpt.manifest is not None:
        return param_views(ckpt.manifest)
    return megatron_views(ckpt, experts=True, dense_experts=True)  # MoE at EP 1 too (experts in the dense buffers)
