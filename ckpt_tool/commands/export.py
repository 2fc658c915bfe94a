"""``ckpt export SRC DST --to hf|fully_reshardable|torch``: the per-parameter state for other tools."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated, Any

import typer

from ckpt_tool.copying import DEFAULT_MAX_MEMORY
from ckpt_tool.locations import checkpoint_arg
from ckpt_tool.output import (
    FormatOption,
    MaxMemoryOption,
    OutputFormat,
    count,
    fmt_bytes,
    handle_errors,
    print_written,
    progress_opener,
    size_option,
)

DEFAULT_SHARD = 5 * 10**9  # Hugging Face's default max_shard_size, "5GB" (not imported: export pulls numpy)

EPILOG = """Examples:

  ckpt export runs/gpt/checkpoints hf_out --to hf --tokenizer data/corpus.tokenizer.json

  ckpt export CKPT hf_out --to hf --optimizer --max-shard-size 2GB

  ckpt export MEGATRON_CKPT hf_out --to hf   (megatron-core: the class its recorded args map onto)

  ckpt export MEGATRON_CKPT raw_out --to hf --names megatron   (the raw tensors, Megatron names)

  ckpt export CKPT megatron_fr --to fully_reshardable --format json

  ckpt export CKPT model.pt --to torch   (one torch.save file, streamed)

hf: a folder AutoModelForCausalLM.from_pretrained loads (config.json for ArceeForCausalLM,
generation_config.json, transformers names, q/k/v split from the fused QKV), model.safetensors or
model-0000i-of-0000n.safetensors + model.safetensors.index.json, full (unsharded, unpadded)
shapes, stored dtype. A megatron-core GPT: the transformers class of the model its common_state
args record (Llama, Qwen2, Qwen3, Arcee, Starcoder2, GPTBigCode, Mixtral, Qwen3-MoE), every
forward-changing config key from the checkpoint; a model no class computes exactly is refused
naming the Megatron flag. --num-heads only fills a head count the args lack (and must agree).
--names megatron keeps the checkpoint's names (no config.json).
--optimizer adds optimizer*.safetensors with optimizer.state.{param,exp_avg,exp_avg_sq}.<name>
(fp32), from megatron-core dp_reshardable or fully_reshardable saves. Without --optimizer any
checkpoint that holds model weights exports (megatron-core dp_reshardable, fully_reshardable,
dp_zero_gather_scatter, model-only). fully_reshardable: a
torch_dist checkpoint of Megatron's per-parameter optimizer layout. torch: {key: global tensor}
for every tensor key of SRC in one torch.save file, the tensors PyTorch's dcp_to_torch_save writes;
its non-tensor objects (common_state, rng_state, optimizer param groups) are left out and named,
since dcp_to_torch_save unpickles them (ckpt never does).
Sizes: bytes or with a unit, 5GB = 5*10^9 (as Hugging Face), 512MiB = 512*2^20.

Exit codes: 0 written, 2 unreadable, incomplete or aliased SRC, no matching transformers class,
DST exists, or a write failed."""


@handle_errors
def export_command(
    src: Annotated[object, typer.Argument(  # a Location: Typer refuses Union annotations
        parser=checkpoint_arg("SRC"), help="Checkpoint folder (iter_XXXXXXX) or its parent.", show_default=False)],
    dst: Annotated[object, typer.Argument(  # a Location: Typer refuses Union annotations
        parser=checkpoint_arg("DST"), help="New folder or s3://BUCKET/PREFIX (a new file or object for --to torch).",
        show_default=False)],
    to: Annotated[str, typer.Option("--to", metavar="hf|fully_reshardable|torch",
                                           help="What to write.")] = "hf",
    optimizer: Annotated[bool, typer.Option("--optimizer", help="hf: also write master weights and moments.")
                         ] = False,
    names: Annotated[str | None, typer.Option("--names", show_default="hf",
                                              help="hf: hf (transformers names + config.json) or megatron.")
                     ] = None,
    num_heads: Annotated[int | None, typer.Option("--num-heads", min=1, help="hf, megatron-core SRC whose args do "
                                                  "not record num_attention_heads: the head count (must agree "
                                                  "where they do).")
                         ] = None,
    tokenizer: Annotated[Path | None, typer.Option("--tokenizer", help="hf: a tokenizers JSON file to include "
                                                   "(PREFIX.tokenizer.json of `gtp_runtime.data prepare`).")
                         ] = None,
    max_shard_size: Annotated[int, size_option("--max-shard-size", "hf: largest safetensors file.")
                              ] = DEFAULT_SHARD,
    max_memory: MaxMemoryOption = DEFAULT_MAX_MEMORY,
    workers: Annotated[int | None, typer.Option("--workers", min=1, max=64, show_default="one per core, at most 4",
                                                help="Files written in parallel.")] = None,
    fmt: FormatOption = OutputFormat.table,
    session: Any = None,  # the command's (handle_errors): no option
) -> None:
    """Export SRC's weights (and optimizer state) as a Hugging Face model folder, Megatron
    fully_reshardable, or one torch.save file."""
    from ckpt_tool.export.engine import export
    from gtp_format import ranks

    with contextlib.ExitStack() as stack:
        bar = progress_opener(stack, f"exporting to {to}", fmt)
        run = lambda: export(src, dst, to, optimizer, max_memory, workers, max_shard_size, bar,  # noqa: E731
                             names, tokenizer, num_heads, session)
        # under torchrun: hf and fully_reshardable split their files over the ranks (rank 0 commits); torch's one
        # file is written by rank 0 alone
        info = ranks.on_root(run) if to == "torch" else run()
    group = ranks.current()
    if info is None or (group is not None and not group.root):
        return
    what = count(info["params"], "param") if to != "torch" else count(info["keys"], "key")
    if info.get("objects"):  # megatron-core's byte objects: what came along and what did not
        what += (f", {count(info['objects'], 'byte object')} (common_state, _extra_state; "
                 f"{count(info['rng_state_dropped'], 'rng_state')} of the source topology left out: "
                 "resume with --no-load-rng)")
    tail = ""
    if info.get("left_out"):  # --to torch: the non-tensor objects dcp_to_torch_save would unpickle
        left = info["left_out"]
        kinds = sorted({k.split("/", 1)[0].rsplit(".", 1)[-1] for k in left})  # common_state, rng_state, ...
        tail = (f"; left out {count(len(left), 'non-tensor object')} ({', '.join(kinds[:8])}"
                f"{', ...' if len(kinds) > 8 else ''}; --format json lists the keys and why): torch.load with "
                "weights_only=True refuses them, so the file is not all of PyTorch's dcp_to_torch_save; read them "
                "with ckpt show SRC KEY")
    print_written(fmt, info, f"wrote {info['dst']} ({to}{', ' + info['names'] + ' names' if 'names' in info else ''}"
                  f"): {what}, {count(info['files'], 'file')}, {fmt_bytes(info['bytes_written'])} in "
                  f"{info['seconds']:.1f} s{tail}")


def register(app: typer.Typer) -> None:
    app.command(name="export", epilog=EPILOG)(export_command)
