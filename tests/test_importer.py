"""Checkmate / Moccasin graphs: imported with their published semantics."""

from __future__ import annotations

import json

import pytest

from planner.importer import GraphImportError, graph_to_profile_data, import_graph
from planner.simulator import simulate
from planner.strategies.keep_all import keep_all_schedule
from tests.conftest import CHECKMATE_GRAPHS, requires_shared


@pytest.mark.parametrize(
    ("graph", "nodes", "peak_bytes", "cost"),
    [
        ("vgg19_b256_train.json", 51, 17_058_234_368, 9_493_135),
        ("vgg16_b256_train.json", 45, 15_825_108_992, 15_500),
    ],
)
def test_topological_order_peak_and_cost(graph, nodes, peak_bytes, cost):
    profile = import_graph(requires_shared(CHECKMATE_GRAPHS / graph))
    result = simulate(profile, keep_all_schedule(profile))
    assert len(profile.nodes) == nodes
    assert result.peak_memory_bytes == peak_bytes
    assert result.step_time_ms == cost
    kinds = [node.kind for node in profile.nodes]
    assert kinds.count("loss") == 1 and kinds.index("loss") < kinds.index("backward")


def test_random_layered_dialect_uses_the_published_order():
    path = requires_shared(CHECKMATE_GRAPHS / "random_layered_n100.json")
    profile = import_graph(path, d2h_bandwidth_gb_per_s=12.0, h2d_bandwidth_gb_per_s=11.0)
    order = json.loads(path.read_text())["graph"]["order"]
    assert [node.id for node in profile.nodes] == [str(n) for n in order]
    assert profile.order == [str(n) for n in order]
    assert all(node.kind == "forward" for node in profile.nodes)
    assert profile.hardware.can_transfer


def test_bad_graphs_are_explained():
    with pytest.raises(GraphImportError, match="node-link object"):
        graph_to_profile_data([1, 2])
    with pytest.raises(GraphImportError, match="not a known graph dialect"):
        graph_to_profile_data({"nodes": [{"id": 0}], "links": []})
    bad_link = {"nodes": [{"id": 0, "cost_ram": 1, "cost_cpu": 1}], "links": [{"source": 0, "target": 9}]}
    with pytest.raises(GraphImportError) as caught:
        graph_to_profile_data(bad_link)
    assert caught.value.issues[0].path == "links[0].target"
    bad_number = {"nodes": [{"id": 0, "cost_ram": "big", "cost_cpu": 1}], "links": []}
    with pytest.raises(GraphImportError) as caught:
        graph_to_profile_data(bad_number)
    assert caught.value.issues[0].path == "nodes[0].cost_ram"


@pytest.mark.parametrize(
    ("document", "path", "fragment"),
    [
        ({"nodes": [1, 2], "links": []}, "nodes[0]", "a node is a JSON object, not int"),
        ({"graph": [1], "nodes": [{"id": 0, "cost_ram": 1, "cost_cpu": 1}], "links": []}, "graph", "not a list"),
        ({"nodes": [{"id": 0, "cost_ram": 1, "cost_cpu": 1}, {"id": 0, "cost_ram": 1, "cost_cpu": 1}], "links": []},
         "nodes[1]", "duplicate node id '0' (also nodes[0])"),
        ({"nodes": [{"id": 0, "cost_ram": 1, "cost_cpu": -2}], "links": []}, "nodes[0].cost_cpu", "must not be negative"),
        ({"nodes": [{"id": 0, "cost_ram": float("nan"), "cost_cpu": 1}], "links": []}, "nodes[0].cost_ram",
         "integer, not NaN"),
    ],
)
def test_odd_graph_shapes_are_explained_at_their_place_in_the_graph(document, path, fragment):
    with pytest.raises(GraphImportError) as caught:
        graph_to_profile_data(document)
    assert caught.value.issues[0].path == path and fragment in caught.value.issues[0].message


def flop_graph(flops=(2.2e11, 4.0e9, 5.1e8)):
    """A Checkmate-dialect chain whose costs count floating-point operations, as some published graphs do."""
    nodes = [{"id": i, "name": f"conv{i}", "backward": False, "cost_cpu": cost, "cost_ram": 1 << 20}
             for i, cost in enumerate(flops)]
    links = [{"source": i, "target": i + 1} for i in range(len(flops) - 1)]
    return {"directed": True, "multigraph": False, "graph": {"name": "flops"}, "nodes": nodes, "links": links}


def test_costs_beyond_the_time_bound_ask_for_a_time_unit_that_fits():
    with pytest.raises(GraphImportError) as caught:
        graph_to_profile_data(flop_graph())
    [issue] = caught.value.issues  # one issue that says what to change, not one per node
    assert issue.path == "nodes[0].cost_cpu"
    assert "220000000000" in issue.message and "'conv0'" in issue.message and "3 of 3 nodes are over" in issue.message
    assert "--time-unit-ms 1e-05 fits" in issue.message and "4.55e-05" in issue.message
    with pytest.raises(GraphImportError, match="at --time-unit-ms 0.0001 that is 2.2e\\+07 ms"):
        graph_to_profile_data(flop_graph(), time_unit_ms=1e-4)
    data = graph_to_profile_data(flop_graph(), time_unit_ms=1e-5)
    assert [n["implementations"][0]["time_ms"] for n in data["nodes"]] == pytest.approx([2.2e6, 4.0e4, 5.1e3])
    # the bound itself still fits
    graph_to_profile_data(flop_graph((1e7,)))
