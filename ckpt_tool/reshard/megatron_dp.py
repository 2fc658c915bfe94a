"""``ckpt reshard`` of a genuine megatron-core ``dp_reshardable`` checkpoint to another TP x PP x DP x CP.

megatron-core itself cannot: its ``dp_reshardable`` load at another topology fails with "Global
shape mismatch" (the bucket keys' shapes are the buffers of the topology that saved), and its
``load_checkpoint`` refuses another (TP, PP) for that format outright. This writes the checkpoint
megatron-core would have saved at the target, from the source's per-parameter view:

1. the source view (:func:`gtp_format.megatron.view.megatron_views`: every parameter's slices derived
   from megatron-core's bucket rules and checked against the stored chunks, MoE's dense and
   expert buffers included; what they do not cover is refused in one line);
2. the target layout (:mod:`gtp_format.megatron.layout`: megatron-core's own bucket rules at the
   target, TP splits of the GPT local spec, layers split evenly over the stages, one model chunk
   per stage: a source with virtual pipeline stages is read chunk by chunk, the target has none);
3. every chunk: model weights (stacked layer keys, one chunk per layer and TP part, as megatron
   writes them), each target bucket's fp32 master / ``exp_avg`` / ``exp_avg_sq`` slices copied
   from the source's bits (:func:`ckpt_tool.copying.plan.holder_chunks`, the reshard's own),
   alignment gaps as zeros; each chunk in the data file of the target rank that would have written
   it (``__<rank>_0.distcp``, rank order tp-cp-ep-dp-pp), so the output's own view reads back;
4. the byte objects (:mod:`.megatron_dp_objects`: ``common_state`` edited on its opcodes,
   ``per_bucket_numel`` per target rank, ``rng_state`` dropped);
5. streamed within the chunk budget and committed atomically through the one writer
   (:func:`.engine.build_atomically`), after the source's reads passed their checksums.

``bucket_size``: a run with ``overlap_grad_reduce`` splits the first stage's buffer into buckets of
its ``--ddp-bucket-size`` (default ``max(4e7, 1e6 x dp x cp)``); the checkpoint does not record it.
A source whose stages each have one bucket (apart from the shared embedding's) was written without
a split, and the target is laid out so (``None``); any other source needs ``--bucket-size``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from ckpt_tool.copying import DEFAULT_MAX_MEMORY
from ckpt_tool.copying.engine import (
    Progress,
    Result,
    build_atomically,
    chunk_budget,
    chunk_data,
    default_workers,
    peak_rss,
    prefetch_reads,
    rss_after_imports,
    run_files,
    share_files,
    written_sizes,
)
from ckpt_tool.copying.megatron_plan import Split, check_experts, plan_megatron, target_params, target_split
from ckpt_tool.copying.plan import read_order
from ckpt_tool.copying.source import Buffers, Source, open_source
from ckpt_tool.copying.writers import write_distcp, write_distcp_metadata, write_objects
from ckpt_tool.reshard.megatron_dp_objects import PP_FIRST, PP_LAST, target_objects
from gtp_format.errors import FormatError
from gtp_format.layout.config import target_world_problem
from gtp_format.names import DCP_METADATA_FILE, iter_dir_name
from gtp_format.ranks import current as current_group
from gtp_format.session import Session
from gtp_format.storage.location import ObjectURL
from gtp_format.writer.checkpoint import CheckpointWriter, megatron_metadata
from gtp_format.writer.sink import stage_bytes


def target_refusal(src: Path | ObjectURL, tp: int, pp: int, cp: int, dp: int, ep: int | None,
                   etp: int | None, reshard: bool = True, split: Split | None = None) -> str | None:
    """For ``ckpt plan``: establish SRC's per-parameter view as reshard and export do (a view that cannot be
    established is raised, one line), then, if ``reshard``, the line :func:`reshard_megatron` would refuse
    this target with (its own checks of the TP, PP, EP and expert-TP splits; nothing planned or written),
    or None. Why: plan said "needs_reshard" and printed ``--etp 3`` for experts that do not split over 3,
    and printed an export command for a checkpoint whose expert chunks no command could lay out."""
    source = open_source(src, megatron=True, experts=True, dense_experts=True)
    try:
        if not reshard:
            return None
        experts = [v for v in source.views.values() if v.expert is not None]
        target_params(source, tp, pp, split)
        if experts:
            check_experts(source, experts, tp, dp * cp, ep or 1, etp or tp)
    except FormatError as e:
        return e.message
    finally:
        source.reader.close()
    return None


def reshard_megatron(src: Path | Source, dst: Path, tp: int | None, pp: int | None, cp: int | None, dp: int | None,
                     ep: int | None = None, bucket_size: int | None = None, max_memory: int = DEFAULT_MAX_MEMORY,
                     workers: int | None = None, progress: Callable[[int], Progress] | None = None,
                     etp: int | None = None, split: Split | None = None, session: Session | None = None) -> Result:
    """Reshard a megatron-core ``dp_reshardable`` SRC to TP x PP x CP x DP into the new folder DST."""
    from gtp_format.megatron.topology import derive

    t0 = time.perf_counter()
    baseline = rss_after_imports("torch_dist")
    source = src if isinstance(src, Source) else open_source(src, megatron=True, experts=True, max_memory=max_memory,
                                                             dense_experts=True, session=session)
    try:
        meg = derive(source.ckpt)
        if meg.format != "dp_reshardable":
            raise FormatError(f"{source.root}: its optimizer format is {meg.format}; reshard reads dp_reshardable "
                              "(a fully_reshardable checkpoint loads at any topology as it is)")
        moe = any(v.expert is not None for v in source.views.values())  # in the expert or (EP 1) dense buffers
        if ep not in (None, 1) and not moe:
            raise FormatError(f"--ep {ep}: {source.root} has no experts; drop --ep")
        if etp not in (None, 1) and not moe:
            raise FormatError(f"--etp {etp}: {source.root} has no experts; drop --etp")
        ep = ep or meg.ep or 1
        src_tp, src_pp = meg.tp or 1, meg.pp or 1
        src_cp, src_dp = meg.cp or 1, meg.dp or meg.dp_cp or 1
        tp, pp, cp = tp or src_tp, pp or src_pp, cp or src_cp
        dp = dp or max(1, (meg.dp_cp or src_dp * src_cp) // cp)
        workers = workers or default_workers()
        chunk_bytes = chunk_budget(max_memory, workers)
        etp = etp or tp  # megatron-core's default --expert-tensor-parallel-size: the TP size
        too_big = target_world_problem({"--tp": tp, "--pp": pp, "--cp": cp, "--dp": dp},
                                       source.ckpt.model_elements())
        if too_big is not None:  # before a data file per target rank is planned
            raise FormatError(too_big)
        files, shapes, numels = plan_megatron(source, tp, pp, dp * cp, bucket_size, chunk_bytes, ep, etp, split)
        sizes = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "context_parallel_size": cp,
                 "data_parallel_size": dp, "world_size": tp * pp * cp * dp, "expert_model_parallel_size": ep,
                 "expert_tensor_parallel_size": etp}
        _, first, last = target_split(source, pp, split)
        # megatron-core's no-weight-decay rule: biases and 1-D parameters (its expert optimizer's groups follow it)
        no_decay = any(v.expert is not None and (v.name.endswith(".bias") or len(v.full_shape) == 1)
                       for v in source.views.values())
        objects, dropped = target_objects(source.ckpt, numels, sizes, chunk_bytes,
                                          {PP_FIRST: first, PP_LAST: last}, no_decay)
        iteration = source.ckpt.iteration or 0
        ranks = sorted(files)
        names = [f"__{r}_0.distcp" for r in ranks]
        total = sum(c.nbytes for cs in files.values() for c in cs)

        def body(writer: CheckpointWriter) -> None:
            folder = writer.folder
            advance = progress(total) if progress else (lambda n: None)
            bufs = Buffers()
            # from a bucket, the source chunks are fetched ahead in the order the workers reach them (as reshard
            # of this runtime's checkpoints does): without it each chunk was read on demand by its worker
            def one(i: int, tick: Any) -> Any:
                return write_distcp(folder / names[i], files[ranks[i]], lambda c: chunk_data(source, c, bufs), tick,
                                    stage_bytes(chunk_bytes))

            group = current_group()
            if group is None:
                prefetch_reads(source, read_order([files[r] for r in ranks], workers), max_memory)
                results = run_files(one, len(ranks), workers, advance)
            else:  # under torchrun: this rank's files, then every file's placements gathered (engine.share_files)
                results = share_files(group, [files[r] for r in ranks], one, [[] for _ in ranks], workers, advance,
                                      lambda order: prefetch_reads(source, order, max_memory))
                if not group.root:
                    source.verify_reads()  # its share of the source's checks; rank 0 writes the rest and commits
                    return
            # each rank file's entry (size, CRC-32C, from the bytes as written): no manifest lists them, but a bucket
            # output's ranks check their share of the staged files against them before the upload (copying/nodes.py)
            writer.add_files({n: r[0] for n, r in zip(names, results)})
            placed: list[tuple[str, Any, int, int]] = [(n, c, off, ln) for n, r in zip(names, results)
                                                       for c, off, ln in r[1]]
            placed.extend(write_objects(folder / "__0_1.distcp", objects))
            write_distcp_metadata(folder / DCP_METADATA_FILE, shapes, placed, list(objects))
            source.verify_reads()  # a damaged SRC is refused here, before anything is committed
            writer.finish(None, megatron_metadata("torch_dist"))  # megatron-core's layout: no manifest

        build_atomically(dst, source.names, body, inner=iter_dir_name(iteration), latest=str(iteration),
                         session=session)
    finally:
        source.reader.close()
    out = written_sizes(dst / iter_dir_name(iteration))  # a bucket's as its store lists them
    vpp = f" vpp{meg.vpp}" if meg.vpp and meg.vpp > 1 else ""
    before = f"tp{src_tp} pp{src_pp}{vpp} cp{src_cp} dp{src_dp} (megatron-core dp_reshardable)"
    result = Result(str(source.root), str(dst), before, f"tp{tp} pp{pp} cp{cp} dp{dp} (megatron-core dp_reshardable)",
                    "torch_dist", len(out), sum(len(c) for c in files.values()), sum(out),
                    source.reader.bytes_read, time.perf_counter() - t0, max_memory, chunk_bytes, workers, peak_rss(),
                    baseline)
    notes = [f"rng_state dropped ({len([k for k in dropped if k.startswith('rng_state/')])} objects; "
             "args.no_save_rng set, so megatron-core starts fresh RNG streams)"]
    if vpp:
        notes.append(f"virtual pipeline stages: the source has {meg.vpp} model chunks per stage, the output one (its "
                     "args' virtual_pipeline_model_parallel_size None): resume without "
                     "--num-layers-per-virtual-pipeline-stage")
    if moe and tp > 1:
        notes.append(f"MoE at TP {tp}, expert TP {etp}: megatron-core trains it only with --sequence-parallel, and "
                     f"with --expert-tensor-parallel-size {etp}")
    return replace(result, notes=notes)
