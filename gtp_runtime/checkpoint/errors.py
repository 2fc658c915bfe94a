"""The runtime's checkpoint error: one line that names the folder or key and the fix.

Its own module because saving (:mod:`io`) and the verified load path (:mod:`verified`) both raise
it, and the launcher reports it as a user-facing error rather than a crash; so does the one rule
both apply before anything is written or read (:func:`sharding_refusal`).
"""

from __future__ import annotations

from gtp_format import names as fmt


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded as asked. One line, names the fix."""


class CheckpointSaveError(RuntimeError):
    """A save that failed while writing (full disk, removed folder, a rank that failed).

    Not a :class:`CheckpointError`: the input was fine and the run's state is lost unless it is
    saved again, so the run exits 1 (a failure), not 2 (a usage error). One line: the folder that
    was being written, the cause, and which checkpoint is still the latest.
    """


def sharding_refusal(sharding: str, folded: bool, action: str) -> None:
    """Refuse an optimizer sharding that would write (or read) a wrong checkpoint."""
    if sharding not in fmt.OPTIMIZER_SHARDINGS:
        raise CheckpointError(f"unknown --optimizer-sharding {sharding!r}; use one of {fmt.OPTIMIZER_SHARDINGS}")
    if sharding == fmt.FORMAT_NAME:
        return
    if folded:
        raise CheckpointError(f"cannot {action}: " + fmt.folded_refusal(sharding))
    raise CheckpointError(f"cannot {action}: optimizer sharding {sharding!r} is not implemented by gtp_runtime "
                          "(it would gather buffers over DP x CP); use 'dp_reshardable'")
