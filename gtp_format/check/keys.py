"""Every key the manifest's layout implies is stored, with the shape the layout gives it.

Why this check exists: the other checks look at the keys a ``.metadata`` holds, so a key that is
simply absent (dropped by a damaged or hand-edited metadata file) went unnoticed; ``ckpt verify``
passed such a checkpoint and ``--load`` failed on every rank after they had started. The
manifest's ``buffers`` and ``topology`` name every key a gtp_runtime checkpoint must have:

* one model key per parameter (the layout's ``name``) with its ``global_shape``;
* one optimizer key per (dp_group_idx, buffer, bucket, state, and cp_rank for folded buffers),
  of shape ``[numel_unpadded]``, for every ``dp_group_idx`` some rank of the topology owns
  (:func:`gtp_format.layout.election.dp_group_idx`);
* ``per_bucket_numel`` and ``per_bucket_numel_unpadded`` for each of those ``dp_group_idx``.

Checkpoints without a manifest (Megatron's, foreign DCP) or whose manifest lacks the sections are
not checked here. A folded key whose cp-less twin is stored is left to the aliasing check, which
names the real problem (the pre-fix writer). Byte objects may carry Megatron's ShardedObject
suffix (``/shard_0_1``). When not one parameter name of the layout is a stored key, the names are
not model keys (a layout written by hand or by another tool) and only the optimizer keys are
checked, with an ``info`` saying so; one missing weight among stored ones is damage.
"""

from __future__ import annotations

from gtp_format.layout.election import dp_group_idx
from gtp_format.layout.topology import Topology
from gtp_format.manifest import Manifest
from gtp_format.model import Checkpoint, Problem
from gtp_format.names import SHARDED_OBJECT_RE, STATES, optimizer_key, per_bucket_numel_key

MAX_LISTED = 3  # missing keys named one by one; the rest are counted in one more problem


Expected = dict[str, tuple[tuple[int, ...] | None, str | None]]


def expected_keys(manifest: Manifest) -> tuple[Expected, set[str]] | None:
    """Key -> (global shape or None when any, its cp-less twin for folded keys), and which of the
    keys are model weights; None when the manifest lacks the topology or the buffers."""
    if manifest.topology is None or manifest.buffers is None:
        return None
    t = Topology(manifest.topology)
    out: Expected = {}
    weights: set[str] = set()
    owners_of: dict[bool, list[int]] = {}  # one pass over the world per kind, not per buffer
    for buf in manifest.buffers:
        if buf.is_expert not in owners_of:
            owners_of[buf.is_expert] = sorted({dp_group_idx(t, r, buf.is_expert) for r in range(t.world_size)})
        owners = owners_of[buf.is_expert]
        cp_ranks: list[int | None] = list(range(t.par.cp)) if buf.excludes_cp else [None]
        for b in buf.buckets:
            for p in b.params:
                out[p.name] = (p.global_shape, None)
                weights.add(p.name)
            for n in owners:
                for state in STATES:
                    twin = optimizer_key(n, buf.gbuf_idx, buf.dtype, b.bucket_idx, state, None)
                    for cp in cp_ranks:
                        key = optimizer_key(n, buf.gbuf_idx, buf.dtype, b.bucket_idx, state, cp)
                        out[key] = ((b.numel_unpadded,), twin if cp is not None else None)
        for n in owners:
            for unpadded in (False, True):
                out[per_bucket_numel_key(n, unpadded)] = (None, None)
    return out, weights


def check_manifest_keys(ckpt: Checkpoint) -> list[Problem]:
    """Keys the manifest's layout implies but the metadata lacks, or stores with another shape."""
    found = expected_keys(ckpt.manifest) if ckpt.manifest is not None else None
    if found is None:
        return []
    expected, weights = found
    out: list[Problem] = []
    if weights and not weights & ckpt.entries.keys():
        out.append(Problem("info", "manifest_keys", "no parameter name of the manifest's bucket layout is a stored "
                           "key; model weights not checked against it"))
        expected = {k: v for k, v in expected.items() if k not in weights}
    stored = set(ckpt.entries)
    stored.update(m.group("key") for k in ckpt.entries if (m := SHARDED_OBJECT_RE.match(k)))
    missing = []
    for key, (shape, twin) in expected.items():
        entry = ckpt.entries.get(key)
        if entry is None:
            if key not in stored and (twin is None or twin not in stored):
                missing.append(key)
        elif shape is not None and entry.shape is not None and tuple(entry.shape) != shape:
            out.append(Problem("error", "manifest_keys", f"global shape {list(entry.shape)} but the manifest's "
                               f"layout gives {list(shape)}", key=key))
    for key in missing[:MAX_LISTED]:
        out.append(Problem("error", "manifest_keys", "key is missing from the metadata although the manifest's "
                           "layout needs it (a damaged or edited metadata file?); use another iteration", key=key))
    if len(missing) > MAX_LISTED:
        out.append(Problem("error", "manifest_keys", f"{len(missing) - MAX_LISTED} more keys the manifest's layout "
                           "needs are missing from the metadata"))
    return out
