#!/usr/bin/env python3
"""Time the genuine megatron-core saving and loading a distributed-optimizer checkpoint
(``torch_dist`` backend, ``dp_reshardable`` optimizer sharding) on CPU, against torch.save /
torch.load of the same tensors per rank in the same run.

Run under the megatron venv (Python 3.12, megatron-core 0.19.2; see fixtures/megatron/README.md):

    fixtures/megatron/_venv/bin/python benchmarks/bench_megatron_save.py --json /tmp/megatron_save.json

Two gloo ranks (TP1/DP2), a GPTModel with megatron's local layer spec, bf16 params with fp32
master params and Adam moments in megatron's DistributedOptimizer, one training step through
megatron's forward/backward schedule so optimizer state exists, then the same save path as
fixtures/megatron/make_megatron_fixtures.py (generate_state_dict + dist_checkpointing.save with
FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy())) and dist_checkpointing.load.
The CUDA-only calls are shimmed to CPU by that script's ``install_cpu_shims``.

Baseline: each rank torch.save's (and fsyncs, as megatron's writer does) a dict holding its own
DP shard of the bf16 parameter buffers plus its fp32 master-param and Adam-moment shards, i.e. the
same bytes megatron writes, then torch.load's it back (weights_only=True).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import sys
import time
import warnings
from functools import partial
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE_DIR = os.path.join(ROOT, "fixtures", "megatron")
SECTION = "Megatron-core dp_reshardable save on CPU"
SEED = 1234
WORLD = 2


def _fixture_module() -> Any:
    if FIXTURE_DIR not in sys.path:
        sys.path.insert(0, FIXTURE_DIR)
    import make_megatron_fixtures

    return make_megatron_fixtures


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def worker(rank: int, port: int, opts: argparse.Namespace) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ.update(WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    import logging

    logging.disable(logging.WARNING)
    import random

    import numpy as np
    import torch
    import torch.distributed as dist

    fx = _fixture_module()
    torch.set_num_threads(opts.threads)
    fx.install_cpu_shims()
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from megatron.core import dist_checkpointing, tensor_parallel
    from megatron.core import parallel_state as mpu

    mpu.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module
    from megatron.core.utils import unwrap_model

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[rank0 {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    t_setup = time.perf_counter()
    config = TransformerConfig(
        num_layers=opts.layers,
        hidden_size=opts.hidden,
        ffn_hidden_size=opts.ffn,
        num_attention_heads=opts.heads,
        use_cpu_initialization=True,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=opts.vocab,
        max_sequence_length=opts.seq,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=True,
        position_embedding_type="learned_absolute",
    )
    n_params = sum(p.numel() for p in model.parameters())
    model = Float16Module(config, model)
    # megatron's default Adam betas (0.9, 0.999), as this benchmark has always used
    (model,), optimizer = fx.build_ddp_and_optimizer(config, [model], betas=(0.9, 0.999))
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=1e-3,
        min_lr=1e-5,
        lr_warmup_steps=0,
        lr_decay_steps=100,
        lr_decay_style="cosine",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=100,
        wd_incr_style="constant",
    )
    log(f"built GPTModel, {n_params / 1e6:.1f} M params, {time.perf_counter() - t_setup:.1f} s")

    # ---- one training step so the Adam moments exist ----
    gen = torch.Generator().manual_seed(SEED + 17 * mpu.get_data_parallel_rank())
    tokens = torch.randint(0, opts.vocab, (1, opts.seq + 1), generator=gen)
    batch = dict(
        tokens=tokens[:, :-1].contiguous(),
        labels=tokens[:, 1:].contiguous(),
        position_ids=torch.arange(opts.seq).unsqueeze(0),
        loss_mask=torch.ones(1, opts.seq),
    )

    def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple:
        loss = torch.sum(output_tensor.float().view(-1) * loss_mask.view(-1))
        num_tokens = loss_mask.sum().clone().detach().to(torch.int)
        return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1).float()])}

    def forward_step(data_iterator: Any, model_chunk: Any) -> tuple:
        b = next(data_iterator)
        out = model_chunk(b["tokens"], b["position_ids"], None, labels=b["labels"])
        return out, partial(loss_func, b["loss_mask"])

    t_step = time.perf_counter()
    model.zero_grad_buffer()
    optimizer.zero_grad()
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([batch]),
        model=[model],
        num_microbatches=1,
        seq_length=opts.seq,
        micro_batch_size=1,
        forward_only=False,
    )
    ok, _, _ = optimizer.step()
    assert ok, "optimizer step skipped"
    scheduler.step(increment=WORLD)
    log(f"training step done, {time.perf_counter() - t_step:.1f} s")

    def timed(fn: Any) -> tuple[float, Any]:
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        dist.barrier()
        return time.perf_counter() - t0, out

    res: dict[str, Any] = {}
    mg_dir = os.path.join(opts.out_dir, "megatron", "iter_0000001")
    tc_dir = os.path.join(opts.out_dir, "torch")
    if rank == 0:
        for d in (mg_dir, tc_dir):
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d)

    # ---- megatron save ----
    metadata = fx.sharded_sd_metadata_for("dp_reshardable")
    args = argparse.Namespace(
        num_layers=opts.layers,
        hidden_size=opts.hidden,
        ffn_hidden_size=opts.ffn,
        num_attention_heads=opts.heads,
        seq_length=opts.seq,
        max_position_embeddings=opts.seq,
        padded_vocab_size=opts.vocab,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        data_parallel_size=WORLD,
        world_size=WORLD,
        use_distributed_optimizer=True,
        ckpt_format="torch_dist",
        dist_ckpt_optim_fully_reshardable=False,
        bf16=True,
        iteration=1,
    )
    res["mg_state_dict_s"], state_dict = timed(
        lambda: fx.generate_state_dict(model, optimizer, scheduler, args, 1, metadata)
    )
    res["mg_save_s"], _ = timed(lambda: fx.torch_dist_save(state_dict, mg_dir, metadata))
    state_dict = None  # drop the references before the baseline
    log(f"megatron save {res['mg_save_s']:.1f} s")

    # ---- torch.save baseline: the same bytes, one file per rank ----
    dp = mpu.get_data_parallel_world_size()
    local: dict[str, torch.Tensor] = {}
    for i, buf in enumerate(model.buffers):
        shard = buf.param_data.numel() // dp
        local[f"model_param_buffer_{i}"] = buf.param_data[rank * shard : (rank + 1) * shard]
    for i, t in enumerate(fx._optimizer_tensors(optimizer)):
        local[f"optim_{i}"] = t.detach()
    # torch.save writes a view's whole storage: copy views so each rank writes only its own bytes.
    for k, t in local.items():
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():
            local[k] = t.clone()
    tc_file = os.path.join(tc_dir, f"rank{rank}.pt")

    def tsave() -> None:
        with open(tc_file, "wb") as f:
            torch.save(local, f)
            f.flush()
            os.fsync(f.fileno())

    res["torch_save_s"], _ = timed(tsave)
    log(f"torch.save {res['torch_save_s']:.1f} s")

    # ---- megatron load ----
    def sharded_for_load() -> dict:
        module = unwrap_model(model)
        sd = {"model": module.sharded_state_dict(metadata=metadata)}
        sd["optimizer"] = optimizer.sharded_state_dict(sd, is_loading=True, metadata=metadata)
        return sd

    res["mg_load_state_dict_s"], sharded = timed(sharded_for_load)
    res["mg_load_s"], loaded = timed(lambda: dist_checkpointing.load(sharded, mg_dir))
    log(f"megatron load {res['mg_load_s']:.1f} s")
    # Spot check: the loaded model tensors equal the live ones.
    live = unwrap_model(model).state_dict()
    checked = 0
    for k, v in loaded["model"].items():
        if isinstance(v, torch.Tensor) and k in live and "_extra_state" not in k:
            assert torch.equal(v, live[k]), f"model tensor {k} differs after load"
            checked += 1
    res["model_tensors_checked"] = checked
    loaded = sharded = live = None

    # ---- torch.load baseline ----
    res["torch_load_s"], back = timed(lambda: torch.load(tc_file, weights_only=True))
    assert all(torch.equal(back[k], v) for k, v in local.items()), "torch.load mismatch"
    del back
    log(f"torch.load {res['torch_load_s']:.1f} s")

    res["local_bytes"] = sum(t.numel() * t.element_size() for t in local.values())
    res["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, res)
    if rank == 0:
        import megatron.core

        out = dict(
            per_rank=everyone,
            n_params=n_params,
            mg_bytes=_dir_bytes(mg_dir),
            torch_bytes=_dir_bytes(tc_dir),
            mg_files=sorted(os.listdir(mg_dir)),
            megatron_core_version=megatron.core.__version__,
            torch_version=torch.__version__,
            python_version=sys.version.split()[0],
        )
        with open(os.path.join(opts.out_dir, "_result.json"), "w") as f:
            json.dump(out, f, indent=1)
    dist.destroy_process_group()


def fmt_table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    return "\n".join([line, sep, *body])


def summarize(r: dict) -> dict:
    pr = r["per_rank"]
    t = {k: pr[0][k] for k in pr[0] if k.endswith("_s")}  # rank 0 wall time between barriers
    mg_gb, tc_gb = r["mg_bytes"] / 1e9, r["torch_bytes"] / 1e9
    return dict(
        n_params=r["n_params"],
        mg_gb=round(mg_gb, 3),
        torch_gb=round(tc_gb, 3),
        mg_save_s=round(t["mg_save_s"], 2),
        mg_save_gbps=round(mg_gb / t["mg_save_s"], 3),
        torch_save_s=round(t["torch_save_s"], 2),
        torch_save_gbps=round(tc_gb / t["torch_save_s"], 3),
        save_ratio=round((mg_gb / t["mg_save_s"]) / (tc_gb / t["torch_save_s"]), 3),
        mg_load_s=round(t["mg_load_s"], 2),
        mg_load_gbps=round(mg_gb / t["mg_load_s"], 3),
        torch_load_s=round(t["torch_load_s"], 2),
        torch_load_gbps=round(tc_gb / t["torch_load_s"], 3),
        load_ratio=round((mg_gb / t["mg_load_s"]) / (tc_gb / t["torch_load_s"]), 3),
        mg_state_dict_s=round(t["mg_state_dict_s"], 2),
        mg_load_state_dict_s=round(t["mg_load_state_dict_s"], 2),
        peak_rss_mib_max_rank=round(max(p["peak_rss_mib"] for p in pr)),
    )


def tables(s: dict) -> str:
    h = ["op", "megatron GB", "megatron s", "megatron GB/s", "torch GB", "torch s", "torch GB/s", "ratio"]
    rows = [
        ["save", s["mg_gb"], s["mg_save_s"], s["mg_save_gbps"], s["torch_gb"], s["torch_save_s"]]
        + [s["torch_save_gbps"], s["save_ratio"]],
        ["load", s["mg_gb"], s["mg_load_s"], s["mg_load_gbps"], s["torch_gb"], s["torch_load_s"]]
        + [s["torch_load_gbps"], s["load_ratio"]],
    ]
    return fmt_table(h, rows)


def write_docs(body: str) -> str:
    path = os.path.join(ROOT, "docs", "performance.md")
    helper = os.path.join(ROOT, "benchmarks", "docs_section.py")
    if os.path.exists(helper):
        sys.path.insert(0, os.path.dirname(helper))
        from docs_section import write_section

        write_section(SECTION, body)
        return f"{path} (via benchmarks/docs_section.py)"
    # Same rule as docs_section.write_section: replace from the "## {title}" line up to the next
    # "## " line, or append at the end.
    lines = (open(path).read() if os.path.exists(path) else "# Performance\n").splitlines(keepends=True)
    head = f"## {SECTION}"
    section = [f"{head}\n", "\n", *(ln + "\n" for ln in body.strip().split("\n")), "\n"]
    start = next((i for i, ln in enumerate(lines) if ln.rstrip("\n") == head), None)
    if start is None:
        while lines and not lines[-1].strip():
            lines.pop()
        lines += ["\n", *section]
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        lines[start:end] = section
    text = "".join(lines).rstrip("\n") + "\n"
    with open(path, "w") as f:
        f.write(text)
    return path


def docs_body(s: dict, r: dict, opts: argparse.Namespace, command: str) -> str:
    load = r.get("loadavg_1min", os.getloadavg()[0])
    same = (
        "the same bytes megatron writes"
        if abs(s["torch_gb"] - s["mg_gb"]) <= 0.01 * s["mg_gb"]
        else "the data megatron writes plus the parameter buffers' alignment padding"
    )
    return f"""Genuine megatron-core {r["megatron_core_version"].split("+")[0]} (PyPI) saving a distributed-optimizer \
