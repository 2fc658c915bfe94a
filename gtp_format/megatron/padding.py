"""The alignment padding of a megatron-core ``dp_reshardable`` checkpoint: the elements of its bucket
keys that belong to no parameter.

Known from the bucket layout alone (:func:`gtp_format.megatron.view.megatron_views`: each
holder's range in its bucket), so ``verify --data``, ``ckpt show`` and
``ckpt diff`` leave these elements out; where the layout cannot be established,
:func:`padding_layout` says why and nothing is called padding.
"""

from __future__ import annotations

from bisect import bisect_right

from gtp_format.errors import FormatError
from gtp_format.megatron.view import megatron_views
from gtp_format.model import TENSOR, Checkpoint
from gtp_format.names import parse_optimizer_key


def padding_ranges(ckpt: Checkpoint) -> dict[str, list[tuple[int, int]]]:
    """Optimizer key -> its alignment gaps ``[a, z)``: elements that belong to no parameter.

    megatron-core allocates its buffers with ``torch.empty``, so these hold whatever memory held
    (NaN and 1e35s in the fixtures); NaN counts and statistics leave them out. Empty when the
    layout cannot be established (the refusal is ``inspect --params``'s to report).
    """
    return padding_layout(ckpt)[0]


def padding_layout(ckpt: Checkpoint) -> tuple[dict[str, list[tuple[int, int]]], str | None]:
    """(:func:`padding_ranges`, ``None``), or ``({}, why)`` where the parameter layout cannot be established."""
    try:
        views = megatron_views(ckpt, experts=True, dense_experts=True)  # MoE at EP 1 too
    except FormatError as e:
        return {}, str(e).removeprefix(f"{ckpt.root}: ")
    used: dict[str, list[tuple[int, int]]] = {}
    for v in views.values():
        for h in v.holders:
            used.setdefault(h.ref.key("param"), []).append((h.start, h.start + h.numel))
    out: dict[str, list[tuple[int, int]]] = {}
    for key, e in ckpt.entries.items():
        o = parse_optimizer_key(key) if e.kind == TENSOR else None
        if o is None or not e.shape:
            continue
        spans = sorted(used.get(key.rsplit(".", 1)[0] + ".param", []))
        gaps, pos = [], 0
        for a, z in spans:
            if a > pos:
                gaps.append((pos, a))
            pos = max(pos, z)
        if pos < e.shape[0]:
            gaps.append((pos, e.shape[0]))
        out[key] = gaps
    return out, None


def padding_chunks(ckpt: Checkpoint) -> frozenset[tuple[str, int]]:
    """(key, chunk index) of every stored chunk that lies wholly in an alignment gap."""
    return padding_chunks_of(ckpt, padding_ranges(ckpt))


def padding_chunks_of(ckpt: Checkpoint, ranges: dict[str, list[tuple[int, int]]]) -> frozenset[tuple[str, int]]:
    """:func:`padding_chunks` of ranges already computed."""
    out = set()
    for key, gaps in ranges.items():
        starts = [a for a, _ in gaps]
        for c in ckpt.entries[key].chunks:
            a, z = c.offsets[0], c.offsets[0] + c.sizes[0]
            i = bisect_right(starts, a) - 1
            if i >= 0 and gaps[i][0] <= a and z <= gaps[i][1]:
                out.add((key, c.index))
    return frozenset(out)
