"""The manifest's bucket layout is the one its model and topology imply, and keys carry its dtypes.

Codes ``bucket_layout`` and ``key_dtype`` (``ckpt verify``, ``--load``, ``reshard`` and ``export``
all run them through :func:`gtp_format.check.verify.verify`).

Why: every per-parameter read (``reshard``, ``export``, ``inspect --params``) trusts the
manifest's slice ``[start, end)`` of each parameter in its bucket. The red team edited the
manifest so that two parameters shared one slice: ``verify`` passed (every key was present with
its shape), and reshard/export wrote one parameter's fp32 master weights under the other's name,
exit 0. A gtp_runtime run never chooses its layout: :func:`gtp_format.layout.params.buffer_layouts`
derives it from the model, the topology, the bucket size and the param dtype with
:func:`gtp_format.layout.buckets.lay_out`, the rule the runtime's ``GradBuffer`` uses (checked
against it in ``tests/runtime/test_param_layout.py``). So the check is equality with that
derivation, which refuses overlapping slices, gaps, reordered or resized params, buckets of the
wrong size and invented params at once (the class, not the example). Before it, a plain sweep
names overlapping slices as such, so the line says what is wrong, not only that something is.

Shapes are checked by :mod:`.keys`; dtypes were not: a bf16 model key stored as float16 (both
are 2-byte carriers) was copied bit for bit and relabelled bf16. Model keys must be stored in the
manifest's ``param_dtype``, optimizer states in float32, ``per_bucket_numel`` in int64.
"""

from __future__ import annotations

from gtp_format.layout.buckets import DEFAULT_BUCKET_SIZE
from gtp_format.layout.config import ConfigError
from gtp_format.layout.params import buffer_layouts
from gtp_format.layout.schema import BufferLayout, derive_bucket_size
from gtp_format.model import TENSOR, Checkpoint, Problem
from gtp_format.names import parse_optimizer_key, parse_per_bucket_numel_key

LAYOUT = "bucket_layout"
DTYPE = "key_dtype"


def overlapping_slices(buffers: tuple[BufferLayout, ...]) -> list[Problem]:
    """Params whose slices of one bucket overlap, or leave the bucket: a sweep per bucket."""
    out: list[Problem] = []
    for buf in buffers:
        for b in buf.buckets:
            where = f"gbuf {buf.gbuf_idx} bucket {b.bucket_idx}"
            prev = None
            for p in sorted(b.params, key=lambda p: (p.start, p.end)):
                if p.start < 0 or p.end > b.numel_unpadded or p.end < p.start:
                    out.append(Problem("error", LAYOUT, f"{where}: param {p.name!r} slice [{p.start}, {p.end}) "
                                       f"leaves the bucket's {b.numel_unpadded} elements; the manifest was edited",
                                       key=p.name))
                elif p.end == p.start:  # an empty slice holds no element, so it overlaps nothing
                    continue
                elif prev is not None and p.start < prev.end:
                    out.append(Problem("error", LAYOUT, f"{where}: params {prev.name!r} [{prev.start}, {prev.end}) and "
                                       f"{p.name!r} [{p.start}, {p.end}) overlap, so one would be read as the other; "
                                       "restore the manifest the run wrote", key=p.name))
                prev = p if prev is None or p.end > prev.end else prev
    return out


