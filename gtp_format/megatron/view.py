"""The per-parameter view of a genuine megatron-core ``dp_reshardable`` checkpoint (no manifest).

megatron-core writes no bucket layout, so it is rebuilt from the checkpoint itself: which
parameters the model has (:mod:`gtp_format.megatron.keys`, the model description of
:mod:`gtp_format.megatron.args`), where each TP rank's part sits, which stage and model chunk holds
each, and megatron-core's bucket rules (:mod:`gtp_format.megatron.buckets`) placing them in their
buffers.

Virtual pipeline stages (``--num-layers-per-virtual-pipeline-stage``): a stage holds several model
chunks of interleaved layers, each with its own buffers, numbered chunk after chunk
(:func:`_stages`, :func:`gtp_format.megatron.buckets.stage_buffers`); the bucket rules hold per
buffer as before; with experts, each chunk also has its own expert buffer (checked against
megatron-core's own PP2 x VPP2 x EP2 MoE save).

Pipeline stages: each stage has its own buffer, keyed ``dp_group_idx = pp_rank * TP + tp_rank``
(the rank in the tp x pp model-parallel group). Embeddings sit on the first stage; the final
layernorm and the output layer on the last; a layer on the stage whose ranks wrote its chunks
(rank order tp-cp-ep-dp-pp, so stage = rank // (world / PP)). The stacked keys use global layer
numbers (offset ``[layer, ...]``), and so does the view; megatron's modules number layers per
stage. With tied embeddings the last stage's ``output_layer.weight`` has no key of its own: it is
a non-primary holder of ``embedding.word_embeddings.weight`` (megatron all-reduces the two
gradients over the embedding group, so their fp32 state is bit-identical; checked on the PP2
fixture).

The module order and the key of each module
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

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from gtp_format.errors import FormatError
from gtp_format.layout.shard import ShardSpec
from gtp_format.megatron.buckets import check_chunks, param_dtype, place_buffer, stage_buffers
from gtp_format.megatron.glu import glu_holders
from gtp_format.megatron.keys import (
    BUFFERS,
    EXPERT,
    EXPERT_PREFIX,
    GATED,
    HEAD,
    LAYER,
    TAIL,
    expert_keys,
    refusal,
)
from gtp_format.megatron.moe import expert_views
from gtp_format.model import TENSOR, Checkpoint, Chunk, Entry
from gtp_format.names import OPT_PREFIX, parse_optimizer_key
from gtp_format.views.records import Holder, KeyRef, ParamView

if TYPE_CHECKING:
    from gtp_format.megatron.args import ModelDescription


def _layer_index(ckpt: Checkpoint, keys: list[str]) -> dict[str, dict[int, list[Chunk]]]:
    """Stacked key -> layer -> its chunks, built in one pass over the stored chunks.

    Indexed once so that per-layer lookups cost what the key stores, not layers x chunks (a 10-32
    MB ``.metadata`` made the per-layer scans quadratic). A chunk is listed under every layer it
    covers only as far as its bytes hold them (each layer at least one stored byte): a chunk whose
    layers are empty (shape ``(10**9, 0)``) counts as one, and the layers listed over all keys are
    bounded by :func:`check_stored` (a 56 KB checkpoint declaring 3 million empty layers took
    18.7 GB and 138 s before).
    """
    spans: list[tuple[str, Chunk, int]] = []
    total = 0
    for k in keys:
        e = ckpt.entries[k]
        itemsize = e.dtype.itemsize if e.dtype is not None else 1
        for c in e.chunks:
            if not c.offsets:
                continue
            # megatron-core stores one chunk per layer; a plain DCP save (a model-only checkpoint) one
            # chunk for all of them.
            per_layer = math.prod(c.sizes[1:]) * itemsize
            whole = c.storage is not None and per_layer > 0 and c.numel * itemsize <= c.storage.length
            span = max(1, c.sizes[0]) if whole else 1
            spans.append((k, c, span))
            total += span
    check_stored(ckpt, total, "layers of its stacked keys")
    out: dict[str, dict[int, list[Chunk]]] = {k: {} for k in keys}
    for k, c, span in spans:
        by_layer = out[k]
        for layer in range(c.offsets[0], c.offsets[0] + span):
            by_layer.setdefault(layer, []).append(c)
    return out


def check_stored(ckpt: Checkpoint, count: int, what: str) -> None:
    """Refuse ``count`` per-parameter entries (layers, (layer, expert) pairs) that the checkpoint's
    stored bytes cannot hold: each is at least one element, so at least one byte of its own.

    Up to the chunk count nothing is read (the metadata's size already bounds it, and megatron-core
    writes a chunk per layer); past it, the bound is the bytes the data files really store
    (``st_blocks``: holes are free to make), so a declared count costs no more than the data behind it.
    """
    if count <= ckpt.chunk_count():
        return
    from gtp_format.reader.storage import stored_size

    stored = sum(stored_size(ckpt.store, rel) for rel in ckpt.data_files)
    if count > stored:
        raise refusal(ckpt, f"its keys declare {count} {what}, more than the {stored} bytes its data files store "
                      "(each needs at least one)")


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
        raise refusal(ckpt, f"stacked layer keys disagree on the layer count ({sorted(layers)})")
    n = layers.pop() if layers else 0
    for k in stacked:
        stored = layer_chunks[k]
        if len(stored) != n or any(i < 0 or i >= n for i in stored):
            missing = next((i for i in range(min(n, len(stored) + 1)) if i not in stored), None)
            raise refusal(ckpt, f"{k} declares {n} layers but stores chunks for {len(stored)}"
                          + (f" (layer {missing} has none)" if missing is not None else ""))
    for i in range(n):  # n <= the chunks stored, checked above
        out += [(f"decoder.layers.{i}.{m}", f"decoder.layers.{k}", i) for m, k in LAYER
                if f"decoder.layers.{k}" in keys]
    out += [(k, k, None) for k in TAIL if k in keys]
    used = {k for _, k, _ in out}
    unknown = sorted(keys - used)
    if unknown:
        raise refusal(ckpt, f"model key {unknown[0]!r} is not a parameter of that model")
    return out


def _tp_boxes(ckpt: Checkpoint, entry: Entry, layer: int | None, chunks: list[Chunk] | tuple[Chunk, ...],
              lead: int | None = None) -> tuple[str | None, tuple[int, ...], list[tuple[int, ...]]]:
    """(tp_mode, full shape, per-TP-rank offsets in the full tensor) from a model key's chunks (of one layer;
    ``lead`` 2: of one (layer, expert) of a stacked expert key)."""
    assert entry.shape is not None
    lead = (0 if layer is None else 1) if lead is None else lead
    if lead == 2 and (not chunks or len(entry.shape) < lead):
        raise refusal(ckpt, f"{entry.key} stores no chunk for an expert it declares")
    if lead and any(len(c.sizes) < lead or any(n != 1 for n in c.sizes[:lead]) for c in chunks):
        raise refusal(ckpt, f"{entry.key} stores several layers in one chunk")  # megatron-core: one per layer
    full = entry.shape[lead:]
    boxes = sorted((c.offsets[lead:], c.sizes[lead:]) for c in chunks)
    if len(boxes) == 1:
        if boxes[0] != ((0,) * len(full), full):
            raise refusal(ckpt, f"{entry.key} has one chunk that is not the whole tensor")
        return None, full, [(0,) * len(full)]
    axes = {i for _, sz in boxes for i, (s, f) in enumerate(zip(sz, full)) if s != f}
    if len(axes) != 1 or next(iter(axes)) > 1:
        raise refusal(ckpt, f"{entry.key} is split along {sorted(axes)}, not along one of its first two axes")
    axis = axes.pop()
    return ("column" if axis == 0 else "row"), full, [o for o, _ in boxes]


def _stages(ckpt: Checkpoint, params: list[tuple[str, str, int | None]], pp: int,
            layer_chunks: dict[str, dict[int, list[Chunk]]]) -> tuple[dict[str, int], dict[str, int], int]:
    """(module name -> pipeline stage, module name -> model chunk of its stage, model chunks per stage).

    Embeddings on the first stage's first chunk, final layernorm and output layer on the last
    stage's last chunk; a layer on the stage of the ranks that wrote its chunks (rank order
    tp-cp-ep-dp-pp, so stage = rank // (world / PP)). The stages' layer runs are the model chunks
    (:func:`gtp_format.megatron.topology.model_chunks`): one ascending run per stage, or, with
    virtual pipeline stages, ``vpp`` runs per stage interleaved over the stages; anything else is
    refused. ``args.virtual_pipeline_model_parallel_size``, where recorded, must agree.
    """
    if pp == 1:
        return {name: 0 for name, _, _ in params}, {name: 0 for name, _, _ in params}, 1
    from gtp_format.megatron.topology import args_sizes, common_state, model_chunks
    from gtp_format.names import writer_rank

    ranks = [r for r in (writer_rank(f) for f in ckpt.data_files) if r is not None]
    world = max(ranks) + 1 if ranks else 0
    if world == 0 or world % pp:
        raise refusal(ckpt, f"its {world} data files do not split into {pp} pipeline stages")
    per_stage = world // pp
    layer_stage: dict[int, int] = {}
    for key, by_layer in layer_chunks.items():
        for layer, chunks in by_layer.items():
            for c in chunks:
                r = writer_rank(c.storage.file if c.storage else None)
                if r is None or r >= world:
                    raise refusal(ckpt, f"layer {layer} of {key} has a chunk in no rank's data file")
                if layer_stage.setdefault(layer, r // per_stage) != r // per_stage:
                    raise refusal(ckpt, f"layer {layer} has chunks written by ranks of two pipeline stages")
    try:
        vpp, layer_chunk = model_chunks(layer_stage, pp) if layer_stage else (1, {})
    except ValueError as e:
        raise refusal(ckpt, str(e)) from None
    recorded = args_sizes(common_state(ckpt)).get("vpp")
    if recorded is not None and recorded != vpp:
        raise refusal(ckpt, f"its args record virtual_pipeline_model_parallel_size={recorded}, but the ranks that "
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
    from gtp_format.megatron.args import describe_model
    from gtp_format.megatron.layout import stage_counts

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
        raise refusal(ckpt, f"its args record decoder_first_pipeline_num_layers={first}, "
                      f"decoder_last_pipeline_num_layers={last}, but the ranks that wrote decoder.layers.* hold "
                      f"{counts} layers per pipeline stage")


def megatron_views(ckpt: Checkpoint, experts: bool = False, dense_experts: bool = False) -> dict[str, ParamView]:
    """Every parameter of a megatron-core GPT ``dp_reshardable`` checkpoint, TP x PP (see the module docstring).

    ``experts``: also MoE checkpoints (:mod:`gtp_format.megatron.moe`): ``inspect --params``, the
    padding map and ``export --to fully_reshardable`` ask (expert keys are indexed by (layer, expert),
    :attr:`gtp_format.views.records.ParamView.lead`), ``ckpt reshard`` and ``export --to hf --optimizer``.

    A gated ``linear_fc1`` (``--swiglu``: the dense MLP's, the shared experts', each expert's at any
    expert TP) gives each TP rank two holders, its gate and its up half
    (:func:`gtp_format.megatron.glu.glu_holders`); q/k layernorm and shared experts are laid out as any
    parameter; every range is checked against the chunks megatron-core wrote (:func:`check_chunks`).

    ``dense_experts`` (the Hugging Face export asks): also MoE at EP 1 with expert TP = TP, one optimizer with no
    ``chained_`` prefix, whose experts megatron-core keeps in the dense buffers after each layer's router, expert
    by expert (``linear_fc1`` then ``linear_fc2``), TP-split as the dense MLP (:func:`_with_dense_experts`;
    ``fixtures/megatron/pair_mixtral_tp2_ep1_dp_reshardable``; a shared expert follows them). Reshard, ``inspect
    --params`` and the padding map ask too; the planner lays the experts out by the target's rules.
    """
    opts = {k: parse_optimizer_key(k) for k, e in ckpt.entries.items() if e.kind == TENSOR}
    opts = {k: o for k, o in opts.items() if o is not None}
    if not opts:
        raise FormatError(f"{ckpt.root}: no dp_reshardable optimizer keys; the per-parameter view needs them")
    prefixes = sorted({o.prefix for o in opts.values()})
    moe = bool(expert_keys(ckpt))
    if moe and prefixes == [f"chained_{i}.{OPT_PREFIX}" for i in range(2)]:
        if not experts:
            raise refusal(ckpt, "it is MoE (chained_ optimizers), and this reader was asked for a dense model's view")
        expert_opts = {k: o for k, o in opts.items() if o.prefix == prefixes[1]}
        opts = {k: o for k, o in opts.items() if o.prefix == prefixes[0]}
    elif moe and dense_experts and prefixes == [OPT_PREFIX]:
        moe = False  # the experts are dense parameters here (EP 1, expert TP = TP): no expert optimizer
    elif prefixes != [OPT_PREFIX] or moe:
        raise refusal(ckpt, f"its optimizer keys start with {prefixes[:3]}" + (" and it has expert keys" if moe else "")
                      + ": not one optimizer, nor MoE's chained dense + expert pair")
    from gtp_format.megatron.args import describe_model

    model = describe_model(ckpt)  # once: the experts' implementation and the gated unit both come from it
    if expert_keys(ckpt):
        _check_experts_sequential(ckpt, model)
    prefix = next(iter(opts.values())).prefix
    dtags: dict[tuple[int, int], str] = {}
    for o in opts.values():
        if dtags.setdefault((o.dp_group_idx, o.gbuf_idx), o.dtype) != o.dtype:
            raise refusal(ckpt, f"gbuf_idx_{o.gbuf_idx} of dp_group_idx_{o.dp_group_idx} has keys of two dtypes")
    if any(o.cp_rank is not None for o in opts.values()):
        raise refusal(ckpt, "optimizer keys carry cp_rank")
    if HEAD[0] not in ckpt.entries:
        raise refusal(ckpt, f"it has no {HEAD[0]}")
    gated = _gated(model)
    stacked = [k for k, e in ckpt.entries.items() if e.kind == TENSOR and k.startswith("decoder.layers.")]
    layer_chunks = _layer_index(ckpt, stacked)
    params = _module_params(ckpt, layer_chunks)
    expert_of: dict[str, int] = {}
    if dense_experts and expert_keys(ckpt) and not moe:
        params, expert_of = _with_dense_experts(ckpt, params)
    emb = ckpt.entries[HEAD[0]]
    tp_size = len(_tp_boxes(ckpt, emb, None, emb.chunks)[2])
    n_idx = len({o.dp_group_idx for o in opts.values()})
    if n_idx % tp_size or {o.dp_group_idx for o in opts.values()} != set(range(n_idx)):
        raise refusal(ckpt, f"dp_group_idx values {sorted({o.dp_group_idx for o in opts.values()})[:8]} are not "
                      f"TP {tp_size} (the embedding's vocab parts) x PP stages")
    pp = n_idx // tp_size
    tied = pp > 1 and "output_layer.weight" not in ckpt.entries
    if tied:  # the last stage's output layer: a replica of the word embeddings with its own buffer slot
        params.append(("output_layer.weight", HEAD[0], None))
    stage_of, chunk_of, vpp = _stages(ckpt, params, pp, layer_chunks)
    bucket_keys: dict[tuple[int, int, int], str] = {}  # a bucket's .param key, for the refusals
    numel: dict[tuple[int, int, int], int] = {}
    for k, o in opts.items():  # one pass, not one per bucket over all keys (issue 22 class 5)
        shape = ckpt.entries[k].shape
        if o.state == "param" and shape:
            numel.setdefault((o.dp_group_idx, o.gbuf_idx, o.bucket_idx), shape[0])
            bucket_keys.setdefault((o.dp_group_idx, o.gbuf_idx, o.bucket_idx), k)
    info = {}
    for name, key, layer in params:
        entry = ckpt.entries[key]
        chunks = entry.chunks if layer is None else layer_chunks[key][layer]
        if name in expert_of:  # this expert's chunks of the (layer, expert) stacked key
            chunks = [c for c in chunks if len(c.offsets) > 1 and c.offsets[1] == expert_of[name]]
        mode, full, offsets = _tp_boxes(ckpt, entry, layer, chunks, 2 if name in expert_of else None)
        if gated and _gated_name(name, expert_of) and mode == "column" and len(offsets) == 2 * tp_size:
            offsets = offsets[:tp_size]  # a TP rank's gate and up chunks: its part is their two halves (glu_holders)
        if mode is not None and len(offsets) != tp_size:
            raise refusal(ckpt, f"{key} has {len(offsets)} TP parts but the embedding has {tp_size}")
        mode = "vocab" if mode == "column" and key == HEAD[0] else mode
        info[name] = (key, layer, mode, full)
    shared = {HEAD[0], "output_layer.weight"} if tied else set()
    placed: list[tuple[str, int, int, int, int, int]] = []  # name, stage, gbuf, bucket, start, end (local numel)
    for stage in range(pp):
        names = [name for name, _, _ in params if stage_of[name] == stage]
        for gbuf, _dtag, members in stage_buffers(ckpt, names, info, dtags, stage, tp_size, chunk_of):
            place_buffer(ckpt, members, info, numel, shared, stage, gbuf, tp_size, placed, bucket_keys)
    check_chunks(ckpt, opts, placed, tp_size)
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
            if gated and _gated_name(name, expert_of) and mode == "column":
                holders += glu_holders(full, tp_size, t, ref, start)
                continue
            holders.append(Holder(ref, start, spec, (), not replica and (mode is not None or t == 0)))
        if replica:
            replicas += tuple(holders)
            continue
        views[name] = replace(ParamView(name, full, full, mode, None, False, gbuf, bucket, start, param_dtype(dtag),
                                        tuple(holders)), weight_key=key, layer=layer, expert=expert_of.get(name))
    if replicas:
        views[HEAD[0]] = replace(views[HEAD[0]], holders=views[HEAD[0]].holders + replicas)
    # module order; experts after the dense parameters, as the chained layout's expert views come, so that what
    # reads the views in order (the Hugging Face export's files) does not depend on EP
    order = [name for name, _, _ in params if name in views and name not in expert_of]
    order += [name for name, _, _ in params if name in views and name in expert_of]
    out = {name: views[name] for name in order}
    if moe:
        layers = max((ln for _, _, ln in params if ln is not None), default=-1) + 1
        layer_stage = {ln: stage_of[name] for name, _, ln in params if ln is not None}
        layer_chunk = {ln: chunk_of[name] for name, _, ln in params if ln is not None}  # VPP: one buffer each
        ev, eplaced = expert_views(ckpt, expert_opts, prefixes[1], layers, lambda why: refusal(ckpt, why),
                                   layer_stage, pp, gated, layer_chunk)
        check_chunks(ckpt, expert_opts, eplaced, 1)
        out.update(ev)
    return out


def _gated_name(name: str, expert_of: dict[str, int]) -> bool:
    """A gated linear's parameter: the dense MLP's or shared experts' ``linear_fc1``, or an expert's in the dense
    buffers (each TP rank stores its gate and its up half)."""
    return name.endswith(GATED) or (name in expert_of and name.endswith(("linear_fc1.weight", "linear_fc1.bias")))


def _with_dense_experts(ckpt: Checkpoint, params: list[tuple[str, str, int | None]]
                        ) -> tuple[list[tuple[str, str, int | None]], dict[str, int]]:
    """``params`` with each layer's experts after its router (megatron-core's module order at EP 1 with expert TP
    = TP: ``mlp.router``, then ``mlp.experts.local_experts.<e>.linear_fc1``, ``.linear_fc2``), and each expert
    parameter's global expert index. The (layer, expert) pairs are bounded by what the data files store."""
    keys = [(s, EXPERT_PREFIX + s) for s in EXPERT if EXPERT_PREFIX + s in ckpt.entries]
    unknown = sorted(set(expert_keys(ckpt)) - {k for _, k in keys})
    if unknown:
        raise refusal(ckpt, f"expert key {unknown[0]!r} is not a SequentialMLP expert parameter")
    shapes = {ckpt.entries[k].shape[:2] if ckpt.entries[k].shape else () for _, k in keys}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise refusal(ckpt, "expert keys disagree on (layers, experts)")
    layers, n_exp = next(iter(shapes))
    check_stored(ckpt, layers * n_exp, "(layer, expert) pairs of its expert keys")
    routers = {ln: i for i, (name, _, ln) in enumerate(params) if ln is not None and ".mlp.router." in name}
    if set(routers) != set(range(layers)):
        raise refusal(ckpt, f"its expert keys declare {layers} layers, but {len(routers)} layers have a router")
    out: list[tuple[str, str, int | None]] = []
    expert_of: dict[str, int] = {}
    for i, p in enumerate(params):
        out.append(p)
        layer = p[2]
        if layer is not None and routers.get(layer) == i:
            for e in range(n_exp):
                for s, k in keys:
                    name = f"decoder.layers.{layer}.mlp.experts.{e}.{s}"
                    out.append((name, k, layer))
                    expert_of[name] = e
    return out, expert_of


