"""The chart as SVG: three stream lanes and the memory curve on one time axis.

Spans and the memory curve are drawn once, in data coordinates (x in milliseconds)
inside one group whose transform the page's script changes to zoom and pan: a
zoom is one attribute write, whatever the plan's size. Text that must not stretch
(time ticks, labels inside bars) is placed by the script for the visible window;
the time ticks are also drawn here so that the picture reads without it.
"""

from __future__ import annotations

from planner.viewer.facts import PlanFacts
from planner.viewer.text import escape, ticks

WIDTH = 1200
LEFT = 124
RIGHT = 24
PLOT_WIDTH = WIDTH - LEFT - RIGHT
LANE_TOP = 14
LANE_HEIGHT = 30
LANE_GAP = 8
LANE_NAMES = {"compute": "compute", "d2h": "device → host", "h2d": "host → device"}
LANES = {stream: LANE_TOP + i * (LANE_HEIGHT + LANE_GAP) for i, stream in enumerate(LANE_NAMES)}
MEMORY_TOP = LANE_TOP + 3 * (LANE_HEIGHT + LANE_GAP) + 18
MEMORY_HEIGHT = 240
AXIS_Y = MEMORY_TOP + MEMORY_HEIGHT
HEIGHT = AXIS_Y + 44
TIME_TICKS = 10  # drawn here for WIDTH; the script keeps about one tick per TICK_SPACING pixels
TICK_SPACING = 105
MIN_WIDTH = 760  # narrower windows scroll the chart sideways rather than squeeze it
MAX_ZOOM = 1e5  # the narrowest window is the step / MAX_ZOOM
CHUNK_ITEMS = 64
CHUNKS_PER_DOMAIN = 512
_DRAW_ORDER = {"compute": 0, "offload": 0, "prefetch": 0, "recompute": 1, "stall": 2}
_MEMORY_UNITS = ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))


def _number(value: float) -> str:
    return f"{value:.9g}"


def memory_unit(largest_bytes: int) -> tuple[int, str]:
    """The axis unit follows the largest figure, so a small profile is not drawn as 0.00 GiB."""
    return next(((size, name) for size, name in _MEMORY_UNITS if largest_bytes >= size), (1, "B"))


class MemoryScale:
    def __init__(self, facts: PlanFacts):
        result = facts.result
        largest = max(result.peak_memory_bytes, result.budget_bytes or 0, result.fixed_memory_bytes, 1)
        self.unit_bytes, self.unit = memory_unit(largest)
        self.ticks, self.decimals = ticks(0.0, largest * 1.08 / self.unit_bytes, 5)
        self.top_bytes = max(largest * 1.08, self.ticks[-1] * self.unit_bytes)

    def y(self, size_bytes: float) -> float:
        return AXIS_Y - size_bytes / self.top_bytes * MEMORY_HEIGHT


def layout(facts: PlanFacts, scale: MemoryScale) -> dict:
    """What the script needs to know of the drawing."""
    return {
        "left": LEFT,
        "plot_width": PLOT_WIDTH,
        "right": RIGHT,
        "height": HEIGHT,
        "min_width": MIN_WIDTH,
        "tick_spacing": TICK_SPACING,
        "lanes": {stream: [top, LANE_HEIGHT] for stream, top in LANES.items()},
        "memory": [MEMORY_TOP, MEMORY_HEIGHT],
        "axis_y": AXIS_Y,
        "memory_top_bytes": scale.top_bytes,
        "memory_unit": [scale.unit_bytes, scale.unit],
        "max_zoom": MAX_ZOOM,
    }


def _chunks(items: list, start_of, end_of, domain_ms: float) -> list[list]:
    """Runs of at most CHUNK_ITEMS items spanning at most domain/CHUNKS_PER_DOMAIN (a longer item stays alone).

    Each run is drawn relative to its own start, so the coordinates a zoomed transform multiplies stay small
    and the browser's single-precision geometry stays exact to a fraction of a pixel at MAX_ZOOM.
    """
    limit = domain_ms / CHUNKS_PER_DOMAIN
    runs: list[list] = []
    for item in items:
        if runs and len(runs[-1]) < CHUNK_ITEMS and end_of(item) - start_of(runs[-1][0]) <= limit:
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs


def _chunk_open(base: float, start: float, end: float, domain_ms: float) -> str:
    """A chunk placed for the whole step; the script moves it for other windows."""
    scale = PLOT_WIDTH / domain_ms
    return (
        f'<g class="chunk" data-base="{_number(base)}" data-start="{_number(start)}" data-end="{_number(end)}" '
        f'transform="translate({LEFT + base * scale:.9g},0) scale({scale:.9g},1)">'
    )