def _first_difference(have: tuple[BufferLayout, ...], want: tuple[BufferLayout, ...]) -> str:
    if len(have) != len(want):
        return f"{len(have)} gradient buffers where the model and topology give {len(want)}"
    for h, w in zip(have, want):
        head = f"gbuf {h.gbuf_idx}"
        for field in ("gbuf_idx", "dtype", "param_dtype", "grad_dtype", "is_expert", "excludes_cp", "dp_group_kind",
                      "dp_size", "grad_divisor", "example_dp_group_idx"):
            if getattr(h, field) != getattr(w, field):
                return f"{head}: {field} is {getattr(h, field)!r}, the runtime's rule gives {getattr(w, field)!r}"
        if len(h.buckets) != len(w.buckets):
            return f"{head}: {len(h.buckets)} buckets, the runtime's rule gives {len(w.buckets)}"
        for hb, wb in zip(h.buckets, w.buckets):
            at = f"{head} bucket {hb.bucket_idx}"
            if (hb.bucket_idx, hb.numel, hb.numel_unpadded) != (wb.bucket_idx, wb.numel, wb.numel_unpadded):
                return (f"{at}: index/numel/numel_unpadded {hb.bucket_idx}/{hb.numel}/{hb.numel_unpadded}, the "
                        f"runtime's rule gives {wb.bucket_idx}/{wb.numel}/{wb.numel_unpadded}")
            if len(hb.params) != len(wb.params):
                return f"{at}: {len(hb.params)} params, the runtime's rule gives {len(wb.params)}"
            for hp, wp in zip(hb.params, wb.params):
                if hp != wp:
                    return f"{at}: param {hp.name!r} is laid out as {_brief(hp)}, the runtime's rule gives {_brief(wp)}"
    return "the layouts differ"


def _brief(p: object) -> str:
    from dataclasses import asdict

    d = asdict(p)  # type: ignore[call-overload]
    return "{" + ", ".join(f"{k}={d[k]!r}" for k in ("name", "start", "end", "valid_numel", "local_shape")) + "}"


def check_canonical_layout(ckpt: Checkpoint) -> list[Problem]:
    """The manifest's ``buffers`` equal what its model/topology/bucket size/param dtype derive.

    Overlaps are refused in any layout. The derivation is compared where the layout's parameter
    names are stored keys, i.e. a layout this runtime wrote (as :mod:`.keys` decides): a layout
    written by another tool or by hand names no stored key, so no per-parameter read can use it
    (reshard and export refuse it as incomplete) and it is only swept for overlaps.
    """
    manifest = ckpt.manifest
    if manifest is None or manifest.buffers is None:
        return []
    out = overlapping_slices(manifest.buffers)
    if manifest.model is None or manifest.topology is None or manifest.param_dtype is None:
        return out
    names = {p.name for b in manifest.buffers for k in b.buckets for p in k.params}
    if names and not names & ckpt.entries.keys():
        return out
    bucket_size = manifest.bucket_size or derive_bucket_size(manifest.buffers, DEFAULT_BUCKET_SIZE)
    try:
        want = buffer_layouts(manifest.model, manifest.topology, bucket_size, manifest.param_dtype)
    except (ConfigError, ValueError, KeyError, ZeroDivisionError) as e:
        return out + [Problem("error", LAYOUT, f"the manifest's model and topology give no bucket layout ({e}); "
                              "the manifest was edited or belongs to another run")]
    if want != manifest.buffers and not out:
        out.append(Problem("error", LAYOUT, f"the manifest's bucket layout is not the one its model and topology "
                           f"give: {_first_difference(manifest.buffers, want)}; every per-parameter read trusts it, "
                           "so restore the manifest the run wrote"))
    return out


def check_key_dtypes(ckpt: Checkpoint) -> list[Problem]:
    """Model keys in ``param_dtype``, optimizer states float32, bucket numels int64."""
    m = ckpt.manifest
    if m is None or m.buffers is None:
        return []
    want: dict[str, str] = {}
    if m.param_dtype is not None:
        for buf in m.buffers:
            for b in buf.buckets:
                for p in b.params:
                    want[p.name] = m.param_dtype.removeprefix("torch.")
    out: list[Problem] = []
    for key, entry in ckpt.entries.items():
        if entry.kind != TENSOR or entry.dtype is None:
            continue
        need = want.get(key)
        if need is None:
            if parse_optimizer_key(key) is not None:
                need = "float32"
            elif parse_per_bucket_numel_key(key) is not None:
                need = "int64"
        if need is not None and entry.dtype.name != need:
            out.append(Problem("error", DTYPE, f"stored as {entry.dtype.name} but the manifest's layout gives {need}; "
                               "a copy would relabel its bits: restore the checkpoint the run wrote", key=key))
            if len(out) >= 3:
                break
    return out
