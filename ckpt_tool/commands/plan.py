"""``ckpt plan``: rehearse a resume at another topology before any GPU is allocated.

Metadata only, plus one small timed read for the bandwidth when ``--read-gbps`` is not given (the
load-time estimate is bytes per node over that bandwidth; a read served from the page cache
overstates it, so pass the storage's real figure for a cold start).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Annotated, Any

import typer

from ckpt_tool.locations import checkpoint_arg
from ckpt_tool.output import (
    FirstLayersOption,
    FormatOption,
    LastLayersOption,
    OutputFormat,
    fmt_bytes,
    handle_errors,
    print_blocks,
    print_json,
    table,
)
from gtp_format.errors import FormatError

EPILOG = """Examples:

  ckpt plan runs/gpt/checkpoints --tp 1 --cp 2 --dp 4

  ckpt plan CKPT --tp 2 --pp 1 --cp 2 --dp 2 --nproc-per-node 4 --read-gbps 2 --format json

  ckpt plan MEGATRON_CKPT --tp 2 --pp 2 --cp 1 --dp 2   (a megatron-core checkpoint: the verdict)

  ckpt plan MEGATRON_CKPT --pp 2 --vpp 2 --dp 2   (virtual pipeline stages: 2 model chunks per stage)

Verdicts: works_as_is (per rank: keys, chunks, bytes read, peak host memory, load time),
needs_reshard (the exact command), impossible (why).

Exit codes: 0 a plan was made (whatever the verdict), 2 unreadable input or bad options."""

PROBE_BYTES = 64 << 20


def _probe_gbps(ckpt: Any) -> float | None:
    """GB/s of one sequential read of up to 64 MiB of the checkpoint's largest data file."""
    from gtp_format.reader.storage import open_regular

    if not ckpt.data_files:
        return None
    name = max(ckpt.data_files, key=lambda n: ckpt.data_files[n])
    t, n = time.perf_counter(), 0
    with open_regular(ckpt.store, name) as f:
        while n < PROBE_BYTES:
            got = f.read(min(8 << 20, PROBE_BYTES - n))
            if not got:
                break
            n += len(got)
    dt = time.perf_counter() - t
    return n / dt / 1e9 if n and dt > 0 else None


