"""The runtime's checkpoint error: one line that names the folder or key and the fix.

Its own module because saving (:mod:`io`) and the verified load path (:mod:`verified`) both raise
it, and the launcher reports it as a user-facing error rather than a crash.
"""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded as asked. One line, names the fix."""
