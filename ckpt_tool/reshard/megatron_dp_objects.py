"""The byte objects of a megatron-core ``dp_reshardable`` checkpoint resharded to another topology.

Never unpickled; each is the source's blob, copied or edited on its pickle *opcodes*
(:mod:`pickletools` decodes them without running anything, as :mod:`.megatron_objects` does for the
``fully_reshardable`` export):

* ``_extra_state``: copied as stored (per layer, not per rank: the same at any TP/PP).
* ``optimizer.distributed.dp_group_idx_{N}.per_bucket_numel[_unpadded]/shard_0_1``: one pair per
  target model-parallel rank ``N``; the source's blob with its pickle written anew as the target's
  ``[[{(param dtype, grad dtype): [n, ...]}, ...]]`` (one dict per gbuf, in the target stage's
  buffer order). megatron-core's load asserts the unpadded lists equal to the ones it computes.
* ``optimizer.distributed.dp_group_idx_{N}.optimizer/shard_0_1``: the source's rank-0 blob (its
  ``param_groups``: lr, betas, weight decay, ``step``) for every ``N``; megatron-core's load takes
  each group's hyper-parameters from it by the group's identity (``wd_mult``, ``lr_mult``, ...)
  and the params from the live optimizer, so the groups, not their param lists, must match.
* ``common_state``: ``args``' ``tensor_model_parallel_size``, ``pipeline_model_parallel_size``,
  ``context_parallel_size``, ``data_parallel_size`` and ``world_size`` set to the target's
  (megatron's ``load_checkpoint`` refuses a ``dp_reshardable`` optimizer whose recorded (TP, PP)
  differ from the run's), ``no_save_rng = True``, and the virtual-pipeline arguments
  (``virtual_pipeline_model_parallel_size``, ``num_layers_per_virtual_pipeline_stage``) ``None``:
  the output has one model chunk per stage; the pipeline layout fields
  (``decoder_first_pipeline_num_layers``, ``decoder_last_pipeline_num_layers``) the target's: the
  source's uneven split where PP stays, None (an even split) where it changes.
* MoE between one optimizer (EP 1 with expert TP = TP: the experts in the dense buffers) and the chained
  dense + expert pair: ``common_state``'s optimizer part and the param groups as :mod:`.megatron_chain` edits them.
* ``rng_state``: dropped. It is per (pp, tp) rank of the *source*; copied onto other ranks it
  would give two TP ranks one dropout stream. With ``args.no_save_rng`` megatron's loader does
  not ask for it (as after a save with ``--no-save-rng``), so no ``--no-load-rng`` is needed.
"""

from __future__ import annotations

from typing import Any

from ckpt_tool.copying.megatron_blobs import INT_OPS, PUT_OPS, blob_records, numel_blob, pickle_int, pickle_ops
from ckpt_tool.reshard.megatron_chain import chain_common, expert_groups, source_prefix
from ckpt_tool.reshard.megatron_objects import COMMON, pickle_str
from gtp_format.errors import FormatError
from gtp_format.reader.checkpoint import Checkpoint
from gtp_format.reader.chunks import chunk_bytes
from gtp_format.writer.torch_blob import object_blob

_STR = ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE")
ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
        "data_parallel_size", "world_size")
NO_SAVE_RNG = "no_save_rng"
# megatron's virtual-pipeline arguments: the output is laid out without virtual pipeline stages
# (one model chunk per stage), and a stale size would describe chunks it does not have
# the pipeline layout: per-stage layer counts where uneven, set to the target's (None: even split)
PP_FIRST, PP_LAST = "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"
VIRTUAL = ("virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
           "num_virtual_stages_per_pipeline_rank")


def _blob(ckpt: Checkpoint, key: str) -> bytes:
    e = ckpt.entries.get(key)
    if e is None or e.kind != "bytes" or not e.chunks:
        raise FormatError(f"{ckpt.root}: byte object {key} is missing; reshard of this checkpoint is not supported")
    return bytes(chunk_bytes(ckpt, e, e.chunks[0]))


