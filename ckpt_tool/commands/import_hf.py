"""``ckpt import SRC DST --from hf``: a Hugging Face model folder as a gtp_runtime checkpoint."""

from __future__ import annotations

import contextlib
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
)
from gtp_format.layout.buckets import DEFAULT_BUCKET_SIZE

EPILOG = """Examples:

  ckpt import hf_model ckpts/run --from hf --cp 2 --fold-cp --gtp-remat 2 --dp 2

  ckpt import s3://bucket/models/gpt s3://bucket/ckpts/run --from hf --dp 2   (both in a bucket)

  ckpt import llama_hf megatron_ckpt --from hf --to megatron-core --tp 2 --pp 2 --dp 4 --lr 3e-4

  python -m gtp_runtime.train --nproc-per-node 8 --cp 2 --fold-cp --gtp-remat 2 --vocab-size V \\
      --hidden H --num-layers L --num-heads A --ffn-hidden F --seq-length S --load ckpts/run

SRC: a folder of ArceeForCausalLM with hidden_act "gelu" (the runtime's GPT: RMSNorm, RoPE base
10000, non-gated GELU MLP, no bias, untied output layer), as `ckpt export --to hf` writes it or
save_pretrained does (config.json, model.safetensors or model-*.safetensors + index). DST: a new
folder holding iter_0000000 and the latest marker, at the topology given: model weights as stored,
fp32 master weights equal to them, zero Adam moments, step 0. If SRC has the optimizer files of
`ckpt export --to hf --optimizer` (optimizer*.safetensors), the master weights and Adam moments
come from them, and the iteration, Adam step, lr schedule and data position from their metadata:
DST (iter_N) resumes the exported run (--no-optimizer: ignore them, start at step 0). Train it with
the model flags that `--format json` prints under "model" and the same --bucket-size. Anything
else is refused in one line naming the config field or tensor.

--to megatron-core: a LlamaForCausalLM (GQA/MQA, tied or untied), Qwen2ForCausalLM, Qwen3ForCausalLM,
ArceeForCausalLM, Starcoder2ForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM, Qwen2MoeForCausalLM (--ep E,
--etp 1; or --ep 1 --etp = --tp: the experts in the dense optimizer) or GPTBigCodeForCausalLM folder as a
megatron-core torch_dist checkpoint at --tp --pp [--vpp] --dp
(iter_0000000, latest_checkpointed_iteration.txt): weights as stored, fp32 masters equal to them, zero Adam
moments, step 0, the args a Megatron-LM run of the model records, --sharding dp_reshardable (default) or
fully_reshardable. A run that loads the optimizer passes the same --lr/--min-lr (megatron-core matches param
groups by them) and --override-opt_param-scheduler; --finetune or --no-load-optim takes the weights alone. If
SRC has the optimizer files of `ckpt export --to hf --optimizer` of a megatron-core checkpoint, the masters,
moments, iteration, Adam step, lr schedule and consumed samples are carried (--no-optimizer: fresh). A config
that disagrees with the tensors, or a setting megatron-core's GPT cannot compute, is refused in one line.

Exit codes: 0 written, 2 unreadable or unsupported SRC, impossible topology, DST exists, or a
write failed."""


