"""Import the networkx node-link training graphs that Checkmate and Moccasin publish.

Two dialects: Checkmate graphs (`backward`, `cost_cpu`, `cost_ram`, links with
`source`/`target`) and random layered graphs (`out_cost`, `duration`, links
with keys "0"/"1", `graph.order`). An imported graph has one implementation
per node and no transfer bandwidth unless one is given. Costs become
milliseconds through `time_unit_ms`; a graph whose costs would exceed the
profile's bound on one operation (FLOP counts, say) is refused with one issue
that names a unit that fits. Backward nodes stay as published (one per layer,
one cost): a convolution's filter/data split would have to invent their shares.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from planner.errors import Issue, ProfileError
from planner.profile import MAX_TIME_MS, PROFILE_SCHEMA_VERSION, GraphProfile, parse_profile, read_json


class GraphImportError(ProfileError):
    document = "graph to import"


def _dialect(data: dict, source: str | None) -> str:
    nodes = data.get("nodes") or []
    strays = [Issue(f"nodes[{i}]", f"a node is a JSON object, not {type(node).__name__}")
              for i, node in enumerate(nodes) if not isinstance(node, dict)]
    if strays:
        raise GraphImportError(strays, source)
    if nodes and all("cost_ram" in node for node in nodes):
        return "checkmate"
    if nodes and all("out_cost" in node for node in nodes):
        return "random-layered"
    raise GraphImportError(
        [Issue("nodes", "not a known graph dialect: expected every node to have 'cost_ram' (Checkmate) "
                        "or 'out_cost' (random layered)")],
        source,
    )


def _node_key(node: dict, index: int, issues: list[Issue]) -> str | None:
    key = node.get("id", node.get("name"))
    if key is None:
        issues.append(Issue(f"nodes[{index}]", "node has neither 'id' nor 'name'"))
        return None
    return str(key)


def _number(node: dict, field: str, index: int, issues: list[Issue], default=None):
    value = node.get(field, default)
    if value is None:
        issues.append(Issue(f"nodes[{index}].{field}", "required field is missing"))
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        issues.append(Issue(f"nodes[{index}].{field}", f"must be a finite number, got {value!r}"))
        return 0
    if value < 0:
        issues.append(Issue(f"nodes[{index}].{field}", f"must not be negative, got {value!r}"))
        return 0
    return value


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
    """Translate a node-link document into a profile document (not yet validated)."""
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list) or not isinstance(data.get("links"), list):
        raise GraphImportError([Issue("", "expected a networkx node-link object with 'nodes' and 'links' lists")], source)
    if data.get("graph") is not None and not isinstance(data["graph"], dict):
        raise GraphImportError([Issue("graph", f"'graph' is a JSON object, not {type(data['graph']).__name__}")], source)
    dialect = _dialect(data, source)
    issues: list[Issue] = []
    size_field, time_field = ("cost_ram", "cost_cpu") if dialect == "checkmate" else ("out_cost", "duration")
    keys: list[str | None] = [_node_key(node, i, issues) for i, node in enumerate(data["nodes"])]
    first_index: dict[str, int] = {}
    for i, key in enumerate(keys):
        if key is not None and key in first_index:
            issues.append(Issue(f"nodes[{i}]", f"duplicate node id {key!r} (also nodes[{first_index[key]}])"))
        elif key is not None:
            first_index[key] = i
    inputs: dict[str, list[str]] = {key: [] for key in keys if key is not None}
    source_key, target_key = ("source", "target") if dialect == "checkmate" else ("0", "1")
    for i, link in enumerate(data["links"]):
        if not isinstance(link, dict) or source_key not in link or target_key not in link:
            issues.append(Issue(f"links[{i}]", f"a link needs {source_key!r} and {target_key!r}"))
            continue
        src, dst = str(link[source_key]), str(link[target_key])
        if dst not in inputs:
            issues.append(Issue(f"links[{i}].{target_key}", f"link to {dst!r}, which is not a node"))
            continue
        inputs[dst].append(src)
    if issues:
        raise GraphImportError(issues, source)
    backward = {key: bool(node.get("backward", False)) for key, node in zip(keys, data["nodes"])}
    nodes, costs = [], []
    for i, (key, node) in enumerate(zip(keys, data["nodes"])):
        kind = "forward"
        if backward[key]:
            reads_backward = any(backward.get(src, False) for src in inputs[key])
            kind = "backward" if reads_backward else "loss"
        time = _number(node, time_field, i, issues)
        costs.append(time)
        nodes.append(
            {
                "id": key,
                "name": str(node.get("name", key)),
                "kind": kind,
                "op_type": str(node.get("op_type", "imported")),
                "output_bytes": _number(node, size_field, i, issues),
                "inputs": inputs[key],
                "implementations": [{"name": "default", "time_ms": time * time_unit_ms, "workspace_bytes": 0}],
            }
        )
    if issues:
        raise GraphImportError(issues, source)
    _check_time_unit(nodes, costs, time_field, time_unit_ms, source)
    order = (data.get("graph") or {}).get("order")
    if isinstance(order, list) and sorted(map(str, order)) == sorted(inputs):
        rank = {str(key): i for i, key in enumerate(order)}
        nodes.sort(key=lambda node: rank[node["id"]])
    graph_name = (data.get("graph") or {}).get("name")
    total_bytes = sum(node["output_bytes"] for node in nodes)
    return {
        "schema_version": PROFILE_SCHEMA_VERSION,
        "name": name or str(graph_name or (Path(source).stem if source else "imported graph")),
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


def _check_time_unit(nodes: list[dict], costs: list[float], time_field: str, time_unit_ms: float, source: str | None) -> None:
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
