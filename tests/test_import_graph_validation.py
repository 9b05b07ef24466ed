"""`mosos import-graph` validates the input graph's own fields, with their exact JSON types, and names them.

A bad input must never silently change the graph (a string "false" read as true made a forward node the loss),
and an error must name the input file's field (`nodes[3].cost_ram`), not a field of the converted profile
(`hardware.memory_capacity_bytes`) that the user never wrote; an option out of range names the option.
"""

from __future__ import annotations

import copy
import json

import pytest
from typer.testing import CliRunner

from cli import app
from planner.errors import MososError
from planner.importer import GraphImportError, graph_to_profile_data, import_graph
from planner.profile import parse_profile

runner = CliRunner()


def checkmate_graph() -> dict:
    """A Checkmate-dialect training graph: two forward layers, the loss, two backward nodes (as published)."""
    names = ["block1_conv1", "block2_conv1", "loss", "block2_conv1_grad", "block1_conv1_grad"]
    nodes = [
        {"name": name, "backward": i >= 2, "cost_cpu": 100 + i, "cost_ram": 1024 * (i + 1), "id": i}
        for i, name in enumerate(names)
    ]
    links = [(0, 1), (1, 2), (2, 3), (1, 3), (3, 4), (0, 4)]
    return {
        "directed": True,
        "multigraph": False,
        "graph": {"name": "tiny"},
        "nodes": nodes,
        "links": [{"source": s, "target": t} for s, t in links],
    }


def layered_graph() -> dict:
    """The random-layered dialect: `out_cost`, `duration`, links keyed "0"/"1", `graph.order`."""
    nodes = [{"out_cost": 10 * (i + 1), "param_cost": 0, "duration": i, "name": i} for i in range(4)]
    links = [{"0": 0, "1": 2}, {"0": 0, "1": 3}, {"0": 2, "1": 1}, {"0": 3, "1": 1}]
    return {"directed": True, "multigraph": False, "graph": {"name": "layered", "order": [0, 3, 2, 1]},
            "nodes": nodes, "links": links}


def mutated(base, change) -> dict:
    document = copy.deepcopy(base())
    change(document)
    return document


def _parent(document: dict, path: tuple):
    """The object holding `path`'s last key."""
    for part in path[:-1]:
        document = document[part]
    return document


def setter(*path_and_value):
    *path, value = path_and_value

    def change(document):
        _parent(document, path)[path[-1]] = value

    return change


def deleter(*path):
    def change(document):
        del _parent(document, path)[path[-1]]

    return change


def test_the_well_formed_graphs_still_import_as_published():
    data = graph_to_profile_data(checkmate_graph())
    assert [node["kind"] for node in data["nodes"]] == ["forward", "forward", "loss", "backward", "backward"]
    assert [node["inputs"] for node in data["nodes"]] == [[], ["0"], ["1"], ["2", "1"], ["3", "0"]]
    parse_profile(data)
    layered = graph_to_profile_data(layered_graph())
    assert [node["id"] for node in layered["nodes"]] == ["0", "3", "2", "1"]
    parse_profile(layered)


