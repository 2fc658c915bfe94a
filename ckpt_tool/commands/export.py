"""``ckpt export SRC DST --to hf|fully_reshardable|torch``: the per-parameter state for other tools."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated

import typer

from ckpt_tool.output import (
    FormatOption,
    MaxMemoryOption,
    OutputFormat,
    count,
    fmt_bytes,
    handle_errors,
    print_json,
    print_line,
    progress_opener,
)
from ckpt_tool.reshard import DEFAULT_MAX_MEMORY

EPILOG = """Examples:

  ckpt export runs/gpt/checkpoints hf_out --to hf

  ckpt export CKPT hf_out --to hf --optimizer --max-shard-size 2000000000

  ckpt export CKPT megatron_fr --to fully_reshardable --format json

  ckpt export CKPT model.pt --to torch   (small models: one torch.save file)

hf: model-0000i-of-0000n.safetensors + model.safetensors.index.json, Megatron parameter names,
full (unsharded, unpadded) shapes, stored dtype; --optimizer adds optimizer-*.safetensors with
optimizer.state.{param,exp_avg,exp_avg_sq}.<name> (fp32). fully_reshardable: a torch_dist
checkpoint of Megatron's per-parameter optimizer layout. torch: {key: global tensor} for every
key of SRC in one torch.save file, as PyTorch's dcp_to_torch_save writes it.

Exit codes: 0 written, 2 unreadable, incomplete or aliased SRC, DST exists, or a write failed."""


@handle_errors
def export_command(
    src: Annotated[Path, typer.Argument(help="Checkpoint folder (iter_XXXXXXX) or its parent.", show_default=False)],
    dst: Annotated[Path, typer.Argument(help="New folder (a new file for --to torch).", show_default=False)],
    to: Annotated[str, typer.Option("--to", metavar="hf|fully_reshardable|torch",
                                           help="What to write.")] = "hf",
    optimizer: Annotated[bool, typer.Option("--optimizer", help="hf: also write master weights and moments.")
                         ] = False,
    max_shard_size: Annotated[int, typer.Option("--max-shard-size", min=1, help="hf: bytes per safetensors file.")
                              ] = 5 * 10**9,
    max_memory: MaxMemoryOption = DEFAULT_MAX_MEMORY,
    workers: Annotated[int | None, typer.Option("--workers", min=1, max=64, show_default="one per core, at most 4",
                                                help="Files written in parallel.")] = None,
    fmt: FormatOption = OutputFormat.table,
) -> None:
    """Export SRC's weights (and optimizer state) as Hugging Face safetensors, Megatron
    fully_reshardable, or one torch.save file."""
    from ckpt_tool.reshard.export import export

    with contextlib.ExitStack() as stack:
        bar = progress_opener(stack, f"exporting to {to}", fmt)
        info = export(src, dst, to, optimizer, max_memory, workers, max_shard_size, bar)
    if fmt == OutputFormat.json:
        print_json({"ok": True, **info})
    else:
        print_line(f"wrote {info['dst']} ({to}): {count(info['params'], 'param')}, {count(info['files'], 'file')}, "
                   f"{fmt_bytes(info['bytes_written'])} in {info['seconds']:.1f} s; peak memory "
                   f"{fmt_bytes(info['peak_rss_bytes'])} (budget {fmt_bytes(info['max_memory'])})")


def register(app: typer.Typer) -> None:
    app.command(name="export", epilog=EPILOG)(export_command)
