"""``ckpt export``: the per-parameter state of a checkpoint in formats other tools load.

* ``hf``: a Hugging Face model folder. For this runtime's checkpoints (``--names hf``, the
  default) one that ``AutoModelForCausalLM.from_pretrained`` loads with no code: ``config.json``
  (``ArceeForCausalLM``), ``generation_config.json``, transformers' parameter names with the fused
  QKV split into q/k/v (:mod:`ckpt_tool.hf.mapping`, the table import reads too), and, from
  ``--tokenizer FILE``, ``tokenizer.json``. A megatron-core GPT (local spec) becomes
  ``GPTBigCodeForCausalLM`` given ``--num-heads``. ``--names megatron`` keeps the checkpoint's
  own names (the default for megatron-core checkpoints without ``--num-heads``). Full shapes (GTP
  padding removed), the stored dtype, HF's file naming (``model.safetensors``, or
  ``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``). ``optimizer=True``
  adds ``optimizer*.safetensors`` holding ``optimizer.state.{param,exp_avg,exp_avg_sq}.<name>``
  (fp32 master weights and Adam moments), from a ``dp_reshardable`` save's buckets or a ``fully_reshardable``
  one's per-parameter keys. Without ``--optimizer`` only model keys are read, so any megatron-core checkpoint
  that holds model weights exports, whatever its optimizer sharding (:mod:`ckpt_tool.copying.weights`).
* ``fully_reshardable``: Megatron's per-parameter optimizer layout as a torch_dist (DCP)
  checkpoint: ``optimizer.state.{param,exp_avg,exp_avg_sq}.<name>`` next to the model weights
  ``<name>``, every tensor at its global shape, chunked in row blocks.
* ``torch``: one ``torch.save`` file of ``{key: global tensor}`` for every tensor key of SRC, the
  tensors PyTorch's ``dcp_to_torch_save`` writes (its non-tensor objects are left out and named:
  :mod:`.to_torch`); the whole state is in memory at once, so it is
  refused above ``--max-memory`` (small models only: PyTorch's own ``dcp_to_torch_save``, added in
  pytorch/pytorch#119814, holds the whole state too, and its docstring warns of running out of memory).

All three stream through the per-parameter view (:class:`ckpt_tool.copying.source.Source`) in row blocks of at
most the chunk budget and appear atomically through the one checkpoint writer
(:class:`gtp_format.writer.checkpoint.CheckpointWriter` via :func:`ckpt_tool.copying.engine.build_atomically`;
``torch``'s single file through :func:`gtp_format.commit.commit_file`): never replacing a DST that
appeared meanwhile. ``hf`` and ``fully_reshardable`` files go out through
:class:`gtp_format.writer.sink.Sink` (``O_DIRECT``, fsynced), as reshard's do.
"""

from __future__ import annotations

import json
import math
import struct
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ckpt_tool.copying import DEFAULT_MAX_MEMORY, WEIGHT_STATE
from ckpt_tool.copying.ahead import ReadAhead, ahead_depth
from ckpt_tool.copying.engine import (
    COPIES,
    build_atomically,
    check_destination,
    chunk_budget,
    chunk_data,
    default_workers,
    peak_rss,
    rank_cores,
    rss_after_imports,
    run_files,
    share_files,
    written_sizes,
)
from ckpt_tool.copying.plan import FP32, OutChunk, dtype_of, row_blocks, split_files
from ckpt_tool.copying.source import Buffers, Source, open_source
from ckpt_tool.copying.writers import write_distcp, write_distcp_metadata, write_objects
from ckpt_tool.export.to_torch import export_torch
from ckpt_tool.hf import folder as hf_folder
from ckpt_tool.hf import mapping, megatron_arch, megatron_run_state
from ckpt_tool.hf import run_state as hf_run_state
from ckpt_tool.reshard.megatron_objects import extra_objects
from gtp_format import ranks
from gtp_format.check.st_names import refuse_unstorable
from gtp_format.commit import write_durable
from gtp_format.dtypes import DType
from gtp_format.errors import FormatError
from gtp_format.integrity.records import ChunkRecord
from gtp_format.layout.params import model_params
from gtp_format.lineage import attestation, attestation_beside, derived
from gtp_format.manifest import FileEntry
from gtp_format.megatron.args import describe_model, recorded_args
from gtp_format.names import DCP_METADATA_FILE, STATES, iter_dir_name
from gtp_format.progress import Progress, ProgressOpener
from gtp_format.session import Session
from gtp_format.storage import objects
from gtp_format.storage.base import storage_for
from gtp_format.storage.location import ObjectURL
from gtp_format.views.records import ParamView
from gtp_format.work import remove_owned
from gtp_format.writer.checkpoint import CheckpointWriter, data_file_name, megatron_metadata
from gtp_format.writer.sink import Sink, stage_bytes

