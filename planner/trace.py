"""Chrome trace JSON (Perfetto, chrome://tracing): one track per stream, plus a memory counter."""

from __future__ import annotations

import json
from pathlib import Path

from planner.simulator import STREAMS, SimulationResult

_TRACK_NAMES = {"compute": "compute stream", "d2h": "device-to-host copies", "h2d": "host-to-device copies"}


def chrome_trace(result: SimulationResult, title: str = "mosos schedule") -> dict:
    """Times in the trace are microseconds, as the format wants."""
    events: list[dict] = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": title}}]
    for tid, stream in enumerate(STREAMS, start=1):
        events.append({"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": _TRACK_NAMES[stream]}})
        events.append({"ph": "M", "pid": 1, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
    track = {stream: tid for tid, stream in enumerate(STREAMS, start=1)}
    for span in result.spans:
        events.append(
            {
                "ph": "X",
                "pid": 1,
                "tid": track[span.stream],
                "name": span.label,
                "cat": "stall" if span.label.startswith("stall") else span.stream,
                "ts": span.start_ms * 1000.0,
                "dur": max(0.0, span.end_ms - span.start_ms) * 1000.0,
                "args": {"stage": span.stage},
            }
        )
    for point in result.memory_timeline:
        events.append(
            {"ph": "C", "pid": 1, "name": "device memory", "ts": point.time_ms * 1000.0, "args": {"bytes": point.used_bytes}}
        )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"peak_memory_bytes": result.peak_memory_bytes}}


def write_chrome_trace(result: SimulationResult, path: str | Path, title: str = "mosos schedule") -> None:
    Path(path).write_text(json.dumps(chrome_trace(result, title)))
