"""The per-parameter view of a genuine megatron-core ``dp_reshardable`` checkpoint (no manifest).

megatron-core writes no bucket layout, so it is rebuilt from the checkpoint itself and
megatron-core's bucketing rules (``_ParamAndGradBuffer.__init__`` in
``megatron/core/distributed/param_and_grad_buffer.py``), checked against megatron-core 0.19.2
(the version that wrote ``fixtures/megatron``) and the Megatron-LM main branch source:

1. a buffer holds the params of one (param dtype, grad dtype) in module order, and lays them out
   **in reverse order**; a stage with params of several dtypes has one buffer each, numbered in
   order of first appearance (:func:`_stage_buffers`), and every rule below holds per buffer;
2. with the distributed optimizer each param **starts at a multiple of 64** elements;
3. a bucket closes after the param that brings it to ``bucket_size`` elements, and is padded at
   its end to ``lcm(dp, 128)``, which is not stored (the key's shape is the unpadded numel);
4. with PP > 1 and tied embeddings, the *shared embedding* (``word_embeddings`` on the first
   stage, ``output_layer`` on the last, megatron's ``shared_embedding`` attribute) gets a bucket of
   its own: the bucket before it is closed, and it closes its own.

Virtual pipeline stages (``--num-layers-per-virtual-pipeline-stage``): a stage holds several model
chunks of interleaved layers, each with its own buffers, numbered chunk after chunk
(:func:`_stages`, :func:`_stage_buffers`); the bucket rules hold per buffer as before. MoE with
virtual pipeline stages is refused (not checked against a save).

Pipeline stages: each stage has its own buffer, keyed ``dp_group_idx = pp_rank * TP + tp_rank``
(the rank in the tp x pp model-parallel group). Embeddings sit on the first stage; the final
layernorm and the output layer on the last; a layer on the stage whose ranks wrote its chunks
(rank order tp-cp-ep-dp-pp, so stage = rank // (world / PP)). The stacked keys use global layer
numbers (offset ``[layer, ...]``), and so does the view; megatron's modules number layers per
stage. With tied embeddings the last stage's ``output_layer.weight`` has no key of its own: it is
a non-primary holder of ``embedding.word_embeddings.weight`` (megatron all-reduces the two
gradients over the embedding group, so their fp32 state is bit-identical; checked on the PP2
fixture).

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
refused: unknown parameter keys, a layer written by ranks of two stages, stages out of order
(neither ascending nor interleaved over virtual pipeline stages).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import replace

from gtp_format.errors import FormatError
from gtp_format.layout.shard import ShardSpec
from gtp_format.model import TENSOR, Checkpoint, Chunk, Entry
from gtp_format.names import OPT_PREFIX, parse_optimizer_key
from gtp_format.views.megatron_moe import EXPERT_PREFIX, expert_keys, expert_views
from gtp_format.views.records import Holder, KeyRef, ParamView

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
    ("self_attention.q_layernorm.weight", "self_attention.q_layernorm.weight"),  # --qk-layernorm
    ("self_attention.q_layernorm.bias", "self_attention.q_layernorm.bias"),
    ("self_attention.k_layernorm.weight", "self_attention.k_layernorm.weight"),
    ("self_attention.k_layernorm.bias", "self_attention.k_layernorm.bias"),
    ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
    ("pre_mlp_layernorm.bias", "mlp.linear_fc1.layer_norm_bias"),
    ("mlp.router.weight", "mlp.router.weight"),  # MoE layers: the router is a dense parameter
    ("mlp.router.bias", "mlp.router.bias"),
    # --moe-shared-expert-intermediate-size: dense parameters after the router (the experts have their own buffer)
    ("mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight"),
    ("mlp.shared_experts.linear_fc1.bias", "mlp.shared_experts.linear_fc1.bias"),
    ("mlp.shared_experts.linear_fc2.weight", "mlp.shared_experts.linear_fc2.weight"),
    ("mlp.shared_experts.linear_fc2.bias", "mlp.shared_experts.linear_fc2.bias"),
    ("mlp.shared_experts.gate_weight", "mlp.shared_experts.gate_weight"),
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


def _refuse(ckpt: Checkpoint, why: str) -> FormatError:
    return FormatError(f"{ckpt.root}: cannot establish the parameter layout of this megatron-core checkpoint: "
                       f"{why}; the rules of this version cover megatron-core's GPT (local spec), dense, TP x PP "
                       f"(checked against {VERSIONS})")


def _layer_index(ckpt: Checkpoint, keys: list[str]) -> dict[str, dict[int, list[Chunk]]]:
    """Stacked key -> layer -> its chunks, built in one pass over the stored chunks.

    Indexed once so that per-layer lookups cost what the key stores, not layers x chunks (issue
    22 class 5: a 10-32 MB ``.metadata`` made the per-layer scans quadratic).
    """
    out: dict[str, dict[int, list[Chunk]]] = {}
    for k in keys:
        e = ckpt.entries[k]
        itemsize = e.dtype.itemsize if e.dtype is not None else 1
        by_layer: dict[int, list[Chunk]] = {}
        for c in e.chunks:
            if not c.offsets:
                continue
            # megatron-core stores one chunk per layer; a plain DCP save (a model-only checkpoint) one
            # chunk for all of them. A chunk is listed under every layer it covers only as far as its
            # stored bytes hold them, so a declared span costs no more than the bytes behind it.
            span = c.sizes[0] if c.storage is not None and c.numel * itemsize <= c.storage.length else 1
            for layer in range(c.offsets[0], c.offsets[0] + max(1, span)):
                by_layer.setdefault(layer, []).append(c)
        out[k] = by_layer
    return out


def module_params(ckpt: Checkpoint) -> list[tuple[str, str, int | None]]:
    """:func:`_module_params` with its own layer index: the module parameters of a megatron-core GPT
    checkpoint, whatever its optimizer sharding (the weights-only export's view)."""
    stacked = [k for k, e in ckpt.entries.items() if e.kind == TENSOR and k.startswith("decoder.layers.")]
    return _module_params(ckpt, _layer_index(ckpt, stacked))


def _module_params(ckpt: Checkpoint, layer_chunks: dict[str, dict[int, list[Chunk]]]
                   ) -> list[tuple[str, str, int | None]]:
    """(module name, checkpoint key, layer or None) in module order, for the keys present.

    The layer count is the stacked keys' declared leading dimension, but the loop runs over the
    layers whose chunks are *stored*, and every declared layer must have one: a ``.metadata`` that
    declares 10^9 layers and stores two is refused before any per-layer work (issue 22 class 3).
    """
    keys = {k for k, e in ckpt.entries.items() if e.kind == TENSOR and not k.startswith("optimizer.")
            and not k.startswith("chained_") and not k.startswith(EXPERT_PREFIX) and k not in BUFFERS}
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
    if lead and any(c.sizes[0] != 1 for c in chunks):  # megatron-core writes one chunk per layer
        raise _refuse(ckpt, f"{entry.key} stores several layers in one chunk")
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


def _stages(ckpt: Checkpoint, params: list[tuple[str, str, int | None]], pp: int,
            layer_chunks: dict[str, dict[int, list[Chunk]]]) -> tuple[dict[str, int], dict[str, int], int]:
    """(module name -> pipeline stage, module name -> model chunk of its stage, model chunks per stage).

    Embeddings on the first stage's first chunk, final layernorm and output layer on the last
    stage's last chunk; a layer on the stage of the ranks that wrote its chunks (rank order
    tp-cp-ep-dp-pp, so stage = rank // (world / PP)). The stages' layer runs are the model chunks
    (:func:`gtp_format.megatron_topology.model_chunks`): one ascending run per stage, or, with
    virtual pipeline stages, ``vpp`` runs per stage interleaved over the stages; anything else is
    refused. ``args.virtual_pipeline_model_parallel_size``, where recorded, must agree.
    """
    if pp == 1:
        return {name: 0 for name, _, _ in params}, {name: 0 for name, _, _ in params}, 1
    from gtp_format.megatron_topology import _args_sizes, common_state, model_chunks
    from gtp_format.names import writer_rank

    ranks = [r for r in (writer_rank(f) for f in ckpt.data_files) if r is not None]
    world = max(ranks) + 1 if ranks else 0
    if world == 0 or world % pp:
        raise _refuse(ckpt, f"its {world} data files do not split into {pp} pipeline stages")
    per_stage = world // pp
    layer_stage: dict[int, int] = {}
    for key, by_layer in layer_chunks.items():
        for layer, chunks in by_layer.items():
            for c in chunks:
                r = writer_rank(c.storage.file if c.storage else None)
                if r is None or r >= world:
                    raise _refuse(ckpt, f"layer {layer} of {key} has a chunk in no rank's data file")
                if layer_stage.setdefault(layer, r // per_stage) != r // per_stage:
                    raise _refuse(ckpt, f"layer {layer} has chunks written by ranks of two pipeline stages")
    try:
        vpp, layer_chunk = model_chunks(layer_stage, pp) if layer_stage else (1, {})
    except ValueError as e:
        raise _refuse(ckpt, str(e)) from None
    recorded = _args_sizes(common_state(ckpt)).get("vpp")
    if recorded is not None and recorded != vpp:
        raise _refuse(ckpt, f"its args record virtual_pipeline_model_parallel_size={recorded}, but the ranks that "
                      f"wrote its layers give {vpp} model chunks per stage")
    _check_recorded_split(ckpt, layer_stage, pp)
    stage = {name: (layer_stage[layer] if layer is not None else 0 if name in HEAD else pp - 1)
             for name, _, layer in params}
    chunk = {name: (layer_chunk[layer] if layer is not None else 0 if name in HEAD else vpp - 1)
             for name, _, layer in params}
    return stage, chunk, vpp


def _check_recorded_split(ckpt: Checkpoint, layer_stage: dict[int, int], pp: int) -> None:
    """The uneven split the args record (``decoder_first/last_pipeline_num_layers``) must be the one the
    ranks that wrote the layers show: a checkpoint whose args say otherwise is refused naming both."""
    from gtp_format.megatron_args import describe_model
    from gtp_format.megatron_layout import stage_counts

    model = describe_model(ckpt)
    first, last = model.first_stage_layers, model.last_stage_layers
    if first is None and last is None:
        return
    counts = [sum(1 for s in layer_stage.values() if s == i) for i in range(pp)]
    try:
        want = stage_counts(len(layer_stage), pp, first, last)
    except ValueError as e:
        want = [str(e)]  # type: ignore[list-item]
    if want != counts:
        raise _refuse(ckpt, f"its args record decoder_first_pipeline_num_layers={first}, "
                      f"decoder_last_pipeline_num_layers={last}, but the ranks that wrote decoder.layers.* hold "
                      f"{counts} layers per pipeline stage")


def megatron_views(ckpt: Checkpoint, experts: bool = False, ranges_only: bool = False) -> dict[str, ParamView]:
    """Every parameter of a megatron-core GPT ``dp_reshardable`` checkpoint, TP x PP (see the module docstring).

    ``experts``: also MoE checkpoints (:mod:`gtp_format.views.megatron_moe`): ``inspect --params``, the
    padding map and ``export --to fully_reshardable`` ask (expert keys are indexed by (layer, expert),
    :attr:`gtp_format.views.records.ParamView.lead`) and ``ckpt reshard``; the Hugging Face export does not.

    ``ranges_only``: the padding map's view, where only each holder's bucket range counts (``start``,
    numel), not where its elements sit in the global tensor. A gated ``linear_fc1`` (``--swiglu``)
    then passes: each TP rank holds ``2 x ffn / TP`` rows of it (its gate and up halves, stored as two
    chunks each), which is the numel a column split gives; its holders' specs are that column split's,
    which is *not* where those rows sit globally, so such a view serves ranges and nothing else. q/k
    layernorm and shared experts are laid out as any parameter; every range is still checked against
    the chunks megatron-core wrote (:func:`_check_chunks`).
    """
    opts = {k: parse_optimizer_key(k) for k, e in ckpt.entries.items() if e.kind == TENSOR}
    opts = {k: o for k, o in opts.items() if o is not None}
    if not opts:
        raise FormatError(f"{ckpt.root}: no dp_reshardable optimizer keys; the per-parameter view needs them")
    prefixes = sorted({o.prefix for o in opts.values()})
    moe = bool(expert_keys(ckpt))
    if moe and prefixes == [f"chained_{i}.{OPT_PREFIX}" for i in range(2)]:
        if not experts:
            raise _refuse(ckpt, "it is MoE (chained_ optimizers): 'ckpt inspect --params', 'export --to "
                          "fully_reshardable' and 'reshard' read it, but the Hugging Face export has no experts")
        expert_opts = {k: o for k, o in opts.items() if o.prefix == prefixes[1]}
        opts = {k: o for k, o in opts.items() if o.prefix == prefixes[0]}
    elif prefixes != [OPT_PREFIX] or moe:
        raise _refuse(ckpt, f"its optimizer keys start with {prefixes[:3]}" + (" and it has expert keys" if moe else "")
                      + ": not one optimizer, nor MoE's chained dense + expert pair")
    prefix = next(iter(opts.values())).prefix
    dtags: dict[tuple[int, int], str] = {}
    for o in opts.values():
        if dtags.setdefault((o.dp_group_idx, o.gbuf_idx), o.dtype) != o.dtype:
            raise _refuse(ckpt, f"gbuf_idx_{o.gbuf_idx} of dp_group_idx_{o.dp_group_idx} has keys of two dtypes")
    if any(o.cp_rank is not None for o in opts.values()):
        raise _refuse(ckpt, "optimizer keys carry cp_rank")
    if HEAD[0] not in ckpt.entries:
        raise _refuse(ckpt, f"it has no {HEAD[0]}")
    gated = _refuse_unsupported(ckpt, ranges_only)
    stacked = [k for k, e in ckpt.entries.items() if e.kind == TENSOR and k.startswith("decoder.layers.")]
    layer_chunks = _layer_index(ckpt, stacked)
    params = _module_params(ckpt, layer_chunks)
    emb = ckpt.entries[HEAD[0]]
    tp_size = len(_tp_boxes(ckpt, emb, None, emb.chunks)[2])
    n_idx = len({o.dp_group_idx for o in opts.values()})
    if n_idx % tp_size or {o.dp_group_idx for o in opts.values()} != set(range(n_idx)):
        raise _refuse(ckpt, f"dp_group_idx values {sorted({o.dp_group_idx for o in opts.values()})[:8]} are not "
                      f"TP {tp_size} (the embedding's vocab parts) x PP stages")
    pp = n_idx // tp_size
    tied = pp > 1 and "output_layer.weight" not in ckpt.entries
    if tied:  # the last stage's output layer: a replica of the word embeddings with its own buffer slot
        params.append(("output_layer.weight", HEAD[0], None))
    stage_of, chunk_of, vpp = _stages(ckpt, params, pp, layer_chunks)
    if moe and vpp > 1:
        raise _refuse(ckpt, f"it is MoE with {vpp} virtual pipeline stages (model chunks per stage), whose expert "
                      "buffers this version has not been checked against")
    numel: dict[tuple[int, int, int], int] = {}
    for k, o in opts.items():  # one pass, not one per bucket over all keys (issue 22 class 5)
        shape = ckpt.entries[k].shape
        if o.state == "param" and shape:
            numel.setdefault((o.dp_group_idx, o.gbuf_idx, o.bucket_idx), shape[0])
    info = {}
    for name, key, layer in params:
        entry = ckpt.entries[key]
        mode, full, offsets = _tp_boxes(ckpt, entry, layer, entry.chunks if layer is None else layer_chunks[key][layer])
        if gated and name.endswith(GATED) and mode == "column" and len(offsets) == 2 * tp_size:
            offsets = offsets[:tp_size]  # ranges only: a TP rank's gate and up halves, sized as one column part
        if mode is not None and len(offsets) != tp_size:
            raise _refuse(ckpt, f"{key} has {len(offsets)} TP parts but the embedding has {tp_size}")
        mode = "vocab" if mode == "column" and key == HEAD[0] else mode
        info[name] = (key, layer, mode, full)
    shared = {HEAD[0], "output_layer.weight"} if tied else set()
    placed: list[tuple[str, int, int, int, int, int]] = []  # name, stage, gbuf, bucket, start, end (local numel)
    for stage in range(pp):
        names = [name for name, _, _ in params if stage_of[name] == stage]
        for gbuf, _dtag, members in _stage_buffers(ckpt, names, info, dtags, stage, tp_size, chunk_of):
            _place_buffer(ckpt, members, info, numel, shared, stage, gbuf, tp_size, placed)
    _check_chunks(ckpt, opts, placed, tp_size)
    views: dict[str, ParamView] = {}
    replicas: tuple[Holder, ...] = ()
    for name, stage, gbuf, bucket, start, _ in reversed(placed):
        key, layer, mode, full = info[name]
        dtag = dtags[(stage * tp_size, gbuf)]
        replica = name == "output_layer.weight" and tied
        holders = []
        for t in range(tp_size):
            spec = ShardSpec(full, mode, tp_size, t if mode else 0, None, 1, 0, 1)
            ref = KeyRef(stage * tp_size + t, gbuf, dtag, bucket, None, numel[(stage * tp_size, gbuf, bucket)], prefix)
            holders.append(Holder(ref, start, spec, (), not replica and (mode is not None or t == 0)))
        if replica:
            replicas += tuple(holders)
            continue
        views[name] = replace(ParamView(name, full, full, mode, None, False, gbuf, bucket, start, _param_dtype(dtag),
                                        tuple(holders)), weight_key=key, layer=layer)
    if replicas:
        views[HEAD[0]] = replace(views[HEAD[0]], holders=views[HEAD[0]].holders + replicas)
    order = [name for name, _, _ in params if name in views]
    out = {name: views[name] for name in order}  # module order
    if moe:
        layers = max((ln for _, _, ln in params if ln is not None), default=-1) + 1
        layer_stage = {ln: stage_of[name] for name, _, ln in params if ln is not None}
        ev, eplaced = expert_views(ckpt, expert_opts, prefixes[1], layers, lambda why: _refuse(ckpt, why),
                                   layer_stage, pp, gated)
        egbuf = next(iter(expert_opts.values())).gbuf_idx
        _check_chunks(ckpt, expert_opts, [(n, r, egbuf, b, a, z) for n, r, b, a, z in eplaced], 1)
        out.update(ev)
    return out


def _refuse_unsupported(ckpt: Checkpoint, ranges_only: bool = False) -> bool:
    """Refuse, naming the Megatron flag, a model whose tensors these rules do not lay out.

    The model comes from :func:`gtp_format.megatron_args.describe_model` (args checked against the
    shapes; a disagreement is refused there). A gated MLP (``--swiglu``) stores each TP rank's
    ``linear_fc1`` as two chunks (its gate and up halves, megatron-core's
    ``apply_swiglu_sharded_factory``), at global rows the column split does not give; q/k layernorm,
    shared experts and the router's expert bias are laid out but not checked against a save of
    megatron-core's beyond their ranges. With ``ranges_only`` (the padding map) nothing is refused.
    Returns whether the MLP is gated.
    """
    from gtp_format.megatron_args import FLAGS, describe_model

    model = describe_model(ckpt)
    features = [("gated_linear_unit", "a gated linear unit (SwiGLU: linear_fc1 holds a gate and an up half per TP "
                 "rank)"), ("moe_shared_expert_intermediate_size", "MoE shared experts")]
    for name, what in features if not ranges_only else ():
        if getattr(model, name):
            flag = "--quick-geglu" if name == "gated_linear_unit" and model.activation == "quick_gelu" else FLAGS[name]
            raise _refuse(ckpt, f"it has {what} ({flag}), which this version's per-parameter view does not lay out")
    return bool(model.gated_linear_unit)


def _param_dtype(dtag: str) -> str:
    """``torch.bfloat16`` of the key tag ``(torch.bfloat16, torch.float32)`` (param dtype, grad dtype)."""
    return dtag.strip("()").split(",")[0].strip()


def _stage_buffers(ckpt: Checkpoint, names: list[str], info: dict, dtags: dict[tuple[int, int], str], stage: int,
                   tp: int, chunk_of: dict[str, int]) -> list[tuple[int, str, list[str]]]:
    """(gbuf_idx, dtype tag, its params in module order) of one stage's buffers.

    megatron-core (``group_params_for_buffers``) makes one buffer per (param dtype, grad dtype) in
    the order each first appears in ``named_parameters()`` (module order), and ``grad_reduce_in_fp32``
    gives every buffer one grad dtype, so a param's buffer is the one of its model key's dtype: with
    the layernorms kept in fp32 after the bf16 cast, stage 0 (embeddings first) has ``gbuf_idx_0``
    (bf16, fp32) and ``gbuf_idx_1`` (fp32, fp32), a stage that starts with a layernorm the reverse
    (``fixtures/megatron/pair_fp32norm_dp2_dp_reshardable``). With virtual pipeline stages every
    model chunk has its own DDP and buffers, and the one ``DistributedOptimizer`` numbers them
    chunk after chunk (``chain(*per_model_buffers.values())``): chunk 0's buffers, then chunk 1's,
    the same dtype tag once per chunk (``pair_vpp_pp2_dp2_dp_reshardable``). What the keys hold must
    be exactly that, on every TP rank of the stage, or the rules do not describe this checkpoint.
    """
    groups: list[tuple[str, list[str]]] = []  # per gbuf: (param dtype, its params), chunk by chunk
    for c in sorted({chunk_of[name] for name in names}):
        members: dict[str, list[str]] = {}
        for name in names:
            if chunk_of[name] == c:
                members.setdefault(str(ckpt.entries[info[name][0]].dtype), []).append(name)
        groups += list(members.items())
    order = [dt for dt, _ in groups]
    for t in range(tp):
        have = {g: d for (n, g), d in dtags.items() if n == stage * tp + t}
        want = [_param_dtype(have.get(g, "")) for g in range(len(have))]
        if want != order:
            raise _refuse(ckpt, f"the buffers of dp_group_idx_{stage * tp + t} hold param dtypes {want}, but its "
                          f"model keys in module order give {order} (one buffer per dtype and model chunk, in order "
                          "of appearance)")
    return [(g, dtags[(stage * tp, g)], members) for g, (_, members) in enumerate(groups)]


def _place_buffer(ckpt: Checkpoint, names: list[str], info: dict, numel: dict[tuple[int, int, int], int],
                  shared: set[str], stage: int, gbuf: int, tp_size: int,
                  placed: list[tuple[str, int, int, int, int, int]]) -> None:
    """Lay out one buffer's params (module order) in its buckets, by the rules of the module docstring."""
    n0 = stage * tp_size
    buckets = sorted(b for (n, g, b) in numel if n == n0 and g == gbuf)
    for t in range(1, tp_size):
        if sorted(b for (n, g, b) in numel if n == n0 + t and g == gbuf) != buckets or any(
                numel[(n0 + t, gbuf, b)] != numel[(n0, gbuf, b)] for b in buckets):
            raise _refuse(ckpt, f"TP ranks of pipeline stage {stage} disagree on the buckets of gbuf_idx_{gbuf}")
    if buckets != list(range(len(buckets))):
        raise _refuse(ckpt, f"gbuf_idx_{gbuf} of pipeline stage {stage} has buckets {buckets[:8]}, not "
                      f"0..{len(buckets) - 1}")
    b, pos = 0, 0
    where = f"of gbuf_idx_{gbuf} of stage {stage}"
    for name in reversed(names):
        _key, _layer, mode, full = info[name]
        n = 1
        for d in ShardSpec(full, mode, tp_size, 0, None, 1, 0, 1).local_shape:
            n *= d
        if name in shared and pos:  # megatron-core: the shared embedding gets a bucket of its own
            raise _refuse(ckpt, f"{name} shares bucket {b} {where} with other parameters")
        start = -(-pos // PARAM_ALIGN) * PARAM_ALIGN
        have = numel.get((n0, gbuf, b))
        if have is None or start + n > have:
            raise _refuse(ckpt, f"{name} does not fit bucket {b} {where} ({have} elements unpadded)")
        placed.append((name, stage, gbuf, b, start, start + n))
        pos = start + n
        if pos == have:
            b, pos = b + 1, 0
        elif name in shared:
            raise _refuse(ckpt, f"{name} does not fill bucket {b} {where} alone")
    if b != len(buckets) or pos:
        raise _refuse(ckpt, f"the parameters {where} fill {b} buckets, the checkpoint has {len(buckets)}")


def _check_chunks(ckpt: Checkpoint, opts: dict, placed: list[tuple[str, int, int, int, int, int]], tp: int) -> None:
    """Every stored chunk of every bucket key lies inside one derived param slice or one gap.

    The edges of each (stage, gbuf, bucket) are sorted once and each chunk finds the first edge after
    its start by bisection: chunks x log(edges), where a scan of every edge per chunk was quadratic.
    """
    edges: dict[tuple[int, int, int], list[int]] = {}
    for _, stage, g, b, s, e in placed:
        edges.setdefault((stage, g, b), []).extend((s, e))
    cuts_of = {sb: sorted(set(v)) for sb, v in edges.items()}
    for key, o in opts.items():
        cuts = cuts_of.get((o.dp_group_idx // tp, o.gbuf_idx, o.bucket_idx), [])
        for c in ckpt.entries[key].chunks:
            a, z = c.offsets[0], c.offsets[0] + c.sizes[0]
            i = bisect_right(cuts, a)
            if i < len(cuts) and cuts[i] < z:
                raise _refuse(ckpt, f"chunk [{a}, {z}) of {key} straddles a derived parameter edge")


def padding_ranges(ckpt: Checkpoint) -> dict[str, list[tuple[int, int]]]:
    """Optimizer key -> its alignment gaps ``[a, z)``: elements that belong to no parameter.

    megatron-core allocates its buffers with ``torch.empty``, so these hold whatever memory held
    (NaN and 1e35s in the fixtures); NaN counts and statistics leave them out. Empty when the
    layout cannot be established (the refusal is ``inspect --params``'s to report).
    """
    return padding_layout(ckpt)[0]


def padding_layout(ckpt: Checkpoint) -> tuple[dict[str, list[tuple[int, int]]], str | None]:
    """(:func:`padding_ranges`, ``None``), or ``({}, why)`` where the parameter layout cannot be established."""
    try:
        views = megatron_views(ckpt, experts=True, ranges_only=True)
    except FormatError as e:
        return {}, str(e).removeprefix(f"{ckpt.root}: ")
    used: dict[str, list[tuple[int, int]]] = {}
    for v in views.values():
        for h in v.holders:
            used.setdefault(h.ref.key("param"), []).append((h.start, h.start + h.numel))
    out: dict[str, list[tuple[int, int]]] = {}
    for key, e in ckpt.entries.items():
        o = parse_optimizer_key(key) if e.kind == TENSOR else None
        if o is None or not e.shape:
            continue
        spans = sorted(used.get(key.rsplit(".", 1)[0] + ".param", []))
        gaps, pos = [], 0
        for a, z in spans:
            if a > pos:
                gaps.append((pos, a))
            pos = max(pos, z)
        if pos < e.shape[0]:
            gaps.append((pos, e.shape[0]))
        out[key] = gaps
    return out, None


def padding_chunks(ckpt: Checkpoint) -> frozenset[tuple[str, int]]:
    """(key, chunk index) of every stored chunk that lies wholly in an alignment gap."""
    return padding_chunks_of(ckpt, padding_ranges(ckpt))


def padding_chunks_of(ckpt: Checkpoint, ranges: dict[str, list[tuple[int, int]]]) -> frozenset[tuple[str, int]]:
    """:func:`padding_chunks` of ranges already computed."""
    out = set()
    for key, gaps in ranges.items():
        starts = [a for a, _ in gaps]
        for c in ckpt.entries[key].chunks:
            a, z = c.offsets[0], c.offsets[0] + c.sizes[0]
            i = bisect_right(starts, a) - 1
            if i >= 0 and gaps[i][0] <= a and z <= gaps[i][1]:
                out.add((key, c.index))
    return frozenset(out)
