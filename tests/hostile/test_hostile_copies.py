"""The copies against crafted sources (issue 22 class 6, class 4's ``--to torch``, class 13's full disk).

Every copy command (``reshard``; ``export --to hf``, ``hf --optimizer``, ``fully_reshardable``,
``torch``) on every input of :mod:`copies_corpus`, in forked children (:mod:`runner`): exit 1 or 2,
one line naming what is wrong, no traceback, peak RSS under 512 MB, bounded time, no outside open,
the source unchanged (the checks of :mod:`test_hostile`), and nothing at DST, not even a hidden
work folder beside it.
"""

from __future__ import annotations

import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gtp_format.check.integrity import readable_bytes
from gtp_format.reader.checkpoint import open_checkpoint
from gtp_format.reader.storage import stored_bytes

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from copies_corpus import SPECS, build_copies  # noqa: E402
from test_hostile import CKPT_TIMEOUT_S, _check, _run_batch  # noqa: E402

REPO = HERE.parents[1]
COMMANDS = 5  # reshard + the four export targets


@pytest.fixture(scope="module")
def copies(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    root = tmp_path_factory.mktemp("hostile-copies")
    dst_root = tmp_path_factory.mktemp("hostile-copies-dst")  # outside the corpus: writing there is allowed
    cases = build_copies(root, dst_root)
    results = _run_batch("ckpt", root, cases, lambda c: c.commands, CKPT_TIMEOUT_S)
    results["_canary"] = False  # no crafted pickle here: the metadata is DCP's own, rewritten
    return results, {c.name: c for c in cases}


@pytest.mark.parametrize("job", [f"{name}-{i}" for name, _, _, _ in SPECS for i in range(COMMANDS)])
def test_copy_refuses(copies: tuple[dict, dict], job: str) -> None:
    results, cases = copies
    r = results[job]
    _check(r, "ckpt: error: ", CKPT_TIMEOUT_S, False)
    case = cases[job.rsplit("-", 1)[0]]
    dst = Path(case.notes["dst"])
    assert list(dst.iterdir()) == [], f"{r['argv']}: left {sorted(p.name for p in dst.iterdir())} at DST"
    for word in filter(None, case.notes["words"].split("|")):  # reshard reads megatron-core sources too now
        assert word.lower() in r["stderr"].lower(), f"{r['argv']}: {word!r} not in {r['stderr']}"


def _full_disk() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))


def test_torch_export_on_a_full_disk_names_dst_and_cause(tmp_path: Path) -> None:
    """Class 13: torch.save's failed write was "unexpected RuntimeError ... please report this"."""
    src = REPO / "fixtures/gtp/fold_cp2_g2_dp2"
    dst = tmp_path / "out" / "model.pt"
    dst.parent.mkdir()
    r = subprocess.run([sys.executable, "-m", "ckpt_tool.cli", "export", str(src), str(dst), "--to", "torch"],
                       capture_output=True, text=True, preexec_fn=_full_disk, timeout=300, cwd=REPO)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert str(dst) in lines[0] and "File too large" in lines[0] and "unexpected" not in lines[0], lines[0]
    assert list(dst.parent.iterdir()) == []


def _punch_payloads(it: Path) -> None:
    """Punch a hole (``fallocate(PUNCH_HOLE | KEEP_SIZE)``) over every whole page of each tensor's elements."""
    import ctypes
    import os

    from gtp_format.model import TENSOR
    from gtp_format.reader.blob import parse_blob
    from gtp_format.reader.chunks import chunk_bytes
    from gtp_format.reader.zip_blob import ViewReader

    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    ckpt = open_checkpoint(it)
    for e in ckpt.entries.values():
        for c in e.chunks if e.kind == TENSOR else ():
            layout = parse_blob(ViewReader(memoryview(bytes(chunk_bytes(ckpt, e, c)))))
            lo = c.storage.offset + layout.payload_offset
            a, b = -(-lo // 4096) * 4096, (lo + layout.payload_bytes) // 4096 * 4096
            if b > a:
                fd = os.open(it / c.storage.file, os.O_RDWR)
                try:
                    if libc.fallocate(fd, 3, a, b - a) != 0:
                        pytest.skip(f"this file system cannot punch holes (errno {ctypes.get_errno()})")
                finally:
                    os.close(fd)


def test_torch_export_of_punched_payloads_is_refused(tmp_path: Path) -> None:
    """Holes where data was are not trusted as zeros: the copy's hashes (the zip CRC-32 of each record)
    refuse them, whether or not the file is sparse enough for the read budget to refuse it first."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_reshard import make_source, parse_args

    make_source(tmp_path / "run", 1, parse_args(["--hidden", "256", "--ffn", "512", "--vocab", "2048"]))
    it = next((tmp_path / "run").glob("iter_*"))  # a 4 MB checkpoint whose chunks span whole pages
    files = list(it.glob("*.distcp"))
    full = sum(p.stat().st_size for p in files)
    assert readable_bytes(open_checkpoint(it)) == full
    _punch_payloads(it)  # zip structure intact (verify's gate passes), the elements' pages hold nothing
    assert sum(stored_bytes(p.stat()) for p in files) < full // 2
    from ckpt_tool.export.engine import export
    from gtp_format.errors import FormatError

    with pytest.raises(FormatError, match="damaged|store only|sparse") as info:
        export(it, tmp_path / "m.pt", "torch")
    assert "\n" not in str(info.value)
    assert not (tmp_path / "m.pt").exists()
