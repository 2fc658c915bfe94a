"""The disk's durable write ceiling on this machine, and what its file system offers a copy.

    python benchmarks/disk_ceiling.py --workdir /tmp/disk --gib 8 --out disk.json

Measures, each on a fresh set of files under ``--workdir`` (removed after), ``--gib`` GiB per row:

* ``dd if=/dev/zero oflag=direct conv=fsync`` in 1, 2, 4, 8 and 16 parallel streams (64 MiB blocks), and 8
  streams of 16 MiB blocks (the sink's write size): what more writes in flight buy; with ``--quick``, threads
  writing ``O_DIRECT`` into new files or files ``fallocate``d first, by write size and streams;
* ``dd conv=fsync`` through the page cache (1, 4, 8 streams): buffered writes and the final ``fsync``;
* buffered ``pwrite`` with ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` after every 64 MiB, then ``fdatasync``
  (8 threads): writeback started early, so the last flush is short;
* ``cp -r`` of a folder of 8 files (then ``sync`` timed apart) and ``dd iflag=direct`` reads (1 and 8 streams)
  of the same files, cold: the baselines the copies are held against;
* the file system (``findmnt``, ``lsblk``), and whether ``FICLONE`` (reflink), ``copy_file_range`` and
  ``cp --reflink=always`` work here, with ``copy_file_range``'s speed (page cache to page cache, then its
  ``fsync``) against ``pread`` + ``pwrite``.

With ``--reads FILE`` (an existing large file, e.g. the data file of a ``dcp.save`` checkpoint), only cold reads
of it instead (:func:`read_sweep`, ``--read-gib`` GiB a row from its own region of the file, the page cache emptied
before each row): what limits ``verify --data`` cold. Rows: ``O_DIRECT`` reads issued in file order by ``depth``
threads of ``size`` bytes each (1..16 in flight, 2..32 MiB); the pattern of the pass before spans (16 threads, each
8 MiB task read as four 2 MiB direct requests); buffered reads: one thread of 128 KiB (``cat``), 16 threads of 2 MiB
windows with ``POSIX_FADV_SEQUENTIAL`` (``CKPT_VERIFY_DIRECT=0`` before), and the same with each 8 MiB task asked
for first with ``POSIX_FADV_WILLNEED``. ``--smoke`` runs the sweep too, on a 16 MiB file.

No project code runs; every figure is GB/s (10^9 bytes) of wall time, ``fsync``/``sync`` included where named.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import fcntl
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from bench_hash import on_threads  # threads started together, timed to the last join

FICLONE = 0x40049409
SYNC_FILE_RANGE_WRITE = 2


def sh(cmd: str) -> str:
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True)
    return (r.stdout + r.stderr).strip()


def dd_streams(work: Path, streams: int, total: int, bs: int, direct: bool) -> float:
    """GB/s of ``streams`` concurrent dd writers, ``total`` bytes in all, each ending with its fsync."""
    work.mkdir(parents=True, exist_ok=True)
    count = max(1, total // (streams * bs))
    flags = ["oflag=direct"] if direct else []
    os.sync()
    t = time.perf_counter()
    procs = [subprocess.Popen(["dd", "if=/dev/zero", f"of={work}/s{i}", f"bs={bs}", f"count={count}", *flags,
                               "conv=fsync", "status=none"]) for i in range(streams)]
    for p in procs:
        p.wait()
    dt = time.perf_counter() - t
    shutil.rmtree(work)
    return round(streams * count * bs / 1e9 / dt, 3)


def sfr_streams(work: Path, streams: int, total: int, step: int = 64 << 20) -> float:
    """GB/s of buffered pwrite with sync_file_range(WRITE) after each ``step``, then fdatasync, per thread."""
    libc = ctypes.CDLL(None, use_errno=True)
    work.mkdir(parents=True, exist_ok=True)
    per = total // streams // step * step
    buf = os.urandom(step)
    os.sync()

    def one(i: int) -> None:
        fd = os.open(work / f"s{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            for off in range(0, per, step):
                os.pwrite(fd, buf, off)
                libc.sync_file_range(fd, ctypes.c_longlong(off), ctypes.c_longlong(step), SYNC_FILE_RANGE_WRITE)
            os.fdatasync(fd)
        finally:
            os.close(fd)

    dt = on_threads(streams, one)
    shutil.rmtree(work)
    return round(streams * per / 1e9 / dt, 3)


def direct_threads(work: Path, streams: int, total: int, write: int, prealloc: bool) -> float | None:
    """GB/s of ``streams`` threads, each writing its own new file with ``O_DIRECT`` ``pwrite`` of ``write`` bytes
    from one aligned buffer (one write in flight per file, as a sink), then ``fsync``; ``prealloc``: the file's
    size ``fallocate``d first, so no write extends it (ext4 serialises and journals extending direct writes)."""
    import mmap

    work.mkdir(parents=True, exist_ok=True)
    per = total // streams // write * write
    os.sync()

    def one(i: int) -> None:
        buf = mmap.mmap(-1, write)
        buf.write(os.urandom(1 << 20) * (write >> 20))
        fd = os.open(work / f"s{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT)
        try:
            if prealloc:
                os.posix_fallocate(fd, 0, per)
            for off in range(0, per, write):
                os.pwrite(fd, buf, off)
            os.fsync(fd)
        finally:
            os.close(fd)

    failed: list[OSError] = []

    def guarded(i: int) -> None:
        try:
            one(i)
        except OSError as e:  # a file system without O_DIRECT (tmpfs before Linux 6.6)
            failed.append(e)

    dt = on_threads(streams, guarded)
    shutil.rmtree(work)
    return None if failed else round(streams * per / 1e9 / dt, 3)


def evict(path: Path, everything: bool = True) -> None:
    """Empty the page cache of ``path`` (and, with ``everything``, the whole page cache where
    ``/proc/sys/vm/drop_caches`` is writable: never under ``--smoke``, which may run beside other work)."""
    os.sync()
    if everything:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        except OSError:
            pass
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cold_read(path: Path, base: int, nbytes: int, threads: int, unit: int, piece: int, direct: bool,
              willneed: bool = False, everything: bool = True) -> float | None:
    """GB/s of ``threads`` threads reading ``[base, base + nbytes)`` of ``path`` cold: each takes the next ``unit``
    bytes in file order (a shared counter) and reads them in ``piece``-byte ``preadv`` calls into its own page-aligned
    buffer, with ``O_DIRECT`` or through the cache (``POSIX_FADV_SEQUENTIAL``; ``willneed``: the unit asked for
    first). None where the file system refuses ``O_DIRECT``."""
    import mmap
    import threading

    evict(path, everything)
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    if not direct:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    lock = threading.Lock()
    nxt = [base]
    failed: list[OSError] = []

    def one(_: int) -> None:
        buf = mmap.mmap(-1, piece)
        view = memoryview(buf)
        while True:
            with lock:
                at = nxt[0]
                nxt[0] += unit
            if at >= base + nbytes:
                return
            end = min(base + nbytes, at + unit)
            try:
                if willneed:
                    for lo in range(at, end, 1 << 20):
                        os.posix_fadvise(fd, lo, min(end, lo + (1 << 20)) - lo, os.POSIX_FADV_WILLNEED)
                for lo in range(at, end, piece):
                    os.preadv(fd, [view[:min(piece, end - lo)]], lo)
            except OSError as e:
                failed.append(e)
                return

    try:
        dt = on_threads(threads, one)
    finally:
        os.close(fd)
    return None if failed else round(nbytes / 1e9 / dt, 3)


def read_sweep(path: Path, per_row: int, small: bool = False) -> dict[str, float | None]:
    """Cold read GB/s of ``path`` by pattern (see the module's docstring); each row reads ``per_row`` bytes of its
    own region of the file (rows revisit regions only once the file is used up)."""
    mib = (lambda n: 64 << 10) if small else (lambda n: n << 20)  # noqa: E731 - a read's size
    rows: list[tuple[str, int, int, int, bool, bool]] = []  # name, threads, unit, piece, direct, willneed
    for size, depths in ((2, (1, 4, 16)), (8, (1, 2, 4, 6, 8, 16)), (16, (2, 3, 4)), (32, (1, 2, 4))):
        rows += [(f"direct_{size}M_depth{d}", d, mib(size), mib(size), True, False) for d in depths]
    rows += [("direct_verify_before_16x_8M_in_2M", 16, mib(8), mib(2), True, False),
             ("buffered_cat_1x128K", 1, 128 << 10, 128 << 10, False, False),
             ("buffered_16x_8M_in_2M", 16, mib(8), mib(2), False, False),
             ("buffered_willneed_16x_8M_in_2M", 16, mib(8), mib(2), False, True),
             ("buffered_willneed_4x_8M_in_2M", 4, mib(8), mib(2), False, True)]
    size = path.stat().st_size
    step = max(ALIGN_REGION, -(-per_row // ALIGN_REGION) * ALIGN_REGION)
    regions = max(1, size // step)
    out: dict[str, float | None] = {}
    for k, (name, threads, unit, piece, direct, willneed) in enumerate(rows):
        base = (k % regions) * step
        nbytes = min(per_row, size - base) // ALIGN_REGION * ALIGN_REGION or min(per_row, size - base) >> 12 << 12
        out[name] = cold_read(path, base, nbytes, threads, unit, piece, direct, willneed, not small)
        print(f"{name}: {out[name]} GB/s", flush=True)
    return out


ALIGN_REGION = 64 << 20


def copies(work: Path, total: int) -> dict:
    """cp -r (+ sync), cold direct reads, FICLONE, copy_file_range, cp --reflink=always on 8 files."""
    src = work / "src"
    src.mkdir(parents=True, exist_ok=True)
    per = total // 8
    procs = [subprocess.Popen(["dd", "if=/dev/urandom", f"of={src}/f{i}", "bs=1M", f"count={per >> 20}",
                               "iflag=fullblock", "status=none"]) for i in range(8)]
    for p in procs:
        p.wait()
    os.sync()
    nbytes = sum(p.stat().st_size for p in src.iterdir())
    out: dict = {"bytes": nbytes}
    for streams in (1, 8):
        files = sorted(src.iterdir())
        t = time.perf_counter()
        if streams == 1:
            for p in files:
                subprocess.run(["dd", f"if={p}", "of=/dev/null", "bs=64M", "iflag=direct", "status=none"])
        else:
            ps = [subprocess.Popen(["dd", f"if={p}", "of=/dev/null", "bs=64M", "iflag=direct", "status=none"])
                  for p in files]
            for p in ps:
                p.wait()
        out[f"read_direct_{streams}_gbps"] = round(nbytes / 1e9 / (time.perf_counter() - t), 3)
    for p in src.iterdir():  # warm, as the reshard benchmark's source
        subprocess.run(["cat", str(p)], stdout=subprocess.DEVNULL)
    for rnd in range(2):
        os.sync()
        t = time.perf_counter()
        subprocess.run(["cp", "-r", str(src), str(work / "copy")], check=True)
        cp = time.perf_counter() - t
        t = time.perf_counter()
        os.sync()
        out[f"cp_r_s_{rnd}"], out[f"cp_r_then_sync_s_{rnd}"] = round(cp, 3), round(time.perf_counter() - t, 3)
        shutil.rmtree(work / "copy")
    out["cp_r_gbps"] = round(nbytes / 1e9 / min(out["cp_r_s_0"], out["cp_r_s_1"]), 3)
    one = src / "f0"
    # FICLONE
    fd_in = os.open(one, os.O_RDONLY)
    fd_out = os.open(work / "clone", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        fcntl.ioctl(fd_out, FICLONE, fd_in)
        out["ficlone"] = "ok"
    except OSError as e:
        out["ficlone"] = f"{errno.errorcode.get(e.errno or 0, e.errno)}: {e.strerror}"
    finally:
        os.close(fd_out)
    os.unlink(work / "clone")
    # copy_file_range, whole file, then fsync
    fd_out = os.open(work / "cfr", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    size = one.stat().st_size
    try:
        t = time.perf_counter()
        done = 0
        while done < size:
            n = os.copy_file_range(fd_in, fd_out, size - done, done, done)
            if n == 0:
                break
            done += n
        t1 = time.perf_counter()
        os.fsync(fd_out)
        t2 = time.perf_counter()
        out["copy_file_range"] = {"bytes": done, "gbps": round(done / 1e9 / (t1 - t), 3),
                                  "then_fsync_s": round(t2 - t1, 3),
                                  "durable_gbps": round(done / 1e9 / (t2 - t), 3)}
    except OSError as e:
        out["copy_file_range"] = f"{errno.errorcode.get(e.errno or 0, e.errno)}: {e.strerror}"
    finally:
        os.close(fd_out)
    os.unlink(work / "cfr")
    # pread + pwrite (page cache), then fsync: what copy_file_range replaces
    fd_out = os.open(work / "pp", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    t = time.perf_counter()
    for off in range(0, size, 16 << 20):
        os.pwrite(fd_out, os.pread(fd_in, 16 << 20, off), off)
    t1 = time.perf_counter()
    os.fsync(fd_out)
    t2 = time.perf_counter()
    os.close(fd_out)
    os.close(fd_in)
    out["pread_pwrite"] = {"gbps": round(size / 1e9 / (t1 - t), 3), "then_fsync_s": round(t2 - t1, 3),
                           "durable_gbps": round(size / 1e9 / (t2 - t), 3)}
    os.unlink(work / "pp")
    out["cp_reflink_always"] = sh(f"cp --reflink=always {one} {work}/rl && echo ok; rm -f {work}/rl")
    shutil.rmtree(work)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="/tmp/disk_ceiling")
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--out")
    ap.add_argument("--smoke", action="store_true", help="16 MiB per row in 1 MiB writes (tests/benchmarks)")
    ap.add_argument("--reads", metavar="FILE", help="only cold reads of FILE (an existing large file), by depth, "
                                                    "size and O_DIRECT against buffered")
    ap.add_argument("--read-gib", type=float, default=1.0, help="GiB each --reads row reads")
    ap.add_argument("--quick", action="store_true",
                    help="direct writes only: threads writing O_DIRECT into new or fallocated files (8 streams of 16 "
                         "and 32 MiB writes), and dd 32M x8")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    total = 16 << 20 if args.smoke else int(args.gib * (1 << 30))
    unit = (lambda mib: 1 << 20) if args.smoke else (lambda mib: mib << 20)  # noqa: E731 - a write's size
    res: dict = {"fs": sh(f"findmnt -T {work} -o SOURCE,FSTYPE,OPTIONS"),
                 "lsblk": sh("lsblk -o NAME,TYPE,SIZE,ROTA,MODEL,LOG-SEC,PHY-SEC,MIN-IO,OPT-IO"),
                 "queue": sh("for q in /sys/block/*/queue; do echo $q $(cat $q/nr_requests $q/max_sectors_kb "
                             "$q/read_ahead_kb $q/scheduler 2>/dev/null); done"),
                 "df": sh(f"df -h {work}"), "cp": sh("cp --version | head -1"), "kernel": os.uname().release,
                 "nproc": os.cpu_count()}
    print(json.dumps(res, indent=1), flush=True)
    if args.reads:
        res["cold_read_gbps"] = read_sweep(Path(args.reads), int(args.read_gib * (1 << 30)))
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))
        return 0
    rows = {}
    for streams in () if args.quick else (1, 2, 4, 8, 16):
        rows[f"dd_direct_64M_x{streams}"] = dd_streams(work / "dd", streams, total, unit(64), True)
        print(f"dd direct 64M x{streams}: {rows[f'dd_direct_64M_x{streams}']} GB/s", flush=True)
    if args.quick:
        sizes = [(8, 16), (8, 32)]
        for streams, mib in sizes:
            for pre in (False, True):
                name = f"py_direct_{mib}M_x{streams}{'_fallocate' if pre else ''}"
                rows[name] = direct_threads(work / "py", streams, total, unit(mib), pre)
                print(f"{name}: {rows[name]} GB/s", flush=True)
    for streams, mib in ((8, 32),) if args.quick else ((8, 16),):
        rows[f"dd_direct_{mib}M_x{streams}"] = dd_streams(work / "dd", streams, total, unit(mib), True)
        print(f"dd direct {mib}M x{streams}: {rows[f'dd_direct_{mib}M_x{streams}']} GB/s", flush=True)
    if not args.quick:
        for streams in (1, 4, 8):
            rows[f"dd_buffered_fsync_64M_x{streams}"] = dd_streams(work / "dd", streams, total, unit(64), False)
            print(f"dd buffered+fsync x{streams}: {rows[f'dd_buffered_fsync_64M_x{streams}']} GB/s", flush=True)
        rows["buffered_sync_file_range_x8"] = sfr_streams(work / "sfr", 8, total, unit(64))
        print(f"buffered + sync_file_range x8: {rows['buffered_sync_file_range_x8']} GB/s", flush=True)
        res["copies"] = copies(work / "cp", total)
        print(json.dumps(res["copies"], indent=1), flush=True)
    if args.smoke:  # the read sweep's code, on a small file of its own
        probe = work / "reads.bin"
        probe.write_bytes(os.urandom(total))
        res["cold_read_gbps"] = read_sweep(probe, total // 4, small=True)
        probe.unlink()
    res["write_gbps"] = rows
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
