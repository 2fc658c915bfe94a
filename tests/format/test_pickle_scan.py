"""The opcode walk in front of the C unpickler, and the allow-list readers built on it.

The walk must agree with the unpickler on where every opcode starts (else a memo bomb could
hide inside an argument), so it is checked against ``pickletools`` on arbitrary pickles of every
protocol; then each hazard it or the readers guard against gets a crafted file.
"""

from __future__ import annotations

import pickle
import pickletools
import resource
import struct
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gtp_format.errors import FormatError
from gtp_format.reader.checkpoint import open_checkpoint
from gtp_format.reader.pickle_scan import PickleScanError, check_pickle
from gtp_format.reader.safe_pickle import MetadataRecord, load_metadata_pickle

_leaves = (st.none() | st.booleans() | st.integers() | st.integers(min_value=2**60, max_value=2**600)
           | st.floats(allow_nan=False) | st.text(max_size=300) | st.binary(max_size=300))
_values = st.recursive(_leaves, lambda inner: (
    st.lists(inner, max_size=6) | st.tuples(inner, inner) | st.dictionaries(st.text(max_size=8), inner, max_size=6)
    | st.frozensets(st.integers(), max_size=4) | st.sets(st.text(max_size=4), max_size=4)), max_leaves=30)


def _stop_position(data: bytes) -> int:
    return next(pos for op, _, pos in pickletools.genops(data) if op.name == "STOP")


@settings(max_examples=300, deadline=None)
@given(value=_values, protocol=st.integers(min_value=0, max_value=pickle.HIGHEST_PROTOCOL))
def test_walk_agrees_with_pickletools(value, protocol: int):
    data = pickle.dumps([value, value], protocol=protocol)  # twice: memo PUT/GET on every protocol
    assert check_pickle(data) == _stop_position(data)


@settings(max_examples=150, deadline=None)
@given(value=_values, protocol=st.integers(min_value=0, max_value=pickle.HIGHEST_PROTOCOL),
       window=st.integers(min_value=258, max_value=600))
def test_walk_in_small_windows_agrees_with_pickletools(value, protocol: int, window: int):
    """The walk matches in windows (bounded memory on Python 3.10); a window edge inside an opcode changes nothing."""
    import gtp_format.reader.pickle_scan as scan

    data = pickle.dumps([value, value, "y" * 300, b"z" * 250], protocol=protocol)
    saved, scan.WINDOW = scan.WINDOW, window
    try:
        assert check_pickle(data) == _stop_position(data)
    finally:
        scan.WINDOW = saved


def test_large_arguments_of_every_kind():
    # 4- and 8-byte lengths (BINUNICODE, BINBYTES, BINBYTES8 via protocol 5 framing off) and text opcodes
    value = ["x" * 70_000, b"y" * 70_000, bytearray(b"z" * 300), 2**5000, -1.5, {"k": (1, 2, 3)}]
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        data = pickle.dumps(value, protocol=protocol)
        assert check_pickle(data) == _stop_position(data)


@pytest.mark.parametrize(("data", "needle"), [
    (b"\x80\x04Nr" + struct.pack("<I", 2**31) + b".", "memo index 2147483648"),
    (b"Np4000000000\n.", "memo index 4000000000"),
    (b"Np99999999999999999999999\n.", "not a decimal memo index"),
    (b"Np-1\n.", "not a decimal memo index"),
    (b"\x80\x04\xff.", "not a pickle opcode"),
    (b"\x80\x04X\xff\xff\xff\x00abc.", "past the end"),
    (b"\x80\x04\x8e" + struct.pack("<Q", 2**62) + b".", "past the end"),
    (b"\x80\x04N", "without a STOP"),
    (b"\x80\x04cos\nsys", "no newline-terminated argument"),
    (b"\x80\x04Nr\x00\x00", "cut off"),
])
def test_hazards_are_refused_before_unpickling(data: bytes, needle: str):
    with pytest.raises(PickleScanError, match=needle):
        check_pickle(data)


def test_memo_index_inside_an_argument_is_not_an_opcode():
    # 'r' + a huge index inside a string payload is data, not a LONG_BINPUT: accepted
    data = pickle.dumps("r\xff\xff\xff\x7f" * 10, protocol=4)
    assert check_pickle(data) == _stop_position(data)


def _ru_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def test_the_load_path_refuses_a_memo_bomb(tmp_path: Path):
    """``open_checkpoint`` is how ``ckpt`` and ``--load`` both read ``.metadata``."""
    (tmp_path / "__0_0.distcp").write_bytes(b"\0" * 1024)
    (tmp_path / ".metadata").write_bytes(b"\x80\x04Nr" + struct.pack("<I", 2**31) + b".")
    before = _ru_kib()
    with pytest.raises(FormatError, match="memo index"):
        open_checkpoint(tmp_path)
    assert _ru_kib() - before < 64 * 1024