def _lane(facts: PlanFacts, stream: str) -> str:
    top = LANES[stream]
    parts = [f'<g id="lane-{stream}" data-stream="{stream}">']
    previous_kind, alternate = None, False
    for run in _chunks(facts.spans[stream], lambda s: s.start_ms, lambda s: s.end_ms, facts.domain_ms):
        base = run[0].start_ms
        parts.append(_chunk_open(base, base, max(span.end_ms for span in run), facts.domain_ms))
        rects = []
        for span in run:
            # Neighbours of one kind alternate two shades, so back-to-back operations stay apart.
            alternate = not alternate if span.kind == previous_kind else False
            previous_kind = span.kind
            css = f"{span.kind} alt" if alternate else span.kind
            rects.append((
                _DRAW_ORDER[span.kind],
                f'<rect class="{css}" x="{_number(span.start_ms - base)}" y="{top}" '
                f'width="{_number(max(0.0, span.end_ms - span.start_ms))}" height="{LANE_HEIGHT}"/>',
            ))
        # Recomputes and stalls go on top, so that their one-pixel outline survives sub-pixel neighbours.
        parts.extend(rect for _, rect in sorted(rects, key=lambda item: item[0]))
        parts.append("</g>")
    parts.append("</g>")
    return "".join(parts)


def memory_instants(facts: PlanFacts) -> list[tuple[float, int, int]]:
    """(time, highest, last) bytes in use per instant of the timeline.

    Several events often share an instant (a free, then the next allocation). The curve keeps the highest
    value of each instant, so a transient peak shows as the simulator counts it, and drops the dips between
    a free and an allocation at one instant, which hold for no time and would only add noise.
    """
    instants: list[tuple[float, int, int]] = []
    for point in facts.result.memory_timeline:
        if instants and instants[-1][0] == point.time_ms:
            time_ms, highest, _ = instants[-1]
            instants[-1] = (time_ms, max(highest, point.used_bytes), point.used_bytes)
        else:
            instants.append((point.time_ms, point.used_bytes, point.used_bytes))
    return instants


def _memory_paths(facts: PlanFacts, scale: MemoryScale) -> str:
    """The step curve of memory in use, and the area under it, in chunks that together cover [0, domain]."""
    instants = memory_instants(facts)
    end_ms = max(facts.domain_ms, instants[-1][0])
    runs = _chunks(list(enumerate(instants)), lambda item: item[1][0], lambda item: item[1][0], facts.domain_ms)
    parts = ['<g id="memory">']
    for number, run in enumerate(runs):
        base = run[0][1][0]
        stop = runs[number + 1][0][1][0] if number + 1 < len(runs) else end_ms
        before = instants[max(0, run[0][0] - 1)][2]
        steps = []
        for position, (_, (time_ms, highest, last)) in enumerate(run):
            if position:
                steps.append(f"H{_number(time_ms - base)}")
            if highest > last:
                steps.append(f"V{scale.y(highest):.2f}")
            steps.append(f"V{scale.y(last):.2f}")
        path = "".join(steps) + f"H{_number(stop - base)}"
        parts.append(
            _chunk_open(base, base, stop, facts.domain_ms)
            + f'<path class="memory-area" d="M0,{AXIS_Y}{path}V{AXIS_Y}Z"/>'
            + f'<path class="memory-line" d="M0,{scale.y(before):.2f}{path}"/>'
            + "</g>"
        )
    parts.append("</g>")
    return "".join(parts)


def _time_axis(facts: PlanFacts) -> str:
    values, decimals = ticks(0.0, facts.domain_ms, TIME_TICKS)
    parts = ['<g id="time-axis">']
    for value in values:
        x = LEFT + value / facts.domain_ms * PLOT_WIDTH
        parts.append(
            f'<line class="grid" x1="{x:.2f}" x2="{x:.2f}" y1="{LANE_TOP}" y2="{AXIS_Y + 5}"/>'
            f'<text class="tick" x="{x:.2f}" y="{AXIS_Y + 18}" text-anchor="middle">{value:,.{decimals}f}</text>'
        )
    parts.append("</g>")
    return "".join(parts)


