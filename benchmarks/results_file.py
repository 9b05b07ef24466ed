"""Results files made of `## ` sections: a benchmark run replaces its own section and keeps the others."""

from __future__ import annotations

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
