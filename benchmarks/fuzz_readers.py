"""Time-boxed mutation fuzzer for the readers of untrusted input (not part of CI).

    python benchmarks/fuzz_readers.py --seconds 120 [--seed 1] [--out fuzz-findings]
    python benchmarks/fuzz_readers.py --smoke --out /tmp/fuzz   # 10 inputs per target (tests/benchmarks)

Targets, each fed mutations (bit flips, byte overwrites with interesting values, insertions,
deletions, truncation, splices of the input with itself) of genuine inputs from the fixtures:

* ``pickle``: ``.metadata`` files through the allow-list unpickler (opcode walk, shape replay,
  C unpickler) into the DCP reader's entries;
* ``zip``: ``torch.save`` blobs of single chunks through the zip-structure parser and the
  tensor decoder (``parse_blob`` + ``decode_elements``);
* ``safetensors``: whole safetensors checkpoint folders (header length, JSON header, index);
* ``json``: manifests through ``safe_json`` and the typed manifest parser;
* ``idx`` and ``layout`` (benchmarks/fuzz_targets.py): Megatron ``.idx`` files through the data
  reader and sampler, and manifests with hostile topology and bucket-layout values through
  ``open_checkpoint``, ``verify`` and the per-parameter view.

The contract checked: a reader either succeeds or raises the format's one-line error
(``FormatError``/``BlobError``; the data reader's ``DataError``); anything else (another
exception, a message with a newline, an input that takes over ``--slow`` seconds) is a finding,
written to ``--out`` with the target, the exception and the input bytes. Every finding so far is a regression test in
tests/format/test_fuzz_regressions.py. The last input tried is kept in ``--out/last-*`` so a hard
crash (a segfault ends the process) can be replayed.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))  # fuzz_targets, also when this file is imported as a module

import fuzz_targets  # noqa: E402

from gtp_format.errors import FormatError  # noqa: E402
from gtp_format.reader.zip_blob import BlobError  # noqa: E402
from gtp_runtime.data.indexed import DataError  # noqa: E402

INTERESTING = [0, 1, 0x7F, 0x80, 0xFF, ord("("), ord("]"), ord("}"), ord("b"), ord("\\"), ord('"'), ord("["), ord("{")]


def mutate(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rng.choice([1, 1, 2, 4, 8])):
        if not b:
            b.append(rng.randrange(256))
        op = rng.randrange(7)
        i = rng.randrange(len(b))
        if op == 0:
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1:
            b[i] = rng.choice(INTERESTING)
        elif op == 2:
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
        elif op == 3:
            del b[i:i + rng.randrange(1, 17)]
        elif op == 4:
            del b[i:]
        elif op == 5:
            j = rng.randrange(len(b))
            b[i:i] = b[j:j + rng.randrange(1, 64)]
        else:
            b[i:i + 4] = rng.randrange(1 << 32).to_bytes(4, "little")
    return bytes(b)


def pickle_target() -> tuple[list[bytes], Callable[[bytes], None]]:
    from gtp_format.reader.dcp_reader import metadata_entries
    from gtp_format.reader.safe_pickle import load_metadata_pickle

    seeds = [p.read_bytes() for p in sorted(REPO.glob("fixtures/*/*/iter_*/.metadata"))]

    def run(data: bytes) -> None:
        metadata_entries(Path("fuzz/.metadata"), data, load_metadata_pickle(data, "fuzz/.metadata"))

    return seeds, run


def zip_target() -> tuple[list[bytes], Callable[[bytes], None]]:
    from gtp_format.model import TENSOR
    from gtp_format.reader.blob import check_payload_crc, element_view, parse_blob
    from gtp_format.reader.checkpoint import open_checkpoint
    from gtp_format.reader.chunks import chunk_bytes
    from gtp_format.reader.zip_blob import ViewReader

    seeds = []
    for folder in sorted(p.parent for p in REPO.glob("fixtures/*/*/iter_*/.metadata"))[:3]:
        ckpt = open_checkpoint(folder)
        for e in list(ckpt.entries.values())[:8]:
            if e.kind == TENSOR:
                seeds.append(bytes(chunk_bytes(ckpt, e, e.chunks[0])))

    def run(data: bytes) -> None:
        view = memoryview(data)
        layout = parse_blob(ViewReader(view))
        payload = view[layout.payload_offset:layout.payload_offset + layout.payload_bytes]
        check_payload_crc(layout, payload)
        element_view(layout, payload)

    return seeds, run


def safetensors_target() -> tuple[list[bytes], Callable[[bytes], None]]:
    from gtp_format.check.verify import verify
    from gtp_format.reader.checkpoint import open_checkpoint

    src = REPO / "fixtures/compat/bf16_cp2_g2_fold_st/iter_0000002"
    work = Path(tempfile.mkdtemp(prefix="fuzz-st-")) / src.name
    shutil.copytree(src, work)
    name = "__1_0.safetensors"
    seeds = [(src / name).read_bytes()[:4096]]  # the header and the start of the data
    tail = (src / name).read_bytes()[4096:]

    def run(data: bytes) -> None:
        (work / name).write_bytes(data + tail)
        verify(open_checkpoint(work))

    return seeds, run


def json_target() -> tuple[list[bytes], Callable[[bytes], None]]:
    from gtp_format import safe_json
    from gtp_format.manifest import parse_manifest

    seeds = [p.read_bytes() for p in sorted(REPO.glob("fixtures/*/*/iter_*/gtp_manifest.json"))[:3]]
    seeds += [p.read_bytes()[:20000] for p in sorted(REPO.glob("fixtures/*/*/iter_*/index.json"))]

    def run(data: bytes) -> None:
        obj = safe_json.loads(data, "fuzz.json", "fix it")
        if isinstance(obj, dict) and "format" in obj:
            parse_manifest(obj, "fuzz.json", strict=False)
            parse_manifest(obj, "fuzz.json", strict=True)

    return seeds, run


TARGETS = {"pickle": pickle_target, "zip": zip_target, "safetensors": safetensors_target, "json": json_target,
           **fuzz_targets.TARGETS}


def fuzz(name: str, seconds: float, rng: random.Random, out: Path, slow: float,
         max_runs: int | None = None) -> dict[str, int]:
    seeds, run = TARGETS[name]()
    stats = {"runs": 0, "ok": 0, "refused": 0, "findings": 0}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and (max_runs is None or stats["runs"] < max_runs):
        fresh = getattr(run, "fresh", None)  # a structure-aware target makes half its inputs itself
        data = fresh(rng) if fresh is not None and rng.random() < 0.5 else mutate(rng.choice(seeds), rng)
        (out / f"last-{name}").write_bytes(data)
        t0 = time.monotonic()
        finding = None
        try:
            run(data)
            stats["ok"] += 1
        except (FormatError, BlobError, DataError) as e:
            stats["refused"] += 1
            message = e.message if isinstance(e, FormatError) else str(e)
            if "\n" in message:
                finding = f"multi-line message: {message[:300]!r}"
        except Exception as e:  # noqa: BLE001 - this is what we look for
            finding = f"{type(e).__name__}: {str(e)[:300]}\n{traceback.format_exc()[-2000:]}"
        if time.monotonic() - t0 > slow:
            finding = (finding or "") + f" slow: {time.monotonic() - t0:.1f} s"
        stats["runs"] += 1
        if finding:
            stats["findings"] += 1
            n = stats["findings"]
            (out / f"{name}-{n}.bin").write_bytes(data)
            (out / f"{name}-{n}.txt").write_text(finding)
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="total time, split over the targets")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--slow", type=float, default=5.0, help="seconds after which one input is a finding")
    ap.add_argument("--out", default="fuzz-findings")
    ap.add_argument("--runs", type=int, default=None, help="at most this many inputs per target")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny run (tests/benchmarks): 10 inputs per target, whatever the time, none slow")
    args = ap.parse_args()
    if args.smoke:
        args.seconds, args.slow, args.runs = float("inf"), 600.0, 10
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    names = args.targets.split(",")
    report = {n: fuzz(n, args.seconds / len(names), rng, out, args.slow, args.runs) for n in names}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