def _check_experts_sequential(ckpt: Checkpoint, model: ModelDescription) -> None:
    """Refuse experts that are Transformer Engine's ``TEGroupedMLP`` (:attr:`ModelDescription.grouped_experts`,
    from the recorded args: its sharded keys are SequentialMLP's, so no shape or key tells). Where
    ``linear_fc1`` and ``linear_fc2`` hold as many elements (no gated unit), its order would pass every chunk
    check and give each expert another's optimizer state."""
    if model.grouped_experts:
        raise refusal(ckpt, "its experts are Transformer Engine's TEGroupedMLP (args moe_grouped_gemm, "
                      f"transformer_impl {model.transformer_impl!r}), whose buffers hold every expert's "
                      "linear_fc1, then every expert's linear_fc2, not SequentialMLP's expert-by-expert order "
                      "these rules were checked on; save with --dist-ckpt-optim-fully-reshardable (one optimizer "
                      "key per parameter), or train without --moe-grouped-gemm")


def _gated(model: ModelDescription) -> bool:
    """Whether the MLPs are gated (``--swiglu``), from :func:`gtp_format.megatron.args.describe_model`
    (args checked against the shapes; a disagreement is refused there). A gated MLP stores each TP
    rank's ``linear_fc1`` as two chunks (its gate and up halves), and so does each expert at expert
    TP > 1 per expert-TP rank; at expert TP 1 an expert's ``[gate; up]`` is whole (one part: the
    global order)."""
    return bool(model.gated_linear_unit)


