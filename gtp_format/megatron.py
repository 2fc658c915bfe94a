"""The per-parameter view of a genuine megatron-core ``dp_reshardable`` checkpoint (no manifest).

megatron-core writes no bucket layout, so it is rebuilt from the checkpoint itself and
megatron-core's bucketing rules (``_ParamAndGradBuffer.__init__`` in
``megatron/core/distributed/param_and_grad_buffer.py``), checked against megatron-core 0.19.2
(the version that wrote ``fixtures/megatron``) and the Megatron-LM main branch source:

1. a buffer holds the params of one (param dtype, grad dtype) in module order, and lays them out
   **in reverse order**;
2. with the distributed optimizer each param **starts at a multiple of 64** elements;
3. a bucket closes after the param that brings it to ``bucket_size`` elements (the shared
   embedding gets a bucket of its own with PP > 1), and is padded at its end to
   ``lcm(dp, 128)``, which is not stored (the key's shape is the unpadded numel).

``bucket_size`` is not recorded, so bucket boundaries are taken from the keys' own shapes (each
bucket key's global shape is its unpadded numel). The module order and the key of each module
parameter are megatron-core's GPT with the local layer spec (``get_gpt_layer_local_spec``): layers
stacked under ``decoder.layers.*`` with a leading layer axis; the input and pre-MLP layernorms
saved under Transformer Engine's names (``linear_qkv.layer_norm_weight``,
``linear_fc1.layer_norm_weight``). TP splits are read from the model keys' chunks (TP rank ``t``
holds the ``t``-th chunk along the split axis).

Every derived slice is then checked against the optimizer key's chunks: megatron-core writes one
chunk per parameter slice (split only at DP-rank boundaries) and one per alignment gap, so a
chunk that straddles a derived parameter edge, or a bucket that does not end where its last
parameter ends, means the rules do not describe this checkpoint: refused with one line. Also
refused: PP > 1, MoE (``chained_`` optimizers, experts), several buffers, unknown parameter keys.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import replace

from gtp_format.errors import FormatError
from gtp_format.layout.shard import ShardSpec
from gtp_format.model import TENSOR, Checkpoint, Chunk, Entry
from gtp_format.names import parse_optimizer_key

VERSIONS = "megatron-core 0.19.2 (fixtures/megatron) and Megatron-LM main (param_and_grad_buffer.py)"
PARAM_ALIGN = 64

# (module suffix, checkpoint key suffix) of one transformer layer, in module order.
LAYER = (
    ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
    ("input_layernorm.bias", "self_attention.linear_qkv.layer_norm_bias"),
    ("self_attention.linear_proj.weight", "self_attention.linear_proj.weight"),
    ("self_attention.linear_proj.bias", "self_attention.linear_proj.bias"),
    ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.weight"),
    ("self_attention.linear_qkv.bias", "self_attention.linear_qkv.bias"),
    ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
    ("pre_mlp_layernorm.bias", "mlp.linear_fc1.layer_norm_bias"),
    ("mlp.linear_fc1.weight", "mlp.linear_fc1.weight"),
    ("mlp.linear_fc1.bias", "mlp.linear_fc1.bias"),
    ("mlp.linear_fc2.weight", "mlp.linear_fc2.weight"),
    ("mlp.linear_fc2.bias", "mlp.linear_fc2.bias"),
)
HEAD = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
TAIL = ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight")


def _refuse(ckpt: Checkpoint, why: str) -> FormatError:
    return FormatError(f"{ckpt.root}: cannot establish the parameter layout of this megatron-core checkpoint: "
                       f"{why}; the rules of this version cover megatron-core's GPT (local spec), dense, PP 1 "
                       f"(checked against {VERSIONS})")


def _layer_index(ckpt: Checkpoint, keys: list[str]) -> dict[str, dict[int, list[Chunk]]]:
    """Stacked key -> layer -> its chunks, built in one pass over the stored chunks.

    Indexed once so that per-layer lookups cost what the key stores, not layers x chunks (issue
    22 class 5: a 10-32 MB ``.metadata`` made the per-layer scans quadratic).
    """
    out: dict[str, dict[int, list[Chunk]]] = {}
    for k in keys:
        by_layer: dict[int, list[Chunk]] = {}
        for c in ckpt.entries[k].chunks:
            if c.offsets:
                by_layer.setdefault(c.offsets[0], []).append(c)
        out[k] = by_layer
    return out


def _module_params(ckpt: Checkpoint, layer_chunks: dict[str, dict[int, list[Chunk]]]
                   ) -> list[tuple[str, str, int | None]]:
    """(module name, checkpoint key, layer or None) in module order, for the keys present.

    The layer count is the stacked keys' declared leading dimension, but the loop runs over the
    layers whose chunks are *stored*, and every declared layer must have one: a ``.metadata`` that
    declares 10^9 layers and stores two is refused before any per-layer work (issue 22 class 3).
    """
    keys = {k for k, e in ckpt.entries.items() if e.kind == TENSOR and not k.startswith("optimizer.")
            and not k.startswith("chained_")}
    out: list[tuple[str, str, int | None]] = [(k, k, None) for k in HEAD if k in keys]
    stacked = sorted(k for k in keys if k.startswith("decoder.layers."))
    layers = {ckpt.entries[k].shape[0] for k in stacked if ckpt.entries[k].shape}  # type: ignore[index]
    if len(layers) > 1:
        raise _refuse(ckpt, f"stacked layer keys disagree on the layer count ({sorted(layers)})")
    n = layers.pop() if layers else 0
    for k in stacked:
        stored = layer_chunks[k]
        if len(stored) != n or any(i < 0 or i >= n for i in stored):
            missing = next((i for i in range(min(n, len(stored) + 1)) if i not in stored), None)
            raise _refuse(ckpt, f"{k} declares {n} layers but stores chunks for {len(stored)}"
                          + (f" (layer {missing} has none)" if missing is not None else ""))
    for i in range(n):  # n <= the chunks stored, checked above
        out += [(f"decoder.layers.{i}.{m}", f"decoder.layers.{k}", i) for m, k in LAYER
                if f"decoder.layers.{k}" in keys]
    out += [(k, k, None) for k in TAIL if k in keys]
    used = {k for _, k, _ in out}
    unknown = sorted(keys - used)
    if unknown:
        raise _refuse(ckpt, f"model key {unknown[0]!r} is not a parameter of that model")
    return out


def _tp_boxes(ckpt: Checkpoint, entry: Entry, layer: int | None, chunks: list[Chunk] | tuple[Chunk, ...]
              ) -> tuple[str | None, tuple[int, ...], list[tuple[int, ...]]]:
    """(tp_mode, full shape, per-TP-rank offsets in the full tensor) from a model key's chunks (of one layer)."""
    assert entry.shape is not None
    lead = 0 if layer is None else 1
    full = entry.shape[lead:]
    boxes = sorted((c.offsets[lead:], c.sizes[lead:]) for c in chunks)
    if len(boxes) == 1:
        if boxes[0] != ((0,) * len(full), full):
            raise _refuse(ckpt, f"{entry.key} has one chunk that is not the whole tensor")
        return None, full, [(0,) * len(full)]
    axes = {i for _, sz in boxes for i, (s, f) in enumerate(zip(sz, full)) if s != f}
    if len(axes) != 1 or next(iter(axes)) > 1:
        raise _refuse(ckpt, f"{entry.key} is split along {sorted(axes)}, not along one of its first two axes")
    axis = axes.pop()
    return ("column" if axis == 0 else "row"), full, [o for o, _ in boxes]


