"""``ckpt reshard SRC DST``: the whole training state of SRC at another TP/CP/GTP_remat/DP/fold."""

from __future__ import annotations

import contextlib
from typing import Annotated, Any

import typer

from ckpt_tool.copying import DEFAULT_MAX_MEMORY
from ckpt_tool.locations import checkpoint_arg
from ckpt_tool.output import (
    FirstLayersOption,
    FormatOption,
    LastLayersOption,
    MaxMemoryOption,
    OutputFormat,
    count,
    fmt_bytes,
    handle_errors,
    print_json,
    print_line,
    progress_opener,
)

EPILOG = """Examples:

  ckpt reshard runs/a/checkpoints runs/b/checkpoints --cp 4 --fold-cp --dp 1

  ckpt reshard A B --tp 2 --gtp-remat 1 --no-fold-cp --dp 2

  ckpt reshard A B --cp 2 --fold-cp --expert-gtp-remat 2 --layout safetensors --format json

  python -m gtp_runtime.train --nproc-per-node 4 --cp 4 --fold-cp --load runs/b/checkpoints

  ckpt reshard MEGATRON/ckpt MEGATRON/ckpt_tp1pp2 --tp 1 --pp 2 --dp 2   (a megatron-core dp_reshardable one)

Every size not given keeps SRC's value. DST is a new folder holding iter_XXXXXXX and the latest
marker: `python -m gtp_runtime.train ... --load DST` at the new topology resumes from it with no
other flag. Model weights, fp32 master weights and Adam moments move bit-exactly; the manifest
is rewritten. SRC is only read; DST appears whole or not at all. Aliased sources are refused
(run `ckpt migrate-aliased` first). A megatron-core dp_reshardable SRC becomes the dp_reshardable
checkpoint megatron-core saves at --tp --pp --cp --dp (its common_state records them; rng_state is
dropped): megatron-core's loader takes it at that topology with no other flag.

Exit codes: 0 written, 2 unreadable, incomplete or aliased SRC, impossible topology, DST exists,
or a write failed (a full disk)."""


@handle_errors
def reshard_command(
    src: Annotated[object, typer.Argument(  # a Location: Typer refuses Union annotations
        parser=checkpoint_arg("SRC"), help="Checkpoint folder (iter_XXXXXXX), its parent, or s3://BUCKET/PREFIX.",
        show_default=False)],
    dst: Annotated[object, typer.Argument(  # a Location: Typer refuses Union annotations
        parser=checkpoint_arg("DST"), help="New folder (or s3://BUCKET/PREFIX) to create.", show_default=False)],
    tp: Annotated[int | None, typer.Option("--tp", min=1, help="Tensor-parallel size.")] = None,
    pp: Annotated[int | None, typer.Option("--pp", min=1, help="Pipeline-parallel size (megatron-core).")] = None,
    cp: Annotated[int | None, typer.Option("--cp", min=1, help="Context-parallel size.")] = None,
    gtp_remat: Annotated[int | None, typer.Option("--gtp-remat", min=1, help="GTP_remat size.")] = None,
    dp: Annotated[int | None, typer.Option("--dp", min=1, help="Data-parallel (replicate) size.")] = None,
    fold_cp: Annotated[bool | None, typer.Option("--fold-cp/--no-fold-cp",
                                                 help="Shard dense weights over cp x gtp_remat.")] = None,
    expert_gtp_remat: Annotated[int | None, typer.Option("--expert-gtp-remat", min=1,
                                                         help="GTP_remat size of expert weights.")] = None,
    layout: Annotated[str | None, typer.Option("--layout", metavar="torch_dist|safetensors",
                                                          help="Layout of DST (default: SRC's).")] = None,
    ep: Annotated[int | None, typer.Option("--ep", min=1, help="Expert-parallel size (megatron-core sources; "
                                                               "default: the source's).")] = None,
    etp: Annotated[int | None, typer.Option("--etp", "--expert-tensor-parallel-size", min=1,
                                            help="Expert tensor-parallel size (megatron-core MoE sources; default: "
                                            "--tp, megatron-core's default).")] = None,
    first_layers: FirstLayersOption = None,
    last_layers: LastLayersOption = None,
    bucket_size: Annotated[int | None, typer.Option("--bucket-size", min=1, help="The target run's --ddp-bucket-size "
                                                    "(megatron-core sources split into buckets).")] = None,
    max_memory: MaxMemoryOption = DEFAULT_MAX_MEMORY,
    workers: Annotated[int | None, typer.Option("--workers", min=1, max=64, show_default="one per core, at most 4",
                                                help="Data files written in parallel.")] = None,
    fmt: FormatOption = OutputFormat.table,
    session: Any = None,  # the command's (handle_errors): no option
) -> None:
    """Write SRC's model and optimizer state for another topology into DST."""
    from ckpt_tool.reshard.engine import reshard_checkpoint

    with contextlib.ExitStack() as stack:
        bar = progress_opener(stack, "resharding", fmt)
        result = reshard_checkpoint(src, dst, tp=tp, pp=pp, cp=cp, gtp_remat=gtp_remat, dp=dp, fold_cp=fold_cp,
                                    expert_gtp_remat=expert_gtp_remat, layout=layout, ep=ep, etp=etp,
                                    bucket_size=bucket_size, max_memory=max_memory, workers=workers, progress=bar,
                                    first_layers=first_layers, last_layers=last_layers, session=session)
    _report(result, fmt)


def _report(result: Any, fmt: OutputFormat) -> None:
    if fmt == OutputFormat.json:
        print_json({"ok": True, **result.to_json()})
    else:
        print_line(f"wrote {result.dst} ({result.target_topology}, {result.layout}): {count(result.files, 'file')}, "
                   f"{fmt_bytes(result.bytes_written)} from {result.source_topology} in {result.seconds:.1f} s; "
                   f"peak memory {fmt_bytes(result.peak_rss_bytes)} (budget {fmt_bytes(result.max_memory)})")
        for note in result.notes:
            print_line(f"note: {note}")


def register(app: typer.Typer) -> None:
    app.command(name="reshard", epilog=EPILOG)(reshard_command)
