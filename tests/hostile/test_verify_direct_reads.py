"""``verify --data`` reading cold windows (``gtp_format/check/data_read.py``): through the cache, asked for ahead
(the default), or with ``O_DIRECT`` (``CKPT_VERIFY_DIRECT=1``).

With ``O_DIRECT``, a window the page cache lacks is read from the disk on a second descriptor of the file; a
warm one is copied from the cache. The fixtures are small and warm, so here the windows are made small, the
threshold lowered and the cache made to answer "not resident": every window then takes the direct
path. What must hold there: the same report as through the cache (every check, every digest), damage
found the same way, a file that shrinks under the pass one ``data_file`` error, a file system that
refuses the read falling back to the cache, and any other read error raised after every read ended.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import shutil
from pathlib import Path

import pytest
from damage import truncate_once_planned

import gtp_format.check.data_read as data_read
from gtp_format.check import data as data_check
from gtp_format.check.verify import verify
from gtp_format.reader.checkpoint import open_checkpoint
from gtp_format.reader.preads import PageCache, reopen_direct

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "gtp" / "fold_cp2_g2_dp2" / "iter_0000002"


def _takes_direct(folder: Path) -> bool:
    probe = folder / "direct_probe"
    probe.write_bytes(b"x" * 8192)
    try:
        fd = os.open(probe, os.O_RDONLY)
        direct = reopen_direct(fd)
        os.close(fd)
        if direct is None:
            return False
        try:
            os.preadv(direct, [mmap.mmap(-1, 4096)], 0)  # a page-aligned buffer
            return True
        except OSError:
            return False
        finally:
            os.close(direct)
    finally:
        probe.unlink()


@pytest.fixture
def cold(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[int]:
    """Every window of 64 KiB or less read with O_DIRECT; the lengths of the direct reads taken."""
    if not _takes_direct(tmp_path):
        pytest.skip("this file system refuses O_DIRECT: verify reads through the cache")
    monkeypatch.setenv(data_read.DIRECT_ENV, "1")
    monkeypatch.setattr(data_check, "WINDOW", 64 << 10)
    monkeypatch.setattr(data_read, "DIRECT_MIN", 4096)
    monkeypatch.setattr(PageCache, "resident", lambda self, start, stop: False)
    taken: list[int] = []
    real = data_read.WindowReads._direct

    def spy(self, view, start, stop, **kw):  # noqa: ANN001, ANN003, ANN202
        out = real(self, view, start, stop, **kw)
        if out is not None:
            taken.append(len(out))
        return out

    monkeypatch.setattr(data_read.WindowReads, "_direct", spy)
    return taken


def _copy(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    return run


def _report(run: Path, workers: int = 3) -> tuple[list[dict], dict, bool]:
    res = verify(open_checkpoint(run), data=True, workers=workers)
    return [p.to_dict() for p in res.problems], res.stats, res.ok


class _OpenDirect(set):
    """Descriptor numbers reopened with ``O_DIRECT``; ``fd in`` also asks the descriptor for the flag now, since a
    number closed by one worker is reused by another's buffered open (a cache read refused as a direct one made
    ``test_a_refused_span_read_falls_back_to_the_cache`` fail now and then)."""

    def __contains__(self, fd: object) -> bool:
        if not super().__contains__(fd):
            return False
        try:
            return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
        except OSError:
            return False


def direct_descriptors(monkeypatch: pytest.MonkeyPatch) -> set[int]:
    """The descriptors the data check reopens with ``O_DIRECT`` from now on (filled as it opens them)."""
    fds: set[int] = _OpenDirect()
    real_reopen = data_read.reopen_direct

    def reopen(fd):  # noqa: ANN001, ANN202
        out = real_reopen(fd)
        if out is not None:
            fds.add(out)
        return out

    monkeypatch.setattr(data_read, "reopen_direct", reopen)
    return fds


def test_direct_windows_give_the_report_of_the_cache(tmp_path: Path, cold: list[int],
                                                      monkeypatch: pytest.MonkeyPatch):
    run = _copy(tmp_path)
    direct = _report(run)
    assert cold and sum(cold) == direct[1]["bytes_read"], "every window was read from the disk"
    monkeypatch.setattr(data_read, "DIRECT_MIN", 1 << 62)
    assert _report(run) == direct and direct[2]


def test_damage_is_found_the_same_on_the_direct_path(tmp_path: Path, cold: list[int],
                                                      monkeypatch: pytest.MonkeyPatch):
    run = _copy(tmp_path)
    victim = run / "__1_0.distcp"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x40
    victim.write_bytes(bytes(data))
    direct = _report(run)
    assert cold and not direct[2]
    assert any(p.get("file") == "__1_0.distcp" for p in direct[0] if p["severity"] == "error")
    monkeypatch.setattr(data_read, "DIRECT_MIN", 1 << 62)
    assert _report(run) == direct


def test_a_file_that_shrinks_under_direct_reads_is_one_error(tmp_path: Path, cold: list[int],
                                                              monkeypatch: pytest.MonkeyPatch):
    run = _copy(tmp_path)
    victim = "__3_0.distcp"
    truncate_once_planned(monkeypatch, run, victim)
    problems, _, ok = _report(run, workers=2)
    cut = [p for p in problems if p["check"] == "data_file"]
    assert len(cut) == 1 and cut[0]["file"] == victim and "shrank while reading" in cut[0]["message"]
    assert cold and not ok


def test_a_refused_direct_read_falls_back_to_the_cache(tmp_path: Path, cold: list[int],
                                                      monkeypatch: pytest.MonkeyPatch):
    """A file system that opens with O_DIRECT but refuses the read (EINVAL): the same report, from the cache."""
    run = _copy(tmp_path)
    want = _report(run)
    real = data_read.read_fully
    refused: list[int] = []

    def refuse_direct(fd, buf, offset):  # noqa: ANN001, ANN202
        if fd in direct_fds:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buf, offset)

    direct_fds = direct_descriptors(monkeypatch)
    monkeypatch.setattr(data_read, "read_fully", refuse_direct)
    cold.clear()
    assert _report(run) == want
    assert refused and not cold, "the direct reads were refused, and the windows read through the cache"


def test_another_read_error_on_the_direct_path_is_raised(tmp_path: Path, cold: list[int],
                                                         monkeypatch: pytest.MonkeyPatch):
    """EIO from the disk is not a refusal: verify raises it (no silent cache fallback), with every file closed."""
    run = _copy(tmp_path)
    real = data_read.read_fully
    direct_fds = direct_descriptors(monkeypatch)
    def fail(fd, buf, offset):  # noqa: ANN001, ANN202
        if fd in direct_fds:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buf, offset)

    monkeypatch.setattr(data_read, "read_fully", fail)
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="Input/output error"):
        _report(run)
    assert len(os.listdir("/proc/self/fd")) == fds


def test_page_cache_residency_never_reads_the_mapping(tmp_path: Path):
    """``mincore`` answers for pages read and pages dropped, and a file cut short under the mapping is no SIGBUS."""
    path = tmp_path / "f"
    path.write_bytes(os.urandom(1 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        cache = PageCache(fd, 1 << 20)
        os.pread(fd, 1 << 20, 0)
        assert cache.resident(0, 1 << 20) in (True, False)  # answers; resident unless the machine evicted it
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        dropped = not cache.resident(0, 1 << 20)
        os.truncate(path, 4096)
        assert cache.resident(0, 1 << 20) in (True, False)  # pages past the new end: looked up, never touched
        cache.close()
        assert cache.resident(0, 1 << 20), "closed: it cannot tell, so the caller reads through the cache"
    finally:
        os.close(fd)
    if not dropped:
        pytest.skip("the kernel kept the dropped pages (nothing else to check)")


def test_the_switch_turns_direct_reads_off(tmp_path: Path, cold: list[int], monkeypatch: pytest.MonkeyPatch):
    """``CKPT_VERIFY_DIRECT=0``: every window through the cache, the same report."""
    run = _copy(tmp_path)
    want = _report(run)
    assert cold
    cold.clear()
    monkeypatch.setenv(data_read.DIRECT_ENV, "0")
    assert _report(run) == want and not cold


@pytest.mark.parametrize("value", ["2", "-1", "yes", "", " 1", "1" * 400, "\x1b[31m1"])
def test_a_bad_switch_is_one_line_and_exit_2(tmp_path: Path, value: str, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]):
    from ckpt_tool.cli import run as cli

    monkeypatch.setenv(data_read.DIRECT_ENV, value)
    assert cli(["verify", "--data", str(_copy(tmp_path))]) == 2
    err = capsys.readouterr().err.strip()
    assert data_read.DIRECT_ENV in err and "set it to 1" in err and "Traceback" not in err
    assert "\n" not in err and "\x1b" not in err and len(err) < 400, err
    monkeypatch.setenv(data_read.DIRECT_ENV, "1")
    assert cli(["verify", "--data", str(_copy(tmp_path / "again"))]) == 0


# -- cold spans: a worker's windows in a row read as one O_DIRECT request ---------------------------

@pytest.fixture
def spans(cold: list[int], monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The spans read in one request (start, stop), every window cold as in ``cold``."""
    monkeypatch.setenv(data_read.SPAN_ENV, "8")
    taken: list[tuple[int, int]] = []
    real = data_read.WindowReads.span

    def spy(self, pool, start, stop):  # noqa: ANN001, ANN202
        out = real(self, pool, start, stop)
        if out is not None:
            taken.append((start, stop))
        return out

    monkeypatch.setattr(data_read.WindowReads, "span", spy)
    return taken


