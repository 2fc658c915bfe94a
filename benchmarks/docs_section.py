"""Replace (or append) one ``## title`` section of docs/performance.md.

Shared by the benchmark scripts' ``--write-docs``: the section runs from its ``## {title}`` line
up to the next ``## `` heading (or the end of the file); a missing section is appended.
"""

from __future__ import annotations

from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "performance.md"


def write_section(title: str, body: str, doc: Path = DOC) -> None:
    """Write ``## {title}`` followed by ``body`` into ``doc``, replacing that section if present."""
    heading = f"## {title}"
    section = f"{heading}\n\n{body.strip(chr(10))}\n"
    text = doc.read_text() if doc.exists() else "# Performance\n"
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip("\n") == heading), None)
    if start is None:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        tail = "".join(lines[end:])
        text = "".join(lines[:start]) + section + ("\n" + tail if tail else "")
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


def write_report(title: str, intro: str, command: str, table: str, notes: list[str], doc: Path = DOC) -> None:
    """The benchmarks' section layout: what was measured and where, the command, the table, the notes."""
    write_section(title, "\n".join([intro, "", "```", command, "```", "", table, "", *notes, ""]), doc)