TWIN = '"0" is not a node (node ids are compared with their JSON type: a node has the id 0)'
BAD_CHECKMATE = [
    # the user's report: a string where a boolean belongs made block2_conv1 the loss, silently
    (setter("nodes", 1, "backward", "false"), "nodes[1].backward", 'must be true or false, not the string "false"'),
    (setter("nodes", 1, "backward", "yes"), "nodes[1].backward", 'must be true or false, not the string "yes"'),
    (setter("nodes", 1, "backward", 1), "nodes[1].backward", "must be true or false, not the number 1"),
    (setter("nodes", 1, "backward", None), "nodes[1].backward", "must be true or false, not null"),
    # sizes are integers: the error names cost_ram, not the profile's output_bytes or memory capacity
    (setter("nodes", 1, "cost_ram", 1.5), "nodes[1].cost_ram", "must be an integer, not the number 1.5"),
    (setter("nodes", 1, "cost_ram", 2.0), "nodes[1].cost_ram", "must be an integer, not the number 2.0"),
    (setter("nodes", 1, "cost_ram", "3"), "nodes[1].cost_ram", 'must be an integer, not the string "3"'),
    (setter("nodes", 1, "cost_ram", True), "nodes[1].cost_ram", "must be an integer, not true"),
    (setter("nodes", 1, "cost_ram", 10**20), "nodes[1].cost_ram", "must be at most 1125899906842624 (1.00 PiB)"),
    (setter("nodes", 1, "cost_ram", -5), "nodes[1].cost_ram", "must not be negative, got -5"),
    (deleter("nodes", 1, "cost_ram"), "nodes[1].cost_ram", "required field is missing"),
    (setter("nodes", 1, "cost_cpu", "12"), "nodes[1].cost_cpu", 'must be a number, not the string "12"'),
    (setter("nodes", 1, "cost_cpu", False), "nodes[1].cost_cpu", "must be a number, not false"),
    (setter("nodes", 1, "cost_cpu", 10**400), "nodes[1].cost_cpu", "too large"),  # was an OverflowError
    (setter("nodes", 1, "cost_cpu", float("nan")), "nodes[1].cost_cpu", "finite"),
    (deleter("nodes", 1, "cost_cpu"), "nodes[1].cost_cpu", "required field is missing"),
    (setter("nodes", 1, "id", 1.5), "nodes[1].id", "must be an integer or a string, not the number 1.5"),
    (setter("nodes", 1, "id", True), "nodes[1].id", "must be an integer or a string, not true"),
    (setter("nodes", 1, "id", None), "nodes[1].id", "must be an integer or a string, not null"),
    (setter("nodes", 1, "id", ""), "nodes[1].id", "must not be empty"),
    (setter("nodes", 1, "name", ["a"]), "nodes[1].name", "must be a string or an integer, not a list"),
    (setter("nodes", 1, "op_type", 7), "nodes[1].op_type", "must be a string, not the number 7"),
    (setter("nodes", 1, "backwards", True), "nodes[1].backwards", "did you mean 'backward'"),
    # links: the exact ids of nodes, in the input's own terms
    (setter("links", 0, "source", "0"), "links[0].source", TWIN),
    (setter("links", 0, "source", 9), "links[0].source", "9 is not a node"),
    (setter("links", 0, "target", 9), "links[0].target", "9 is not a node"),
    (setter("links", 0, "target", 2.5), "links[0].target", "must be an integer or a string, not the number 2.5"),
    (deleter("links", 0, "target"), "links[0].target", "required field is missing"),
    (setter("links", 0, "target", 0), "links[0]", "links node 0 ('block1_conv1') to itself"),
    (lambda d: d["links"].append({"source": 4, "target": 1}), "links[6]", "closes a cycle: 1 -> 3 -> 4 -> 1"),
    (lambda d: d["links"].append({"source": 0, "target": 1}), "links[6]", "the same link as links[0] (0 -> 1)"),
    (setter("links", 0, 3), "links[0]", "must be a JSON object, not the number 3"),
    # the document and its graph attributes
    (setter("directed", "true"), "directed", 'must be true or false, not the string "true"'),
    (setter("directed", False), "directed", "must be true"),
    (setter("multigraph", 0), "multigraph", "must be true or false, not the number 0"),
    (setter("graph", "name", 5), "graph.name", "must be a string, not the number 5"),
    (setter("graph", "order", "0,1"), "graph.order", 'must be a list of node ids, not the string "0,1"'),
    (setter("graph", "order", [0, 1, 2, 3]), "graph.order", "misses node 4"),
    (setter("graph", "order", [0, 1, 2, 3, 4, 4]), "graph.order[5]", "lists node 4 again (also graph.order[4])"),
    (setter("graph", "order", [0, 1, 2, 3, 9]), "graph.order[4]", "9 is not a node"),
    (setter("graph", "order", [1, 0, 2, 3, 4]), "graph.order[0]", "node 1 comes before node 0, which it reads"),
]


@pytest.mark.parametrize(("change", "path", "fragment"), BAD_CHECKMATE)
def test_every_field_of_a_checkmate_graph_is_checked_with_its_exact_type(change, path, fragment):
    with pytest.raises(GraphImportError) as caught:
        graph_to_profile_data(mutated(checkmate_graph, change), source="g.json")
    assert [issue.path for issue in caught.value.issues] == [path], str(caught.value)
    assert fragment in caught.value.issues[0].message, str(caught.value)
    assert "graph to import (g.json)" in str(caught.value)
    for profile_field in ("hardware", "output_bytes", "time_ms", "inputs", "implementations", "kind"):
        assert profile_field not in str(caught.value)


def test_a_node_s_name_comes_with_an_error_about_it():
    with pytest.raises(GraphImportError) as caught:
        graph_to_profile_data(mutated(checkmate_graph, setter("nodes", 1, "backward", "false")))
    assert str(caught.value.issues[0]) == (
        "nodes[1].backward: must be true or false, not the string \"false\" (node 1, 'block2_conv1')"
    )


BAD_LAYERED = [
    (setter("nodes", 2, "out_cost", 1.5), "nodes[2].out_cost", "must be an integer, not the number 1.5"),
    (setter("nodes", 2, "duration", "3"), "nodes[2].duration", 'must be a number, not the string "3"'),
    (setter("nodes", 2, "param_cost", -1), "nodes[2].param_cost", "must not be negative"),
    (setter("nodes", 2, "name", 2.0), "nodes[2].name", "must be a string or an integer, not the number 2.0"),
    (setter("links", 1, "0", "0"), "links[1].0", TWIN),
    (setter("links", 1, "1", True), "links[1].1", "must be an integer or a string, not true"),
    (setter("graph", "order", [0, 2, 3]), "graph.order", "misses node 1"),
]


@pytest.mark.parametrize(("change", "path", "fragment"), BAD_LAYERED)
def test_every_field_of_a_random_layered_graph_is_checked_with_its_exact_type(change, path, fragment):
    with pytest.raises(GraphImportError) as caught:
        graph_to_profile_data(mutated(layered_graph, change))
    assert [issue.path for issue in caught.value.issues] == [path], str(caught.value)
    assert fragment in caught.value.issues[0].message, str(caught.value)


