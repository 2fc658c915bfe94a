"""Nesting depth and container count are bounded before the C unpickler builds anything."""

from __future__ import annotations

import pickle

import pytest

from gtp_format.errors import FormatError
from gtp_format.reader.pickle_scan import PickleScanError
from gtp_format.reader.pickle_shape import MAX_DEPTH, check_shape
from gtp_format.reader.safe_pickle import load_metadata_pickle


def _nested(n: int) -> tuple:
    x: tuple = ()
    for _ in range(n):
        x = (x,)
    return x


@pytest.mark.parametrize("proto", range(6))
def test_genuine_shapes_pass(proto):
    for obj in [_nested(MAX_DEPTH - 2), {_nested(10): 1}, [[[[1]]]], {"a": {"b": [1, (2, 3)]}}, {1, 2},
                frozenset([3]), list(range(1000))]:
        check_shape(pickle.dumps(obj, protocol=proto))


@pytest.mark.parametrize("proto", range(6))
def test_deep_nesting_refused(proto):
    with pytest.raises(PickleScanError, match="nested"):
        check_shape(pickle.dumps({_nested(MAX_DEPTH + 5): 1}, protocol=proto))


def test_deep_tuple_key_is_one_line_error_not_a_segfault():
    # a dict key a million tuples deep: hashing it recursed in C and killed the process
    data = b"\x80\x04}" + b")" + b"\x85" * 10**6 + b"Ns."
    with pytest.raises(FormatError, match="nested"):
        load_metadata_pickle(data, "x/.metadata")


def test_append_chain_depth_refused():
    data = b"\x80\x04" + b"]" * 40 + b"a" * 39 + b"."
    with pytest.raises(PickleScanError):
        check_shape(data, max_containers=10**6)


def test_empty_container_flood_refused():
    with pytest.raises(PickleScanError, match="containers"):
        check_shape(b"\x80\x04" + b"]" * 100_000 + b".")


def test_stack_underflow_is_a_scan_error():
    with pytest.raises(PickleScanError, match="stack"):
        check_shape(b"\x80\x04a.")


def test_fixture_metadata_passes(fixtures_dir=None):
    from pathlib import Path

    files = sorted(Path(__file__).resolve().parents[2].glob("fixtures/*/*/iter_*/.metadata"))
    assert files
    for f in files:
        check_shape(f.read_bytes())


@pytest.mark.parametrize("data", [
    b"\x80\x04ctorch\nfloat32\n}\x8c\x08itemsizeK\x07sb.",  # GLOBAL then BUILD with a dict state
    b"\x80\x04\x8c\x05torch\x8c\x07float32\x93N}\x8c\x08itemsizeK\x07s\x86b.",  # STACK_GLOBAL, slot state
    b"\x80\x04ctorch\nfloat32\n\x94N0h\x00}\x8c\x08itemsizeK\x07sb.",  # a memo copy of the global
    b"\x80\x04ctorch\nSize\n}\x8c\x0c__defaults__K\x07\x85sb.",  # a helper function's defaults
])
def test_build_on_allow_listed_global_refused(data):
    from gtp_format.dtypes import DTYPES

    with pytest.raises(FormatError, match="global"):
        load_metadata_pickle(data, "x/.metadata")
    assert DTYPES["float32"].itemsize == 4


def test_build_on_fresh_instances_still_allowed():
    from gtp_format.reader.safe_pickle import MetadataRecord

    data = (b"\x80\x04ctorch.distributed.checkpoint.metadata\nMetadata\n)\x81}\x8c\x07versionX\x01\x00\x00\x001sb.")
    md = load_metadata_pickle(data, "x/.metadata")
    assert type(md) is MetadataRecord and md.get("version") == "1"


# -- the fast path (runs of same-shaped records) gives the opcode-by-opcode replay's verdict -------

class _Chunk:
    def __init__(self, offsets: tuple, sizes: tuple, note: object = None) -> None:
        self.offsets, self.sizes, self.note = offsets, sizes, note


class _Index:
    def __init__(self, fqn: str, offset: tuple, index: int) -> None:
        self.fqn, self.offset, self.index = fqn, offset, index


class _Info:
    def __init__(self, path: str, offset: int, length: int) -> None:
        self.path, self.offset, self.length = path, offset, length


