"""megatron-core's alignment padding in ``verify --data``: counted apart from the data, never as NaN/Inf in it.

Why apart: megatron-core pads each distributed-optimizer bucket to an alignment and leaves those
elements uninitialised, so a genuine checkpoint's padding can hold NaN bit patterns that belong to
no parameter (:func:`gtp_format.megatron.padding.padding_chunks` finds the chunks that are padding only).
Counting them as the key's NaN would flag every such checkpoint; ignoring them would hide a
writer that filled its padding. So the data pass tallies them under a tagged key
(:func:`tally_key`) and :func:`split_padding` reports them as one ``info`` line per key.
GTP tail padding, which must be zero, is the other padding check
(:func:`gtp_format.check.values.check_padding`).
"""

from __future__ import annotations

from gtp_format.model import Checkpoint, Chunk, Entry, Problem

PADDING_TAG = "\x00padding"  # tally key suffix of padding-only chunks (no key can hold NUL)


def tally_key(ckpt: Checkpoint, entry: Entry, chunk: Chunk) -> str:
    """Where a chunk's NaN/Inf count goes: its key, or its key's alignment padding."""
    return entry.key + PADDING_TAG if (entry.key, chunk.index) in ckpt.padding_chunks else entry.key


def find_megatron_padding(ckpt: Checkpoint) -> str | None:
    """Set ``ckpt.padding_chunks`` for a genuine megatron-core checkpoint (ours have a manifest and no padding).

    Returns why the padding is unknown (the parameter layout cannot be established, so the
    distributed optimizer's bucket keys may hold padding nobody can tell from data), else ``None``.
    Only ``dp_reshardable`` bucket keys hold padding: a checkpoint without them has none to find.
    """
    if ckpt.manifest is None and not ckpt.padding_chunks:
        from gtp_format.megatron.padding import padding_chunks_of, padding_layout
        from gtp_format.megatron.topology import is_megatron_core
        from gtp_format.names import parse_optimizer_key

        if is_megatron_core(ckpt) and any(parse_optimizer_key(k) is not None for k in ckpt.entries):
            ranges, why = padding_layout(ckpt)
            ckpt.padding_chunks = padding_chunks_of(ckpt, ranges)
            return why
    return None


def split_padding(nan: dict[str, int], inf: dict[str, int]) -> tuple[dict[str, dict[str, int]], list[Problem]]:
    """The data pass's tallies as (NaN/Inf per key of data, problems): a warning per key, an info per padding."""
    nonfinite: dict[str, dict[str, int]] = {}
    padding: dict[str, dict[str, int]] = {}
    for key in sorted(nan.keys() | inf.keys()):
        n, i = nan.get(key, 0), inf.get(key, 0)
        if n or i:
            if key.endswith(PADDING_TAG):
                padding[key.removesuffix(PADDING_TAG)] = {"nan": n, "inf": i}
            else:
                nonfinite[key] = {"nan": n, "inf": i}
    problems = [Problem("warning", "nonfinite", f"{v['nan']} NaN and {v['inf']} Inf values", key=k)
                for k, v in nonfinite.items()] + [
        Problem("info", "padding", f"{v['nan']} NaN and {v['inf']} Inf values in alignment padding (no "
                "parameter's elements; megatron-core leaves it uninitialised), not counted as data", key=k)
        for k, v in padding.items()]
    return nonfinite, problems
