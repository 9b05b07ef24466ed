"""Kept instances of real plans' buffers (tests/arena_instances/*.json): sizes and lifetimes as
planner.simulator.allocations gave them, and the room the plan's budget left where the instance keeps it."""

from __future__ import annotations

import json
from pathlib import Path

from planner.simulator import Allocation

INSTANCES = sorted((Path(__file__).parent / "arena_instances").glob("*.json"))


def load_kept_buffers(path: Path) -> tuple[list[Allocation], int | None]:
    data = json.loads(path.read_text())
    buffers = [Allocation(i, 0, f"t{i}", False, size, start, end)
               for i, (size, start, end) in enumerate(zip(data["size_bytes"], data["start"], data["end"]))]
    return buffers, data.get("room_bytes")
