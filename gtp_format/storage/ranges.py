"""Which ranged requests serve a list of byte ranges of one object: the coalescing plan.

Why: on a bucket every read is a round trip, and a reader that asks for what it needs, range by
range, sends thousands of small requests (``benchmarks/bench_s3_ckpt.py --count-requests``: an
``export --to torch`` of a 291 MB checkpoint sent one ``HEAD`` and four or five ``GET`` s of under
64 KB per chunk, so the export ran at 0.03x boto3's ``download_file`` of the same objects). Ranges
that are adjacent or near are fetched as one request; what lies between them (a zip header, a
pickle) costs less than another round trip, and it is usually read next anyway.

The rules, checked against a brute-force reader by ``tests/format/test_ranges.py``:

* every byte of every range is inside exactly one request, and every request lies inside the object
  (``[0, size)``);
* two ranges share a request only when the hole between them is at most ``gap`` bytes;
* no request is longer than ``cap`` (the per-request bound on memory); a range longer than ``cap``
  is split into pieces of ``cap``.

Pure arithmetic, no I/O: :mod:`gtp_format.storage.objects` fetches the plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GAP = 1 << 20  # a hole this small is read through: cheaper than one more round trip on any store measured


@dataclass
class Request:
    """One ranged request ``[start, stop)`` and the caller's ranges it serves (their indices)."""

    start: int
    stop: int
    members: list[int] = field(default_factory=list)


def coalesce(ranges: list[tuple[int, int]], size: int, cap: int, gap: int = GAP) -> list[Request]:
    """The requests that serve ``ranges`` (``(start, stop)`` pairs, any order) of an object of ``size``
    bytes, in file order. A range outside ``[0, size)``, reversed or empty is a ``ValueError`` (the
    caller checks ranges against the store's size first); ``cap`` must be positive.
    """
    if cap <= 0 or gap < 0:
        raise ValueError(f"cap {cap} and gap {gap}: cap must be positive, gap not negative")
    for start, stop in ranges:
        if not (0 <= start < stop <= size):
            raise ValueError(f"range [{start}, {stop}) is empty or outside the object's {size} bytes")
    order = sorted(range(len(ranges)), key=lambda i: ranges[i])
    out: list[Request] = []
    for i in order:
        start, stop = ranges[i]
        k = len(out)
        while k > 0 and out[k - 1].stop > start:  # planned requests that already hold part of this range
            k -= 1
        for r in out[k:]:
            if r.start < stop:
                r.members.append(i)
        if out and out[-1].stop >= stop:
            continue  # wholly inside what is planned
        start = max(start, out[-1].stop) if out else start
        last = out[-1] if out else None
        if last is not None and start <= last.stop + gap and stop - last.start <= cap:
            last.stop = stop  # adjacent, or a hole of at most gap bytes: read through it
            if not last.members or last.members[-1] != i:
                last.members.append(i)
            continue
        while stop - start > cap:  # over the cap: whole pieces of cap, each its own request
            out.append(Request(start, start + cap, [i]))
            start += cap
        out.append(Request(start, stop, [i]))
    return out


def pieces(start: int, stop: int, part: int) -> list[tuple[int, int]]:
    """``[start, stop)`` cut into consecutive parts of at most ``part`` bytes (one request each)."""
    return [(a, min(stop, a + part)) for a in range(start, stop, part)]
