"""Placing the buffers of real plans kept as instances (tests/arena_instances: each a plan's buffers with their
lifetimes, from planner.simulator.allocations): per instance and search time, the arena `place()` finds over the
lower bound (the most bytes ever live), over the room its budget leaves where the instance keeps it, which pass
found it, and the wall time. Search time 0 is the greedy passes alone. The search is ended by a count of nodes, so
the arenas are the same on a loaded machine; the times are not.

    .venv/bin/python benchmarks/arena_search.py [--search 0,0.5,1,3] [--no-write]

Another checkout's placement on the same instances (before and after a change): copy this file into it and run
it there with `--instances` pointing here and `--no-write`.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results_file import publish_section  # noqa: E402
from planner.addresses import place  # noqa: E402
from tests.kept_buffers import load_kept_buffers  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "arena_search.md"
INTRO = ("# Placing kept plans' buffers\n\nMade by `benchmarks/arena_search.py` on the instances in "
         "`tests/arena_instances` (each a real plan's buffers). `arena / bound` is the arena over the most bytes "
         "ever live (1.0000: no arena can be smaller); `arena / room` the arena over what the plan's budget "
         "leaves beside fixed memory, where the instance keeps it (at most 1.0000: it fits).\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--search", default="0,0.5,1,3", help="search times in seconds, comma-separated")
    parser.add_argument("--instances", type=Path, default=ROOT / "tests" / "arena_instances")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    takes_room = "room_bytes" in inspect.signature(place).parameters
    rows = ["| instance | buffers | search s | arena / bound | arena / room | pass | wall ms |", "|" + " --- |" * 7]
    for path in sorted(args.instances.glob("*.json")):
        buffers, room = load_kept_buffers(path)
        for search_s in (float(s) for s in args.search.split(",")):
            began = time.perf_counter()
            found = place(buffers, search_s, room_bytes=room) if takes_room else place(buffers, search_s)
            wall_ms = 1000 * (time.perf_counter() - began)
            over_room = "" if room is None else f"{found.arena_bytes / room:.4f}"
            rows.append(f"| {path.stem} | {len(buffers)} | {search_s:g} | {1 + found.overhead:.4f} | {over_room} | "
                        f"{found.order} | {wall_ms:.0f} |")
    publish_section(RESULTS, INTRO, "Arena over the lower bound, by search time",
                    "python benchmarks/arena_search.py " + " ".join(sys.argv[1:]), "2 cores, CPU only", rows,
                    write=not args.no_write)


if __name__ == "__main__":
    main()
