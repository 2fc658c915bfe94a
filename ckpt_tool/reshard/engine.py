"""``ckpt reshard``: a whole ``dp_reshardable`` training state moved to another topology, offline.

1. open and check SRC (:mod:`ckpt_tool.copying.source`): manifest, not aliased, complete;
2. the target manifest: same model, optimizer and bucket size, the new topology, and the bucket
   layout a run there builds (:func:`gtp_format.layout.params.buffer_layouts`, the runtime's rule);
3. the plan (:mod:`ckpt_tool.copying.plan`): every target chunk and the box of a parameter it copies;
4. ``2 * workers`` data files, each written by one thread (as many at once as
   :func:`ckpt_tool.copying.engine.write_threads` allows), chunk by chunk, reading only the source
   bytes each chunk needs (:class:`gtp_format.reader.boxes.BoxReader`); numpy copies and file I/O
   release the GIL, so threads run in parallel;
5. metadata, manifest (with every file's size and CRC-32C), ``metadata.json``, the latest marker,
   all through the one checkpoint writer (:class:`gtp_format.writer.checkpoint.CheckpointWriter`):
   built in a hidden sibling and renamed to DST without ever replacing anything, so a DST that
   appeared meanwhile (another process, a second reshard) is refused and left alone. On any failure
   (a full disk, SIGTERM included) the sibling is removed: DST appears whole or not at all, and SRC
   is only ever read.

Memory, speed and the atomic build: :mod:`ckpt_tool.copying.engine`, the copy kernel.
"""

from __future__ import annotations

import time
from pathlib import Path

from ckpt_tool.copying import DEFAULT_MAX_MEMORY
from ckpt_tool.copying.engine import (
    Result,
    build_atomically,
    chunk_budget,
    chunk_data,
    copied_crc,
    default_workers,
    peak_rss,
    prefetch_reads,
    rss_after_imports,
    write_checkpoint,
    write_threads,
    written_sizes,
)
from ckpt_tool.copying.plan import plan_target
from ckpt_tool.copying.source import Buffers, Source, open_source
from gtp_format.errors import FormatError
from gtp_format.layout.buckets import DEFAULT_BUCKET_SIZE
from gtp_format.layout.config import ConfigError, ParallelConfig
from gtp_format.layout.params import buffer_layouts
from gtp_format.layout.schema import derive_bucket_size
from gtp_format.lineage import LINEAGE_KEY, attestation, derived
from gtp_format.manifest import HASH_ALGORITHM, Manifest, format_version_for
from gtp_format.names import FORMAT_NAME, iter_dir_name
from gtp_format.progress import ProgressOpener
from gtp_format.session import Session
from gtp_format.storage.location import ObjectURL
from gtp_format.views.ours import param_views
from gtp_format.views.records import ParamView
from gtp_format.writer.checkpoint import CheckpointWriter
from gtp_format.writer.sink import stage_bytes


def target_manifest(src: Manifest, par: ParallelConfig, layout: str) -> Manifest:
    """SRC's manifest at topology ``par``; a topology the model cannot run is refused (exit 2)."""
    assert src.model is not None and src.param_dtype is not None and src.buffers is not None
    try:
        par.validate(num_experts=src.model.num_experts)
        src.model.validate(par)
    except ConfigError as e:
        raise FormatError(f"impossible target topology {par.describe()}: {e}") from None
    bucket_size = src.bucket_size or derive_bucket_size(src.buffers, DEFAULT_BUCKET_SIZE)
    assert src.topology is not None
    note = {"tool": "ckpt reshard", "from": src.topology.describe(), "to": par.describe()}
    return Manifest(
        format_version=format_version_for(src.optimizer), layout=layout, optimizer_sharding=FORMAT_NAME,
        iteration=src.iteration,
        topology=par, model=src.model, param_dtype=src.param_dtype, optimizer=src.optimizer,
        bucket_size=bucket_size, buffers=buffer_layouts(src.model, par, bucket_size, src.param_dtype),
        hash_algorithm=HASH_ALGORITHM, files={}, notes=[*src.notes, note], extra=dict(src.extra))


def _check_same_params(source: Source, target_views: dict[str, ParamView]) -> None:
    want = {n: (v.full_shape, v.param_dtype) for n, v in target_views.items()}
    have = {n: (v.full_shape, v.param_dtype) for n, v in source.views.items()}
    if want != have:
        diff = sorted(set(want.items()) ^ set(have.items()))
        raise FormatError(f"{source.root}: its parameters do not match the model its manifest names (e.g. "
                          f"{diff[0][0]}); the manifest's bucket layout was not written by this runtime's rules")


def target_topology(src: Path | Source, layout: str | None, **asked: int | bool | None) -> ParallelConfig:
    """SRC's saved topology with the sizes the user gave (``None``: keep SRC's).

    ``src`` an opened :class:`Source` (``ckpt reshard`` opens it once, for this and :func:`reshard`)
    or a path, opened here through the gate.
    """
    import dataclasses

    from gtp_format.names import LAYOUTS

    if layout is not None and layout not in LAYOUTS:
        raise FormatError(f"--layout {layout!r}: use one of {', '.join(LAYOUTS)}")
    source = src if isinstance(src, Source) else open_source(src)
    assert source.manifest is not None  # open_source without megatron=True needs one
    saved = source.manifest.topology
    assert saved is not None
    par = dataclasses.replace(saved, **{k: v for k, v in asked.items() if v is not None})
    from gtp_format.layout.config import target_world_problem

    too_big = target_world_problem({"--tp": par.tp, "--cp": par.cp, "--gtp-remat": par.gtp_remat, "--dp": par.dp},
                                   source.ckpt.model_elements())
    if too_big is not None:  # before anything is planned per rank
        raise FormatError(too_big)
    if par.cp == 1 and asked.get("fold_cp") is None:
        par = dataclasses.replace(par, fold_cp=False)  # fold needs CP > 1; only an explicit --fold-cp is refused
    return par