TARGETS = ("hf", "fully_reshardable", "torch")
DEFAULT_SHARD = 5 * 10**9  # Hugging Face's default max_shard_size ("5GB")
NAMES = ("hf", "megatron")


def state_key(state: str, name: str) -> str:
    """Megatron's fully_reshardable name of one parameter's optimizer state."""
    return f"optimizer.state.{state}.{name}"


def ordered_views(source: Source) -> list[ParamView]:
    """Parameters in model order (the manifest lists them in bucket order, reversed)."""
    if source.manifest is None or source.manifest.model is None:
        return list(source.views.values())  # megatron-core views are built in module order
    order = {p.name: i for i, p in enumerate(model_params(source.manifest.model))}
    return sorted(source.views.values(), key=lambda v: order.get(v.name, len(order)))


def param_chunks(view: ParamView, state: str, key: str, max_bytes: int, stacked: bool = False) -> list[OutChunk]:
    """Row blocks of one parameter's full tensor for ``state``, as chunks of key ``key``.

    ``stacked``: the key has a leading layer axis (megatron-core) and the chunk sits at ``view.layer``.
    """
    dt = dtype_of(view.param_dtype) if state == WEIGHT_STATE else FP32
    shape, rest = view.full_shape, view.full_shape[1:]
    lead: tuple[int, ...] = view.lead if stacked else ()
    one: tuple[int, ...] = (1,) * len(lead)
    return [OutChunk(key, (*lead, a, *(0,) * len(rest)), (*one, b - a, *rest), dt, view.name, state,
                     ((a, *(0,) * len(rest)), (b - a, *rest)))
            for a, b in row_blocks(shape[0] if shape else 1, math.prod(rest), dt.itemsize, max_bytes)]


# -- hf ---------------------------------------------------------------------------------------------

def part_chunks(view: ParamView, state: str, key: str, ranges: tuple[tuple[int, int], ...],
                max_bytes: int) -> list[OutChunk]:
    """Row blocks of rows ``ranges`` of one parameter's full tensor, back to back as key ``key``."""
    dt = dtype_of(view.param_dtype) if state == WEIGHT_STATE else FP32
    rest = view.full_shape[1:]
    zeros = (0,) * len(rest)
    out, pos = [], 0
    for ra, rb in ranges:
        for a, b in row_blocks(rb - ra, math.prod(rest), dt.itemsize, max_bytes):
            out.append(OutChunk(key, (pos + a, *zeros), (b - a, *rest), dt, view.name, state,
                                ((ra + a, *zeros), (b - a, *rest))))
        pos += rb - ra
    return out


def _hf_files(tensors: list[tuple[str, DType, tuple[int, ...], list[OutChunk]]], max_shard: int,
              prefix: str) -> list[tuple[str, list[Any]]]:
    groups: list[list[Any]] = [[]]
    size = 0
    for t in tensors:
        nbytes = math.prod(t[2]) * t[1].itemsize
        if groups[-1] and size + nbytes > max_shard:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += nbytes
    return list(zip(hf_folder.shard_names(len(groups), prefix), groups))


