"""Every bad profile is rejected with a JSON path and a sentence, never a traceback."""

from __future__ import annotations

import json

import pytest

from planner.budget import check_budget, minimum_budget_bytes, node_floor_parts, nodes_over
from planner.errors import BudgetError, ProfileError
from planner.profile import GraphProfile, load_profile, parse_profile
from planner.schedule import Schedule
from tests.conftest import make_profile, node, profile_data


def chain():
    return [
        node("x", output_bytes=100),
        node("y", inputs=["x"], output_bytes=200, workspace_bytes=50),
        node("loss", kind="loss", inputs=["y"], output_bytes=4),
        node("y:bwd", kind="backward", inputs=["loss", "x"], output_bytes=200, forward_node="y"),
    ]


def issues_of(data) -> list[tuple[str, str]]:
    with pytest.raises(ProfileError) as caught:
        parse_profile(data)
    return [(issue.path, issue.message) for issue in caught.value.issues]


def test_a_valid_profile_loads_and_orders_topologically():
    nodes = chain()
    nodes.reverse()  # listed out of order on purpose
    profile = make_profile(nodes)
    assert profile.order == ["x", "y", "loss", "y:bwd"]
    assert profile.consumers["x"] == ["y", "y:bwd"]


def test_cycle_is_named():
    nodes = chain()
    nodes[0]["inputs"] = ["y"]
    [(path, message)] = issues_of(profile_data(nodes))
    assert "cycle" in message and "'x'" in message and "'y'" in message
    assert path.startswith("nodes[")


def test_edge_to_missing_node():
    nodes = chain()
    nodes[1]["inputs"] = ["x", "ghost"]
    assert issues_of(profile_data(nodes)) == [("nodes[1].inputs[1]", "node 'y' reads 'ghost', which is not a node")]


def test_duplicate_ids():
    nodes = chain() + [node("x")]
    [(path, message)] = issues_of(profile_data(nodes))
    assert path == "nodes[4].id" and "duplicate node id 'x'" in message and "nodes[0]" in message


def test_backward_node_reading_nothing_from_forward():
    nodes = chain()
    nodes[3]["inputs"] = []
    [(path, message)] = issues_of(profile_data(nodes))
    assert path == "nodes[3].inputs"
    assert "claims to differentiate 'y' but neither it nor another backward node" in message
    assert "reads a tensor of the forward pass" in message


def split_convolution():
    """y = conv(x), z = relu(y): the convolution's backward as a filter-gradient node (reads x and dz)
    and a data-gradient node (reads dz only: the weights are fixed memory)."""
    return [
        node("x", output_bytes=100),
        node("y", inputs=["x"], output_bytes=200),
        node("z", inputs=["y"], output_bytes=200),
        node("loss", kind="loss", inputs=["z"], output_bytes=200),
        node("z:bwd", kind="backward", inputs=["loss", "z"], output_bytes=200, forward_node="z"),
        node("y:bwd_filter", kind="backward", inputs=["z:bwd", "x"], output_bytes=0, forward_node="y"),
        node("y:bwd_data", kind="backward", inputs=["z:bwd"], output_bytes=100, forward_node="y"),
        node("x:bwd", kind="backward", inputs=["y:bwd_data", "x"], output_bytes=100, forward_node="x"),
    ]


def test_a_data_gradient_node_may_read_only_gradients_when_its_filter_gradient_reads_the_forward_pass():
    profile = make_profile(split_convolution())
    assert profile.order == ["x", "y", "z", "loss", "z:bwd", "y:bwd_filter", "y:bwd_data", "x:bwd"]
    assert profile.consumers["x"] == ["y", "y:bwd_filter", "x:bwd"]
    nodes = split_convolution()
    nodes[5]["inputs"] = ["z:bwd"]  # now neither backward node of 'y' reads the forward pass
    issues = issues_of(profile_data(nodes))
    assert [path for path, _ in issues] == ["nodes[5].inputs", "nodes[6].inputs"]
    assert all("claims to differentiate 'y'" in message for _, message in issues)


@pytest.mark.parametrize(
    ("field", "value", "path", "fragment"),
    [
        ("output_bytes", -1, "nodes[1].output_bytes", "must be at least 0, not -1"),
        ("time_ms", float("nan"), "nodes[1].implementations[0].time_ms", "finite"),
        ("time_ms", float("inf"), "nodes[1].implementations[0].time_ms", "finite"),
        ("time_ms", -0.5, "nodes[1].implementations[0].time_ms", "must be at least 0.0 ms, not -0.5"),
        ("workspace_bytes", -3, "nodes[1].implementations[0].workspace_bytes", "must be at least 0, not -3"),
        # Past the bounds that keep a whole step's sums finite and inside the solver's int64 arithmetic.
        ("output_bytes", 2**60, "nodes[1].output_bytes", "must be at most 1125899906842624 (1.00 PiB)"),
        ("time_ms", 1e308, "nodes[1].implementations[0].time_ms", "must be at most 10000000.0 ms, not 1e+308"),
        ("workspace_bytes", 2**51, "nodes[1].implementations[0].workspace_bytes", "must be at most"),
        ("output_bytes", 1e40, "nodes[1].output_bytes", "is far too large for this field, not 1e+40"),
        # Quoted numbers and booleans are mistakes, not numbers to coerce.
        ("output_bytes", "1000", "nodes[1].output_bytes", "must be a number, not str '1000'"),
        ("time_ms", True, "nodes[1].implementations[0].time_ms", "must be a number, not bool True"),
    ],
)
def test_negative_huge_or_non_finite_numbers(field, value, path, fragment):
    nodes = chain()
    if field == "output_bytes":
        nodes[1][field] = value
    else:
        nodes[1]["implementations"][0][field] = value
    [(got_path, message)] = issues_of(profile_data(nodes))
    assert got_path == path and fragment in message


