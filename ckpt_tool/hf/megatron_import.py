"""``ckpt import --from hf --to megatron-core``: a transformers folder as a megatron-core ``torch_dist`` checkpoint.

The folder is read as megatron-core's GPT by :mod:`.megatron_model` (the inverse of the export's
table, every tensor checked against the config). What is written is what a Megatron-LM run of that
model saves at iteration 0 with ``--ckpt-format torch_dist --use-distributed-optimizer``, in
``iter_0000000`` with ``latest_checkpointed_iteration.txt`` and ``metadata.json``:

* ``fully_reshardable`` (``--sharding fully_reshardable``): every model weight under megatron-core's
  key (``decoder.layers.*`` stacked over layers, the norms under the names the local and Transformer
  Engine specs both load: ``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``), and
  ``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>`` at the same global shape. The keys hold no
  topology, so the chunks are row blocks of the chunk budget (one layer per chunk of a stacked key)
  and megatron-core's loader reads them at any TP x PP.
* ``dp_reshardable`` (the default, megatron-core's own default): the same state laid out in the
  distributed optimizer's buckets of the target topology, by the writer of ``ckpt reshard``
  (:func:`ckpt_tool.copying.megatron_plan.plan_megatron` over this folder's per-parameter view,
  :mod:`.megatron_fresh`); with ``--vpp`` one set of buffers per model chunk, dense and expert, as megatron-core's
  own VPP saves hold them (``fixtures/megatron/pair_mixtral_vpp_pp2_dp_reshardable``).

The optimizer state is a fresh one: fp32 master weights equal to the model weights (bf16 widens
exactly), both Adam moments zero, ``step`` 0 in each param group, as megatron-core's optimizer holds
before its first step; or, where the folder has the optimizer files of ``ckpt export --to hf
--optimizer`` of a megatron-core checkpoint, the carried one: their masters and moments (cut by the same
name table as the weights), at the iteration and with the Adam ``step`` their run state records
(:mod:`.megatron_run_state`), its lr schedule with param groups at the rates it gives there
(:mod:`.megatron_schedule`). The byte objects are written anew (never copied or unpickled):
``common_state`` (:func:`.megatron_fresh.common_state`) and one ``_extra_state`` per linear layer
(``[None]``, what the local spec saves). No ``rng_state``: ``args.no_save_rng`` is set, so megatron's
loader asks for none and the run starts fresh RNG streams.

Written through the one writer (:func:`ckpt_tool.reshard.engine.build_atomically`): streamed in
row blocks within ``--max-memory``, hashed as written (``verify --data`` checks every chunk), into a
hidden work folder that appears as DST whole or not at all; ``s3://`` DSTs as every command's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ckpt_tool.copying import DEFAULT_MAX_MEMORY, WEIGHT_STATE
from ckpt_tool.copying.engine import (
    build_atomically,
    chunk_budget,
    default_workers,
    peak_rss,
    write_distcp_files,
    write_threads,
    written_sizes,
)
from ckpt_tool.copying.plan import FP32, OutChunk, row_blocks, split_files
from ckpt_tool.copying.writers import Zeros, write_distcp_metadata, write_objects
from ckpt_tool.hf.megatron_dp_import import plan_dp_reshardable, view_pieces, view_rows
from ckpt_tool.hf.megatron_fresh import (
    EXPERT_LINEARS,
    LINEARS,
    SHARDINGS,
    check_topology,
    common_state,
    extra_state,
)
from ckpt_tool.hf.megatron_model import EXPERT_KEY, HFMegatron, MegatronParam, open_hf_megatron
from ckpt_tool.hf.megatron_run_state import MegatronRunState
from ckpt_tool.hf.megatron_schedule import lr_at, wd_at
from gtp_format.errors import FormatError
from gtp_format.integrity.records import ChunkRecord
from gtp_format.integrity.stats import warm_up
from gtp_format.names import DCP_METADATA_FILE, STATES, iter_dir_name
from gtp_format.progress import ProgressOpener
from gtp_format.reader.boxes import Buffer
from gtp_format.session import Session
from gtp_format.storage.location import ObjectURL
from gtp_format.writer.checkpoint import CheckpointWriter, megatron_metadata
from gtp_format.writer.sink import stage_bytes

ITERATION = 0


def param_name(p: MegatronParam) -> str:
    """The per-layer name of a parameter (``decoder.layers.3.mlp.linear_fc1.weight``; an expert's
    ``decoder.layers.3.mlp.experts.5.linear_fc1.weight``): the chunks' ``param``."""
    if p.expert is not None:
        return f"decoder.layers.{p.layer}.mlp.experts.{p.expert}.{p.key[len(EXPERT_KEY):]}"
    return p.key if p.layer is None else p.key.replace("decoder.layers.", f"decoder.layers.{p.layer}.", 1)


