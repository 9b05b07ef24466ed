"""Results files made of `## ` sections: a benchmark run replaces its own section and keeps the others."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path


def write_section(path: Path, intro: str, section: str) -> None:
    """Write `intro` and every section, `section` replacing the one with its heading; sorted by heading."""
    sections: dict[str, str] = {}
    if path.exists():
        for chunk in path.read_text().split("\n## ")[1:]:
            sections[chunk.split("\n", 1)[0]] = "## " + chunk.rstrip() + "\n"
    sections[section.split("\n", 1)[0][3:]] = section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(intro + "".join("\n" + body for _, body in sorted(sections.items())))


def publish_section(path: Path, intro: str, heading: str, command: str, setting: str, body: list[str],
                    write: bool = True) -> None:
    """Print a section (its heading, the command with when and where it ran, the body) and, with `write`, put it
    in the results file at `path` in place of the one with its heading."""
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = "\n".join([f"## {heading}", "", f"`{command}` ({stamp}; {setting})", "", *body, ""])
    print(text)
    if write:
        write_section(path, intro, text)
        print(f"wrote {path.relative_to(path.parents[2])}")