def common_blob(root: str, blob: bytes, sizes: dict[str, int], layout: dict[str, int | None] | None = None) -> bytes:
    """``common_state`` with ``args``' parallel sizes set to ``sizes``, ``no_save_rng`` True, the
    virtual-pipeline sizes (:data:`VIRTUAL`) None and the pipeline layout fields (``layout``:
    :data:`PP_FIRST`, :data:`PP_LAST`) set to the target's: an int, or None for an even split. A
    layout field the source's args lack is added where the target needs a value."""
    layout = layout or {}
    prefix, records = blob_records(root, COMMON, blob)
    ops = pickle_ops(root, COMMON, dict(records)["data.pkl"])
    out = [raw for _, _, raw in ops]
    found: dict[str, int] = {}
    for i, (name, arg, _) in enumerate(ops):
        if name in _STR and arg in sizes and arg not in found:
            k = i + (2 if i + 1 < len(ops) and ops[i + 1][0] in PUT_OPS else 1)
            if k >= len(ops) or ops[k][0] not in INT_OPS:
                raise FormatError(f"{root}: {COMMON}'s args.{arg} is not an int; reshard of this common state is "
                                  "not supported")
            out[k] = pickle_int(sizes[arg])
            found[arg] = k
        elif name in _STR and arg == NO_SAVE_RNG:
            k = i + (2 if i + 1 < len(ops) and ops[i + 1][0] in PUT_OPS else 1)
            if k >= len(ops) or ops[k][0] not in ("NEWTRUE", "NEWFALSE"):
                raise FormatError(f"{root}: {COMMON}'s args.{NO_SAVE_RNG} is not a bool; reshard of this common "
                                  "state is not supported")
            out[k] = b"\x88"  # NEWTRUE
            found[NO_SAVE_RNG] = k
        elif name in _STR and arg in layout and arg not in found:
            k = i + (2 if i + 1 < len(ops) and ops[i + 1][0] in PUT_OPS else 1)
            if k >= len(ops) or ops[k][0] not in (*INT_OPS, "NONE"):
                raise FormatError(f"{root}: {COMMON}'s args.{arg} is not an int or None; reshard of this common "
                                  "state is not supported")
            value = layout[arg]
            out[k] = b"N" if value is None else pickle_int(value)
            found[arg] = k
        elif name in _STR and arg in VIRTUAL:
            k = i + (2 if i + 1 < len(ops) and ops[i + 1][0] in PUT_OPS else 1)
            if k >= len(ops) or ops[k][0] not in (*INT_OPS, "NONE"):
                raise FormatError(f"{root}: {COMMON}'s args.{arg} is not an int or None; reshard of this common "
                                  "state is not supported")
            out[k] = b"N"  # NONE
    first = found.get(ARGS[0])
    if first is None or ARGS[1] not in found:
        raise FormatError(f"{root}: {COMMON}'s args record no {ARGS[0]} / {ARGS[1]}; megatron-core's loader "
                          "would not know the topology; reshard of this common state is not supported")
    if NO_SAVE_RNG not in found:
        if first + 1 < len(ops) and ops[first + 1][0] == "SETITEM":
            raise FormatError(f"{root}: {COMMON}'s args are not stored as a batch of items; reshard of this common "
                              "state is not supported")
        out[first] += pickle_str(NO_SAVE_RNG) + b"\x88"  # one more (key, True) in the same SETITEMS batch
    for arg, value in layout.items():
        if arg not in found and value is not None:
            if first + 1 < len(ops) and ops[first + 1][0] == "SETITEM":
                raise FormatError(f"{root}: {COMMON}'s args are not stored as a batch of items; reshard of this "
                                  "common state is not supported")
            out[first] += pickle_str(arg) + pickle_int(value)  # the target's uneven split, which the source's args lack
    return object_blob(prefix, [(n, b"".join(out) if n == "data.pkl" else d) for n, d in records])


