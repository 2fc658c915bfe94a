"""megatron-core's distributed-optimizer bucket layout for a topology of our choice (``ckpt reshard``).

:mod:`gtp_format.megatron.view` reads the layout a checkpoint *has* (bucket boundaries from its keys'
shapes); this module computes the layout megatron-core *will build* at a target TP x PP x (DP x CP),
so that a ``dp_reshardable`` checkpoint written for it passes megatron-core's load (which checks
every bucket key's global shape and asserts ``per_bucket_numel_unpadded`` equal to its own). The
rules, from megatron-core 0.19.2 (``DistributedOptimizer._compute_per_buffer_param_layout``,
``optimizer/param_layout.py``, ``DistributedDataParallel.__init__``, ``LanguageModule.
setup_embeddings_and_output_layer``; Megatron-LM main has the same):

1. one buffer per (param dtype, grad dtype) per model-parallel rank, ``dp_group_idx = pp_rank * TP
   + tp_rank``, numbered in order of first appearance (:func:`buffers_of`); its params in module
   order, laid out **in reverse**; every rule below holds per buffer;
2. each param starts at a multiple of 64 elements (``pad_param_start``);
3. a bucket closes after the param that brings it to ``bucket_size`` elements; stages other than
   the first never split (DDP sets ``bucket_size = None`` for ``pp_rank > 0``), and neither does a
   run without ``overlap_grad_reduce`` (``bucket_size = None`` everywhere);
4. with tied embeddings and PP > 1 the *shared embedding* (``word_embeddings`` on the first stage,
   ``output_layer`` on the last) closes the bucket before it and its own;
5. a bucket's end is padded to ``lcm(dp x cp, 128)`` (``pad_bucket_end``; not stored: the key's
   global shape is the unpadded numel, and the next bucket starts after the padding).

Layers split over the stages as megatron-core does (:func:`stage_counts`): evenly (``num_layers /
PP`` each, its default), or with a first and/or last stage of its own size
(``--decoder-first/last-pipeline-num-layers``) and the rest evenly. A parameter's numel per TP rank
comes from its TP split (:data:`TP_MODES`, megatron's GPT local spec: which linear is column- or row-parallel).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PARAM_ALIGN = 64
BUCKET_ALIGN = 128

# module-name suffix -> TP split of megatron-core's GPT (local spec); every other param is replicated
TP_MODES = (
    ("embedding.word_embeddings.weight", "vocab"),
    ("output_layer.weight", "column"),
    ("self_attention.linear_qkv.weight", "column"),
    ("self_attention.linear_qkv.bias", "column"),
    ("mlp.linear_fc1.weight", "column"),
    ("mlp.linear_fc1.bias", "column"),
    ("self_attention.linear_proj.weight", "row"),
    ("mlp.linear_fc2.weight", "row"),
    # MoE shared experts (--moe-shared-expert-intermediate-size): a dense MLP, split as the one above
    ("mlp.shared_experts.linear_fc1.weight", "column"),
    ("mlp.shared_experts.linear_fc1.bias", "column"),
    ("mlp.shared_experts.linear_fc2.weight", "row"),
)


# an expert's linears (``decoder.layers.<l>.mlp.experts.<e>.<param>``) split over expert TP as the dense MLP's over TP
EXPERT_TP_MODES = {"linear_fc1.weight": "column", "linear_fc1.bias": "column", "linear_fc2.weight": "row"}


def tp_mode_of(name: str) -> str | None:
    """The TP split of a dense GPT parameter, by its module name; an expert's (``mlp.experts.<e>.*``), where it
    sits in the dense buffers (EP 1 with expert TP = TP: megatron-core builds it with the dense groups), splits
    over TP as the dense MLP does."""
    layer, sep, rest = name.partition(".mlp.experts.")
    expert, _, param = rest.partition(".")
    if sep and layer.startswith("decoder.layers.") and expert.isdigit():
        return EXPERT_TP_MODES.get(param)
    return next((mode for suffix, mode in TP_MODES if name.endswith(suffix)), None)


@dataclass(frozen=True)
class TargetParam:
    """One parameter of one pipeline stage, as the target's buffer holds it (per TP rank)."""

    name: str  # the module parameter (``output_layer.weight`` for the last stage's tied copy)
    source: str  # the parameter whose state it holds (the tied copy: the word embeddings)
    stage: int
    numel: int  # elements per TP rank
    shared: bool = False  # megatron's ``shared_embedding``: a bucket of its own
    dtype: str = ""  # the buffer's key tag ``(param dtype, grad dtype)``: one buffer per tag
    chunk: int = 0  # its model chunk on its stage (virtual pipeline stages): one set of buffers per chunk


@dataclass(frozen=True)
class Slot:
    param: TargetParam
    bucket: int
    start: int  # bucket-relative first element


@dataclass(frozen=True)
class Bucket:
    stage: int
    index: int
    numel_unpadded: int  # the key's global shape
    numel: int  # padded to lcm(dp x cp, 128): ``per_bucket_numel``


