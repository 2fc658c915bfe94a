"""Benchmark: ``ckpt inspect --params`` of a large genuine-layout megatron-core ``.metadata`` against plain ``inspect``.

Why: the megatron layout inference scanned every chunk of a stacked key once per
layer, every edge once per chunk and every key once per bucket, so a 10-32 MB ``.metadata`` cost
minutes. This writes (under ``--workdir``, never the repository) a megatron-core GPT local-spec
layout with ``--layers`` stacked layers (each layer its own chunk, as megatron-core stores them)
and one ``dp_reshardable`` bucket whose chunks are one per parameter slice and one per 64-element
alignment gap (the layout :mod:`gtp_format.megatron.view` derives and checks), with sparse data files
just long enough for every byte range. Then, in the same run, each command in a fresh process:

* ``inspect``: ``ckpt inspect PATH --format json`` (the baseline: parse ``.metadata``, classify keys);
* ``inspect --params``: the same plus the per-parameter view.

The figure is the ratio of the two wall times (``--params`` / plain), best of ``--repeats``.

    python benchmarks/bench_megatron_inspect.py --layers 4000
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gtp_format.dtypes import DTYPES  # noqa: E402
from gtp_format.megatron.buckets import PARAM_ALIGN  # noqa: E402
from gtp_format.megatron.keys import HEAD, LAYER  # noqa: E402
from gtp_format.names import optimizer_key  # noqa: E402
from gtp_format.writer.dcp_metadata import metadata_bytes  # noqa: E402


def shapes_of(layers: int, h: int, f: int, vocab: int, seq: int) -> dict[str, tuple[int, ...]]:
    per_layer = {"self_attention.linear_qkv.layer_norm_weight": (h,), "self_attention.linear_qkv.layer_norm_bias": (h,),
                 "self_attention.linear_proj.weight": (h, h), "self_attention.linear_proj.bias": (h,),
                 "self_attention.linear_qkv.weight": (3 * h, h), "self_attention.linear_qkv.bias": (3 * h,),
                 "mlp.linear_fc1.layer_norm_weight": (h,), "mlp.linear_fc1.layer_norm_bias": (h,),
                 "mlp.linear_fc1.weight": (f, h), "mlp.linear_fc1.bias": (f,),
                 "mlp.linear_fc2.weight": (h, f), "mlp.linear_fc2.bias": (h,)}
    out = {HEAD[0]: (vocab, h), HEAD[1]: (seq, h)}
    out.update({f"decoder.layers.{k}": (layers, *s) for k, s in per_layer.items()})
    out.update({"decoder.final_layernorm.weight": (h,), "decoder.final_layernorm.bias": (h,)})
    return out


def generate(folder: Path, layers: int, h: int = 8, f: int = 16, declared: int | None = None) -> dict[str, int]:
    """Write the ``.metadata`` and sparse data files; return key, chunk and byte counts.

    ``declared`` (tests): the layer count the stacked keys' shapes declare, when it is not the
    number of layers stored.
    """
    shapes = shapes_of(declared or layers, h, f, 128, 32)
    order: list[tuple[str, int | None]] = [(k, None) for k in HEAD]
    order += [(f"decoder.layers.{k}", i) for i in range(layers) for _, k in LAYER
              if f"decoder.layers.{k}" in shapes]  # dense layers: no router
    order += [("decoder.final_layernorm.weight", None), ("decoder.final_layernorm.bias", None)]
    placed: list[tuple[str, str, tuple[int, ...], tuple[int, ...], int, int]] = []
    end = 0

    def put(key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], nbytes: int) -> None:
        nonlocal end
        placed.append(("__0_0.distcp", key, offsets, sizes, end, nbytes + 1088))
        end += nbytes + 1088

    for key, layer in order:
        full = shapes[key] if layer is None else shapes[key][1:]
        n = 1
        for d in full:
            n *= d
        if layer is None:
            put(key, (0,) * len(full), full, 2 * n)
        else:
            put(key, (layer, *(0,) * len(full)), (1, *full), 2 * n)
    slices, pos = [], 0
    for key, _ in reversed(order):
        full = shapes[key][1:] if key.startswith("decoder.layers.") else shapes[key]
        n = 1
        for d in full:
            n *= d
        start = -(-pos // PARAM_ALIGN) * PARAM_ALIGN
        if start > pos:
            slices.append((pos, start))
        slices.append((start, start + n))
        pos = start + n
    dtag = "(torch.bfloat16, torch.float32)"
    typed = {k: (s, DTYPES["bfloat16"]) for k, s in shapes.items()}
    for state in ("param", "exp_avg", "exp_avg_sq"):
        key = optimizer_key(0, 0, dtag, 0, state, None)
        typed[key] = ((pos,), DTYPES["float32"])
        for a, z in slices:
            put(key, (a,), (z - a,), 4 * (z - a))
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(metadata_bytes(typed, placed))
    with open(folder / "__0_0.distcp", "wb") as fh:
        fh.truncate(end)  # sparse: in bounds, no disk
    return {"keys": len(typed), "chunks": len(placed), "metadata_bytes": (folder / ".metadata").stat().st_size}


def timed(cmd: list[str], repeats: int) -> float:
    best = float("inf")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for _ in range(repeats):
        t = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        best = min(best, time.perf_counter() - t)
        if r.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed: {r.stderr.strip()[-500:]}")
    return best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--workdir", default="/tmp/bench_megatron_inspect")
    ap.add_argument("--smoke", action="store_true", help="tiny run: 20 layers")
    args = ap.parse_args(argv)
    layers = 20 if args.smoke else args.layers
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    folder = work / "iter_0000001"
    info = generate(folder, layers)
    cli = [sys.executable, "-c", "from ckpt_tool.cli import main; main()", "inspect", str(folder), "--format", "json"]
    plain = timed(cli, args.repeats)
    params = timed([*cli, "--params"], args.repeats)
    print(f"layers {layers}: {info['keys']} keys, {info['chunks']} chunks, .metadata "
          f"{info['metadata_bytes'] / 2**20:.1f} MiB")
    print(f"inspect {plain:.2f} s, inspect --params {params:.2f} s, ratio {params / plain:.2f}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