def test_a_node_missing_its_dialect_s_size_is_named_not_called_an_unknown_dialect():
    with pytest.raises(GraphImportError) as caught:
        graph_to_profile_data(mutated(checkmate_graph, deleter("nodes", 3, "cost_ram")))
    assert [str(issue) for issue in caught.value.issues] == [
        "nodes[3].cost_ram: required field is missing (node 3, 'block2_conv1_grad')"
    ]


def test_every_problem_is_reported_at_once():
    def change(document):
        document["nodes"][1]["backward"] = "false"
        document["nodes"][2]["cost_ram"] = 1.5
        document["nodes"][3]["cost_cpu"] = None

    with pytest.raises(GraphImportError) as caught:
        graph_to_profile_data(mutated(checkmate_graph, change))
    paths = [issue.path for issue in caught.value.issues]
    assert paths == ["nodes[1].backward", "nodes[2].cost_ram", "nodes[3].cost_cpu"]


def test_tensors_beyond_any_memory_ask_for_a_memory_capacity_not_a_hardware_field():
    def change(document):
        for node in document["nodes"]:
            node["cost_ram"] = 2**48

    document = mutated(checkmate_graph, change)
    with pytest.raises(GraphImportError) as caught:
        graph_to_profile_data(document)
    [issue] = caught.value.issues
    assert issue.path == "nodes" and "cost_ram" in issue.message and "--memory-capacity" in issue.message
    assert "hardware" not in str(caught.value)
    data = graph_to_profile_data(document, memory_capacity_bytes=2**40)
    assert data["hardware"]["memory_capacity_bytes"] == 2**40


@pytest.mark.parametrize(
    ("options", "fragments"),
    [
        ({"h2d_bandwidth_gb_per_s": 1e9}, ["--h2d-gb-per-s", "at most 1e+06 GB/s, not 1e+09"]),
        ({"d2h_bandwidth_gb_per_s": 1e-9}, ["--d2h-gb-per-s", "at least 0.001 GB/s, not 1e-09"]),
        ({"d2h_bandwidth_gb_per_s": "12"}, ["--d2h-gb-per-s", "must be a number"]),
        ({"memory_capacity_bytes": 2**51}, ["--memory-capacity", "at most 1125899906842624 bytes (1.00 PiB)"]),
        ({"memory_capacity_bytes": 0}, ["--memory-capacity", "at least 1 byte"]),
        ({"memory_capacity_bytes": 1.5}, ["--memory-capacity", "must be a whole number of bytes"]),
        ({"time_unit_ms": 0}, ["--time-unit-ms", "must be a positive number, not 0"]),
        ({"time_unit_ms": float("nan")}, ["--time-unit-ms", "must be a positive number, not nan"]),
        ({"name": 5}, ["--name", "must be a string"]),
        ({"d2h_bandwidth_gb_per_s": 12.0}, ["--d2h-gb-per-s needs --h2d-gb-per-s too", "or neither"]),
        ({"h2d_bandwidth_gb_per_s": 12.0}, ["--h2d-gb-per-s needs --d2h-gb-per-s too"]),
    ],
)
def test_an_option_out_of_range_is_named_as_the_option(options, fragments):
    with pytest.raises(MososError) as caught:
        graph_to_profile_data(checkmate_graph(), **options)
    assert not isinstance(caught.value, GraphImportError)  # the graph is fine
    for fragment in fragments:
        assert fragment in str(caught.value)
    assert "hardware" not in str(caught.value)


def invoke(*args):
    result = runner.invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (setter("nodes", 1, "backward", "false"),
         "nodes[1].backward: must be true or false, not the string \"false\" (node 1, 'block2_conv1')"),
        (setter("nodes", 1, "backward", "yes"), 'nodes[1].backward: must be true or false, not the string "yes"'),
        (setter("nodes", 3, "cost_ram", 1.5), "nodes[3].cost_ram: must be an integer, not the number 1.5"),
    ],
)
def test_the_command_refuses_a_bad_graph_with_exit_2_naming_the_input_field(tmp_path, change, expected):
    graph = tmp_path / "g.json"
    graph.write_text(json.dumps(mutated(checkmate_graph, change)))
    out = tmp_path / "out.json"
    result = invoke("import-graph", graph, "-o", out)
    assert result.exit_code == 2, result.output
    assert expected in result.output and "wrote" not in result.output and not out.exists()
    assert "hardware" not in result.output and "output_bytes" not in result.output


def test_the_command_names_an_option_out_of_range(tmp_path):
    graph = tmp_path / "g.json"
    graph.write_text(json.dumps(checkmate_graph()))
    out = tmp_path / "out.json"
    result = invoke("import-graph", graph, "-o", out, "--h2d-gb-per-s", "1e9")
    assert result.exit_code == 2 and "--h2d-gb-per-s" in result.output, result.output
    assert "hardware" not in result.output and not out.exists()
    result = invoke("import-graph", graph, "-o", out)
    assert result.exit_code == 0 and import_graph(out.parent / "g.json").nodes[1].kind == "forward"
