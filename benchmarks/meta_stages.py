"""Where opening a large DCP ``.metadata`` spends its time and memory, one stage at a time (one process).

    python benchmarks/meta_stages.py DIR   # DIR holds .metadata (bench_cli_scale.py --make meta DIR)
    python benchmarks/meta_stages.py --smoke --workdir W   # a 2,000-chunk one made in W (seconds)

Stages, each timed in CPU seconds (``time.process_time``) with the process's resident memory after it:
reading the file; the columns scan and the model built from it (what ``ckpt`` runs on large files, with the
peak memory after it); then the old way, for comparison: the two Python pre-walks (``check_pickle``,
``check_shape``) and the compiled one that stands in for them on large files (``pickle_walk.passes``:
numba's import and cached code first, then the pass); the C unpickle into inert records; the model
(``_entries``); and ``verify``'s checks on the model.
Printed as JSON.
"""

from __future__ import annotations

import gc
import json
import resource
import sys
import time
from pathlib import Path


def _rss_mib() -> float:
    return round(int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / 2**20, 1)


def main() -> int:
    args = sys.argv[1:]
    if args[:1] == ["--smoke"]:  # a small .metadata of its own (under the compiled walk's threshold)
        from types import SimpleNamespace

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_inspect import generate

        folder = Path(args[args.index("--workdir") + 1] if "--workdir" in args else "/tmp/meta_stages_smoke")
        generate(folder, 2000, SimpleNamespace(chunks_per_key=100, chunk_numel=4096, files=4))
    else:
        folder = Path(args[0])
    out: dict[str, object] = {}
    t = time.process_time()

    def stage(name: str) -> None:
        nonlocal t
        now = time.process_time()
        out[name] = {"cpu_s": round(now - t, 3), "rss_mib": _rss_mib()}
        t = time.process_time()

    from gtp_format.reader import unpickler

    unpickler.FREEZE_AFTER_LOAD = True
    from gtp_format.check import verify as checks
    from gtp_format.reader import dcp_reader, pickle_walk
    from gtp_format.reader.pickle_scan import check_pickle
    from gtp_format.reader.pickle_shape import check_shape
    from gtp_format.reader.safe_pickle import load_metadata_pickle
    stage("imports")
    raw = (folder / ".metadata").read_bytes()
    stage("read")
    from gtp_format.reader import dcp_columns, dcp_scan

    dcp_scan.scan(b"")  # numba's import and the cached loop (compiled here where no cache is found)
    stage("numba import, cached scan code")
    cols = dcp_scan.scan(raw)
    out["columns scan gave up at"] = cols if isinstance(cols, int) else None
    stage("columns scan (compiled)")
    del cols
    got = dcp_columns.columns_model(folder / ".metadata", raw)
    stage("columns model (scan again, names, join, entries)")
    out["peak_rss_mib_after_columns"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    del got
    check_pickle(raw)
    stage("check_pickle (Python)")
    check_shape(raw)
    stage("check_shape (Python)")
    pickle_walk._compiled()
    stage("numba import, cached code")
    out["compiled walk passes"] = pickle_walk.passes(raw)
    stage("compiled walk (both checks)")
    gc.disable()
    md = load_metadata_pickle(raw, str(folder / ".metadata"))  # runs the compiled walk again (or the Python ones)
    stage("walk again + C unpickle")
    size = len(raw)
    del raw
    entries, notes, _ = dcp_reader.metadata_entries(folder / ".metadata", size, md)
    stage("model (_entries)")
    del md
    stage("records freed")
    from gtp_format.reader.checkpoint import open_checkpoint

    ckpt = open_checkpoint(folder)
    stage("open_checkpoint (all of the above)")
    checks.verify(ckpt)
    stage("verify's checks on the model")
    out["chunks"] = ckpt.chunk_count()
    out["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
