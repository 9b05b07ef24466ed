"""Import the networkx node-link training graphs that Checkmate and Moccasin publish.

Two dialects: Checkmate graphs (`backward`, `cost_cpu`, `cost_ram`, links with
`source`/`target`) and random layered graphs (`out_cost`, `duration`, links
with keys "0"/"1", `graph.order`). An imported graph has one implementation
per node and no transfer bandwidth unless one is given. Costs become
milliseconds through `time_unit_ms`; a graph whose costs would exceed the
profile's bound on one operation (FLOP counts, say) is refused with one issue
that names a unit that fits. Backward nodes stay as published (one per layer,
one cost): a convolution's filter/data split would have to invent their shares.

The graph is checked in its own terms first (`planner.graph_checks`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from planner.errors import Issue
from planner.graph_checks import (  # noqa: F401 - GraphImportError and ImportOptionError: the importer's errors
    DIALECTS,
    OPTIONS,
    GraphImportError,
    ImportOptionError,
    check_options,
    validate_graph,
)
from planner.profile import MAX_BYTES, MAX_TIME_MS, PROFILE_SCHEMA_VERSION, GraphProfile, parse_profile, read_json
from planner.units import format_bytes


def graph_to_profile_data(
    data: Any,
    *,
    name: str | None = None,
    time_unit_ms: float = 1.0,
    memory_capacity_bytes: int | None = None,
    d2h_bandwidth_gb_per_s: float | None = None,
    h2d_bandwidth_gb_per_s: float | None = None,
    source: str | None = None,
) -> dict:
    """Translate a node-link document into a profile document (validated as a graph; `parse_profile` checks the
    result). Raises ImportOptionError for an option out of range, GraphImportError for a bad graph."""
    check_options(name, time_unit_ms, memory_capacity_bytes, d2h_bandwidth_gb_per_s, h2d_bandwidth_gb_per_s)
    dialect, graph = validate_graph(data, source)
    _, size_field, time_field, _, _ = DIALECTS[dialect]
    keys = [str(node.key) for node in graph.nodes]
    inputs: dict[str, list[str]] = {key: [] for key in keys}
    index_of = {node.key: i for i, node in enumerate(graph.nodes)}
    for link in graph.links:
        inputs[keys[index_of[link.target]]].append(keys[index_of[link.source]])
    backward = {key: node.backward for key, node in zip(keys, graph.nodes)}
    nodes, costs = [], []
    for key, node in zip(keys, graph.nodes):
        kind = "forward"
        if node.backward:
            kind = "backward" if any(backward[src] for src in inputs[key]) else "loss"
        time = getattr(node, time_field)
        costs.append(time)
        nodes.append(
            {
                "id": key,
                "name": str(node.name if node.name is not None else key),
                "kind": kind,
                "op_type": node.op_type or "imported",
                "output_bytes": getattr(node, size_field),
                "inputs": inputs[key],
                "implementations": [{"name": "default", "time_ms": time * time_unit_ms, "workspace_bytes": 0}],
            }
        )
    _check_time_unit(nodes, costs, time_field, time_unit_ms, source)
    total_bytes = sum(node["output_bytes"] for node in nodes)
    if memory_capacity_bytes is None and total_bytes > MAX_BYTES:
        raise GraphImportError(
            [Issue("nodes", f"the nodes' {size_field} add up to {total_bytes} bytes ({format_bytes(total_bytes)}), "
                            f"more than the {format_bytes(MAX_BYTES)} a profile's device memory may be, which is what "
                            "the memory capacity is by default (every tensor at once): give the device's memory "
                            f"with {OPTIONS['memory_capacity_bytes']} (memory_capacity_bytes in Python)")],
            source,
        )
    if graph.graph.order is not None:
        rank = {str(key): i for i, key in enumerate(graph.graph.order)}
        nodes.sort(key=lambda node: rank[node["id"]])
    graph_name = graph.graph.name
    return {
        "schema_version": PROFILE_SCHEMA_VERSION,
        "name": name or (graph_name or (Path(source).stem if source else "imported graph")),
        "hardware": {
            "name": "unspecified (imported graph)",
            "memory_capacity_bytes": memory_capacity_bytes or max(1, total_bytes),
            "d2h_bandwidth_gb_per_s": d2h_bandwidth_gb_per_s,
            "h2d_bandwidth_gb_per_s": h2d_bandwidth_gb_per_s,
        },
        "nodes": nodes,
        "provenance": {
            "source": "imported",
            "notes": f"{dialect} node-link graph {graph_name!r}"
            + (f" from {Path(source).name}" if source else "")
            + f"; time_ms = cost x {time_unit_ms}",
        },
    }


def suggested_time_unit_ms(largest_cost: float) -> tuple[float, float]:
    """(a round milliseconds-per-unit that fits the profile's bound on one operation, the largest that fits)."""
    fits = MAX_TIME_MS / largest_cost
    return 10.0 ** math.floor(math.log10(fits)), fits


def _check_time_unit(
    nodes: list[dict], costs: list[float], time_field: str, time_unit_ms: float, source: str | None
) -> None:
    """Costs that are no milliseconds (FLOP counts, say) overflow the bound on one operation: say which unit fits.

    Without this, every node past the bound would be reported on its own, none of them saying what to change.
    """
    largest, index = max(((cost, i) for i, cost in enumerate(costs)), default=(0.0, 0))
    if largest * time_unit_ms <= MAX_TIME_MS:
        return
    suggestion, fits = suggested_time_unit_ms(largest)
    over = sum(cost * time_unit_ms > MAX_TIME_MS for cost in costs)
    raise GraphImportError(
        [
            Issue(
                f"nodes[{index}].{time_field}",
                f"compute costs are in the graph's own units and reach {largest:.12g} (node {_label(nodes[index])}; "
                f"{over} of {len(nodes)} nodes are over): at --time-unit-ms {time_unit_ms:g} that is "
                f"{largest * time_unit_ms:g} ms for one operation, beyond the {MAX_TIME_MS:g} ms a profile allows. "
                f"Give the milliseconds per unit of cost with --time-unit-ms (time_unit_ms in Python): "
                f"--time-unit-ms {suggestion:g} fits (any value up to {fits:.3g} does); costs that count "
                "floating-point operations take the device's milliseconds per FLOP, e.g. 1e-10 at 10 TFLOP/s",
            )
        ],
        source,
    )


def _label(node: dict) -> str:
    return repr(node["id"]) if node["name"] == node["id"] else f"{node['id']!r}, {node['name']!r}"


def import_graph(path: str | Path, **options) -> GraphProfile:
    path = Path(path)
    data = read_json(path, GraphImportError)
    profile_data = graph_to_profile_data(data, source=str(path), **options)
    return parse_profile(profile_data, f"the profile converted from {path}")
