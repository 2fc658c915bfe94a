"""The keys megatron-core's GPT (local spec) writes, and how its stacked expert keys are split.

The lowest module of :mod:`gtp_format.megatron`: the key names every other module of the package
reads (the per-parameter view, the topology, the model description's consumers), the TP split of an
expert key (:func:`expert_split`, the one count both the view and the topology take expert TP from),
and the one refusal line for a checkpoint these rules do not describe (:func:`refusal`).
"""

from __future__ import annotations

from collections.abc import Callable

from gtp_format.errors import FormatError
from gtp_format.model import TENSOR, Checkpoint

VERSIONS = "megatron-core 0.19.2 (fixtures/megatron) and Megatron-LM main (param_and_grad_buffer.py)"

# (module suffix, checkpoint key suffix) of one transformer layer, in module order.
LAYER = (
    ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
    ("input_layernorm.bias", "self_attention.linear_qkv.layer_norm_bias"),
    ("self_attention.linear_proj.weight", "self_attention.linear_proj.weight"),
    ("self_attention.linear_proj.bias", "self_attention.linear_proj.bias"),
    ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.weight"),
    ("self_attention.linear_qkv.bias", "self_attention.linear_qkv.bias"),
    ("self_attention.q_layernorm.weight", "self_attention.q_layernorm.weight"),  # --qk-layernorm
    ("self_attention.q_layernorm.bias", "self_attention.q_layernorm.bias"),
    ("self_attention.k_layernorm.weight", "self_attention.k_layernorm.weight"),
    ("self_attention.k_layernorm.bias", "self_attention.k_layernorm.bias"),
    ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
    ("pre_mlp_layernorm.bias", "mlp.linear_fc1.layer_norm_bias"),
    ("mlp.router.weight", "mlp.router.weight"),  # MoE layers: the router is a dense parameter
    ("mlp.router.bias", "mlp.router.bias"),
    # --moe-shared-expert-intermediate-size: dense parameters after the router (the experts have their own buffer);
    # --moe-shared-expert-gate's gate_weight before the shared linears (megatron-core 0.19.2's buffer order in
    # pair_qwen2moe_ep2_dp_reshardable's params_in_bucket)
    ("mlp.shared_experts.gate_weight", "mlp.shared_experts.gate_weight"),
    ("mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight"),
    ("mlp.shared_experts.linear_fc1.bias", "mlp.shared_experts.linear_fc1.bias"),
    ("mlp.shared_experts.linear_fc2.weight", "mlp.shared_experts.linear_fc2.weight"),
    ("mlp.shared_experts.linear_fc2.bias", "mlp.shared_experts.linear_fc2.bias"),
    ("mlp.linear_fc1.weight", "mlp.linear_fc1.weight"),
    ("mlp.linear_fc1.bias", "mlp.linear_fc1.bias"),
    ("mlp.linear_fc2.weight", "mlp.linear_fc2.weight"),
    ("mlp.linear_fc2.bias", "mlp.linear_fc2.bias"),
)
# model keys that are buffers, not parameters: no optimizer state (--moe-router-enable-expert-bias)
BUFFERS = ("decoder.layers.mlp.router.expert_bias",)
# the linears whose weight and bias are gated (--swiglu): each TP rank stores its gate and its up half
GATED = ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.shared_experts.linear_fc1.weight",
         "mlp.shared_experts.linear_fc1.bias")
HEAD = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
TAIL = ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight")
EXPERT_PREFIX = "decoder.layers.mlp.experts.experts."
EXPERT = ("linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias")


def refusal(ckpt: Checkpoint, why: str) -> FormatError:
    """The one line when these rules do not describe ``ckpt``: ``why``, and what the rules cover."""
    return FormatError(f"{ckpt.root}: cannot establish the parameter layout of this megatron-core checkpoint: "
                       f"{why}; the rules of this version cover megatron-core's GPT (local spec), dense, TP x PP "
                       f"(checked against {VERSIONS})")


def expert_keys(ckpt: Checkpoint) -> list[str]:
    """The stacked expert keys (``decoder.layers.mlp.experts.experts.*``) of ``ckpt``."""
    return [k for k, e in ckpt.entries.items() if e.kind == TENSOR and k.startswith(EXPERT_PREFIX)]


def expert_split(ckpt: Checkpoint, key: str, refuse: Callable[[str], FormatError]) -> tuple[str | None, int]:
    """(TP mode, parts) of a stacked expert key of global shape ``(layers, experts, *full)``.

    megatron-core writes one chunk per (layer, expert) and expert-TP part, split along the expert
    linear's output (``linear_fc1``: column) or input (``linear_fc2.weight``: row) axis, ``parts``
    equal pieces; every (layer, expert) the same, or ``refuse`` names the key. The one count of
    expert-TP parts: the view lays experts out by it, and :mod:`gtp_format.megatron.topology` reads
    the run's expert TP from it.
    """
    e = ckpt.entries[key]
    if e.shape is None or len(e.shape) < 3:
        raise refuse(f"{key} is not stacked by (layer, expert)")
    layers, n_exp, full = e.shape[0], e.shape[1], tuple(e.shape[2:])
    boxes: dict[tuple[int, int], list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for c in e.chunks:
        if len(c.offsets) != 2 + len(full) or tuple(c.sizes[:2]) != (1, 1):
            raise refuse(f"{key} stores several (layer, expert) pairs in one chunk")
        boxes.setdefault((c.offsets[0], c.offsets[1]), []).append((tuple(c.offsets[2:]), tuple(c.sizes[2:])))
    if len(boxes) != layers * n_exp:
        raise refuse(f"{key} stores chunks for {len(boxes)} of its {layers * n_exp} (layer, expert) pairs")
    parts = {len(v) for v in boxes.values()}
    n = parts.pop() if len(parts) == 1 else 0
    axes = {i for v in boxes.values() for _, sz in v for i, (a, f) in enumerate(zip(sz, full)) if a != f}
    if n == 0 or (n == 1) != (not axes) or len(axes) > 1 or (axes and next(iter(axes)) > 1):
        raise refuse(f"{key} is not one chunk per (layer, expert), nor split in equal parts along one of its first "
                     "two axes (expert TP)")
    if n == 1:
        return None, 1
    axis = axes.pop()
    want = [tuple(i * full[axis] // n if d == axis else 0 for d in range(len(full))) for i in range(n)]
    size = tuple(f // n if d == axis else f for d, f in enumerate(full))
    if full[axis] % n or any(sorted(v) != [(o, size) for o in want] for v in boxes.values()):
        raise refuse(f"{key} is not split in {n} equal parts along axis {axis} for every (layer, expert)")
    return ("column" if axis == 0 else "row"), n