def _write_hf_file(path: Path, tensors: list[Any], data: Callable[[OutChunk], np.ndarray], tick: Progress,
                   stage: int, meta: dict[str, str] | None = None, checksum: bool = False) -> FileEntry:
    """One weights file; ``checksum``: its entry's CRC-32C computed from the bytes as they are written (a bucket
    output under torchrun, whose ranks read their share of the staged files in full against it before the
    upload); else the entry has none (no manifest lists an hf file)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(meta or {})}}
    pos = 0
    for name, dt, shape, _ in tensors:
        n = math.prod(shape) * dt.itemsize
        header[name] = {"dtype": dt.safetensors, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with Sink(path, stage, checksum=checksum) as out:
        out.write([struct.pack("<Q", len(raw)) + raw])
        for _, _, _, chunks in tensors:
            for c in chunks:
                out.write([np.ascontiguousarray(data(c)).reshape(-1).view(np.uint8)])
                tick(c.nbytes)
        return out.close()


def megatron_target(source: Source, num_heads: int | None) -> megatron_arch.Target:
    """The transformers class of a megatron-core SRC, from the model its checkpoint records."""
    views = source.views.values()
    dtypes = {v.param_dtype for v in views}
    dtype = mapping.config_dtype(dtypes.pop() if len(dtypes) == 1 else "", str(source.root))
    return megatron_arch.choose(describe_model(source.ckpt), recorded_args(source.ckpt),
                                {v.name: v.full_shape for v in views}, num_heads, dtype, str(source.root))


def _hf_table(source: Source, names: str, target: megatron_arch.Target | None = None
              ) -> list[tuple[str, ParamView, tuple[tuple[int, int], ...]]]:
    """(exported name, parameter, its rows) of every weight: HF's names and fused tensors cut by rows
    (:mod:`ckpt_tool.hf.mapping`, :mod:`ckpt_tool.hf.megatron_arch`), or the checkpoint's own names, whole."""
    views = ordered_views(source)
    if names == "megatron":
        return [(v.name, v, ((0, v.full_shape[0] if v.full_shape else 1),)) for v in views]
    if target is not None:  # megatron-core: the class its recorded model maps onto
        return [(hf, v, rows) for v in views for hf, rows in target.names(v.name, v.full_shape)]
    assert source.manifest is not None and source.manifest.model is not None
    by_name = {v.name: v for v in views}
    return [(p.hf, by_name[p.ours], p.ranges) for p in mapping.parts(source.manifest.model, str(source.root))]


def _hf_config(source: Source, target: megatron_arch.Target | None, eos: int | None = None) -> dict[str, Any]:
    if target is not None:
        return {**target.config, "bos_token_id": eos, "eos_token_id": eos}
    assert source.manifest is not None and source.manifest.model is not None
    return mapping.hf_config(source.manifest.model, source.manifest.param_dtype or "torch.float32", eos,
                             str(source.root))


def _hf_side_files(source: Source, folder: Path, tokenizer: Path | None, target: megatron_arch.Target | None) -> int:
    """config.json, generation_config.json and, from ``--tokenizer``, the tokenizer files."""
    eos, files = None, 2
    config = _hf_config(source, target)
    if tokenizer is not None:
        raw, eos, text = hf_folder.tokenizer_eos(tokenizer, config["vocab_size"])
        write_durable(folder / hf_folder.TOKENIZER, raw)
        write_durable(folder / hf_folder.TOKENIZER_CONFIG, json.dumps(hf_folder.tokenizer_config(eos, text), indent=2))
        files += 2
    write_durable(folder / hf_folder.CONFIG, json.dumps(_hf_config(source, target, eos), indent=2))
    write_durable(folder / hf_folder.GENERATION, json.dumps(mapping.generation_config(eos), indent=2))
    return files


