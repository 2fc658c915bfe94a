"""The zip structure of one ``torch.save`` blob, read by byte range, without :mod:`zipfile`.

A DCP chunk is a whole ``torch.save`` archive at some offset of a ``.distcp`` file. ``ckpt``
reads its structure from memory (a window ``verify --data`` already holds) or from a range of an
open file (a blob too large to hold), through :class:`BlobReader`, whose every range is checked
against the blob's length: a damaged or hostile offset is a :class:`BlobError`, never a read
outside the blob. Only what ``torch.save`` writes is accepted: one disk, no archive comment, at
most ``MAX_RECORDS`` records, all stored (never compressed or encrypted), zip64 where needed.

Why not :mod:`zipfile`: it costs about 1 ms per blob in Python-level reads and seeks, and
``verify --data`` parses one blob per chunk on worker threads, where that time holds the GIL
against every other worker. Parsing the few fixed-size records directly is about 10x cheaper.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from gtp_format.hashing import crc32
from gtp_format.reader.storage import Source, pread

MAX_STRUCTURE = 1 << 20  # the largest structural read from a file range (data.pkl of one tensor is ~150 bytes)
WINDOW = 4 << 10  # small structural reads are served from windows of this size (RangeReader)
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_SIG = 0x04034B50


class BlobError(ValueError):
    """The bytes are not a ``torch.save`` blob of one tensor; the message says why."""


class BlobReader:
    """The bytes of one blob of ``length`` bytes, handed out by range; subclasses say where they are."""

    def __init__(self, length: int) -> None:
        self.length = length

    def get(self, start: int, stop: int) -> bytes | memoryview:
        """Bytes ``[start, stop)``; a range outside the blob is a :class:`BlobError`, never a short read."""
        if not 0 <= start <= stop <= self.length:
            raise BlobError(f"not a zip archive: a record points at bytes [{start}, {stop}) of a "
                            f"{self.length}-byte blob")
        return self._bytes(start, stop)

    def _bytes(self, start: int, stop: int) -> bytes | memoryview:
        raise NotImplementedError


class ViewReader(BlobReader):
    """A blob in memory: ranges are views of it, never copies."""

    def __init__(self, view: memoryview) -> None:
        super().__init__(len(view))
        self._view = view

    def _bytes(self, start: int, stop: int) -> memoryview:
        return self._view[start:stop]


class RangeReader(BlobReader):
    """``[start, start + length)`` of an open file, by ``os.pread`` (for blobs too big to hold).

    A read of at most :data:`WINDOW` bytes is served from a window of the blob read around it, the last two
    kept: a blob's structure is 20-35 reads of a few bytes near its two ends, one ``pread`` each, which were
    3267 system calls and 23 of 205 thread-ms of a 26.5 MB reshard's workers (two windows per blob now).
    A window never extends past the blob, so nothing outside it is read.
    """

    def __init__(self, fd: Source, start: int, length: int) -> None:
        super().__init__(length)
        self._fd, self._start = fd, start
        self._windows: list[tuple[int, bytes]] = []

    def _bytes(self, start: int, stop: int) -> bytes:
        if stop - start > MAX_STRUCTURE:
            raise BlobError(f"a {stop - start}-byte structural read; torch.save writes no such record")
        if stop - start <= WINDOW:
            data = self._from_window(start, stop)
        else:
            data = pread(self._fd, stop - start, self._start + start)
        if len(data) != stop - start:
            raise BlobError(f"the file ends inside the blob (wanted bytes [{start}, {stop}))")
        return data

    def _from_window(self, start: int, stop: int) -> bytes:
        for lo, data in self._windows:
            if lo <= start and stop <= lo + len(data):
                return data[start - lo:stop - lo]
        lo = min(start, max(0, self.length - WINDOW))  # [start, start + WINDOW), or the blob's last WINDOW bytes
        data = pread(self._fd, min(self.length, lo + WINDOW) - lo, self._start + lo)
        self._windows = [(lo, data), *self._windows[:1]]
        return data[start - lo:stop - lo]  # short where the file ends inside the blob: the caller refuses it


# PKWARE APPNOTE 4.3: end of central directory, its zip64 locator and record, central directory
# headers (local headers are _LOCAL_HEADER above).
_EOCD = struct.Struct("<IHHHHIIH")
_EOCD_SIG = 0x06054B50
_LOC64 = struct.Struct("<IIQI")
_LOC64_SIG = 0x07064B50
_EOCD64 = struct.Struct("<IQHHIIQQQQ")
_EOCD64_SIG = 0x06064B50
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_CENTRAL_SIG = 0x02014B50
MAX_RECORDS = 64  # torch.save of one tensor writes 5-7


@dataclass(frozen=True)
class ZipRecord:
    """One stored (uncompressed) record: its name, CRC-32, size and local header offset."""

    name: str
    crc: int
    size: int
    header_offset: int


def zip_records(r: BlobReader) -> dict[str, ZipRecord]:
    """The archive's records by name, from its central directory; anything torch.save would not write is refused."""
    n = r.length
    if n < _EOCD.size:
        raise BlobError(f"not a zip archive: {n} bytes is too short for an end record")
    sig, disk, cd_disk, n_here, n_total, cd_size, cd_offset, comment = _EOCD.unpack(r.get(n - _EOCD.size, n))
    if sig != _EOCD_SIG or comment:
        raise BlobError("not a zip archive: the last 22 bytes are not an end-of-central-directory record "
                        "(torch.save writes one there, with no comment)")
    if disk not in (0, 0xFFFF) or cd_disk not in (0, 0xFFFF):  # 0xFFFF: "see the zip64 record"
        raise BlobError(f"not a zip archive: it spans disks {disk}/{cd_disk}; a torch.save blob is single-disk")
    cd_end = n - _EOCD.size
    if cd_end >= _LOC64.size:
        loc_sig, _, eocd64, _ = _LOC64.unpack(r.get(cd_end - _LOC64.size, cd_end))
        if loc_sig == _LOC64_SIG:  # zip64: the real counts and offsets are in the zip64 record
            if eocd64 > cd_end - _LOC64.size - _EOCD64.size:
                raise BlobError(f"not a zip archive: the zip64 end record offset {eocd64} is out of place")
            (sig, _, _, _, disk, cd_disk, n_here, n_total, cd_size,
             cd_offset) = _EOCD64.unpack(r.get(eocd64, eocd64 + _EOCD64.size))
            if sig != _EOCD64_SIG:
                raise BlobError(f"not a zip archive: no zip64 end record at byte {eocd64}")
            cd_end = eocd64
    if disk or cd_disk or n_here != n_total or n_total > MAX_RECORDS or cd_offset + cd_size > cd_end:
        raise BlobError(f"not a zip archive: a central directory of {n_total} records at [{cd_offset}, "
                        f"{cd_offset + cd_size}) does not fit a single-disk torch.save blob")
    cd = r.get(cd_offset, cd_offset + cd_size)
    records: dict[str, ZipRecord] = {}
    pos = 0
    for _ in range(n_total):
        if pos + _CENTRAL.size > cd_size:
            raise BlobError("not a zip archive: the central directory ends inside a record")
        (sig, _, _, flags, method, _, _, crc, csize, size, name_len, extra_len, comment_len, _, _, _,
         offset) = _CENTRAL.unpack_from(cd, pos)
        stop = pos + _CENTRAL.size + name_len + extra_len + comment_len
        if sig != _CENTRAL_SIG or stop > cd_size:
            raise BlobError(f"not a zip archive: no central directory record at byte {cd_offset + pos}")
        name = bytes(cd[pos + _CENTRAL.size: pos + _CENTRAL.size + name_len]).decode(
            "utf-8" if flags & 0x800 else "cp437", errors="replace")
        if 0xFFFFFFFF in (csize, size, offset):
            size, csize, offset = _zip64_extra(cd[pos + _CENTRAL.size + name_len: stop - comment_len], name,
                                               size, csize, offset)
        if method != 0 or csize != size or size > n or flags & 1:
            raise BlobError(f"record {name!r} is compressed, encrypted or larger than the blob ({size} bytes); "
                            "torch.save never writes that, refusing to inflate it")
        if name in records:
            raise BlobError(f"record {name!r} appears twice in the archive")
        records[name] = ZipRecord(name, crc, size, offset)
        pos = stop
    _check_extents(r, records, cd_offset)
    return records