def test_cold_spans_give_the_report_of_the_cache(tmp_path: Path, spans: list[tuple[int, int]], cold: list[int],
                                                 monkeypatch: pytest.MonkeyPatch):
    """Spans, windows one by one, and the cache: the same report; every byte read from the disk exactly once."""
    run = _copy(tmp_path)
    got = _report(run)
    assert spans and sum(cold) == got[1]["bytes_read"]
    assert sum(b - a for a, b in spans) <= got[1]["bytes_read"]
    spans.clear()
    monkeypatch.setenv(data_read.SPAN_ENV, "0")  # one direct read per window (the default)
    assert _report(run) == got and not spans
    monkeypatch.setenv(data_read.SPAN_ENV, "8")
    monkeypatch.setattr(data_read, "DIRECT_MIN", 1 << 62)  # through the cache
    assert _report(run) == got and got[2]


def test_a_file_that_shrinks_while_its_span_is_in_flight_is_one_error(tmp_path: Path, spans: list[tuple[int, int]],
                                                                      monkeypatch: pytest.MonkeyPatch):
    """Cut between the residency check and the span's read: the span comes short, its windows are read one by one,
    and the first past the new end is the one ``data_file`` error naming the file (no short window checked)."""
    run = _copy(tmp_path)
    victim = "__3_0.distcp"
    real = data_read.WindowReads.span
    cut: list[int] = []

    def shrink_first(self, pool, start, stop):  # noqa: ANN001, ANN202
        if self.rel == victim and not cut:
            cut.append((start + stop) // 2)
            os.truncate(run / victim, cut[0])
        return real(self, pool, start, stop)

    monkeypatch.setattr(data_read.WindowReads, "span", shrink_first)
    problems, _, ok = _report(run, workers=2)
    errors = [p for p in problems if p["check"] == "data_file"]
    assert cut and not ok and len(errors) == 1 and errors[0]["file"] == victim
    assert "shrank while reading" in errors[0]["message"]


def test_a_short_read_inside_a_span_is_read_on(tmp_path: Path, spans: list[tuple[int, int]],
                                               monkeypatch: pytest.MonkeyPatch):
    """``preadv`` may return fewer bytes than asked before the end of a file: the span is read on from there, and
    the report is the same as with whole reads."""
    run = _copy(tmp_path)
    want = _report(run)
    real = os.preadv
    calls: list[int] = []

    def short(fd, buffers, offset):  # noqa: ANN001, ANN202  # at most 3 pages a call: aligned, as O_DIRECT needs
        calls.append(fd)
        return real(fd, [memoryview(buffers[0])[:3 * 4096]], offset)

    spans.clear()
    monkeypatch.setattr(os, "preadv", short)
    assert _report(run) == want and spans and len(calls) > len(spans)


def test_eio_in_the_middle_of_a_span_is_raised_and_frees_everything(tmp_path: Path, spans: list[tuple[int, int]],
                                                                     monkeypatch: pytest.MonkeyPatch):
    """EIO on a span's read (after a part of it came in) is raised, as on a window's: every file closed, every span
    buffer given back (a second pass in the same process does not wait for one)."""
    run = _copy(tmp_path)
    want = _report(run)
    real = data_read.read_fully
    direct_fds = direct_descriptors(monkeypatch)
    pools: list[data_read.Spans] = []
    real_take = data_read.Spans.take

    def take(self):  # noqa: ANN001, ANN202
        pools.append(self)
        return real_take(self)

    def fail(fd, buf, offset):  # noqa: ANN001, ANN202
        if fd in direct_fds and len(buf) > 2 * 4096:
            real(fd, memoryview(buf)[:4096], offset)  # a first part read, then the disk fails
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buf, offset)

    monkeypatch.setattr(data_read.Spans, "take", take)
    monkeypatch.setattr(data_read, "read_fully", fail)
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="Input/output error"):
        _report(run)
    assert len(os.listdir("/proc/self/fd")) == fds
    assert pools and all(len(p.free) == p.made for p in pools), "every span buffer back in its pool"
    monkeypatch.setattr(data_read, "read_fully", real)
    assert _report(run) == want


