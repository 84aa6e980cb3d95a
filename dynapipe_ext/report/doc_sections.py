"""docs/BENCHMARKS.md is written by several benchmark tools: each owns the text between its
`<!-- NAME:start -->` and `<!-- NAME:end -->` markers and leaves the rest of the file alone."""
from __future__ import annotations

from pathlib import Path


def section_markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def replace_section(text: str, name: str, title: str, body: str) -> str:
    """`text` with section `name` replaced by `body` (appended under `## title` if missing)."""
    start, end = section_markers(name)
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        return head + block + rest.split(end, 1)[1]
    return (text.rstrip("\n") or "# Benchmarks") + f"\n\n## {title}\n{block}\n"


def write_section(path: str | Path, name: str, title: str, body: str) -> None:
    path = Path(path)
    text = path.read_text() if path.exists() else ""
    path.write_text(replace_section(text, name, title, body))