@handle_errors
def plan_command(
    path: Annotated[object, typer.Argument(  # a Location: Typer refuses Union annotations
        parser=checkpoint_arg("PATH"), help="Checkpoint folder (iter_XXXXXXX) or its parent, or s3://BUCKET/PREFIX.",
        show_default=False)],
    tp: Annotated[int, typer.Option("--tp", min=1, help="Target tensor-parallel size.")] = 1,
    pp: Annotated[int, typer.Option("--pp", min=1, help="Target pipeline-parallel size.")] = 1,
    vpp: Annotated[int, typer.Option("--vpp", "--virtual-pipeline-model-parallel-size", min=1,
                                     help="Target model chunks per pipeline stage (megatron's virtual pipeline "
                                          "stages, interleaved 1F1B; 1: none).")] = 1,
    cp: Annotated[int, typer.Option("--cp", min=1, help="Target context-parallel size.")] = 1,
    dp: Annotated[int, typer.Option("--dp", min=1, help="Target data-parallel size.")] = 1,
    ep: Annotated[int | None, typer.Option("--ep", min=1, help="Target expert-parallel size (megatron).")] = None,
    etp: Annotated[int | None, typer.Option("--etp", "--expert-tensor-parallel-size", min=1,
                                            help="Target expert tensor-parallel size (megatron MoE; default: --tp)."
                                            )] = None,
    first_layers: FirstLayersOption = None,
    last_layers: LastLayersOption = None,
    gtp_remat: Annotated[int | None, typer.Option("--gtp-remat", min=1, help="Target GTP_remat (ours; default: "
                                                  "the checkpoint's).")] = None,
    nproc_per_node: Annotated[int | None, typer.Option("--nproc-per-node", min=1,
                                                       help="Ranks per node (default: all on one node).")] = None,
    read_gbps: Annotated[float | None, typer.Option("--read-gbps", min=1e-6,
                                                    help="Read GB/s per node (default: measured).")] = None,
    fmt: FormatOption = OutputFormat.table,
    session: Any = None,  # the command's (handle_errors): no option
) -> None:
    """Say whether a load at a topology works as is, needs a reshard, or cannot work; what each rank reads."""
    from gtp_format.load_plan import IMPOSSIBLE, plan_megatron, plan_ours
    from gtp_format.reader.checkpoint import open_checkpoint

    ckpt = open_checkpoint(path, session=session)
    if ckpt.manifest is not None:
        if first_layers is not None or last_layers is not None:
            raise FormatError(f"--decoder-first/last-pipeline-num-layers: are for megatron-core sources; {path} is "
                              "this runtime's checkpoint (it has no pipeline stages)")
        if etp is not None:
            raise FormatError(f"--etp: is for megatron-core MoE sources; {path} is this runtime's checkpoint (its "
                              "experts follow --expert-gtp-remat)")
        plan = plan_ours(ckpt, ckpt.manifest, tp, pp, cp, dp, ep, gtp_remat, str(path), vpp)
    else:
        plan = plan_megatron(ckpt, tp, pp, cp, dp, ep, str(path), etp, vpp, (first_layers, last_layers))
        if plan.commands:  # the copies' own view and checks, before a command is printed
            from ckpt_tool.reshard.megatron_dp import target_refusal

            reshard = any(c.startswith("ckpt reshard ") for c in plan.commands)
            if (why := target_refusal(path, tp, pp, cp, dp, ep, etp, reshard, (first_layers, last_layers))) is not None:
                plan = dataclasses.replace(plan, verdict=IMPOSSIBLE, reason=why, commands=[])
    gbps = read_gbps if read_gbps is not None else (_probe_gbps(ckpt) if plan.ranks else None)
    per_node = nproc_per_node or max(1, len(plan.ranks))
    nodes: dict[int, int] = {}
    for r in plan.ranks:
        nodes[r.rank // per_node] = nodes.get(r.rank // per_node, 0) + r.bytes
    seconds = max(nodes.values()) / (gbps * 1e9) if gbps and nodes else None
    doc = {"path": str(ckpt.root), "verdict": plan.verdict, "reason": plan.reason, "source": plan.source,
           "target": plan.target, "commands": plan.commands, "read_gbps": gbps,
           "read_gbps_source": "given" if read_gbps is not None else ("measured" if gbps else None),
           "nproc_per_node": per_node, "estimated_load_seconds": seconds,
           "ranks": [{"rank": r.rank, "keys": r.keys, "chunks": r.chunks, "bytes": r.bytes,
                      "peak_host_bytes": r.peak_host_bytes, "keys_read": plan.rank_keys.get(r.rank, [])}
                     for r in plan.ranks]}
    if fmt == OutputFormat.json:
        print_json(doc)
        return
    rows = [("verdict", plan.verdict), ("why", plan.reason), *[("run", c) for c in plan.commands]]
    if seconds is not None:
        rows.append(("load time", f"{seconds:.3g} s at {gbps:.3g} GB/s per node ({doc['read_gbps_source']}), "
                                  f"{len(nodes)} node(s) of {per_node} ranks"))
    blocks = [table(rows, ("plan", ""))]
    if plan.ranks:
        blocks.append(table([(r.rank, r.keys, r.chunks, fmt_bytes(r.bytes), fmt_bytes(r.peak_host_bytes))
                             for r in plan.ranks], ("rank", "keys", "chunks", "bytes read", "peak host memory"),
                            "Per rank"))
    print_blocks(*blocks)


def register(app: typer.Typer) -> None:
    app.command(name="plan", epilog=EPILOG)(plan_command)
