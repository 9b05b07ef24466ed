"""Untrusted text (profile, node and algorithm names) made safe for HTML, and numbers made readable.

Every name reaches the page through `escape` (element text and attribute values) or
`json_for_script` (the data block the script reads with JSON.parse and shows with
textContent, never as markup).
"""

from __future__ import annotations

import html
import json
import math
import re

from planner.units import format_bytes

# C0/C1 controls (tab and newline excepted) and lone surrogates: no business in a name, and a surrogate
# cannot even be written as UTF-8. They become U+FFFD so that the name stays visibly odd instead of breaking.
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def clean(text: str) -> str:
    return _UNPRINTABLE.sub("\ufffd", text)


def escape(text: object) -> str:
    return html.escape(clean(str(text)), quote=True)


def json_for_script(data: object) -> str:
    """JSON that cannot end its <script> element or open a comment: '<', '>' and '&' as \\u escapes."""
    text = json.dumps(data, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def format_ms(value_ms: float) -> str:
    """Milliseconds with the precision people need at that size."""
    size = abs(value_ms)
    if size >= 100:
        return f"{value_ms:,.1f} ms"
    if size >= 1 or size == 0:
        return f"{value_ms:,.2f} ms"
    if size >= 0.001:
        return f"{value_ms * 1000:,.1f} µs"
    return f"{value_ms * 1e6:,.0f} ns"


def format_size(size_bytes: int | float | None) -> str:
    return format_bytes(size_bytes)


def nice_step(extent: float, target_count: int) -> float:
    """1, 2 or 5 times a power of ten, so that about `target_count` steps cover `extent`."""
    raw = extent / max(1, target_count)
    if not raw > 0 or not math.isfinite(raw):  # also a step so small that the division underflows (5e-324 ms)
        return 1.0
    power = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 5, 10):
        if raw <= factor * power:
            return factor * power
    return 10 * power


def tick_decimals(step: float) -> int:
    return max(0, -math.floor(math.log10(step) + 1e-9)) if step > 0 else 0


def ticks(low: float, high: float, target_count: int) -> tuple[list[float], int]:
    """Tick values within [low, high] and the decimals their labels need."""
    step = nice_step(high - low, target_count)
    first = math.ceil(low / step - 1e-9)
    values = []
    index = first
    while index * step <= high + step * 1e-9:
        values.append(index * step)
        index += 1
    return values, tick_decimals(step)