def buffers_of(params: list[TargetParam]) -> list[tuple[str, list[TargetParam]]]:
    """One stage's buffers in ``gbuf_idx`` order: (dtype tag, its params in module order).

    megatron-core's ``group_params_for_buffers`` keys a buffer by (param dtype, grad dtype) in the
    order each first appears in ``named_parameters()``: a stage that starts with an fp32 layernorm
    has its fp32 buffer first (checked on ``fixtures/megatron/pair_fp32norm_dp2_dp_reshardable``
    resharded to PP 2 and loaded by megatron-core). With virtual pipeline stages each model chunk has
    its own DDP and buffers, and the one optimizer numbers them chunk after chunk, the same tag once per
    chunk: the rule the view reads (:func:`gtp_format.megatron.buckets.stage_buffers`), here at the target.
    """
    out: dict[tuple[int, str], list[TargetParam]] = {}
    for c in sorted({p.chunk for p in params}):
        for p in params:
            if p.chunk == c:
                out.setdefault((c, p.dtype), []).append(p)
    return [(dtag, members) for (_, dtag), members in out.items()]


def chunk_of_layer(layer: int, num_layers: int, pp: int, vpp: int) -> tuple[int, int]:
    """(pipeline stage, model chunk on it) of a global layer with ``vpp`` virtual pipeline stages, evenly split
    (megatron-core's ``get_transformer_layer_offset``): the ``pp * vpp`` chunks of ``num_layers / (pp * vpp)``
    layers each run over the stages ``vpp`` times, chunk ``v`` of stage ``p`` the ``(v * pp + p)``-th."""
    g = layer // (num_layers // (pp * vpp))
    return g % pp, g // pp


def stage_of_layer(layer: int, num_layers: int, pp: int, counts: list[int] | None = None) -> int:
    """The pipeline stage of a global layer: even split, or the per-stage layer ``counts``."""
    if counts is None:
        return layer // (num_layers // pp)
    end = 0
    for stage, n in enumerate(counts):
        end += n
        if layer < end:
            return stage
    raise ValueError(f"layer {layer} is beyond the {end} layers of the stages")


def stage_counts(num_layers: int, pp: int, first: int | None = None, last: int | None = None) -> list[int]:
    """Layers per pipeline stage as megatron-core splits them (``get_transformer_layer_offset``):
    ``first`` / ``last`` layers on the first / last stage where given
    (``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``), the rest
    evenly over the other stages. ``ValueError`` where they do not split."""
    if pp == 1:
        if first not in (None, num_layers) or last not in (None, num_layers):
            raise ValueError("a first or last stage size at PP 1")
        return [num_layers]
    middle = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if rest < 0 or (middle == 0 and rest) or (middle and (rest % middle or rest == 0)):
        raise ValueError(f"{num_layers} layers do not split over PP {pp}"
                         + (f" with first/last stage layers {first}/{last}" if first or last else " evenly"))
    each = rest // middle if middle else 0
    return ([first] if first is not None else []) + [each] * middle + ([last] if last is not None else [])


def uneven_split(counts: list[int]) -> tuple[int | None, int | None]:
    """(first, last) stage layer counts that give ``counts`` by :func:`stage_counts`: ``(None, None)`` for an
    even split. ``ValueError`` where the middle stages differ (no pair of flags gives it)."""
    n, pp = sum(counts), len(counts)
    if pp == 1 or len(set(counts)) == 1:
        return None, None
    for first, last in ((counts[0], None), (None, counts[-1]), (counts[0], counts[-1])):
        try:
            if stage_counts(n, pp, first, last) == counts:
                return first, last
        except ValueError:
            continue
    raise ValueError(f"stages holding {counts} layers are not an even split with a first and last stage of their own")


def lay_out_stage(params: list[TargetParam], stage: int, dp_cp: int, bucket_size: int | None
                  ) -> tuple[list[Slot], list[Bucket]]:
    """The buckets of one stage's buffer and each param's place (``params`` in module order)."""
    divisor = math.lcm(dp_cp, BUCKET_ALIGN)
    size = bucket_size if stage == 0 else None
    slots: list[Slot] = []
    buckets: list[Bucket] = []
    start = bucket_start = 0
    open_params = 0
    end = 0

    def close(param_end: int) -> int:
        padded = -(-param_end // divisor) * divisor
        buckets.append(Bucket(stage, len(buckets), param_end - bucket_start, padded - bucket_start))
        return padded

    for p in reversed(params):
        start = -(-start // PARAM_ALIGN) * PARAM_ALIGN
        if p.shared and open_params:
            bucket_start = start = close(start)
            open_params = 0
        end = start + p.numel
        slots.append(Slot(p, len(buckets), start - bucket_start))
        open_params += 1
        if (size is not None and end - bucket_start >= size) or p.shared:
            bucket_start = start = close(end)
            open_params = 0
        else:
            start = end
    if open_params:
        close(end)
    return slots, buckets
