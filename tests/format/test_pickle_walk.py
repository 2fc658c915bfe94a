"""The compiled pre-walk accepts only what both Python walks accept (check_pickle, check_shape)."""

from __future__ import annotations

import pickle
import random
import sys
from pathlib import Path

import numpy as np
import pytest

from gtp_format.reader import pickle_walk
from gtp_format.reader.pickle_scan import PickleScanError, check_pickle
from gtp_format.reader.pickle_shape import MAX_DEPTH, check_shape

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hostile"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from hostile_pickles import build_pickles  # noqa: E402
from test_pickle_shape import _dcp_like, _nested  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _walks_accept(data: bytes) -> bool:
    try:
        check_pickle(data)
        check_shape(data)
    except PickleScanError:
        return False
    return True


def _compiled(data: bytes, max_depth: int = MAX_DEPTH) -> bool:
    walk = pickle_walk._compiled()
    assert walk is not None, "numba is a dependency"
    return bool(walk(np.frombuffer(data, np.uint8), pickle_walk._ARG, pickle_walk._ACT, max_depth,
                     16 + len(data) // 4))


def _python(data: bytes) -> bool:
    return bool(pickle_walk.walk(np.frombuffer(data, np.uint8), pickle_walk._ARG, pickle_walk._ACT, MAX_DEPTH,
                                 16 + len(data) // 4))


def _corpus() -> dict[str, bytes]:
    out = {name: raw for name, (_, raw) in build_pickles("canary").items()}
    for proto in (2, 3, 4, 5):
        for nested in (None, _nested(8), _nested(MAX_DEPTH + 2), [[[]]] * 3):
            out[f"dcp-like p{proto} {nested!r:.20}"] = pickle.dumps(_dcp_like(50, nested), protocol=proto)
    for f in sorted(ROOT.glob("fixtures/*/*/iter_*/.metadata")):
        out[str(f.relative_to(ROOT))] = f.read_bytes()
    out.update({"empty list bomb": b"\x80\x04" + b"]" * 5000 + b".", "append on empty": b"\x80\x04a.",
                "deep tuple": b"\x80\x04)" + b"\x85" * 100 + b".", "no stop": b"\x80\x04N",
                "memo bomb": b"\x80\x04Nr\xff\xff\xff\x7f.", "long4 negative": b"\x80\x04\x8b\xff\xff\xff\xff.",
                "setitem on a global": b"\x80\x04\x8c\x01m\x8c\x01n\x93}\x94K\x01K\x02s.",
                "build on a global": b"\x80\x04\x8c\x01m\x8c\x01n\x93}b."})
    return out


@pytest.mark.parametrize("run", [_compiled, _python], ids=["numba", "python"])
def test_accepts_only_what_both_walks_accept(run) -> None:
    corpus = _corpus()
    for name, data in corpus.items():
        if run(data):
            assert _walks_accept(data), name
    for proto in (4, 5):  # genuine DCP-like pickles (no text opcodes) are taken in the compiled pass
        assert run(pickle.dumps(_dcp_like(50), protocol=proto))


def test_mutated_pickles() -> None:
    rng = random.Random(41)
    base = [pickle.dumps(_dcp_like(40), protocol=p) for p in (2, 4, 5)]
    taken = 0
    for _ in range(3000):
        data = bytearray(rng.choice(base))
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(2, len(data) - 1)] = rng.choice(b"\x94h)\x81}(u b\x85\x86t]aeK\x00\x01\x02q\x93.r\x8b")
        data = bytes(data)
        got = _compiled(data)
        assert not got or _walks_accept(data), data
        taken += got
    assert taken > 100


def test_depth_and_container_limits() -> None:
    for depth in (MAX_DEPTH - 1, MAX_DEPTH, MAX_DEPTH + 1):
        data = pickle.dumps(_nested(depth), protocol=4)
        assert _compiled(data) == _walks_accept(data)
    data = pickle.dumps([[]] * 10 + [[] for _ in range(5000)], protocol=4)
    assert _compiled(data) == _walks_accept(data)
    walk = pickle_walk._compiled()
    tight = np.frombuffer(data, np.uint8)
    assert not walk(tight, pickle_walk._ARG, pickle_walk._ACT, MAX_DEPTH, 100)  # over a container limit


def test_small_pickles_are_left_to_the_walks(monkeypatch: pytest.MonkeyPatch) -> None:
    data = pickle.dumps(_dcp_like(10), protocol=4)
    assert not pickle_walk.passes(data)  # under MIN_BYTES: numba is not even imported for it
    monkeypatch.setattr(pickle_walk, "MIN_BYTES", 0)
    assert pickle_walk.passes(data)
    assert not pickle_walk.passes(data, max_depth=200)


def test_private_numba_cache_dir_is_this_users_alone(tmp_path, monkeypatch):
    """Where numba can write no cache of its own, the loop is cached in a folder only this user may write:
    numba's cache files are pickles, so a folder another user could write is never used."""
    import os
    import tempfile

    from gtp_format.reader import jit

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    folder = jit.private_cache_dir()
    assert folder == tmp_path / f"gtp-ckpt-numba-{os.getuid()}" and folder.is_dir()
    assert folder.stat().st_mode & 0o777 == 0o700
    folder.chmod(0o777)
    assert jit.private_cache_dir() is None
    folder.rmdir()
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    folder.symlink_to(tmp_path / "elsewhere")
    assert jit.private_cache_dir() is None


def test_compiled_loop_cached_where_numba_finds_no_folder(tmp_path, monkeypatch):
    """``njit(cache=True)`` raising (no writable folder beside the source or in the home) falls back to the
    private folder, and the loop is cached there."""
    pytest.importorskip("numba")
    import tempfile

    import numba

    from gtp_format.reader import jit

    calls = []
    real = numba.njit

    def njit(**options):
        calls.append(dict(options))
        if options.get("cache") and not numba.config.CACHE_DIR:
            raise RuntimeError("cannot cache function: no locator available")
        return real(**options)

    monkeypatch.setattr(numba, "njit", njit)
    monkeypatch.setattr(numba.config, "CACHE_DIR", "")
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))

    def add(a, b):
        return a + b

    fn = jit.njit_cached(add, nogil=True)
    assert fn(2, 3) == 5
    assert [c["cache"] for c in calls] == [True, True]
    assert any(p.suffix == ".nbi" for p in tmp_path.rglob("*")), "nothing was cached in the private folder"