def _dcp_like(n: int, nested: object = None) -> object:
    """Records in runs as DCP pickles them: chunk lists and an index of alternating key/value records."""
    keys = [f"optimizer.state.{k}" for k in range(3)]
    chunks = {k: [_Chunk((i * 4096,), (4096,), nested if i == n // 2 else None) for i in range(n)] for k in keys}
    index = {_Index(k, (i * 4096,), i): _Info(f"__{i % 4}_0.distcp", i * 70000, 17472) for k in keys for i in range(n)}
    return {"chunks": chunks, "index": index, "shared": [chunks[keys[0]][0]] * 3}


def _verdict(data: bytes, fast: bool) -> object:
    from gtp_format.reader.pickle_shape import _replay

    stack: list[int] = []
    memo: list[int] = []
    try:
        pos, built = _replay(data, 0, len(data), stack, [], memo, 0, 16 + len(data) // 4, MAX_DEPTH, fast, 0)
    except PickleScanError as e:
        return str(e)
    return stack, memo, built, pos


def _same_verdict(data: bytes) -> object:
    from gtp_format.reader.pickle_scan import check_pickle

    check_pickle(data)
    fast, slow = _verdict(data, True), _verdict(data, False)
    assert fast == slow
    return fast


@pytest.mark.parametrize("proto", [2, 3, 4, 5])
@pytest.mark.parametrize("nested", [None, _nested(8), _nested(MAX_DEPTH + 2), [[[]]] * 3])
def test_fast_path_agrees_with_the_replay(proto, nested):
    verdict = _same_verdict(pickle.dumps(_dcp_like(300, nested), protocol=proto))
    assert isinstance(verdict, str) == (nested == _nested(MAX_DEPTH + 2))


def test_fast_path_agrees_on_fixtures_and_container_limits():
    from pathlib import Path

    for f in sorted(Path(__file__).resolve().parents[2].glob("fixtures/*/*/iter_*/.metadata")):
        _same_verdict(f.read_bytes())
    data = pickle.dumps(_dcp_like(400), protocol=4)
    for limit in (100, 1001, 2999, 10**6):  # the count runs over inside a run of records: the same byte is named
        from gtp_format.reader.pickle_shape import _replay

        out = []
        for fast in (True, False):
            try:
                _replay(data, 0, len(data), [], [], [], 0, limit, MAX_DEPTH, fast, 0)
                out.append("ok")
            except PickleScanError as e:
                out.append(str(e))
        assert out[0] == out[1] and ("containers" in out[0]) == (limit < 10**6)


def test_fast_path_agrees_on_mutated_records():
    import random

    from gtp_format.reader.pickle_scan import check_pickle

    base = pickle.dumps(_dcp_like(60), protocol=4)
    rng = random.Random(13)
    tried = 0
    for _ in range(400):
        data = bytearray(base)
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(2, len(data) - 1)] = rng.choice(b"\x94h)\x81}(u b\x85t]aK\x00\x01")
        try:
            check_pickle(bytes(data))
        except PickleScanError:
            continue
        tried += 1
        assert _verdict(bytes(data), True) == _verdict(bytes(data), False)
    assert tried > 50


def test_remembered_runs_agree_with_the_replay():
    """A run replayed by a remembered unit's effect (the next run of the same shape) gives the replay's verdict,
    also where its records copy memo entries of other depths (the same shape, another effect) or run over
    the container limit."""
    from gtp_format.reader import pickle_shape

    shallow, deep = [1], _nested(MAX_DEPTH - 10)
    keys = [f"k{i}" for i in range(30)]  # a shape's expression is compiled after it starts 8 runs
    notes = [shallow, deep] * 9 + [_nested(MAX_DEPTH + 1)] + [deep, shallow] * 5 + [shallow]
    state = {k: [_Chunk((i * 64,), (64,), note) for i in range(20)] for k, note in zip(keys, notes)}
    for proto in (2, 4, 5):
        pickle_shape._COMPILED.forget_runs()
        data = pickle.dumps({"warm": _dcp_like(40), "state": state}, protocol=proto)
        first = _same_verdict(data)
        remembered = bool(pickle_shape._COMPILED.known(MAX_DEPTH))
        assert remembered == (proto >= 4), "no run was remembered"  # 2: BINPUT, no fast path
        assert _same_verdict(data) == first  # now with every shape remembered
        assert isinstance(first, str) and "deep" in first
        ok = pickle.dumps({"warm": _dcp_like(40), "state": {k: v for k, v in state.items() if k != "k18"}},
                          protocol=proto)
        assert not isinstance(_same_verdict(ok), str)
        for limit in (500, 900, 1500, 2500, 4000):
            out = []
            for fast in (True, False):
                try:
                    pickle_shape._replay(ok, 0, len(ok), [], [], [], 0, limit, MAX_DEPTH, fast, 0)
                    out.append("ok")
                except PickleScanError as e:
                    out.append(str(e))
            assert out[0] == out[1]


def test_shape_counts_are_race_free(monkeypatch):
    """Threads that see a shape for its compiling time at once: the count was read, then deleted, by two
    threads, and the second ``del`` raised KeyError, reported as a malformed pickle. The count's dict here
    yields to the other threads after each read (8 threads then read the same count: the old code raised
    KeyError in 7 of them)."""
    import threading
    import time

    from gtp_format.reader import pickle_shape

    class Yielding(dict):
        def get(self, key, default=None):
            value = super().get(key, default)
            time.sleep(0.0005)
            return value

    cache = pickle_shape._Compiled()
    cache._seen = Yielding()
    monkeypatch.setattr(pickle_shape, "_COMPILED", cache)
    errors: list[BaseException] = []
    shapes = [b"K.%d" % i for i in range(20)]
    start = threading.Barrier(8)

    def work() -> None:
        start.wait()
        try:
            for _ in range(pickle_shape._COMPILE_AFTER + 2):
                for s in shapes:
                    pickle_shape._patterns(s)
        except BaseException as e:  # noqa: BLE001  # the failure this test looks for
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    compiled = [pickle_shape._patterns(s) for s in shapes]
    assert all(p is not None for p in compiled)
    assert [p[1].pattern for p in compiled] == shapes  # type: ignore[index]