def _s(text: str) -> bytes:
    """SHORT_BINUNICODE."""
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


def _global(module: str, name: str) -> bytes:
    return _s(module) + _s(name) + b"\x93"  # STACK_GLOBAL


_DCP_META = "torch.distributed.checkpoint.metadata"


def test_shared_state_dict_is_not_copied_per_build():
    # One state dict of 200k entries handed to 100k records by BUILD: copied each time, that is
    # 2*10^10 dict insertions; the records adopt it instead.
    n, m = 200_000, 100_000
    big = b"}\x94(" + b"".join((b"J" + struct.pack("<i", i)) * 2 for i in range(n)) + b"u0"  # memo 0, popped
    cls = _global(_DCP_META, "ChunkStorageMetadata") + b"\x94" + b"0"  # memo 1, popped
    builds = b"(" + b"h\x01)\x81h\x00b" * m + b"l"  # NEWOBJ, BUILD with the shared dict, into a list
    data = b"\x80\x04" + big + cls + builds + b"."
    start, before = time.perf_counter(), _ru_kib()
    records = load_metadata_pickle(data, "bomb/.metadata")
    assert len(records) == m and all(vars(r) is vars(records[0]) for r in records)
    assert time.perf_counter() - start < 10
    assert _ru_kib() - before < 256 * 1024


def test_set_copies_are_charged_to_the_file_size():
    # builtins.set(L) 50,000 times on one list of 20,000 ints: 10^9 elements copied unless refused
    lst = b"]\x94(" + b"".join(b"J" + struct.pack("<i", i) for i in range(20_000)) + b"e0"  # memo 0
    calls = b"h\x01h\x00\x85R0" * 50_000
    data = b"\x80\x04" + lst + _global("builtins", "set") + b"\x94" + b"0" + calls + b"N."
    start = time.perf_counter()
    with pytest.raises(FormatError, match="more elements"):
        load_metadata_pickle(data, "sets/.metadata")
    assert time.perf_counter() - start < 10


def test_torch_size_argument_is_bounded():
    dims = b"(" + b"K\x01" * 65 + b"t\x85R."
    with pytest.raises(FormatError, match="torch.Size"):
        load_metadata_pickle(b"\x80\x04" + _global("torch", "Size") + dims, "s/.metadata")


def test_error_messages_stay_short_whatever_the_file_holds():
    # a Metadata whose storage_data key is a 1 MB string: its repr stays a few hundred characters
    huge = b"X" + struct.pack("<I", 1 << 20) + b"k" * (1 << 20)
    state = b"}(" + _s("storage_data") + b"}(" + huge + b"K\x01uu"
    data = b"\x80\x04" + _global(_DCP_META, "Metadata") + b")\x81" + state + b"b."
    md = load_metadata_pickle(data, "m/.metadata")
    assert isinstance(md, MetadataRecord)
    assert len(repr(md)) < 400


def test_migrate_planner_copy_is_bounded_on_shared_lists():
    from ckpt_tool.migrate.metadata import plain_copy

    node: list = []
    for _ in range(100):  # 2**100 paths through 100 shared lists
        node = [node, node]
    start = time.perf_counter()
    with pytest.raises(FormatError, match="shared sub-lists"):
        plain_copy(node, "x/.metadata: planner_data", [100_000])
    assert time.perf_counter() - start < 5
    assert plain_copy({"a": ("a",)}, "ok", [100]) == {"a": ("a",)}



def test_gc_paused_freezes_only_when_asked(monkeypatch: pytest.MonkeyPatch):
    """The CLI sets FREEZE_AFTER_LOAD (its metadata is never garbage); a library caller does not get it by default."""
    import gc
    import subprocess
    import sys

    from gtp_format.reader import unpickler

    code = ("import gtp_format.reader.unpickler as p; a = p.FREEZE_AFTER_LOAD; import ckpt_tool.cli; "
            "print(a, p.FREEZE_AFTER_LOAD)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True"]
    monkeypatch.setattr(unpickler, "FREEZE_AFTER_LOAD", False)
    try:
        # Only gc.freeze() adds to the permanent generation, but objects frozen earlier in this process
        # (an in-process CLI test's metadata) may be freed meanwhile, so the count may drop a little
        # (CI saw 586302 -> 586301): "did not freeze" is "did not grow", "froze" is "grew by ~1000".
        before = gc.get_freeze_count()
        with unpickler.gc_paused():
            kept = [[i] for i in range(1000)]
        assert gc.get_freeze_count() <= before and gc.isenabled()
        monkeypatch.setattr(unpickler, "FREEZE_AFTER_LOAD", True)
        before = gc.get_freeze_count()
        with unpickler.gc_paused():
            kept += [[i] for i in range(1000)]
        assert gc.get_freeze_count() >= before + 900 and gc.isenabled()
    finally:
        gc.unfreeze()