def megatron_views(ckpt: Checkpoint) -> dict:  # -> dict[str, ParamView] (imported lazily: no cycle)
    from gtp_format.params import Holder, KeyRef, ParamView

    opts = {k: parse_optimizer_key(k) for k, e in ckpt.entries.items() if e.kind == TENSOR}
    opts = {k: o for k, o in opts.items() if o is not None}
    if not opts:
        raise FormatError(f"{ckpt.root}: no dp_reshardable optimizer keys; the per-parameter view needs them")
    if any(o.prefix != "optimizer.distributed" for o in opts.values()):
        raise _refuse(ckpt, "it has several (chained_) optimizers, as MoE models do")
    if len({(o.gbuf_idx, o.dtype) for o in opts.values()}) != 1:
        raise _refuse(ckpt, "it has several gradient buffers")
    if any(o.cp_rank is not None for o in opts.values()):
        raise _refuse(ckpt, "optimizer keys carry cp_rank")
    tp_size = len({o.dp_group_idx for o in opts.values()})
    gbuf, dtag = next((o.gbuf_idx, o.dtype) for o in opts.values())
    stacked = [k for k, e in ckpt.entries.items() if e.kind == TENSOR and k.startswith("decoder.layers.")]
    layer_chunks = _layer_index(ckpt, stacked)
    params = _module_params(ckpt, layer_chunks)
    buckets = sorted({o.bucket_idx for o in opts.values()})
    numel: dict[int, int] = {}
    for k, o in opts.items():  # one pass, not one per bucket over all keys (issue 22 class 5)
        shape = ckpt.entries[k].shape
        if o.state == "param" and shape:
            numel.setdefault(o.bucket_idx, shape[0])
    if set(numel) != set(buckets):
        raise _refuse(ckpt, f"bucket {min(set(buckets) - set(numel))} has no param state key")
    placed: list[tuple[str, int, int, int]] = []  # name, bucket, start, end (local numel)
    info = {}
    if HEAD[0] not in ckpt.entries:
        raise _refuse(ckpt, f"it has no {HEAD[0]}")
    vocab_parts = len(_tp_boxes(ckpt, ckpt.entries[HEAD[0]], None, ckpt.entries[HEAD[0]].chunks)[2])
    if vocab_parts != tp_size:
        raise _refuse(ckpt, f"{tp_size} dp_group_idx values but TP {vocab_parts} (the embedding's parts): "
                      "the model-parallel group spans pipeline stages (PP > 1)")
    for name, key, layer in params:
        entry = ckpt.entries[key]
        mode, full, offsets = _tp_boxes(ckpt, entry, layer, entry.chunks if layer is None else layer_chunks[key][layer])
        if mode is not None and len(offsets) != tp_size:
            raise _refuse(ckpt, f"{key} has {len(offsets)} TP parts but there are {tp_size} dp_group_idx (PP > 1?)")
        mode = "vocab" if mode == "column" and key == HEAD[0] else mode
        info[name] = (key, layer, mode, full)
    b, pos = 0, 0
    for name, _, _ in reversed(params):
        key, layer, mode, full = info[name]
        spec = ShardSpec(full, mode, tp_size, 0, None, 1, 0, 1)
        n = 1
        for d in spec.local_shape:
            n *= d
        start = -(-pos // PARAM_ALIGN) * PARAM_ALIGN
        if b not in numel or start + n > numel[b]:
            raise _refuse(ckpt, f"{name} does not fit bucket {b} ({numel.get(b)} elements unpadded)")
        placed.append((name, b, start, start + n))
        pos = start + n
        if pos == numel[b]:
            b, pos = b + 1, 0
    if b != len(buckets) or pos:
        raise _refuse(ckpt, f"the parameters fill {b} buckets, the checkpoint has {len(buckets)}")
    _check_chunks(ckpt, opts, placed)
    views = {}
    for name, bucket, start, _ in reversed(placed):
        key, layer, mode, full = info[name]
        holders = []
        for t in range(tp_size):
            spec = ShardSpec(full, mode, tp_size, t if mode else 0, None, 1, 0, 1)
            ref = KeyRef(t, gbuf, dtag, bucket, None, numel[bucket])
            holders.append(Holder(ref, start, spec, (), mode is not None or t == 0))
        pdt = dtag.strip("()").split(",")[0].strip()
        views[name] = replace(ParamView(name, full, full, mode, None, False, gbuf, bucket, start, pdt,
                                        tuple(holders)), weight_key=key, layer=layer)
    return views  # module order


def _check_chunks(ckpt: Checkpoint, opts: dict, placed: list[tuple[str, int, int, int]]) -> None:
    """Every stored chunk of every bucket key lies inside one derived param slice or one gap.

    The edges of each bucket are sorted once and each chunk finds the first edge after its start
    by bisection: chunks x log(edges), where a scan of every edge per chunk was quadratic.
    """
    edges: dict[int, list[int]] = {}
    for _, b, s, e in placed:
        edges.setdefault(b, []).extend((s, e))
    cuts_of = {b: sorted(set(v)) for b, v in edges.items()}
    for key, o in opts.items():
        cuts = cuts_of.get(o.bucket_idx, [])
        for c in ckpt.entries[key].chunks:
            a, z = c.offsets[0], c.offsets[0] + c.sizes[0]
            i = bisect_right(cuts, a)
            if i < len(cuts) and cuts[i] < z:
                raise _refuse(ckpt, f"chunk [{a}, {z}) of {key} straddles a derived parameter edge")