def test_a_workspaces_arena_part_larger_than_the_workspace_is_named():
    nodes = chain()
    nodes[1]["implementations"][0]["arena_workspace_bytes"] = 60  # of a 50-byte workspace
    [(path, message)] = issues_of(profile_data(nodes))
    assert path == "nodes[1].implementations[0]" and "arena_workspace_bytes (60) is more than workspace_bytes (50)" \
        in message
    nodes[1]["implementations"][0]["arena_workspace_bytes"] = 20
    profile = parse_profile(profile_data(nodes))
    assert profile.node_by_id["y"].fastest.placed_workspace_bytes == 20
    del nodes[1]["implementations"][0]["arena_workspace_bytes"]
    unset = parse_profile(profile_data(nodes))  # written as before the field: the same digest as an older mosos'
    assert "arena_workspace_bytes" not in json.dumps(unset.model_dump(mode="json"))
    assert unset.node_by_id["y"].fastest.placed_workspace_bytes == 50


def test_node_without_implementations():
    nodes = chain()
    nodes[2]["implementations"] = []
    [(path, message)] = issues_of(profile_data(nodes))
    assert path == "nodes[2].implementations" and "at least one implementation" in message


@pytest.mark.parametrize("bandwidth", [0, -12.0, 1e-320, 1e30])
def test_bandwidth_outside_what_any_link_has(bandwidth):
    [(path, message)] = issues_of(profile_data(chain(), d2h=bandwidth, h2d=11.0))
    assert path == "hardware.d2h_bandwidth_gb_per_s" and "GB/s, not" in message


def test_unknown_schema_version():
    data = profile_data(chain())
    data["schema_version"] = "7.3"
    [(path, message)] = issues_of(data)
    assert path == "schema_version" and "unknown profile schema version '7.3'" in message


def test_unknown_and_missing_fields_are_reported_together():
    data = profile_data(chain())
    data["nodes"][0]["outptu_bytes"] = 3
    del data["hardware"]["memory_capacity_bytes"]
    found = dict(issues_of(data))
    assert found["nodes[0].outptu_bytes"].startswith("unknown field")
    assert found["hardware.memory_capacity_bytes"] == "required field is missing"


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(ProfileError, match="file not found"):
        load_profile(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text('{"name": ')
    with pytest.raises(ProfileError, match=r"(?s)broken.json.*not valid JSON"):
        load_profile(broken)
    listed = tmp_path / "list.json"
    listed.write_text("[]")
    with pytest.raises(ProfileError, match="a profile is a JSON object"):
        load_profile(listed)


def test_budget_below_any_plan_gives_the_minimum():
    profile = make_profile(chain(), fixed_bytes=1000)
    # y:bwd reads loss (4) and x (100) and writes 200; y reads x (100), writes 200, workspace 50.
    assert minimum_budget_bytes(profile) == 1000 + 350
    check_budget(profile, 1350)
    with pytest.raises(BudgetError) as caught:
        check_budget(profile, 1349)
    assert caught.value.minimum_budget_bytes == 1350
    assert "1350 bytes" in str(caught.value) and "'y'" in str(caught.value)


def test_nodes_over_a_budget_say_what_they_hold():
    profile = make_profile(chain(), fixed_bytes=1000)
    assert node_floor_parts(profile, "y") == [("input", "x", 100), ("output", "y", 200), ("workspace of default", "y", 50)]
    assert node_floor_parts(profile, "y:bwd") == [("input", "loss", 4), ("input", "x", 100), ("output", "y:bwd", 200)]
    assert nodes_over(profile, 1350) == []
    assert nodes_over(profile, 1303) == [("y", 1350), ("y:bwd", 1304)]  # worst first
    assert nodes_over(profile, 1304) == [("y", 1350)]


def test_round_trip_and_schema():
    profile = make_profile(chain())
    again = parse_profile(json.loads(profile.to_json()))
    assert again.digest() == profile.digest()
    for model in (GraphProfile, Schedule):
        schema = model.model_json_schema()
        assert schema["type"] == "object" and "properties" in schema