def state_key(state: str, key: str) -> str:
    return key if state == WEIGHT_STATE else f"optimizer.state.{state}.{key}"


def fully_reshardable_chunks(hf: HFMegatron, max_bytes: int) -> tuple[list[OutChunk], dict[str, Any]]:
    """Every chunk of the fully_reshardable checkpoint and each key's (global shape, dtype)."""
    chunks: list[OutChunk] = []
    shapes: dict[str, Any] = {}
    stacked = (hf.num_layers, hf.num_experts)
    for p in hf.params:
        rest = p.shape[1:]
        for state in (WEIGHT_STATE, *STATES):
            dt = hf.dtype if state == WEIGHT_STATE else FP32
            key = state_key(state, p.key)
            lead = p.lead
            shapes[key] = ((*stacked[:len(lead)], *p.shape), dt)
            for a, b in row_blocks(p.shape[0], int(np.prod(rest, dtype=np.int64)), dt.itemsize, max_bytes):
                chunks.append(OutChunk(key, (*lead, a, *(0,) * len(rest)), (*(1,) * len(lead), b - a, *rest), dt,
                                       param_name(p), state, ((a, *(0,) * len(rest)), (b - a, *rest))))
    return chunks, shapes


def chunk_filler(hf: HFMegatron, views: dict[str, tuple[MegatronParam, int | None]] | None = None
                 ) -> Callable[[OutChunk], np.ndarray | Zeros]:
    """A chunk's elements: the weight's stored bits, its fp32 master (bf16 widened exactly), zero moments
    (:class:`~ckpt_tool.copying.writers.Zeros`: written without an array, their checks' values known).

    ``views`` (dp_reshardable): the chunks name per-parameter views (:mod:`.megatron_dp_import`; a name
    ``model:<view>`` reads the parameter's own rows); else the chunks name parameters (:func:`param_name`).
    """
    by_name = {param_name(p): (p, None) for p in hf.params} if views is None else views
    # each writing thread's buffers (the rows read, a TP part's columns, a widened master), reused chunk after chunk:
    # its chunk is written before it asks for the next. Why: a new array per read is page-faulted in per chunk.
    # Each is at most one chunk (a TP part's rows are read in blocks), so a thread holds these three and its
    # sink's two staging halves: four chunks, its share of --max-memory (ckpt_tool.copying.engine.write_threads)
    local = threading.local()

    def buffer(slot: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        bufs = getattr(local, "bufs", None)
        if bufs is None:
            bufs = local.bufs = (Buffer(), Buffer(), Buffer())
        return bufs[slot].get(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize).view(dtype).reshape(shape)

    def one(c: OutChunk) -> np.ndarray | Zeros:
        carried = hf.run_state is not None and c.state in STATES
        if c.param is None or (c.state in STATES[1:] and not carried):
            return Zeros(c.nbytes)
        assert c.box is not None
        (a, *cols), (n, *widths) = c.box
        state = STATES.index(c.state) if carried else None
        if c.param.startswith("model:"):  # a model weight's own rows (a gated fc1's cut at its global rows)
            p, block = by_name[c.param[len("model:"):]][0], None
        else:
            p, block = by_name[c.param]
        dt = p.rows_dtype(state)
        if cols and (cols[0], widths[0]) != (0, p.shape[1]):  # a row-parallel TP part: its columns
            # read in blocks of whole rows about the part's own size, so no buffer is larger than the chunk
            # (the whole rows of a TP 4 part are four chunks)
            part = buffer(1, (n, widths[0], *p.shape[2:]), dt)
            k = max(1, n * widths[0] // p.shape[1])
            for r in range(0, n, k):
                m = min(k, n - r)
                rows = view_rows(p, block, a + r, a + r + m, state, buffer(0, (m, *p.shape[1:]), dt))
                np.copyto(part[r:r + m], rows[:, cols[0]:cols[0] + widths[0]])
            bits = part
        else:
            bits = view_rows(p, block, a, a + n, state, buffer(0, (n, *p.shape[1:]), dt))
        if c.state != WEIGHT_STATE and hf.dtype != FP32 and not carried:
            # widened and shifted in one buffered ufunc pass into the thread's buffer (not a copy, then a shift)
            bits = np.left_shift(bits, 16, dtype=np.uint32, out=buffer(2, bits.shape, np.dtype(np.uint32)))
            bits = bits.view(np.float32)
        return bits.reshape(c.sizes)

    return one


def chunk_ahead(hf: HFMegatron, pool: ThreadPoolExecutor,
                views: dict[str, tuple[MegatronParam, int | None]] | None = None) -> Callable[[OutChunk], None]:
    """``ahead(chunk)``: the HF rows :func:`chunk_filler` will read for ``chunk`` asked of the kernel now, on
    ``pool`` (:meth:`.megatron_model.MegatronParam.will_need`). Each file thread asks for its next chunk before
    it fills the current one (:func:`ckpt_tool.copying.writers.write_blobs`), so a cold folder is read while the
    thread hashes and the disk writes; at most one chunk per thread ahead, in the page cache, not this process.

    Why: each thread read its chunk's rows only when it came to it, one readahead window at a time, while its
    sink waited (the lent 16-core host's profile: the sinks idle about 1.4 s each behind cold HF reads)."""
    by_name = {param_name(p): (p, None) for p in hf.params} if views is None else views

    def ask(c: OutChunk) -> None:
        carried = hf.run_state is not None and c.state in STATES
        if c.param is None or c.box is None or (c.state in STATES[1:] and not carried):
            return
        (a, *_), (n, *_) = c.box
        state = STATES.index(c.state) if carried else None
        p, block = (by_name[c.param[len("model:"):]][0], None) if c.param.startswith("model:") else by_name[c.param]
        for _, start, k in view_pieces(p, block, a, a + n):
            p.will_need(start, start + k, state)

    def ahead(c: OutChunk) -> None:
        if c.param is not None:
            pool.submit(ask, c)

    return ahead


def extra_objects(hf: HFMegatron) -> dict[str, bytes]:
    """One ``_extra_state`` per linear layer, under megatron-core's stacked key and ``shard_<layer>_<layers>``;
    an expert's under ``shard_<layer>.<expert>_<layers>.<experts>``."""
    n, e = hf.num_layers, hf.num_experts
    blob = extra_state()
    dense = [m for m in LINEARS if not (e and m.startswith("mlp."))]
    if e and hf.args.get("moe_shared_expert_intermediate_size"):
        dense += ["mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"]
    out = {f"decoder.layers.{m}._extra_state/shard_{i}_{n}": blob for i in range(n) for m in dense}
    out.update({f"{EXPERT_KEY}{m}._extra_state/shard_{i}.{j}_{n}.{e}": blob for i in range(n) for j in range(e)
                for m in EXPERT_LINEARS})
    return out


def carried_rates(scheduler: dict[str, Any] | None, lr: float | None, min_lr: float | None, where: str
                  ) -> tuple[float, float]:
    """The param groups' ``max_lr`` / ``min_lr``: the carried scheduler's (megatron-core pairs saved and live
    groups by them), refusing a given ``--lr`` / ``--min-lr`` that contradicts it; else the given or defaults."""
    if scheduler is None:
        return 1e-4 if lr is None else lr, 0.0 if min_lr is None else min_lr
    for flag, given, key in (("--lr", lr, "max_lr"), ("--min-lr", min_lr, "min_lr")):
        if given is not None and given != scheduler[key]:
            raise FormatError(f"{where}: {flag} {given:g} contradicts the carried lr schedule's {key} "
                              f"{scheduler[key]:g} (megatron-core pairs param groups by it); drop {flag}, or pass "
                              "--no-optimizer to start a fresh schedule")
    return scheduler["max_lr"], scheduler["min_lr"]


def carried_groups(run: MegatronRunState | None, where: str) -> dict[str, Any] | None:
    """What the param groups of a carried run hold (:func:`.megatron_fresh.param_groups`): the lr and weight decay
    megatron-core's scheduler sets at the carried schedule's step (``weight_decay`` before ``wd_mult``), and the
    run's Adam ``betas`` / ``eps``, each where the run state records it; ``None`` for a fresh state."""
    if run is None:
        return None
    out: dict[str, Any] = dict(run.adam or {})
    if run.scheduler is not None:
        at = f"{where}: the carried lr schedule"
        out.update(lr=lr_at(run.scheduler, run.schedule_args or {}, at), weight_decay=wd_at(run.scheduler, at))
    return out


def import_megatron(src: Path | ObjectURL, dst: Path | ObjectURL, tp: int, pp: int, dp: int, vpp: int | None = None,
                    sharding: str = "dp_reshardable", seq_length: int | None = None, lr: float | None = None,
                    min_lr: float | None = None, max_memory: int = DEFAULT_MAX_MEMORY, workers: int | None = None,
                    progress: ProgressOpener | None = None, ep: int = 1, etp: int = 1,
                    optimizer: bool = True, session: Session | None = None, run_bytes: int | None = None
                    ) -> dict[str, Any]:
    """Write the HF folder SRC as a megatron-core checkpoint at TP x PP (x VPP) x DP (x EP, expert TP) into
    the new DST. ``lr`` / ``min_lr``: the run's (1e-4 / 0 unless given); a carried scheduler's own where SRC
    has one, which a different value given contradicts. ``run_bytes``: the size of the runs each file is
    written as (:func:`ckpt_tool.copying.engine.write_distcp_files`; tests set it small)."""
    if sharding not in SHARDINGS:
        raise FormatError(f"--sharding {sharding!r}: use one of {', '.join(SHARDINGS)}")
    t0 = time.perf_counter()
    hf = open_hf_megatron(src, optimizer)
    it, step = (hf.run_state.iteration, hf.run_state.step) if hf.run_state is not None else (ITERATION, 0.0)
    scheduler = hf.run_state.scheduler if hf.run_state is not None else None
    lr, min_lr = carried_rates(scheduler, lr, min_lr, str(src))
    extra = hf.run_state.schedule_args if hf.run_state is not None else None
    carried = carried_groups(hf.run_state, str(src))
    consumed = (hf.run_state.consumed or 0) if hf.run_state is not None else 0
    check_topology(hf, tp, pp, vpp, dp, ep, etp, sharding)
    workers = workers or default_workers()
    chunk_bytes = chunk_budget(max_memory, workers)
    args = {**hf.args, "seq_length": seq_length or hf.args["max_position_embeddings"]}
    objects: dict[str, bytes] = extra_objects(hf)
    if sharding == "fully_reshardable":
        chunks, shapes = fully_reshardable_chunks(hf, chunk_bytes)
        files = split_files(chunks, workers * 2)
        names = [f"__{i}_0.distcp" for i in range(len(files))]
        fill = chunk_filler(hf)
        by_view = None
    else:
        per_rank, shapes, numel_objects, by_view = plan_dp_reshardable(hf, tp, pp, dp, chunk_bytes, lr, min_lr, ep,
                                                                       etp, step, carried, vpp or 1)
        ranks = sorted(per_rank)
        files = [per_rank[r] for r in ranks]
        names = [f"__{r}_0.distcp" for r in ranks]
        objects.update(numel_objects)
        fill = chunk_filler(hf, by_view)
    objects["common_state/shard_0_1"] = common_state(args, hf.dtype, tp, pp, vpp, dp, sharding, lr, min_lr,
                                                     it, ep, etp, step, scheduler, consumed, carried, extra)
    total = sum(c.nbytes for cs in files for c in cs)
    threads = write_threads(workers, chunk_bytes, max_memory)

    def body(writer: CheckpointWriter) -> None:
        folder = writer.folder
        advance = progress(total) if progress else (lambda n: None)
        records: list[list[ChunkRecord]] = [[] for _ in range(len(files) + 1)]  # one list per file
        # the files are one per rank and unequal (DP rank 0's hold the model weights too): written as runs of
        # about a (2 x threads)-th of the bytes each, so every thread has work until the end
        results = write_distcp_files(folder, names, files, fill, threads, advance, stage_bytes(chunk_bytes), records,
                                     run_bytes or max(chunk_bytes, total // (2 * threads)),
                                     chunk_ahead(hf, hints, by_view))
        placed: list[tuple[str, Any, int, int]] = [(n, c, off, ln) for n, r in zip(names, results)
                                                   for c, off, ln in r[1]]
        obj_file = "__0_1.distcp"
        placed.extend(write_objects(folder / obj_file, objects, records[-1]))
        write_distcp_metadata(folder / DCP_METADATA_FILE, shapes, placed, list(objects))
        writer.add_records([r for rs in records for r in rs])  # hashed as written: verify --data checks them
        writer.finish(None, megatron_metadata("torch_dist"))  # megatron-core's layout: no manifest

    # the chunk statistics' loop (numba's import and its cached code: over a second under load on 2 cores) is
    # loaded once while the work folder is made and the first chunks are read and hashed, not by every file
    # thread at its first chunk; joined, so no import still runs at the interpreter's exit
    warm = threading.Thread(target=warm_up, args=([hf.dtype, FP32],), name="stats-warm-up", daemon=True)
    warm.start()
    hints = ThreadPoolExecutor(max_workers=1, thread_name_prefix="read-ahead")
    try:
        build_atomically(dst, (src,), body, inner=iter_dir_name(it), latest=str(it), session=session)
    finally:
        hints.shutdown(wait=True, cancel_futures=True)
        warm.join()
    out = written_sizes(dst / iter_dir_name(it))
    topo = f"tp{tp} pp{pp}{f' vpp{vpp}' if vpp and vpp > 1 else ''} dp{dp}"
    topo += f" ep{ep} etp{etp}" if hf.num_experts else ""
    return {"src": str(src), "dst": str(dst), "from": "hf", "to": "megatron-core", "architecture": hf.architecture,
            "topology": topo, "sharding": sharding, "params": len(hf.params), "param_dtype": hf.dtype.name,
            "args": {k: v for k, v in args.items()}, "files": len(out), "bytes_written": sum(out),
            "seconds": time.perf_counter() - t0, "iteration": it,
            "optimizer": (f"carried (step {step:g}{', lr schedule' if scheduler else ''})" if hf.run_state is not None
                          else "fresh (moments at zero)"),
            "max_memory": max_memory, "chunk_bytes": chunk_bytes, "workers": workers, "threads": threads,
            "peak_rss_bytes": peak_rss()}
