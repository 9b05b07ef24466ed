"""Checks of command-line options made before any work starts, so a mistake never costs a finished solve."""

from __future__ import annotations

import math
from pathlib import Path

from planner.errors import MososError


def writable_output(path: Path | None, option: str, suffixes: tuple[str, ...] | None = None) -> None:
    """Refuse, up front, an output path that cannot be written: a folder, a missing folder, a wrong suffix."""
    if path is None:
        return
    if path.is_dir():
        raise MososError(f"{option} {path} is a directory; give a file name")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise MososError(f"{option} {path}: the folder {parent} does not exist")
    if suffixes is not None and path.suffix.lower() not in suffixes:
        raise MososError(f"{option} {path}: the file name must end in {' or '.join(suffixes)}")


def write_output(path: Path, content: str | bytes, option: str) -> None:
    """Write a result; a failure (disk full, permissions) is a message that names the option, not a traceback."""
    try:
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    except OSError as error:
        raise MososError(f"cannot write {option} {path}: {error.strerror or error}") from None


def positive_finite(value: float | None, option: str) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise MososError(f"{option} must be a positive number, not {value}")


def whole_number_in(value: int | None, option: str, lowest: int, highest: int) -> None:
    if value is not None and not lowest <= value <= highest:
        raise MososError(f"{option} must be between {lowest} and {highest}, not {value}")