def _check_extents(r: BlobReader, records: dict[str, ZipRecord], cd_start: int) -> None:
    """Each record has its own local header, under its own name, and its bytes overlap no other record's
    and stop before the central directory.

    Without this, a central directory entry could point at another record's bytes (or the same
    bytes twice) and every per-record check would pass on data nobody described.
    """
    prev_end, prev_name = 0, None
    for rec in sorted(records.values(), key=lambda x: x.header_offset):
        if rec.header_offset < prev_end:
            raise BlobError(f"record {rec.name!r} at byte {rec.header_offset} overlaps record {prev_name!r}, which "
                            f"ends at byte {prev_end}")
        end = rec.header_offset + _LOCAL_HEADER.size
        if end > cd_start:
            raise BlobError(f"record {rec.name!r} has no local header before the central directory")
        sig, _, flags, *_, name_len, extra_len = _LOCAL_HEADER.unpack(r.get(rec.header_offset, end))
        local = bytes(r.get(end, end + name_len)).decode("utf-8" if flags & 0x800 else "cp437", errors="replace")
        if sig != _LOCAL_SIG or local != rec.name:
            raise BlobError(f"the central directory places record {rec.name!r} at byte {rec.header_offset}, where "
                            f"{'record ' + repr(local[:80]) if sig == _LOCAL_SIG else 'no record'} starts")
        prev_end, prev_name = end + name_len + extra_len + rec.size, rec.name
        if prev_end > cd_start:
            raise BlobError(f"record {rec.name!r} runs into the central directory")


