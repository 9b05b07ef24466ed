"""`mosos import-graph`: Checkmate / Moccasin node-link graphs to profiles."""

from __future__ import annotations

from pathlib import Path

import typer

from cli.app import app, console, friendly
from planner.errors import MososError
from cli.checks import distinct_files, positive_finite, writable_output, write_output
from planner.importer import import_graph
from planner.units import format_bytes, parse_bytes


@app.command("import-graph")
@friendly
def import_graph_command(
    graph: Path = typer.Argument(..., help="networkx node-link JSON (Checkmate or random layered dialect)"),
    output: Path = typer.Option(..., "-o", "--output", help="where to write the profile"),
    name: str = typer.Option(None, help="profile name (default: the graph's name)"),
    time_unit_ms: float = typer.Option(1.0, help="milliseconds per unit of the graph's compute cost"),
    memory_capacity: str = typer.Option(None, help="device memory, e.g. 16GiB (default: all tensors at once)"),
    d2h_gb_per_s: float = typer.Option(None, "--d2h-gb-per-s", help="device-to-host bandwidth, GB/s"),
    h2d_gb_per_s: float = typer.Option(None, "--h2d-gb-per-s", help="host-to-device bandwidth, GB/s"),
) -> None:
    """Turn a published training graph into a profile with one implementation per node."""
    writable_output(output, "-o")
    distinct_files({"GRAPH": graph}, {"-o": output})
    positive_finite(time_unit_ms, "--time-unit-ms")
    positive_finite(d2h_gb_per_s, "--d2h-gb-per-s")
    positive_finite(h2d_gb_per_s, "--h2d-gb-per-s")
    capacity_bytes = parse_bytes(memory_capacity) if memory_capacity else None
    if capacity_bytes == 0:
        raise MososError("--memory-capacity must be more than 0 bytes")
    profile = import_graph(
        graph,
        name=name,
        time_unit_ms=time_unit_ms,
        memory_capacity_bytes=capacity_bytes,
        d2h_bandwidth_gb_per_s=d2h_gb_per_s,
        h2d_bandwidth_gb_per_s=h2d_gb_per_s,
    )
    write_output(output, profile.to_json(), "-o")
    total = sum(node.size_bytes for node in profile.nodes)
    console.print(
        f"wrote {output}: {len(profile.nodes)} nodes, "
        f"{sum(len(node.inputs) for node in profile.nodes)} edges, tensors {format_bytes(total)}"
    )