def test_a_refused_span_read_falls_back_to_the_cache(tmp_path: Path, spans: list[tuple[int, int]],
                                                     monkeypatch: pytest.MonkeyPatch):
    run = _copy(tmp_path)
    want = _report(run)
    real = data_read.read_fully
    direct_fds = direct_descriptors(monkeypatch)

    def refuse(fd, buf, offset):  # noqa: ANN001, ANN202
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buf, offset)

    monkeypatch.setattr(data_read, "read_fully", refuse)
    spans.clear()
    assert _report(run) == want and not spans


def test_span_buffers_never_exceed_their_depth(tmp_path: Path, cold: list[int], monkeypatch: pytest.MonkeyPatch):
    """Four workers, a budget of one span: never more than one span buffer exists, whatever the workers do."""
    run = _copy(tmp_path)
    want = _report(run, workers=4)
    span = 2 * data_check.WINDOW
    monkeypatch.setattr(data_read, "SPAN", span)
    monkeypatch.setattr(data_read, "SPAN_BUDGET", span)
    made: list[data_read.Spans] = []
    real_init = data_read.Spans.__init__

    def init(self, span, depth):  # noqa: ANN001, ANN202
        real_init(self, span, depth)
        made.append(self)

    monkeypatch.setattr(data_read.Spans, "__init__", init)
    assert _report(run, workers=4) == want
    assert made and all(p.depth == 1 and p.made == 1 for p in made)
    budget = 48 << 20
    assert data_read.span_depth(8 << 20, 16, budget) == 6 and data_read.span_depth(8 << 20, 2, budget) == 2
    assert data_read.span_depth(64 << 20, 16, budget) == 1