def export_hf(source: Source, writer: CheckpointWriter, optimizer: bool, max_shard: int, chunk_bytes: int,
              workers: int, advance: Progress, names: str = "hf", tokenizer: Path | None = None,
              num_heads: int | None = None, max_memory: int | None = None) -> dict[str, Any]:
    folder = writer.folder
    target = None
    if names == "hf" and (source.manifest is None or source.manifest.model is None):
        target = megatron_target(source, num_heads)  # refuse a model with no class before a byte is written
    elif num_heads is not None:
        raise FormatError("--num-heads is for megatron-core checkpoints; this checkpoint's manifest records its "
                          "own; drop it")
    if names == "hf":
        _hf_config(source, target)
    table = _hf_table(source, names, target)
    sets = [("model", [(name, WEIGHT_STATE, v, rows) for name, v, rows in table])]
    if optimizer:
        sets.append(("optimizer", [(state_key(s, name), s, v, rows) for name, v, rows in table for s in STATES]))
    jobs, side = [], 0
    # what import needs to resume the moments (megatron-core: its Adam step and iteration, from its pickles' opcodes)
    metas = {"optimizer": hf_run_state.metadata(source.manifest) if source.manifest is not None or not optimizer
             else megatron_run_state.read(source.ckpt)}
    group = ranks.current()  # under torchrun: this rank writes its share of the weights files; rank 0 the rest
    root = group is None or group.root
    for prefix, keys in sets:
        tensors = []
        for key, state, view, rows in keys:
            chunks = part_chunks(view, state, key, rows, chunk_bytes)
            shape = (sum(b - a for a, b in rows), *view.full_shape[1:]) if view.full_shape else ()
            tensors.append((key, chunks[0].dtype, shape, chunks))
        refuse_unstorable(source.root, ((t[0], t[1]) for t in tensors))
        files = _hf_files(tensors, max_shard, prefix)
        total = sum(math.prod(t[2]) * t[1].itemsize for t in tensors)
        if root:
            side += hf_folder.write_index(folder, prefix, total, {t[0]: name for name, ts in files for t in ts})
        jobs.extend((name, ts, metas.get(prefix)) for name, ts in files)
    if names == "hf" and root:
        side += _hf_side_files(source, folder, tokenizer, target)
    model_keys = list(dict.fromkeys(view.model_key for _, view, _ in table))  # in the order they are read
    if group is None:
        source.reader.prefetch_layouts(model_keys if not optimizer else [*model_keys, *source.ckpt.entries])
        if not optimizer:  # the ledger reads the optimizer state (to check the file CRCs) beside the copy
            source.reader.ledger.fill_except(model_keys, source.reader.planned_ranges())
    bufs = Buffers()  # thread-local: each worker reads into its own reusable buffers
    # the next chunks of each file are read on other threads while it writes (ckpt_tool.copying.ahead); a bucket's
    # reads are fetched ahead by its own plan already
    depth = 0 if max_memory is None or storage_for(source.root).remote else \
        ahead_depth(max_memory, workers, chunk_bytes, rank_cores())
    pool = ThreadPoolExecutor(max(1, min(workers * depth, rank_cores())), thread_name_prefix="read-ahead") \
        if depth else None

    def fill(i: int) -> Callable[[OutChunk], np.ndarray]:
        if pool is None:
            return lambda c: chunk_data(source, c, bufs)
        return ReadAhead(pool, lambda c, b: chunk_data(source, c, b), [c for t in jobs[i][1] for c in t[3]], depth)

    # a bucket output under torchrun: every rank reads its share of the staged files in full against their
    # entries (size, CRC-32C) before the upload (ckpt_tool/copying/ranked.py, nodes.py)
    staged = group is not None and not writer.storage.in_place

    def one(i: int, tick: Progress) -> FileEntry:
        return _write_hf_file(folder / jobs[i][0], jobs[i][1], fill(i), tick, stage_bytes(chunk_bytes), jobs[i][2],
                              checksum=staged)

    try:
        if group is None:
            run_files(one, len(jobs), workers, advance)
        else:  # this rank's files (by bytes), the same names and bytes as one process writes, then the gather
            parts = [[c for t in job[1] for c in t[3]] for job in jobs]
            if staged and len(group.nodes) > 1:
                commit_on_root_node(group, parts, [name for name, _, _ in jobs], commit_object(names, [
                    name for name, _, _ in jobs]), str(writer.target))
            results = share_files(group, parts, lambda i, tick: (one(i, tick), None), [[] for _ in jobs], workers,
                                  advance, lambda order: prefetch_share(source, order, max_memory))
            if staged and root:
                writer.add_files({name: r[0] for (name, _, _), r in zip(jobs, results)})
    finally:
        if pool is not None:  # no read runs once the copy stopped (the reader is closed next)
            pool.shutdown(wait=True, cancel_futures=True)
    if not root:
        return {}  # rank 0 finishes and commits what every rank wrote
    writer.finish(None, None)  # not a checkpoint: no manifest, no metadata.json
    writer.commit_object = commit_object(names, [name for name, _, _ in jobs])
    arch = target.architecture if target is not None else mapping.ARCHITECTURE
    return {"files": len(jobs) + side, "names": names, **({"architecture": arch} if names == "hf" else {}),
            **({"assumed": target.assumed} if target is not None else {})}


