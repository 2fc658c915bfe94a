"""``ckpt import --from hf``: a Hugging Face model folder as a gtp_runtime checkpoint at any topology.

The folder is read without trust (:mod:`.folder`), its ``config.json`` mapped to the runtime's
model config and refused where the runtime's GPT would compute something else
(:func:`.mapping.model_config`), and every tensor checked against the shape the one name table
(:func:`.mapping.parts`, the table export writes with) expects before anything is written. The
checkpoint is then what a run at ``--tp/--cp/--gtp-remat/--dp [--fold-cp]`` would have saved at
step 0: the model weights as stored (bf16 or fp32), fp32 master weights equal to them, zero Adam
moments, and a manifest whose bucket layout is the runtime's own rule
(:func:`gtp_format.layout.params.buffer_layouts`); ``python -m gtp_runtime.train --load DST`` with
the same model flags and ``--bucket-size`` resumes from it.

A folder with the optimizer files ``ckpt export --to hf --optimizer`` writes
(``optimizer*.safetensors``: ``optimizer.state.{param,exp_avg,exp_avg_sq}.<HF name>``, fp32, in
the same name table) is imported with them: the fp32 master weights and both Adam moments are
read from those files instead, and the iteration, Adam step, lr schedule and data position from
their ``__metadata__`` (:mod:`.run_state`), so the checkpoint resumes the exported run, not a
new one. ``optimizer=False`` (``--no-optimizer``) ignores them.

It is written through the one checkpoint writer (:class:`gtp_format.writer.checkpoint.CheckpointWriter`,
driven by reshard's :func:`ckpt_tool.copying.engine.write_checkpoint` over the plan of
:func:`ckpt_tool.copying.plan.plan_target`): streamed in row blocks of the chunk budget, so memory
is bounded by ``--max-memory`` and not by the model, through the ``O_DIRECT`` sink, into a hidden
work folder that appears as DST whole or not at all. No torch: numpy memory maps of the safetensors.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ckpt_tool.copying import DEFAULT_MAX_MEMORY, WEIGHT_STATE
from ckpt_tool.copying.engine import (
    build_atomically,
    chunk_budget,
    default_workers,
    peak_rss,
    write_checkpoint,
    written_sizes,
)
from ckpt_tool.copying.plan import OutChunk, plan_target
from ckpt_tool.copying.writers import Zeros
from ckpt_tool.hf import mapping
from ckpt_tool.hf import run_state as hf_run_state
from ckpt_tool.hf.folder import Tensor, read_folder, read_set
from gtp_format.errors import FormatError
from gtp_format.layout.buckets import DEFAULT_BUCKET_SIZE
from gtp_format.layout.config import ConfigError, ModelConfig, ParallelConfig, target_world_problem
from gtp_format.layout.params import buffer_layouts, model_params
from gtp_format.lineage import LINEAGE_KEY, attestation, imported
from gtp_format.manifest import HASH_ALGORITHM, Manifest, OptimizerInfo, format_version_for
from gtp_format.names import FORMAT_NAME, LAYOUTS, STATES, iter_dir_name
from gtp_format.progress import ProgressOpener
from gtp_format.reader.boxes import Buffer
from gtp_format.scan import carrier
from gtp_format.session import Session
from gtp_format.storage.location import ObjectURL
from gtp_format.writer.checkpoint import CheckpointWriter
from gtp_format.writer.sink import stage_bytes

PARAM_DTYPES = {"float32": "torch.float32", "bfloat16": "torch.bfloat16"}


@dataclass(frozen=True)
class HFModel:
    root: Path | ObjectURL
    model: ModelConfig
    param_dtype: str  # "torch.float32" or "torch.bfloat16"
    parts: dict[str, list[mapping.Part]]  # runtime parameter -> its HF tensors
    tensors: dict[str, Tensor]
    optimizer: dict[str, Tensor] | None = None  # optimizer.state.<state>.<HF name> -> tensor
    run: hf_run_state.RunState | None = None

    def read_box(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
                 state: str = WEIGHT_STATE, buf: Buffer | None = None) -> np.ndarray:
        """A box of runtime parameter ``name``'s full tensor for ``state`` (the weight, or an optimizer
        state from the optimizer files), assembled from its HF tensors (stored bits).

        ``buf``: the box is assembled in this reusable buffer (valid until its next use). Whole rows of the box
        (no column range, or every column) are read straight into it. Why: each range was read into a new zeroed
        buffer and copied into a new box, two fresh allocations page-faulted in per chunk: the HF reads and the
        assembly were 1.1 and 0.3 CPU s per GB read of a 2.66 GB import (2-core machine,
        ``benchmarks/copy_cpu_stages.py``).
        """
        a, n = offsets[0], sizes[0]
        cols = (offsets[1], offsets[1] + sizes[1]) if len(sizes) == 2 else None
        out: np.ndarray | None = None
        for part in self.parts[name]:
            if state == WEIGHT_STATE:
                t = self.tensors[part.hf]
            else:
                assert self.optimizer is not None
                t = self.optimizer[optimizer_key(state, part.hf)]
            dt = carrier(t.dtype)
            for lo, hi, h in part.hf_rows(a, a + n):
                if out is None:
                    out = np.empty(sizes, dtype=dt) if buf is None else \
                        buf.get(math.prod(sizes) * dt.itemsize).view(dt).reshape(sizes)
                if (cols is None or cols == (0, t.shape[-1]) and len(t.shape) == 2) and out.dtype == dt:
                    t.read_rows_into(h, h + hi - lo, out[lo - a:hi - a])
                    continue
                out[lo - a:hi - a] = t.read_rows(h, h + hi - lo, cols)
        assert out is not None
        return out


def optimizer_key(state: str, hf_name: str) -> str:
    """The name ``ckpt export --optimizer`` gives one optimizer state of one HF tensor."""
    return f"optimizer.state.{state}.{hf_name}"


def _open_optimizer(src: Path | ObjectURL, table: list[mapping.Part], full: dict[str, tuple[int, ...]]
                    ) -> tuple[dict[str, Tensor], hf_run_state.RunState] | None:
    """The optimizer files of ``src``, checked against the name table, and their run state; ``None``
    if the folder has none."""
    fix = "pass a folder written by `ckpt export --to hf --optimizer`, or --no-optimizer"
    got = read_set(src, "optimizer", fix)
    if got is None:
        return None
    tensors, metas = got
    want = {optimizer_key(s, p.hf): (p.rows, *full[p.ours][1:]) for p in table for s in STATES}
    unknown, missing = sorted(set(tensors) - set(want)), sorted(set(want) - set(tensors))
    if unknown or missing:
        what = f"has tensor {unknown[0]!r}, which" if unknown else f"lacks tensor {missing[0]!r}, which"
        raise FormatError(f"{src}: its optimizer files {what} this model's optimizer state "
                          f"{'does not have' if unknown else 'needs'}; {fix}")
    for name, shape in want.items():
        t = tensors[name]
        if t.shape != shape or t.dtype.name != "float32":
            raise FormatError(f"{t.file}: tensor {name!r} is {list(t.shape)} {t.dtype.name}, the model implies "
                              f"{list(shape)} float32 (fp32 optimizer state); {fix}")
    return tensors, hf_run_state.parse(metas, str(src / "optimizer*.safetensors"))


def open_hf(src: Path | ObjectURL, seq_length: int | None = None, optimizer: bool = True) -> HFModel:
    """Read and check an HF folder (headers only): config, names, shapes, one float dtype; and its
    optimizer files, if any (unless ``optimizer`` is false)."""
    cfg, tensors = read_folder(src)
    model = mapping.model_config(cfg, str(src / "config.json"), seq_length)
    # Sizes the config claims are checked against what the files hold before any table is built from
    # them: the table has a part per layer and a row range per head, so a claimed 10^9 layers must not
    # cost memory the folder does not back.
    per_layer = sum(1 for _ in mapping.LAYER)
    if len(tensors) != len(mapping.HEAD) + len(mapping.TAIL) + per_layer * model.num_layers:
        raise FormatError(f"{src}: config.json says {model.num_layers} layers, i.e. "
                          f"{len(mapping.HEAD) + len(mapping.TAIL) + per_layer * model.num_layers} tensors, but the "
                          f"folder holds {len(tensors)}; the weights do not belong to this config")
    embed = tensors.get(mapping.HEAD[0][1])
    if embed is None or embed.shape != (model.vocab_size, model.hidden):
        raise FormatError(f"{src}: tensor {mapping.HEAD[0][1]!r} is {list(embed.shape) if embed else 'missing'}, "
                          f"config.json implies {[model.vocab_size, model.hidden]}; the weights do not belong to it")
    table = mapping.parts(model, str(src))
    want = {p.hf: p for p in table}
    unknown, missing = sorted(set(tensors) - set(want)), sorted(set(want) - set(tensors))
    if unknown or missing:
        what = f"has tensor {unknown[0]!r}, which" if unknown else f"lacks tensor {missing[0]!r}, which"
        raise FormatError(f"{src}: {what} {mapping.ARCHITECTURE} of this config.json "
                          f"{'does not have' if unknown else 'needs'}; the folder is not that model or incomplete")
    full = {p.name: p.full_shape for p in model_params(model)}
    dtypes = {t.dtype.name for t in tensors.values()}
    for p in table:
        shape = (p.rows, *full[p.ours][1:])
        if tensors[p.hf].shape != shape:
            raise FormatError(f"{tensors[p.hf].file}: tensor {p.hf!r} is {list(tensors[p.hf].shape)}, config.json "
                              f"implies {list(shape)}; the weights do not belong to this config")
    if len(dtypes) != 1 or next(iter(dtypes)) not in PARAM_DTYPES:
        raise FormatError(f"{src}: tensors are {', '.join(sorted(dtypes))}; the runtime trains with one param dtype, "
                          "float32 or bfloat16 (convert the model first, e.g. model.to(torch.bfloat16))")
    parts: dict[str, list[mapping.Part]] = {}
    for p in table:
        parts.setdefault(p.ours, []).append(p)
    opt = _open_optimizer(src, table, full) if optimizer else None
    return HFModel(src, model, PARAM_DTYPES[dtypes.pop()], parts, tensors, *(opt or (None, None)))


def _fp32(bits: np.ndarray, param_dtype: str) -> np.ndarray:
    """The fp32 master weight of stored weight bits (bf16 widens exactly: its bits are fp32's top half)."""
    if param_dtype == "torch.float32":
        return bits
    return (bits.astype(np.uint32) << 16).view(np.float32)


def fill(hf: HFModel, zeros: bool = False) -> Callable[[OutChunk], np.ndarray | Zeros]:
    """Each target chunk's stored bits; ``zeros`` (a ``torch_dist`` target, :func:`write_distcp`): a chunk known to
    be all zeros (padding, gaps, fresh Adam moments) as :class:`Zeros`, written with the same bytes and records
    without an array to build, hash and scan. Measured (2-core machine, 2.66 GB import of a 0.63 GB fp32 folder,
    ``benchmarks/copy_cpu_stages.py``): the moments were 48 % of the bytes written, each hashed three times and
    scanned like data."""
    local = threading.local()  # each writing thread's box buffer: its chunk is written before it asks for the next

    def one(c: OutChunk) -> np.ndarray | Zeros:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = Buffer()
        if c.values is not None:
            return np.asarray(c.values, dtype=np.int64)
        if c.param is None or (c.state in STATES[1:] and hf.optimizer is None):  # padding, gaps, moments at 0
            return Zeros(c.nbytes) if zeros else np.zeros(c.sizes, dtype=carrier(c.dtype))
        assert c.box is not None and c.state is not None
        if c.state != WEIGHT_STATE and hf.optimizer is not None:
            return hf.read_box(c.param, *c.box, state=c.state, buf=buf).reshape(c.sizes)
        bits = hf.read_box(c.param, *c.box, buf=buf)
        return (bits if c.state == WEIGHT_STATE else _fp32(bits, hf.param_dtype)).reshape(c.sizes)

    return one


def target(hf: HFModel, par: ParallelConfig, layout: str, bucket_size: int) -> Manifest:
    stored = sum(math.prod(t.shape) for t in hf.tensors.values())
    too_big = target_world_problem({"--tp": par.tp, "--cp": par.cp, "--gtp-remat": par.gtp_remat, "--dp": par.dp},
                                   stored, "the Hugging Face folder")
    if too_big is not None:  # before a shard per rank is planned
        raise FormatError(f"{hf.root}: cannot import at {par.describe()}: {too_big}")
    try:
        par.validate()
        hf.model.validate(par)
    except ConfigError as e:
        raise FormatError(f"{hf.root}: cannot import at {par.describe()}: {e}") from None
    opt = hf.run.optimizer if hf.run is not None else OptimizerInfo("adamw", 0, {})
    return Manifest(
        format_version=format_version_for(opt), layout=layout, optimizer_sharding=FORMAT_NAME,
        iteration=hf.run.iteration if hf.run is not None else 0, topology=par, model=hf.model,
        param_dtype=hf.param_dtype, optimizer=opt, bucket_size=bucket_size,
        buffers=buffer_layouts(hf.model, par, bucket_size, hf.param_dtype), hash_algorithm=HASH_ALGORITHM,
        files={}, notes=[{"tool": "ckpt import", "from": "hf", "architecture": mapping.ARCHITECTURE,
                          "optimizer": "restored" if hf.run is not None else "moments at zero"}],
        extra=dict(hf.run.extra) if hf.run is not None else {})


def import_hf(src: Path | ObjectURL, dst: Path | ObjectURL, par: ParallelConfig, layout: str = "torch_dist",
              bucket_size: int = DEFAULT_BUCKET_SIZE, seq_length: int | None = None,
              max_memory: int = DEFAULT_MAX_MEMORY, workers: int | None = None,
              progress: ProgressOpener | None = None, optimizer: bool = True,
              session: Session | None = None) -> dict[str, Any]:
    """Write the HF folder SRC as a checkpoint at ``par`` into the new folder DST: step 0, or the
    exported run's step with its optimizer state (``optimizer`` and optimizer files present)."""
    if layout not in LAYOUTS:
        raise FormatError(f"--layout {layout!r}: use one of {', '.join(LAYOUTS)}")
    t0 = time.perf_counter()
    hf = open_hf(src, seq_length, optimizer)
    manifest = target(hf, par, layout, bucket_size)
    workers = workers or default_workers()
    chunk_bytes = chunk_budget(max_memory, workers)
    plan = plan_target(manifest, chunk_bytes)
    section, src_id = imported(src)
    manifest.extra[LINEAGE_KEY] = section

    def body(writer: CheckpointWriter) -> None:
        writer.attest(attestation("ckpt import --from hf", src_id))
        advance = progress(plan.nbytes) if progress else (lambda n: None)
        write_checkpoint(fill(hf, zeros=layout == "torch_dist"), manifest, plan, writer, workers, advance,
                         stage_bytes(chunk_bytes))

    build_atomically(dst, (src,), body, inner=iter_dir_name(manifest.iteration), latest=str(manifest.iteration),
                     session=session)
    out = written_sizes(dst / iter_dir_name(manifest.iteration))
    return {"src": str(src), "dst": str(dst), "from": "hf", "architecture": mapping.ARCHITECTURE,
            "topology": par.describe(), "layout": layout, "params": len(hf.parts), "param_dtype": hf.param_dtype,
            "model": hf.model.to_dict(), "bucket_size": bucket_size, "files": len(out),
            "bytes_written": sum(out), "seconds": time.perf_counter() - t0,
            "optimizer": "restored" if hf.run is not None else "moments at zero", "iteration": manifest.iteration,
            "max_memory": max_memory, "chunk_bytes": chunk_bytes, "workers": workers, "peak_rss_bytes": peak_rss()}