def reshard(src: Path | Source, dst: Path, par: ParallelConfig, layout: str | None = None,
            max_memory: int = DEFAULT_MAX_MEMORY, workers: int | None = None,
            progress: ProgressOpener | None = None, session: Session | None = None) -> Result:
    """Reshard SRC (a path, or the :class:`Source` already opened) to topology ``par`` into the new
    folder DST (``DST/iter_N`` + latest marker), written in ``session`` (:class:`gtp_format.session.Session`)."""
    t0 = time.perf_counter()
    baseline = rss_after_imports(layout)
    source = src if isinstance(src, Source) else open_source(src, session=session)
    assert source.manifest is not None and source.manifest.topology is not None
    target = target_manifest(source.manifest, par, layout or source.manifest.layout)
    target_views = param_views(target)
    _check_same_params(source, target_views)
    workers = workers or default_workers()
    chunk_bytes = chunk_budget(max_memory, workers)
    plan = plan_target(target, chunk_bytes, target_views)

    section, src_id = derived(source.ckpt, "reshard")
    target.extra[LINEAGE_KEY] = section

    def body(writer: CheckpointWriter) -> None:
        # every tensor keeps its name: the correspondence is the list of parameters carried over
        writer.attest(attestation(f"ckpt reshard --to {par.describe()}", src_id,
                                  [{"source": n, "target": n} for n in sorted(target_views)]))
        advance = progress(plan.nbytes) if progress else (lambda n: None)
        bufs = Buffers()  # thread-local: each worker reads and assembles in its own
        try:
            write_checkpoint(lambda c: chunk_data(source, c, bufs), target, plan, writer, workers, advance,
                             stage_bytes(chunk_bytes), lambda order: prefetch_reads(source, order, max_memory),
                             lambda c: copied_crc(source, c), write_threads(workers, chunk_bytes, max_memory))
            source.verify_reads()  # a damaged SRC is refused here, before anything is committed
        finally:
            source.reader.close()

    build_atomically(dst, source.names, body, inner=iter_dir_name(target.iteration), latest=str(target.iteration),
                     session=session)
    out = written_sizes(dst / iter_dir_name(target.iteration))
    return Result(str(source.root), str(dst), source.manifest.topology.describe(), par.describe(), target.layout,
                  len(out), len(plan.chunks), sum(out), source.reader.bytes_read,
                  time.perf_counter() - t0, max_memory, chunk_bytes, workers,
                  peak_rss(), baseline)


def reshard_checkpoint(src: Path | ObjectURL, dst: Path, *, tp: int | None = None, pp: int | None = None,
                       cp: int | None = None, gtp_remat: int | None = None, dp: int | None = None,
                       fold_cp: bool | None = None, expert_gtp_remat: int | None = None, layout: str | None = None,
                       ep: int | None = None, etp: int | None = None, bucket_size: int | None = None,
                       max_memory: int = DEFAULT_MAX_MEMORY, workers: int | None = None,
                       progress: ProgressOpener | None = None, first_layers: int | None = None,
                       last_layers: int | None = None, session: Session | None = None) -> Result:
    """``ckpt reshard``: SRC located, parsed, gated and viewed once, and its kind chooses the engine:
    this runtime's checkpoint (it has a manifest) goes to :func:`reshard`, megatron-core's
    ``dp_reshardable`` one to :func:`ckpt_tool.reshard.megatron_dp.reshard_megatron`. A size only the
    other kind takes is refused in one line (``None``: keep SRC's)."""
    source = open_source(src, megatron=True, experts=True, max_memory=max_memory, dense_experts=True,
                         session=session)
    try:
        if source.manifest is None:
            ours = {"--gtp-remat": gtp_remat, "--fold-cp": fold_cp, "--expert-gtp-remat": expert_gtp_remat,
                    "--layout": layout}
            given = [k for k, v in ours.items() if v is not None]
            if given:
                raise FormatError(f"{given[0]}: is for this runtime's checkpoints; {src} is megatron-core's "
                                  "(reshard takes --tp --pp --cp --dp there)")
            from ckpt_tool.reshard.megatron_dp import reshard_megatron

            return reshard_megatron(source, dst, tp, pp, cp, dp, ep, bucket_size, max_memory, workers, progress, etp,
                                    (first_layers, last_layers), session)
        for flag, value in (("--pp", pp), ("--ep", ep), ("--etp", etp), ("--bucket-size", bucket_size),
                            ("--decoder-first-pipeline-num-layers", first_layers),
                            ("--decoder-last-pipeline-num-layers", last_layers)):
            if value is not None:
                raise FormatError(f"{flag}: is for megatron-core sources; {src} is this runtime's checkpoint (it has "
                                  "no pipeline stages; experts follow --expert-gtp-remat)")
        par = target_topology(source, layout, tp=tp, cp=cp, gtp_remat=gtp_remat, dp=dp, fold_cp=fold_cp,
                              expert_gtp_remat=expert_gtp_remat)
    except BaseException:
        source.reader.close()
        raise
    return reshard(source, dst, par, layout, max_memory, workers, progress, session)
