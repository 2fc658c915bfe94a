"""Fuzz targets for benchmarks/fuzz_readers.py: the ``.idx`` reader and the manifest's
topology and bucket layout sections.

* ``idx``: Megatron ``.idx`` files (the fixtures' three, beside their ``.bin``), byte-mutated,
  through :func:`gtp_runtime.data.indexed.read_index` and, when they read, the sampler
  (:class:`gtp_runtime.data.sampler.GPTSamples`: split, first batch). Accepted refusal:
  :class:`~gtp_runtime.data.indexed.DataError`.
* ``layout``: a fixture's ``gtp_manifest.json`` with its ``topology`` and ``buffers`` mutated
  *structurally* (a field set to 0, -1, 2**31, 10**9, 2**62, a bool, a string; a bucket or a param
  repeated, dropped or grown; a section dropped), half the time byte-mutated too, through
  ``open_checkpoint``, ``verify`` and the per-parameter view of ``inspect --params``.
  Accepted refusal: the format's one-line error.

Structure-aware because byte flips of JSON mostly break its syntax, which the JSON target already
covers; what the layout readers must survive is well-formed JSON with hostile values.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VALUES: list[Any] = [0, 1, -1, 2, 3, 7, 64, 2 ** 31, 10 ** 9, 2 ** 62, 2 ** 64, True, False, None, "x", [], {}, 1.5]


def _mutate_value(doc: Any, rng: random.Random) -> None:
    """Set one scalar somewhere under ``doc`` (a dict or list) to an interesting value."""
    path: list[tuple[Any, Any]] = []
    node = doc
    while isinstance(node, (dict, list)) and node:
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        path.append((node, key))
        node = node[key]
        if rng.random() < 0.25:
            break
    if path:
        parent, key = path[-1]
        parent[key] = rng.choice(VALUES)


def _mutate_layout(doc: dict[str, Any], rng: random.Random) -> None:
    op = rng.randrange(6)
    buffers = doc.get("buffers") or [{}]
    buf = rng.choice(buffers) if isinstance(buffers, list) and buffers else {}
    buckets = buf.get("buckets") if isinstance(buf, dict) else None
    if op == 0:
        _mutate_value(doc.get("topology", doc), rng)
    elif op == 1:
        _mutate_value(buffers, rng)
    elif op == 2 and isinstance(buckets, list) and buckets:
        b = rng.choice(buckets)
        buckets.extend([json.loads(json.dumps(b)) for _ in range(rng.choice([1, 2, 50]))])  # repeated bucket_idx
    elif op == 3 and isinstance(buckets, list) and buckets:
        b = rng.choice(buckets)
        if isinstance(b, dict) and isinstance(b.get("params"), list) and b["params"]:
            p = rng.choice(b["params"])
            b["params"].append(json.loads(json.dumps(p)))  # one param twice (on one slice)
    elif op == 4:
        doc.pop(rng.choice(["topology", "buffers", "model", "optimizer"]), None)
    elif isinstance(doc.get("topology"), dict):
        t = doc["topology"]
        name = rng.choice(["tp", "cp", "gtp_remat", "dp", "expert_gtp_remat"])
        t[name] = rng.choice([2, 4, 1000, 10 ** 6, 10 ** 9])
        t.pop("world_size", None)
        t.pop("expert_dp", None)


def idx_target() -> tuple[list[bytes], Callable[[bytes], None]]:
    from gtp_runtime.data.indexed import read_index
    from gtp_runtime.data.sampler import GPTSamples, split_documents

    fix = REPO / "fixtures/megatron/indexed"
    names = sorted(p.stem for p in fix.glob("*.idx"))
    work = Path(tempfile.mkdtemp(prefix="fuzz-idx-"))
    for n in names:
        shutil.copy(fix / f"{n}.bin", work / f"{n}.bin")
    seeds = [(fix / f"{n}.idx").read_bytes() for n in names]
    lengths = {len(s): n for s, n in zip(seeds, names)}

    def run(data: bytes) -> None:
        name = lengths.get(len(data), names[len(data) % len(names)])
        (work / f"{name}.idx").write_bytes(data)
        ds = read_index(work / name)
        (t0, t1), _ = split_documents(ds.num_documents, (98.0, 2.0))
        if t1 > t0:
            samples = GPTSamples(ds, t0, t1, 4, seed=1)
            samples.batch(0, 2)

    return seeds, run


def layout_target() -> tuple[list[bytes], Callable[[bytes], None]]:
    from gtp_format.check.verify import verify
    from gtp_format.reader.checkpoint import open_checkpoint
    from gtp_format.views.ours import param_views
    from gtp_format.views.records import describe

    src = REPO / "fixtures/gtp/fold_cp2_g2_dp2/iter_0000002"
    work = Path(tempfile.mkdtemp(prefix="fuzz-layout-")) / src.name
    shutil.copytree(src, work)
    genuine = json.loads((src / "gtp_manifest.json").read_text())

    def fresh(rng: random.Random) -> bytes:
        """A structural mutation of the genuine manifest (the fuzz loop takes one for half its inputs)."""
        doc = json.loads(json.dumps(genuine))
        for _ in range(rng.choice([1, 1, 2, 3])):
            _mutate_layout(doc, rng)
        return json.dumps(doc).encode()

    seeds = [fresh(random.Random(i)) for i in range(64)]  # for the byte mutator

    def run(data: bytes) -> None:
        (work / "gtp_manifest.json").write_bytes(data)
        ckpt = open_checkpoint(work)
        verify(ckpt)
        if ckpt.manifest is not None and ckpt.manifest.topology is not None and ckpt.manifest.buffers is not None:
            describe(param_views(ckpt.manifest))

    run.fresh = fresh  # type: ignore[attr-defined]
    return seeds, run


TARGETS = {"idx": idx_target, "layout": layout_target}
