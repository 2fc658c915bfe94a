"""The one exception type the CLI turns into a clean exit.

Every message is a single line that names the file or key at fault and says what to do about
it: people run ``ckpt`` on a checkpoint they are worried about, often from scripts that parse
stderr, so a traceback or a multi-line dump is the wrong answer to bad input.
"""

from __future__ import annotations

EXIT_CHECK_FAILED = 1
EXIT_BAD_INPUT = 2


class FormatError(Exception):
    """Input the CLI cannot use (exit 2) or a check that failed (exit 1).

    Newlines in the message are folded into spaces so the one-line promise holds even when a
    file name or an exception text carries one.
    """

    def __init__(self, message: str, exit_code: int = EXIT_BAD_INPUT) -> None:
        super().__init__(" ".join(message.splitlines()))
        self.exit_code = exit_code

    @property
    def message(self) -> str:
        return str(self.args[0])


class ChunkError(FormatError):
    """One stored chunk cannot be read or does not match its metadata.

    ``verify`` catches it and records a problem; ``show`` and ``diff`` let it end the command.
    """

    def __init__(self, message: str, key: str | None = None, chunk: int | None = None,
                 file: str | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.chunk = chunk
        self.file = file