def _memory_axis(facts: PlanFacts, scale: MemoryScale) -> str:
    parts = ['<g id="memory-axis">']
    for value in scale.ticks:
        size_bytes = value * scale.unit_bytes
        y = scale.y(size_bytes)
        parts.append(
            f'<line class="grid" data-bytes="{size_bytes:.0f}" data-stretch="x2" x1="{LEFT}" x2="{LEFT + PLOT_WIDTH}" '
            f'y1="{y:.2f}" y2="{y:.2f}"/>'
            f'<text class="tick" data-bytes="{size_bytes:.0f}" x="{LEFT - 8}" y="{y + 4:.2f}" text-anchor="end">'
            f"{value:,.{scale.decimals}f}</text>"
        )
    middle = MEMORY_TOP + MEMORY_HEIGHT / 2
    parts.append(
        f'<text class="axis-title" x="18" y="{middle:.1f}" text-anchor="middle" '
        f'transform="rotate(-90 18 {middle:.1f})">device memory ({scale.unit})</text>'
    )
    parts.append("</g>")
    return "".join(parts)


def _memory_lines(facts: PlanFacts, scale: MemoryScale) -> str:
    result = facts.result
    right = LEFT + PLOT_WIDTH
    parts = []
    fixed_y = scale.y(result.fixed_memory_bytes)
    parts.append(f'<line id="fixed-line" data-stretch="x2" x1="{LEFT}" x2="{right}" y1="{fixed_y:.2f}" y2="{fixed_y:.2f}"/>')
    if result.budget_bytes is not None:
        y = scale.y(result.budget_bytes)
        parts.append(
            f'<line id="budget-line" data-bytes="{result.budget_bytes}" data-stretch="x2" x1="{LEFT}" x2="{right}" '
            f'y1="{y:.2f}" y2="{y:.2f}"/>'
            f'<text id="budget-label" class="line-label" data-stretch="right:6" x="{right - 6}" y="{y - 5:.2f}" '
            f'text-anchor="end">'
            f"budget {result.budget_bytes / scale.unit_bytes:,.2f} {scale.unit}</text>"
        )
    return "".join(parts)


def chart_svg(facts: PlanFacts, scale: MemoryScale) -> str:
    result = facts.result
    domain = facts.domain_ms
    peak_y = scale.y(result.peak_memory_bytes)
    lane_labels = "".join(
        f'<text class="lane-name" x="{LEFT - 8}" y="{top + LANE_HEIGHT / 2 + 4}" text-anchor="end">{escape(name)}</text>'
        f'<rect class="lane-bg" data-stretch="width" x="{LEFT}" y="{top}" width="{PLOT_WIDTH}" height="{LANE_HEIGHT}"/>'
        for (stream, name), top in zip(LANE_NAMES.items(), LANES.values())
    )
    empty = "".join(
        f'<text class="lane-empty" data-stretch="center" x="{LEFT + PLOT_WIDTH / 2}" '
        f'y="{LANES[stream] + LANE_HEIGHT / 2 + 4}" '
        f'text-anchor="middle">no {"offloads" if stream == "d2h" else "prefetches"}</text>'
        for stream in ("d2h", "h2d")
        if not facts.spans[stream]
    )
    return (
        f'<svg id="chart" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'data-t0="0" data-t1="{_number(domain)}" tabindex="0" role="img" '
        f'aria-label="streams and device memory over the step">'
        f'<defs><clipPath id="plot-clip"><rect data-stretch="width" x="{LEFT}" y="0" width="{PLOT_WIDTH}" '
        f'height="{HEIGHT}"/></clipPath></defs>'
        f"{lane_labels}"
        f'<rect class="memory-bg" data-stretch="width" x="{LEFT}" y="{MEMORY_TOP}" width="{PLOT_WIDTH}" '
        f'height="{MEMORY_HEIGHT}"/>'
        f'<g clip-path="url(#plot-clip)">'
        f'<g id="zoom">'
        f"{''.join(_lane(facts, stream) for stream in LANE_NAMES)}"
        f"{_memory_paths(facts, scale)}"
        f"{_chunk_open(result.peak_time_ms, result.peak_time_ms, result.peak_time_ms, domain)}"
        f'<line id="peak-line" x1="0" x2="0" y1="{peak_y:.2f}" y2="{AXIS_Y}"/></g>'
        f"</g>"
        f'<g id="labels"></g>'
        f"</g>"
        f"{_memory_axis(facts, scale)}{_time_axis(facts)}"
        f"{_memory_lines(facts, scale)}{empty}"
        f'<line id="axis-line" data-stretch="x2" x1="{LEFT}" x2="{LEFT + PLOT_WIDTH}" y1="{AXIS_Y}" y2="{AXIS_Y}"/>'
        f'<text class="axis-title" data-stretch="center" x="{LEFT + PLOT_WIDTH / 2}" y="{AXIS_Y + 38}" '
        f'text-anchor="middle">time (ms)</text>'
        f'<g id="hover-marks"></g>'
        f'<line id="cursor" x1="0" x2="0" y1="{LANE_TOP}" y2="{AXIS_Y}" visibility="hidden"/>'
        f"</svg>"
    )