def test_pool_waits_for_a_buffer_at_its_depth():
    pool = data_read.Spans(4096, 2)
    a, b = pool.take(), pool.take()
    import threading

    got: list[bytearray] = []
    t = threading.Thread(target=lambda: got.append(pool.take()))
    t.start()
    t.join(0.2)
    assert t.is_alive() and not got, "a third take waits while two are out"
    pool.give(a)
    t.join(5)
    assert got and got[0] is a and pool.made == 2
    pool.give(b)
    pool.give(got[0])


def test_through_the_cache_each_span_is_asked_for_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``CKPT_VERIFY_DIRECT=0``: a task's windows are asked for with ``WILLNEED`` before they are read; the same
    report. Planning asks for both ends of each chunk larger than a window, on any path."""
    run = _copy(tmp_path)
    want = _report(run)
    monkeypatch.setattr(data_check, "WINDOW", 16 << 10)
    monkeypatch.setattr(PageCache, "resident", lambda self, start, stop: False)  # cold: a warm task is not asked for
    asked: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def spy(fd, offset, length, advice):  # noqa: ANN001, ANN202
        if advice == os.POSIX_FADV_WILLNEED:
            asked.append((offset, length))
        return real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    monkeypatch.setenv(data_read.DIRECT_ENV, "0")
    assert _report(run) == want
    ends = [a for a in asked if a[1] == data_check.END_BYTES]
    assert ends and len(asked) > len(ends), "the chunks' ends and the spans were asked for"


@pytest.mark.parametrize("value", ["65", "-1", "8M", "", "\x1b[31m8"])
def test_a_bad_span_is_one_line_and_exit_2(tmp_path: Path, value: str, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]):
    from ckpt_tool.cli import run as cli

    monkeypatch.setenv(data_read.SPAN_ENV, value)
    assert cli(["verify", "--data", str(_copy(tmp_path))]) == 2
    err = capsys.readouterr().err.strip()
    assert data_read.SPAN_ENV in err and "MiB" in err and "Traceback" not in err
    assert "\n" not in err and "\x1b" not in err and len(err) < 400, err


def test_by_default_cold_windows_come_through_the_cache_asked_for_first(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch):
    """No ``CKPT_VERIFY_DIRECT``, 8 workers: no ``O_DIRECT`` descriptor is opened; each file's start and each cold
    task are asked for (``WILLNEED``) before they are read; a warm task is not; the report is the same either way.
    With 2 workers the direct reads are the default."""
    run = _copy(tmp_path)
    monkeypatch.delenv(data_read.DIRECT_ENV, raising=False)
    monkeypatch.setattr(data_check, "WINDOW", 16 << 10)
    fds = direct_descriptors(monkeypatch)
    asked: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def spy(fd, offset, length, advice):  # noqa: ANN001, ANN202
        if advice == os.POSIX_FADV_WILLNEED:
            asked.append((offset, length))
        return real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    monkeypatch.setattr(PageCache, "resident", lambda self, start, stop: True)
    warm = _report(run, workers=8)
    assert not fds and all(n == data_check.END_BYTES for _, n in asked), "warm: only the chunks' ends"
    monkeypatch.setattr(PageCache, "resident", lambda self, start, stop: False)
    asked.clear()
    assert _report(run, workers=8) == warm and not fds and warm[2]
    heads = [a for a in asked if a[0] == 0]
    assert heads and len(asked) > len(heads) + 1
    if _takes_direct(tmp_path):
        assert _report(run, workers=2) == warm and fds, "2 workers: O_DIRECT by default"
