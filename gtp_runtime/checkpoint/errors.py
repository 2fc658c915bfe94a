"""The runtime's checkpoint error: one line that names the folder or key and the fix.

Its own module because saving (:mod:`io`) and the verified load path (:mod:`verified`) both raise
it, and the launcher reports it as a user-facing error rather than a crash.
"""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded as asked. One line, names the fix."""


class CheckpointSaveError(RuntimeError):
    """A save that failed while writing (full disk, removed folder, a rank that failed).

    Not a :class:`CheckpointError`: the input was fine and the run's state is lost unless it is
    saved again, so the run exits 1 (a failure), not 2 (a usage error). One line: the folder that
    was being written, the cause, and which checkpoint is still the latest.
    """