@handle_errors
def import_command(
    src: Annotated[object, typer.Argument(  # a Location: Typer refuses Union annotations
        parser=checkpoint_arg("SRC"), help="Hugging Face model folder (or s3://BUCKET/PREFIX).",
        show_default=False)],
    dst: Annotated[object, typer.Argument(  # a Location: Typer refuses Union annotations
        parser=checkpoint_arg("DST"), help="New folder (or s3://BUCKET/PREFIX) to create.", show_default=False)],
    source_format: Annotated[str, typer.Option("--from", help="Source format: hf.")] = "hf",
    to: Annotated[str, typer.Option("--to", metavar="gtp|megatron-core",
                                    help="Target format: this runtime's checkpoint, or megatron-core torch_dist.")
                  ] = "gtp",
    tp: Annotated[int, typer.Option("--tp", min=1, help="Tensor-parallel size.")] = 1,
    cp: Annotated[int, typer.Option("--cp", min=1, help="Context-parallel size.")] = 1,
    gtp_remat: Annotated[int, typer.Option("--gtp-remat", min=1, help="GTP_remat size.")] = 1,
    dp: Annotated[int, typer.Option("--dp", min=1, help="Data-parallel (replicate) size.")] = 1,
    pp: Annotated[int | None, typer.Option("--pp", min=1, help="megatron-core: pipeline-parallel size.")] = None,
    vpp: Annotated[int | None, typer.Option("--vpp", min=1, help="megatron-core: virtual pipeline stages per "
                                            "pipeline rank.")] = None,
    ep: Annotated[int | None, typer.Option("--ep", min=1, help="megatron-core MoE: expert-parallel size.")] = None,
    etp: Annotated[int | None, typer.Option("--etp", min=1, help="megatron-core MoE: expert tensor-parallel size "
                                            "(1; or = --tp with --ep 1, the experts then in megatron-core's dense "
                                            "optimizer).")] = None,
    sharding: Annotated[str | None, typer.Option("--sharding", metavar="dp_reshardable|fully_reshardable",
                                                 help="megatron-core: the distributed optimizer's sharding type.")
                        ] = None,
    lr: Annotated[float | None, typer.Option("--lr", help="megatron-core: the run's --lr (its param groups are "
                                             "matched by it).")] = None,
    min_lr: Annotated[float | None, typer.Option("--min-lr", help="megatron-core: the run's --min-lr.")] = None,
    fold_cp: Annotated[bool, typer.Option("--fold-cp/--no-fold-cp", help="Shard dense weights over cp x gtp_remat.")
                       ] = False,
    layout: Annotated[str, typer.Option("--layout", help="torch_dist or safetensors.")] = "torch_dist",
    bucket_size: Annotated[int, typer.Option("--bucket-size", min=1, help="Gradient bucket size in elements, as "
                                             "the training run's --bucket-size.")] = DEFAULT_BUCKET_SIZE,
    seq_length: Annotated[int | None, typer.Option("--seq-length", min=1, show_default="max_position_embeddings",
                                                   help="Training sequence length to record.")] = None,
    optimizer: Annotated[bool, typer.Option("--optimizer/--no-optimizer", help="Restore master weights, Adam "
                                            "moments and step from SRC's optimizer files, if it has them.")
                         ] = True,
    max_memory: MaxMemoryOption = DEFAULT_MAX_MEMORY,
    workers: Annotated[int | None, typer.Option("--workers", min=1, max=64, show_default="one per core, at most 4",
                                                help="Data files written in parallel.")] = None,
    fmt: FormatOption = OutputFormat.table,
    session: Any = None,  # the command's (handle_errors): no option
) -> None:
    """Write a Hugging Face model as a gtp_runtime checkpoint, or with --to megatron-core a megatron-core
    torch_dist one, at the given topology (step 0, or the run `export --optimizer` came from, with its
    optimizer state)."""
    from ckpt_tool.hf.importer import import_hf
    from gtp_format.errors import FormatError
    from gtp_format.layout.config import ParallelConfig

    if source_format != "hf":
        raise FormatError(f"--from {source_format!r}: ckpt import reads hf (a Hugging Face model folder)")
    if to not in ("gtp", "megatron-core"):
        raise FormatError(f"--to {to!r}: use gtp (this runtime's checkpoint) or megatron-core")
    if to == "megatron-core":
        ours = [f for f, v in (("--cp", cp != 1), ("--gtp-remat", gtp_remat != 1), ("--fold-cp", fold_cp),
                               ("--layout", layout != "torch_dist"),
                               ("--bucket-size", bucket_size != DEFAULT_BUCKET_SIZE)) if v]
        if ours:
            raise FormatError(f"{ours[0]} is this runtime's option; drop it for --to megatron-core")
        from ckpt_tool.hf.megatron_import import import_megatron

        with contextlib.ExitStack() as stack:
            bar = progress_opener(stack, "importing", fmt)
            info = import_megatron(src, dst, tp, pp or 1, dp, vpp, sharding or "dp_reshardable", seq_length,
                                   lr, min_lr, max_memory,
                                   workers, bar, ep or 1, etp or 1, optimizer, session)
        print_written(fmt, info, f"imported {info['src']} ({info['architecture']}) as {info['dst']} (megatron-core "
                      f"{info['sharding']}, {info['topology']}, iteration {info['iteration']}, optimizer "
                      f"{info['optimizer']}): "
                      f"{count(info['params'], 'param')}, {count(info['files'], 'file')}, "
                      f"{fmt_bytes(info['bytes_written'])} in {info['seconds']:.1f} s")
        return
    given = [f for f, v in (("--pp", pp), ("--vpp", vpp), ("--ep", ep), ("--etp", etp), ("--sharding", sharding),
                            ("--lr", lr),
                            ("--min-lr", min_lr)) if v is not None]
    if given:
        raise FormatError(f"{given[0]} is for --to megatron-core; drop it")
    par = ParallelConfig(tp=tp, cp=cp, gtp_remat=gtp_remat, dp=dp, fold_cp=fold_cp)
    with contextlib.ExitStack() as stack:
        bar = progress_opener(stack, "importing", fmt)
        info = import_hf(src, dst, par, layout, bucket_size, seq_length, max_memory, workers, bar, optimizer, session)
    print_written(fmt, info, f"imported {info['src']} ({info['architecture']}) as {info['dst']} ({info['topology']}, "
                  f"{info['layout']}, iteration {info['iteration']}, optimizer {info['optimizer']}): "
                  f"{count(info['params'], 'param')}, {count(info['files'], 'file')}, "
                  f"{fmt_bytes(info['bytes_written'])} in {info['seconds']:.1f} s")


def register(app: typer.Typer) -> None:
    app.command(name="import", epilog=EPILOG)(import_command)