def _zip64_extra(extra: bytes | memoryview, name: str, size: int, csize: int, offset: int) -> tuple[int, int, int]:
    """Sizes and offset from the zip64 extra field (id 1): 8 bytes each, only for the fields saturated."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, pos)
        body = bytes(extra[pos + 4: pos + 4 + length])
        if tag == 1:
            values, at = [], 0
            for v in (size, csize, offset):
                if v == 0xFFFFFFFF:
                    if at + 8 > len(body):
                        break
                    v = struct.unpack_from("<Q", body, at)[0]
                    at += 8
                values.append(v)
            else:
                return values[0], values[1], values[2]
            break
        pos += 4 + length
    raise BlobError(f"record {name!r} needs a zip64 extra field that is missing or short")


def record_bytes(r: BlobReader, rec: ZipRecord) -> tuple[int, int]:
    """``[start, stop)`` of a record's data, from its local header."""
    end = rec.header_offset + _LOCAL_HEADER.size
    header = r.get(rec.header_offset, end) if end <= r.length else b""
    if len(header) != _LOCAL_HEADER.size or _LOCAL_HEADER.unpack(header)[0] != _LOCAL_SIG:
        raise BlobError(f"record {rec.name!r} has no local header at byte {rec.header_offset}")
    *_, name_len, extra_len = _LOCAL_HEADER.unpack(header)
    start = rec.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    if start + rec.size > r.length:
        raise BlobError(f"record {rec.name!r} runs past the end of the blob")
    return start, start + rec.size


def small_record(r: BlobReader, rec: ZipRecord) -> bytes:
    """A structural record's bytes (data.pkl, byteorder), CRC-checked as zip readers do."""
    start, stop = record_bytes(r, rec)
    data = bytes(r.get(start, stop))
    if crc32(data) != rec.crc:
        raise BlobError(f"record {rec.name!r} fails its CRC-32 check (damaged)")
    return data
