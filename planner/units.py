"""Byte sizes as people write them: '10GiB', '12 GB', '10737418240'."""

from __future__ import annotations

import re

from planner.errors import BudgetError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pb": 10**15,
    "pib": 2**50,
}
MAX_SIZE_BYTES = 2**60  # 1 EiB: a bound that keeps budgets finite and inside int64
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def _fraction_of_a_byte(shown: str, number: str) -> BudgetError:
    return BudgetError(f"a size in bytes is a whole number, not {shown}: give a unit for a fraction "
                       f"({number} GiB is '{number}GiB')")


def parse_bytes(text: str | int | float) -> int:
    if isinstance(text, bool):
        raise BudgetError(f"a size is a number of bytes or a string like '10GiB', not {text!r}")
    if isinstance(text, float):
        if text != text or text in (float("inf"), float("-inf")):
            raise BudgetError(f"a size is a finite number of bytes, not {text!r}")
        if not text.is_integer():  # 4.5 is no number of bytes: a unit left out ('4.5GiB'), not 4 bytes
            raise _fraction_of_a_byte(repr(text), f"{text:g}")
        text = int(text)
    if isinstance(text, int):
        if text < 0:
            raise BudgetError(f"a size in bytes cannot be negative: {text}")
        if text > MAX_SIZE_BYTES:
            raise BudgetError(f"{text} bytes is larger than any memory ({format_bytes(MAX_SIZE_BYTES)} at most)")
        return text
    match = _PATTERN.match(str(text))
    if not match:
        raise BudgetError(f"cannot read {text!r} as a size: write bytes (10737418240) or a unit (10GiB, 12GB, 512MiB)")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise BudgetError(f"unknown size unit {unit!r} in {text!r}; use B, KB, MB, GB, TB, PB, KiB, MiB, GiB, TiB or PiB")
    value = float(number) * factor
    if not value <= MAX_SIZE_BYTES:
        raise BudgetError(f"{text!r} is larger than any memory ({format_bytes(MAX_SIZE_BYTES)} at most)")
    if factor == 1 and not value.is_integer():
        raise _fraction_of_a_byte(repr(text), number)
    return int(round(value))


def format_bytes(size_bytes: int | float | None) -> str:
    if size_bytes is None:
        return "-"
    size = float(size_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if abs(size) < 1024 or unit == "EiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