def target_objects(ckpt: Checkpoint, numels: dict[str, dict[int, list[tuple[str, list[int], list[int]]]]],
                   sizes: dict[str, int], max_bytes: int, layout: dict[str, int | None] | None = None,
                   expert_no_decay: bool = True) -> tuple[dict[str, bytes], list[str]]:
    """Every byte object of the resharded checkpoint, by key, and the source keys left out. ``expert_no_decay``:
    whether the experts have parameters without weight decay (biases), so an expert optimizer made from the dense
    one keeps its no-decay group (:func:`.megatron_chain.expert_groups`).

    ``numels``: optimizer prefix -> target ``dp_group_idx`` -> per gbuf (dtype tag, padded, unpadded) bucket numels.
    More than ``max_bytes`` of source objects (megatron-core's are a few KiB each) is refused.
    """
    root = str(ckpt.root)
    objects = [(k, e) for k, e in ckpt.entries.items() if e.kind == "bytes"]
    total = sum(e.chunks[0].storage.length for _, e in objects if e.chunks and e.chunks[0].storage is not None)
    if total > max_bytes:
        raise FormatError(f"{root}: its byte objects declare {total} bytes, more than the {max_bytes}-byte chunk "
                          "budget; raise --max-memory")
    out: dict[str, bytes] = {}
    dropped: list[str] = []
    sources = {p: source_prefix(ckpt, p) for p in numels}  # MoE: one optimizer <-> the chained pair
    known = [f"{p}.dp_group_idx_{{}}.{s}/shard_0_1" for p in {*numels, *(sp for sp, _ in sources.values())}
             for s in ("per_bucket_numel", "per_bucket_numel_unpadded", "optimizer")]
    for key, _ in objects:
        if "._extra_state/" in key:
            blob = _blob(ckpt, key)
            blob_records(root, key, blob)  # CRC-checked: a damaged source is refused, not copied
            out[key] = blob
        elif key == COMMON:
            chained = any(p.startswith("chained_") for p in numels)
            out[key] = chain_common(root, common_blob(root, _blob(ckpt, key), sizes, layout), chained)
        elif not any(_matches(key, k) for k in known):
            dropped.append(key)
    if COMMON not in out:
        raise FormatError(f"{root}: it has no {COMMON}; megatron-core's loader needs one; reshard is not supported")
    for prefix, ranks in numels.items():
        sp, expert = sources[prefix]
        src = {s: _blob(ckpt, f"{sp}.dp_group_idx_0.{s}/shard_0_1")
               for s in ("per_bucket_numel", "per_bucket_numel_unpadded", "optimizer")}
        blob_records(root, f"{sp}.dp_group_idx_0.optimizer", src["optimizer"])  # CRC-checked before it is copied
        if expert:
            src["optimizer"] = expert_groups(root, f"{sp}.dp_group_idx_0.optimizer", src["optimizer"],
                                             expert_no_decay)
        for n, bufs in sorted(ranks.items()):
            base = f"{prefix}.dp_group_idx_{n}"
            for i, name in enumerate(("per_bucket_numel", "per_bucket_numel_unpadded")):
                out[f"{base}.{name}/shard_0_1"] = numel_blob(root, f"{base}.{name}", src[name],
                                                             [(d, nums[i]) for d, *nums in bufs])
            out[f"{base}.optimizer/shard_0_1"] = src["optimizer"]
    return out, dropped


def _matches(key: str, pattern: str) -> bool:
    head, tail = pattern.split("{}")
    mid = key[len(head):len(key) - len(tail)] if key.startswith(head) and key.endswith(tail) else ""
    return mid.isdigit()


def describe(objects: dict[str, Any]) -> dict[str, int]:
    kinds = {"common_state": 0, "_extra_state": 0, "optimizer": 0}
    for k in objects:
        kinds["common_state" if k == COMMON else "_extra_state" if "._extra_state/" in k else "optimizer"] += 1
    return kinds