def commit_on_root_node(group: ranks.Group, parts: list[list[OutChunk]], files: list[str], commit: str,
                        target: str) -> None:
    """Across nodes to a bucket, rank 0 uploads the commit object last from its own node's staging folder; an
    export whose commit object is one of its weights files (``--names megatron`` with one model file) must then
    have that file written on rank 0's node. The split is known before any byte is written: refused here, the
    same line on every rank, where it would fall on another node."""
    if commit not in files:
        return
    owners = ranks.assign([sum(c.nbytes for c in p) for p in parts], group.world)
    owner = owners[files.index(commit)]
    if group.peers[owner].node != group.peers[0].node:
        raise FormatError(f"{target}: {commit}, this export's commit object (rank 0 uploads it last), would be "
                          f"written by rank {owner} on {group.peers[owner].node}, not on rank 0's node; cut the "
                          "weights into several files (--max-shard-size) so that their index is the commit "
                          "object, or run on one node")


def prefetch_share(source: Source, order: list[OutChunk], max_memory: int | None) -> None:
    """Under torchrun: the read-ahead of this rank's chunks only (``order``: its files' chunks in the order its
    workers read them), never the whole source's: each rank reads its share, and the source's file checksums
    are checked from the pieces every rank read (``ReadLedger.finish``), so no rank reads the bytes no export
    needs ahead (one process's ledger does, beside its copy)."""
    pairs = [pair for c in order if c.param is not None and c.state is not None and c.box is not None
             for pair in source.chunks_read(source.views[c.param], c.state, *c.box)]
    if storage_for(source.root).remote:
        source.reader.prefetch_chunks(pairs, max(objects.PART, (max_memory or DEFAULT_MAX_MEMORY) // 4))
    else:
        source.reader.prefetch_layouts(list(dict.fromkeys(k for k, _ in pairs)))


def commit_object(names: str, files: list[str]) -> str:
    """What a bucket's upload of a Hugging Face folder puts last, as a conditional create (its commit
    object, as ``metadata.json`` is a checkpoint's): ``config.json`` (``--names hf``; transformers reads it
    first), else the weights index, else the one weights file. A reader of such a folder in a bucket
    takes it as finished only once that object is there."""
    if names == "hf":
        return hf_folder.CONFIG
    index = hf_folder.index_name("model")
    return index if len([f for f in files if f.startswith("model")]) > 1 else hf_folder.shard_names(1, "model")[0]


# -- fully_reshardable --------------------------------------------------------------------------------

def export_fully_reshardable(source: Source, writer: CheckpointWriter, chunk_bytes: int, workers: int,
                             advance: Progress) -> dict[str, Any]:
    folder = writer.folder
    chunks: list[OutChunk] = []
    shapes: dict[str, Any] = {}
    for v in ordered_views(source):
        stacked = v.layer is not None
        mk = v.model_key
        for state, key in [(WEIGHT_STATE, mk), *((s, state_key(s, mk)) for s in STATES)]:
            part = param_chunks(v, state, key, chunk_bytes, stacked)
            entry_shape = source.ckpt.entries[mk].shape if stacked else None
            shapes[key] = (entry_shape or v.full_shape, part[0].dtype)
            chunks.extend(part)
    if source.manifest is None:  # megatron-core's model buffers (the router's expert bias): copied as stored
        from ckpt_tool.copying.megatron_plan import buffer_chunks

        chunks.extend(buffer_chunks(source, shapes))
    group = ranks.current()  # under torchrun: this rank writes its share of the data files; rank 0 the rest
    root = group is None or group.root
    # megatron-core's byte objects (common_state, _extra_state), written by rank 0 alone into the last file
    objects = extra_objects(source.ckpt, chunk_bytes) if source.manifest is None and root else {}
    parts = split_files(chunks, workers * 2)
    names = [data_file_name(i, 0, "torch_dist") for i in range(len(parts) + (1 if objects else 0))]
    bufs = Buffers()
    records: list[list[ChunkRecord]] = [[] for _ in range(len(parts) + 1)]  # one list per file (one thread each)

    def one(i: int, tick: Progress) -> Any:
        return write_distcp(folder / names[i], parts[i], lambda c: chunk_data(source, c, bufs), tick,
                            stage_bytes(chunk_bytes), records[i])

    if group is None:
        results = run_files(one, len(parts), workers, advance)
    else:  # the same files as one process writes, each by one rank (by bytes), then every file's placements
        results = share_files(group, parts, one, records, workers, advance,
                              lambda order: prefetch_share(source, order, None))
        if not root:
            return {}
    # entries (size, CRC-32C) of the files as written: no manifest lists them here, but a bucket output staged on
    # several nodes is checked against them on each node before its upload (ckpt_tool/copying/nodes.py)
    writer.add_files({n: r[0] for n, r in zip(names, results)})
    placed: list[tuple[str, Any, int, int]] = [(n, c, off, ln) for n, r in zip(names, results) for c, off, ln in r[1]]
    if objects:
        placed.extend(write_objects(folder / names[-1], objects, records[-1]))
    write_distcp_metadata(folder / DCP_METADATA_FILE, shapes, placed, list(objects))
    writer.add_records([r for rs in records for r in rs])  # hashed as written: verify --data checks every chunk
    writer.finish(None, megatron_metadata("torch_dist"))  # Megatron's own layout: no manifest
    info: dict[str, Any] = {"files": len(names) + 2}
    if objects:
        dropped = sorted(k for k, e in source.ckpt.entries.items() if e.kind == "bytes" and k.startswith("rng_state/"))
        info.update(objects=len(objects), rng_state_dropped=len(dropped))
    return info


def attest_file(dst: Path | ObjectURL, beside: Path | ObjectURL, record: dict[str, Any]) -> None:
    """The attestation of a one-file output (``--to torch``), created once the file is committed, only where
    nothing is (:func:`gtp_format.commit.commit_file`; a bucket's conditional create). The file has no chunk
    records, so its ``target`` names the file and carries no root hash; a failure here leaves the committed
    file and says so."""
    iteration = record["source"].get("iteration")
    raw = json.dumps({**record, "target": {"path": str(dst), "root_hash": None, "iteration": iteration,
                                           "run_id": None}}, indent=1).encode()
    store = storage_for(beside)
    local = store.work_target(store.work_parent())  # the file itself, or its name in the upload staging folder
    work = store.new_work(local, "tmp")  # this writer's, so a killed export's leftover is removed by the next one there
    tmp = work / local.name
    try:
        write_durable(tmp, raw)
        store.put(tmp)  # created only where nothing is
    except (OSError, FormatError) as e:
        why = e.message if isinstance(e, FormatError) else (e.strerror or str(e))
        raise FormatError(f"{dst} was written, but its attestation {beside} was not ({why}); the export is "
                          "complete without it") from None
    finally:
        remove_owned(work)


def output_bytes(dst: Path | ObjectURL, inner: str | None) -> int:
    """Bytes of the committed output: a file, a folder's files, or a bucket's objects (as listed)."""
    if storage_for(dst).remote:  # as the store lists them: no folder entries to walk
        st = storage_for(dst.parent).stat(dst.name) if dst.name else None
        if st is None:
            return sum(written_sizes(dst)) + (sum(written_sizes(dst / inner)) if inner else 0)
        return st.size
    return dst.stat().st_size if dst.is_file() else sum(p.stat().st_size for p in dst.rglob("*") if p.is_file())


def export(src: Path | ObjectURL, dst: Path | ObjectURL, to: str, optimizer: bool = False,
           max_memory: int = DEFAULT_MAX_MEMORY, workers: int | None = None, max_shard: int = DEFAULT_SHARD,
           progress: ProgressOpener | None = None, names: str | None = None,
           tokenizer: Path | None = None, num_heads: int | None = None,
           session: Session | None = None) -> dict[str, Any]:
    """Export SRC to DST (a new folder; a new file for ``torch``) and return a summary.

    ``names`` (hf): ``hf`` (transformers' names, config.json: the default for this runtime's
    checkpoints, and for a megatron-core one given ``num_heads``, which its tensors do not record)
    or ``megatron`` (the checkpoint's own names). ``tokenizer``: a ``tokenizers`` JSON file copied
    into the folder. ``session``: the command's (:class:`gtp_format.session.Session`): DST's storage uses its
    limits and the work folder is recorded there.
    """
    if to not in TARGETS:
        raise FormatError(f"--to {to!r}: use one of {', '.join(TARGETS)}")
    if names is not None and names not in NAMES:
        raise FormatError(f"--names {names!r}: use one of {', '.join(NAMES)}")
    if to != "hf" and (names is not None or tokenizer is not None or num_heads is not None):
        raise FormatError(f"--names, --tokenizer and --num-heads shape a Hugging Face folder; drop them for --to {to}")
    if to == "torch" and not storage_for(dst, session).in_place and not dst.name:  # a bucket's top level
        raise FormatError(f"{dst}: --to torch writes one object; name it, e.g. {dst}/model.pt")
    t0 = time.perf_counter()
    baseline = rss_after_imports("safetensors" if to == "hf" else None)
    weights_only = to == "torch" or (to == "hf" and not optimizer)
    source = open_source(src, megatron=True, weights_only=weights_only, views=to != "torch",
                         experts=True, max_memory=max_memory, dense_experts=True, session=session,
                         full_states=to == "hf")
    names = names or "hf"
    if tokenizer is not None and names != "hf":
        raise FormatError("--tokenizer goes with --names hf (a folder transformers loads); drop one of them")
    opt_info = source.manifest.optimizer if source.manifest is not None else None
    if opt_info is not None and opt_info.type == "muon" and (optimizer or to == "fully_reshardable"):
        # Megatron's adam names would call Muon's momentum a first moment and its unused zeros a second one.
        raise FormatError(f"{source.root}: a Muon checkpoint's optimizer state (momentum stored as exp_avg) has no "
                          "Megatron fully_reshardable / Adam name; export the weights only (--to hf without "
                          "--optimizer, or --to torch)")
    workers = workers or default_workers()
    chunk_bytes = chunk_budget(max_memory, workers)
    views = source.views.values()
    weights = sum(v.numel * dtype_of(v.param_dtype).itemsize for v in views)
    states = sum(v.numel * 4 * len(STATES) for v in views)
    total = weights + (states if (optimizer or to == "fully_reshardable") else 0)
    advance = progress(total) if progress else (lambda n: None)
    nested: dict[str, str] = {}
    if to == "torch":
        check_destination(dst, source.names, COPIES)
        beside = attestation_beside(dst)
        record = attestation("ckpt export --to torch", derived(source.ckpt, "export")[1])
        try:  # refused before the file is written, not after
            check_destination(beside, source.names, COPIES)
        except FormatError:
            raise FormatError(f"{beside} already exists (the attestation of an earlier export to {dst.name}); "
                              "nothing was written; remove it or pick a new DST") from None
        info = export_torch(source, dst, max_memory, progress, session)
        attest_file(dst, beside, record)
        info["attestation"] = str(beside)
    else:
        holder: dict[str, Any] = {}

        src_id = derived(source.ckpt, "export")[1]

        def body(writer: CheckpointWriter) -> None:
            writer.attest(attestation(f"ckpt export --to {to}", src_id))
            if to == "hf":
                holder.update(export_hf(source, writer, optimizer, max_shard, chunk_bytes, workers, advance, names,
                                        tokenizer, num_heads, max_memory))
            else:
                holder.update(export_fully_reshardable(source, writer, chunk_bytes, workers, advance))
            source.verify_reads()  # a damaged SRC is refused here, before anything is committed

        iteration = source.manifest.iteration if source.manifest else (source.ckpt.iteration or 0)
        if to == "fully_reshardable":
            nested = {"inner": iter_dir_name(iteration), "latest": str(iteration)}
        try:
            build_atomically(dst, source.names, body, **nested, session=session)
        finally:
            source.reader.close()
        info = holder
    written = output_bytes(dst, nested.get("inner") if to != "torch" else None)
    return {"src": str(source.root), "dst": str(dst), "to": to, "optimizer": optimizer, **info,
            "params": len(source.views), "bytes_written": written, "bytes_read": source.reader.bytes_read,
            "seconds": time.perf_counter() - t0, "max_memory": max_memory, "chunk_bytes": chunk_bytes,
            "workers": workers, "peak_rss_bytes": peak_rss(),
            "baseline_rss_bytes": baseline}