checkpoint with `dist_checkpointing.save`, `torch_dist` backend, `dp_reshardable` optimizer sharding, \
`FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy())` (the path of \
`fixtures/megatron/make_megatron_fixtures.py`, CUDA calls shimmed to CPU), and loading it back with \
`dist_checkpointing.load`, against `torch.save` (+ fsync, as megatron's writer does) / \
`torch.load(weights_only=True)` of the same tensors per rank in the same run. 2 gloo ranks, TP1/DP2, \
torch {r["torch_version"]}, Python {r["python_version"]}, {os.cpu_count()} CPU cores ({platform.machine()}), \
{opts.threads} torch thread(s) per rank; files written under /tmp and still in the page cache when read back; \
1-minute load average {load:.1f} at the end (other jobs share the machine).

Model: GPTModel (local layer spec), {opts.layers} layers, hidden {opts.hidden}, ffn {opts.ffn}, \
{opts.heads} heads, vocab {opts.vocab}, seq {opts.seq}, tied embeddings, {s["n_params"] / 1e6:.1f} M params; \
bf16 params, fp32 grads, fp32 master params and Adam moments in megatron's DistributedOptimizer; one training \
step before saving. Checkpoint: {s["mg_gb"]} GB on disk ({s["n_params"] / 1e6:.1f} M x (2 B bf16 weights + \
4 B fp32 master + 8 B Adam moments), unpadded, plus metadata).

```
fixtures/megatron/setup_venv.sh   # once
{command}
```

{tables(s)}

- *GB* is bytes on disk (all ranks' files, 1e9 bytes); *s* is rank 0's wall time between two barriers; \
*ratio* = megatron GB/s / torch GB/s (below 1: megatron is slower than a plain per-rank torch.save/torch.load \
of the same bytes).
- The torch baseline per rank is a dict of that rank's DP half of the bf16 parameter buffer plus its fp32 \
master-param and Adam-moment shards: {s["torch_gb"]} GB in total, {same} (GB/s is computed from each side's \
own bytes).
- Not in the megatron times: building the sharded state dict, {s["mg_state_dict_s"]} s for the save \
(`generate_state_dict`) and {s["mg_load_state_dict_s"]} s for the load (`sharded_state_dict(is_loading=True)`); \
the load time is `dist_checkpointing.load` only, not `optimizer.load_state_dict`. Peak RSS of the larger rank \
{s["peak_rss_mib_max_rank"]} MiB.
- One run of each operation (the training step alone takes minutes here); on this shared, oversubscribed \
machine the same command can differ by up to about 2x between runs, load more than save, so read the ratios \
from one invocation rather than comparing absolute times across runs.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=None, help="default 4 x hidden")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--out-dir", default="/tmp/bench_megatron_save")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint files")
    ap.add_argument("--json", default=None, help="write the numbers here")
    ap.add_argument("--write-docs", action="store_true", help="write the section into docs/performance.md")
    ap.add_argument("--from-json", default=None, help="skip the run; print (and --write-docs) a saved --json file")
    ap.add_argument("--smoke", action="store_true", help="tiny run (tests/benchmarks): 1 layer, hidden 64")
    opts = ap.parse_args()
    if opts.smoke:
        opts.layers, opts.hidden, opts.heads, opts.vocab, opts.seq = 1, 64, 4, 256, 16
    if opts.from_json:
        with open(opts.from_json) as f:
            saved = json.load(f)
        s, r, run_opts = saved["summary"], saved["raw"], argparse.Namespace(**saved["config"])
        print(tables(s))
        if opts.write_docs:
            print(f"wrote section to {write_docs(docs_body(s, r, run_opts, saved['command']))}")
        return
    opts.ffn = opts.ffn or 4 * opts.hidden
    if not os.path.abspath(opts.out_dir).startswith("/tmp/"):
        ap.error("--out-dir must be under /tmp")
    command = "fixtures/megatron/_venv/bin/python " + " ".join(
        [os.path.relpath(os.path.abspath(__file__), ROOT), *sys.argv[1:]]
    )

    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.makedirs(opts.out_dir, exist_ok=True)
    result_file = os.path.join(opts.out_dir, "_result.json")
    if os.path.exists(result_file):
        os.remove(result_file)
    try:
        mp.spawn(worker, args=(port, opts), nprocs=WORLD, join=True)
        with open(result_file) as f:
            r = json.load(f)
    finally:
        if not opts.keep:
            shutil.rmtree(opts.out_dir, ignore_errors=True)
    r["loadavg_1min"] = os.getloadavg()[0]
    s = summarize(r)
    print(
        f"\nGPTModel {opts.layers} layers, hidden {opts.hidden}, ffn {opts.ffn}, vocab {opts.vocab}: "
        f"{s['n_params'] / 1e6:.1f} M params; megatron-core {r['megatron_core_version']}, torch {r['torch_version']}"
    )
    print(tables(s))
    print(f"megatron files: {r['mg_files']}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(dict(summary=s, raw=r, config=vars(opts), command=command), f, indent=1)
        print(f"wrote {opts.json}")
    if opts.write_docs:
        print(f"wrote section to {write_docs(docs_body(s, r, opts, command))}")


if __name__ == "__main__":
    main()
