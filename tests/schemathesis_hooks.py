"""schemathesis hooks: generated positive requests also keep the profile rules that JSON Schema cannot state.

The OpenAPI document states every constraint JSON Schema can express (bounds,
enums, minItems, the server's limits and strategies). A few rules relate values
to one another and cannot be expressed: node ids unique in a profile, `inputs`
and `forward_node` naming other nodes, no cycles, a backward node that
differentiates a forward one reading a forward tensor, implementation names
unique in a node, a workspace's arena part within the workspace, and a
schedule's stages numbered in order. They are in the
fields' descriptions, and the server refuses a request that breaks them with a
422 that names the path.

A request schemathesis generates as *valid* (positive mode) is made to keep those
rules here, the way a client reading the descriptions would, so that its
positive-data check stays sharp for everything else. Negative cases are never
touched. Loaded by the CI test (tests/test_api_schema.py) and by
benchmarks/service_schemathesis.py (SCHEMATHESIS_HOOKS=tests.schemathesis_hooks).
"""

from __future__ import annotations

from typing import Any

import schemathesis

BODY_WITH_PROFILE = {"/v1/plans", "/v1/simulate"}


def _unique(name: str, taken: set[str]) -> str:
    candidate, suffix = name, 1
    while candidate in taken:
        candidate, suffix = f"{name}~{suffix}", suffix + 1
    taken.add(candidate)
    return candidate


def keep_profile_rules(profile: Any) -> None:
    """Make a generated profile's graph consistent, changing only what the cross-field rules govern."""
    if not isinstance(profile, dict) or not isinstance(profile.get("nodes"), list):
        return
    taken: set[str] = set()
    kinds: dict[str, str] = {}
    for node in profile["nodes"]:
        if not isinstance(node, dict) or not isinstance(node.get("id"), str):
            continue
        node["id"] = _unique(node["id"], taken)
        earlier = dict(kinds)  # only nodes listed before this one: the graph stays acyclic
        if isinstance(node.get("inputs"), list):
            node["inputs"] = [source for source in node["inputs"] if source in earlier]
        reads_forward = any(earlier[source] != "backward" for source in node.get("inputs") or [])
        forward = node.get("forward_node")
        if forward is not None and not (
            node.get("kind") == "backward" and earlier.get(forward) in ("forward", "loss") and reads_forward
        ):
            node.pop("forward_node")
        if isinstance(node.get("implementations"), list):
            names: set[str] = set()
            for implementation in node["implementations"]:
                if isinstance(implementation, dict) and isinstance(implementation.get("name"), str):
                    implementation["name"] = _unique(implementation["name"], names)
                _keep_arena_part_within_workspace(implementation)
        kinds[node["id"]] = node.get("kind")


def _keep_arena_part_within_workspace(implementation: Any) -> None:
    if not isinstance(implementation, dict):
        return
    part, workspace = implementation.get("arena_workspace_bytes"), implementation.get("workspace_bytes", 0)
    if isinstance(part, (int, float)) and isinstance(workspace, (int, float)) and part > workspace:
        implementation["arena_workspace_bytes"] = workspace


def keep_schedule_rules(schedule: Any) -> None:
    if isinstance(schedule, dict) and isinstance(schedule.get("stages"), list):
        for position, stage in enumerate(schedule["stages"]):
            if isinstance(stage, dict):
                stage["index"] = position


@schemathesis.hook
def map_case(context, case):
    meta = getattr(case, "meta", None)
    if meta is None or not meta.generation.mode.is_positive or case.path not in BODY_WITH_PROFILE:
        return case
    if isinstance(case.body, dict):
        keep_profile_rules(case.body.get("profile"))
        keep_schedule_rules(case.body.get("schedule"))
    return case
