"""Bound the counts a manifest declares by what the checkpoint really stores, before any walk.

Why: the manifest is a small JSON file anyone can edit, and its topology decides how much work the
readers do. A 4 KB edit to ``world_size`` 10**9 (``dp`` 10**9) made ``ckpt verify`` walk a
world-long range per buffer (:func:`gtp_format.check.keys.expected_keys`) and ``inspect
--params`` build world-sized DP groups (:func:`gtp_format.views.ours.dp_members`): minutes and gigabytes from
nothing stored. The bounds, each a fact of every complete ``dp_reshardable``
checkpoint, are checked here, once, by :func:`gtp_format.reader.checkpoint.open_checkpoint`, so
every command and ``--load`` gets them before anything uses the topology:

* **world size <= stored chunks.** Every rank owns a distinct, non-empty slice of every bucket
  (buckets are padded to a multiple of ``lcm(dp, 64)``), written as a chunk of its own, so a
  checkpoint of W ranks records at least W chunks (the fixtures: 4-8 ranks, 184-250 chunks).
* **implied optimizer keys <= stored keys.** Each (dp_group_idx, buffer, bucket, state) is stored
  under at least one key (its ``.cp_rank_{i}`` keys, or the cp-less twin the pre-fix writer
  left), so a layout implying more than the metadata holds describes another checkpoint.

What is left is proportional to what is stored: the expected-key check costs at most ``cp``
keys per stored key, and ``cp`` is itself at most the world size.
"""

from __future__ import annotations

from gtp_format.manifest import Manifest, ManifestError
from gtp_format.model import Entry
from gtp_format.names import MANIFEST_FILE, STATES


def owner_count(manifest: Manifest, is_expert: bool) -> int:
    """Distinct ``dp_group_idx`` values of a buffer (:func:`gtp_format.layout.election.dp_group_idx`),
    by arithmetic: tp x gtp_remat dense positions, tp x expert_gtp_remat expert ones."""
    par = manifest.topology
    assert par is not None
    return par.tp * (par.expert_gtp_remat if is_expert else par.gtp_remat)


def check_declared_counts(manifest: Manifest, entries: dict[str, Entry], folder: str) -> None:
    """Refuse (:class:`ManifestError`, exit 2) a manifest whose topology or bucket layout declares
    more than the metadata stores; see the module docstring for the two bounds."""
    par = manifest.topology
    if par is None:
        return
    where = f"{folder}/{MANIFEST_FILE}"
    fix = "the manifest was edited or belongs to another checkpoint: restore it from the run that wrote the checkpoint"
    chunks = sum(len(e.chunks) for e in entries.values())
    if par.world_size > max(1, chunks):
        raise ManifestError(f"{where}: topology {par.describe()} declares {par.world_size} ranks, but the metadata "
                            f"stores only {chunks} chunks (every rank writes at least one); {fix}")
    implied = sum(owner_count(manifest, b.is_expert) * len(b.buckets) * len(STATES) for b in manifest.buffers or ())
    if implied > len(entries):
        raise ManifestError(f"{where}: the bucket layout over topology {par.describe()} implies {implied} optimizer "
                            f"keys, but the metadata stores only {len(entries)} keys; {fix}")
