"""Checks of command-line options made before any work starts, so a mistake never costs a finished solve."""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from pathlib import Path
from typing import Iterator

from planner.errors import MososError
# Imports inside functions here are deferred for start-up time: a command loads what it alone uses when it runs:
# `mosos --help` and the light commands start without OR-Tools, torch, the service or Ray.


def writable_output(path: Path | None, option: str, suffixes: tuple[str, ...] | None = None) -> None:
    """Refuse, up front, an output path that cannot be written: a folder, a missing folder, a wrong suffix."""
    if path is None:
        return
    if str(path) == "-":  # read by many tools as standard output; here it would be a file named "-"
        raise MososError(f"{option} -: give a file name (the results are printed; write them to a file with {option})")
    if path.is_dir():
        raise MososError(f"{option} {path} is a directory; give a file name")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise MososError(f"{option} {path}: the folder {parent} does not exist")
    if suffixes is not None and path.suffix.lower() not in suffixes:
        raise MososError(f"{option} {path}: the file name must end in {' or '.join(suffixes)}")
    if os.path.exists(path) and not os.path.isfile(path):
        return  # a device or a pipe (/dev/null, /dev/stdout): written in place, as it is
    try:  # a file can be made there (a read-only folder, /proc), as the write will need
        handle, probe = tempfile.mkstemp(dir=os.path.realpath(parent), prefix=f".{path.name}.", suffix=".probe")
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        raise MososError(f"{option} {path}: cannot write in the folder {parent}: {error.strerror or error}") from None


def distinct_files(inputs: dict[str, Path | None], outputs: dict[str, Path | None]) -> None:
    """Refuse, up front, an output that would overwrite one of the command's inputs or another of its outputs: the
    command would read a file it then destroys, or write one result over another."""
    seen: list[tuple[str, Path, Path]] = []
    for option, path in [*inputs.items(), *outputs.items()]:
        if path is not None:
            seen.append((option, path, Path(os.path.realpath(path))))
    for index, (option, path, real) in enumerate(seen):
        if option not in outputs:
            continue
        for other_option, other_path, other_real in seen[:index]:
            if real == other_real:
                role = "the input" if other_option in inputs else "the output"
                raise MososError(f"{option} {path} is {role} {other_option} ({other_path}): give another file name")


def workload_file(spec: str | None) -> Path | None:
    """The user's code file in a workload spec `path/to/file.py:build` (None for a module path or a network)."""
    if spec is None or ":" not in spec:
        return None
    path = spec.rsplit(":", 1)[0]
    return Path(path) if path.endswith(".py") else None


@contextlib.contextmanager
def replacing(path: Path, option: str) -> Iterator[Path]:
    """A file to write in place of `path`, which replaces it only once written whole: a write that fails (a full
    disk, no permission) leaves the old file as it was and no part of the new one, and says which file failed.
    The name keeps `path`'s suffix, from which a plot takes its format."""
    target = Path(os.path.realpath(path))
    in_place = target.exists() and not target.is_file()  # a device or a pipe: nothing to keep, never to replace
    if target.exists() and not in_place and not os.access(target, os.W_OK):
        raise MososError(f"cannot write {option} {path}: Permission denied")  # made read-only: not replaced
    temporary: Path | None = None
    try:
        if in_place:
            yield target
            return
        handle, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=target.suffix)
        os.close(handle)
        temporary = Path(name)
        yield temporary
        _take_mode(temporary, target)
        os.replace(temporary, target)
        temporary = None
    except OSError as error:
        raise MososError(f"cannot write {option} {path}: {error.strerror or error}") from None
    finally:
        if temporary is not None:
            with contextlib.suppress(OSError):
                temporary.unlink()


def _take_mode(temporary: Path, target: Path) -> None:
    """The replaced file's permissions, or a new file's (mkstemp makes it private to its owner)."""
    if target.exists():
        os.chmod(temporary, target.stat().st_mode & 0o7777)
        return
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(temporary, 0o666 & ~umask)


def write_output(path: Path, content: str | bytes, option: str) -> None:
    """Write a result; a failure (disk full, permissions) is a message that names the option, not a traceback,
    and loses nothing (see `replacing`)."""
    with replacing(path, option) as temporary:
        if isinstance(content, bytes):
            temporary.write_bytes(content)
        else:
            temporary.write_text(content)


def positive_finite(value: float | None, option: str) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise MososError(f"{option} must be a positive number, not {value}")


def time_limit_within(value: float | None, option: str = "--time-limit") -> None:
    """A positive, finite time limit of at most a day (the planner's own bound), checked before any work."""
    from planner.planning import MAX_TIME_LIMIT_S

    positive_finite(value, option)
    if value is not None and value > MAX_TIME_LIMIT_S:
        raise MososError(f"{option} must be at most {MAX_TIME_LIMIT_S} seconds (a day), not {value:g}")


def whole_number_in(value: int | None, option: str, lowest: int, highest: int) -> None:
    if value is not None and not lowest <= value <= highest:
        raise MososError(f"{option} must be between {lowest} and {highest}, not {value}")
