"""A node-link graph to import, checked in its own terms before anything is converted.

A mistake is reported at the input's field (`nodes[3].backward`, `links[5].target`) and never silently changes the
graph: every field the importer reads has its exact JSON type (a boolean is `true` or `false`, not the string
"false"; a size is an integer, not 1.5 or "3"), links join nodes by their exact ids, a graph that is not a
multigraph has one link per pair, the links make no cycle, and `graph.order`, when given, is a topological order
of every node. Fields the importer does not read are left alone (node-link attributes are open), unless one looks
like a misspelling of a field it does read. An option out of range is named as the option (`--h2d-gb-per-s`),
not as the profile field it fills.
"""

from __future__ import annotations

import difflib
import json
import math
from typing import Annotated, Any

import networkx as nx
from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from planner.errors import Issue, MososError, ProfileError
from planner.profile import MAX_BANDWIDTH_GB_PER_S, MAX_BYTES, MIN_BANDWIDTH_GB_PER_S
from planner.units import format_bytes
from planner.validation import describe, format_location

class GraphImportError(ProfileError):
    document = "graph to import"


class ImportOptionError(MososError):
    """An import option (a bandwidth, the memory capacity, the time unit) out of range: the graph may be fine."""


# The command-line option behind each keyword argument of `graph_to_profile_data`.
OPTIONS = {
    "name": "--name",
    "time_unit_ms": "--time-unit-ms",
    "memory_capacity_bytes": "--memory-capacity",
    "d2h_bandwidth_gb_per_s": "--d2h-gb-per-s",
    "h2d_bandwidth_gb_per_s": "--h2d-gb-per-s",
}


# ---------------------------------------------------------------------------------------------------------------
# The input graph's own fields, with their exact JSON types (pydantic strict mode: no "false" read as a boolean,
# no 1.5 or "3" as a size).




def _json_id(value: int | str) -> str:
    """A node id as the input writes it: 3, "conv1" (a long one cut short)."""
    shown = json.dumps(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def _node_id(value: Any) -> int | str:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise PydanticCustomError("node_id", f"must be an integer or a string, not {describe(value)}")
    if value == "":
        raise PydanticCustomError("node_id", "must not be empty")
    return value


def _node_name(value: Any) -> int | str:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise PydanticCustomError("node_name", f"must be a string or an integer, not {describe(value)}")
    return value


# Optional fields default to None without validation; a field that is given, even as null, must have its type.
NodeId = Annotated[int | str, PlainValidator(_node_id)]
NodeName = Annotated[str | int, PlainValidator(_node_name)]
Size = Annotated[int, Field(ge=0, le=MAX_BYTES)]
Cost = Annotated[float, Field(ge=0)]  # strict: an integer or a float, never a string or a boolean
Text = Annotated[str, Field(min_length=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, populate_by_name=False)


class _Node(_Strict):
    id: NodeId = None  # type: ignore[assignment]
    name: NodeName = None  # type: ignore[assignment]
    backward: bool = False
    op_type: Text = None  # type: ignore[assignment]

    @model_validator(mode="after")
    def _has_a_key(self) -> "_Node":
        if self.id is None and self.name is None:
            raise PydanticCustomError("node_key", "node has neither 'id' nor 'name'")
        return self

    @property
    def key(self) -> int | str:
        return self.id if self.id is not None else self.name


class CheckmateNode(_Node):
    cost_cpu: Cost
    cost_ram: Size


class LayeredNode(_Node):
    duration: Cost
    out_cost: Size
    param_cost: Size = 0


class CheckmateLink(_Strict):
    source: NodeId
    target: NodeId
    key: NodeId = None  # type: ignore[assignment]  # a multigraph's edge key


class LayeredLink(_Strict):
    source: NodeId = Field(alias="0")
    target: NodeId = Field(alias="1")
    key: NodeId = None  # type: ignore[assignment]


class GraphAttributes(_Strict):
    name: str = None  # type: ignore[assignment]
    order: list[NodeId] = None  # type: ignore[assignment]


class _Document(_Strict):
    directed: bool = True
    multigraph: bool = False
    graph: GraphAttributes = Field(default_factory=GraphAttributes)


class CheckmateGraph(_Document):
    nodes: list[CheckmateNode]
    links: list[CheckmateLink]


class LayeredGraph(_Document):
    nodes: list[LayeredNode]
    links: list[LayeredLink]


DIALECTS: dict[str, tuple[type[_Document], str, str, str, str]] = {
    # dialect: (model, size field, cost field, link source key, link target key)
    "checkmate": (CheckmateGraph, "cost_ram", "cost_cpu", "source", "target"),
    "random-layered": (LayeredGraph, "out_cost", "duration", "0", "1"),
}
_NODE_MODELS: dict[str, type[_Node]] = {"checkmate": CheckmateNode, "random-layered": LayeredNode}
# Fields of the dialects that the importer knows and leaves alone (Moccasin's tags); any field named by a graph's
# `*_tag` attribute is known as well.
_KNOWN_UNREAD = {"checkmate": set(), "random-layered": {"input_cost", "output_blocks"}}


def _message(detail: dict) -> str:
    """A pydantic error in the input's terms: what the field must be, and what it is."""
    kind, value = detail["type"], detail.get("input")
    field = next((part for part in reversed(detail["loc"]) if isinstance(part, str)), "")
    if kind == "missing":
        return "required field is missing"
    if kind == "bool_type":
        return f"must be true or false, not {describe(value)}"
    if kind == "int_type":
        return f"must be an integer, not {describe(value)}"
    if kind == "float_type":
        if isinstance(value, int) and not isinstance(value, bool):
            return f"is too large to read as a number: {describe(value)}"
        return f"must be a number, not {describe(value)}"
    if kind == "finite_number":
        return f"must be a finite number, not {describe(value)}"
    if kind == "string_type":
        return f"must be a string, not {describe(value)}"
    if kind == "string_too_short":
        return "must not be empty"
    if kind == "list_type":
        return f"must be a list{' of node ids' if field == 'order' else ''}, not {describe(value)}"
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        return f"must be a JSON object, not {describe(value)}"
    bound = next(iter((detail.get("ctx") or {}).values()), None)
    if kind == "greater_than_equal":
        return f"must not be negative, got {value!r}" if bound == 0 else f"must be at least {bound}, not {value!r}"
    if kind == "less_than_equal":
        shown = f"{bound} ({format_bytes(bound)})" if isinstance(bound, int) else f"{bound}"
        return f"must be at most {shown}, not {value!r}"
    return str(detail["msg"])


def _node_label(node: Any) -> str | None:
    """`node 3, 'block2_conv1'` for a node of the input, from whichever of its id and name are usable."""
    if not isinstance(node, dict):
        return None
    parts = []
    key = node.get("id", node.get("name"))
    if isinstance(key, (int, str)) and not isinstance(key, bool) and key != "":
        parts.append(_json_id(key))
    name = node.get("name")
    if "id" in node and isinstance(name, str) and name:
        parts.append(repr(name))
    return f"node {', '.join(parts)}" if parts else None


def _field_issues(error: ValidationError, data: dict) -> list[Issue]:
    issues = []
    for detail in error.errors(include_url=False):
        location = detail["loc"]
        message = _message(detail)
        if len(location) >= 3 and location[0] == "nodes" and isinstance(location[1], int):
            label = _node_label(data["nodes"][location[1]])
            if label:
                message += f" ({label})"
        issues.append(Issue(format_location(location), message))
    return issues


def _misspelt_fields(data: dict, dialect: str) -> list[Issue]:
    """A field close to one the importer reads ('backwards', 'Cost_ram') would otherwise be ignored silently."""
    read = set(_NODE_MODELS[dialect].model_fields)
    graph = data.get("graph") if isinstance(data.get("graph"), dict) else {}
    known = read | _KNOWN_UNREAD[dialect] | {
        value for key, value in graph.items() if key.endswith("_tag") and isinstance(value, str)
    }
    issues = []
    for index, node in enumerate(data["nodes"]):
        for field in node:
            if field in known:
                continue
            near = [name for name in read if name.lower() == str(field).lower()]
            near = near or difflib.get_close_matches(str(field), sorted(read), n=1, cutoff=0.85)
            if near:
                label = _node_label(node)
                issues.append(
                    Issue(
                        format_location(("nodes", index, str(field))),
                        f"unknown field; did you mean {near[0]!r}? A field the importer does not read is ignored, "
                        "so a misspelt one would silently change the graph" + (f" ({label})" if label else ""),
                    )
                )
    return issues


def _dialect(data: dict, source: str | None) -> str:
    nodes = data["nodes"]
    strays = [Issue(f"nodes[{i}]", f"a node is a JSON object, not {type(node).__name__}")
              for i, node in enumerate(nodes) if not isinstance(node, dict)]
    if strays:
        raise GraphImportError(strays, source)
    if not nodes:
        raise GraphImportError([Issue("nodes", "the graph has no nodes")], source)
    checkmate = [i for i, node in enumerate(nodes) if "cost_ram" in node]
    layered = [i for i, node in enumerate(nodes) if "out_cost" in node]
    if checkmate and layered:
        raise GraphImportError(
            [Issue("nodes", f"mixes two graph dialects: nodes[{checkmate[0]}] has 'cost_ram' (Checkmate) and "
                            f"nodes[{layered[0]}] has 'out_cost' (random layered)")],
            source,
        )
    if checkmate:
        return "checkmate"
    if layered:
        return "random-layered"
    raise GraphImportError(
        [Issue("nodes", "not a known graph dialect: expected every node to have 'cost_ram' (Checkmate) "
                        "or 'out_cost' (random layered)")],
        source,
    )


def validate_graph(data: Any, source: str | None = None) -> tuple[str, CheckmateGraph | LayeredGraph]:
    """The dialect and the validated input graph; GraphImportError names every problem at its place in the input."""
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list) or not isinstance(data.get("links"), list):
        raise GraphImportError([Issue("", "expected a networkx node-link object with 'nodes' and 'links' lists")],
                               source)
    dialect = _dialect(data, source)
    model = DIALECTS[dialect][0]
    issues: list[Issue] = []
    graph: Any = None
    try:
        graph = model.model_validate(data)
    except ValidationError as error:
        issues += _field_issues(error, data)
    issues += _misspelt_fields(data, dialect)
    issues.sort(key=lambda issue: _document_order(issue.path))
    if issues:
        raise GraphImportError(issues, source)
    _check_structure(graph, dialect, source)
    return dialect, graph


def _document_order(path: str) -> tuple:
    """Issues in the order of the document: the top-level fields, then nodes, then links, each by index."""
    head = path.split("[", 1)[0].split(".", 1)[0]
    rank = {"directed": 0, "multigraph": 1, "graph": 2, "nodes": 3, "links": 4}.get(head, 5)
    index = path[len(head) + 1:].split("]", 1)[0] if path[len(head):].startswith("[") else ""
    return rank, int(index) if index.isdigit() else -1


def _check_structure(graph: CheckmateGraph | LayeredGraph, dialect: str, source: str | None) -> None:
    """Graph-level rules in the input's terms: unique ids, links between nodes, no loops or cycles, the order."""
    _, _, _, source_key, target_key = DIALECTS[dialect]
    issues: list[Issue] = []
    if not graph.directed:
        issues.append(Issue("directed", "must be true: links are read as data flowing from source to target, "
                                        "and an undirected graph does not say which way"))
    keys = [node.key for node in graph.nodes]
    labels = [_label_of(node) for node in graph.nodes]
    index_of: dict[int | str, int] = {}  # 3 and "3" are two keys, as networkx has them
    profile_id: dict[str, int] = {}
    for i, key in enumerate(keys):
        if str(key) in profile_id:
            first = profile_id[str(key)]
            same = "" if keys[first] == key and type(keys[first]) is type(key) else (
                f": {_json_id(keys[first])} and {_json_id(key)} are both {str(key)!r} in a profile")
            issues.append(Issue(f"nodes[{i}]", f"duplicate node id {str(key)!r} (also nodes[{first}]){same}"))
        else:
            profile_id[str(key)] = i
            index_of[key] = i
    if issues:
        raise GraphImportError(issues, source)

    def find(value: int | str, path: str) -> int | None:
        found = index_of.get(value)
        if found is None:
            twin = index_of.get(str(value) if isinstance(value, int) else _as_int(value))
            hint = "" if twin is None else (
                f" (node ids are compared with their JSON type: a node has the id {_json_id(keys[twin])})")
            issues.append(Issue(path, f"{_json_id(value)} is not a node{hint}"))
        return found

    edges: list[tuple[int, int, int]] = []  # (source index, target index, link index)
    first_link: dict[tuple[int, int], int] = {}
    for k, link in enumerate(graph.links):
        src = find(link.source, f"links[{k}].{source_key}")
        dst = find(link.target, f"links[{k}].{target_key}")
        if src is None or dst is None:
            continue
        if src == dst:
            issues.append(Issue(f"links[{k}]", f"links {labels[src]} to itself"))
            continue
        if (src, dst) in first_link and not graph.multigraph:
            issues.append(
                Issue(f"links[{k}]", f"the same link as links[{first_link[src, dst]}] "
                                     f"({_json_id(keys[src])} -> {_json_id(keys[dst])}); a graph that is not a "
                                     "multigraph (\"multigraph\": false) has one link per pair of nodes")
            )
            continue
        first_link.setdefault((src, dst), k)
        edges.append((src, dst, k))
    if issues:
        raise GraphImportError(issues, source)
    if not _acyclic(len(keys), edges):
        raise GraphImportError([_cycle_issue(edges, keys)], source)
    if graph.graph.order is not None:
        _check_order(graph.graph.order, keys, index_of, edges, source)


def _as_int(value: str) -> int | None:
    """The integer a string id spells ("3" -> 3), to say that a link's "3" is not the node 3."""
    return int(value) if len(value) <= 30 and value.isascii() and value.isdigit() and str(int(value)) == value else None


def _label_of(node: _Node) -> str:
    name = f" ({node.name!r})" if node.id is not None and isinstance(node.name, str) and node.name else ""
    return f"node {_json_id(node.key)}{name}"


def _acyclic(size: int, edges: list[tuple[int, int, int]]) -> bool:
    """Kahn's algorithm: every node can be taken once all the nodes it reads are."""
    users: list[list[int]] = [[] for _ in range(size)]
    waiting = [0] * size
    for src, dst, _ in edges:
        users[src].append(dst)
        waiting[dst] += 1
    ready = [node for node in range(size) if not waiting[node]]
    taken = 0
    while ready:
        node = ready.pop()
        taken += 1
        for user in users[node]:
            waiting[user] -= 1
            if not waiting[user]:
                ready.append(user)
    return taken == size


def _cycle_issue(edges: list[tuple[int, int, int]], keys: list[int | str]) -> Issue:
    """The first link, in the input's order, that closes a cycle, and the cycle it closes."""
    digraph = nx.DiGraph()
    digraph.add_nodes_from(range(len(keys)))
    for src, dst, k in edges:
        if nx.has_path(digraph, dst, src):
            path = nx.shortest_path(digraph, dst, src) + [dst]
            return Issue(f"links[{k}]", "closes a cycle: " + " -> ".join(_json_id(keys[i]) for i in path))
        digraph.add_edge(src, dst)
    raise AssertionError("a cyclic graph has a link that closes a cycle")


def _check_order(order: list, keys: list, index_of: dict, edges: list, source: str | None) -> None:
    """`graph.order` lists every node once, each after the nodes it reads: else the import would reorder it."""
    issues: list[Issue] = []
    position: dict[int, int] = {}
    for p, key in enumerate(order):
        node = index_of.get(key)
        if node is None:
            issues.append(Issue(f"graph.order[{p}]", f"{_json_id(key)} is not a node"))
        elif node in position:
            again = f"lists node {_json_id(key)} again (also graph.order[{position[node]}])"
            issues.append(Issue(f"graph.order[{p}]", again))
        else:
            position[node] = p
    missing = [_json_id(keys[i]) for i in range(len(keys)) if i not in position]
    if missing and not issues:
        shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        issues.append(Issue("graph.order", f"misses node{'s' if len(missing) > 1 else ''} {shown}: it must list "
                                           "every node once"))
    if issues:
        raise GraphImportError(issues, source)
    backwards = [(src, dst, k) for src, dst, k in edges if position[src] > position[dst]]
    if backwards:
        src, dst, k = backwards[0]
        more = f"; {len(backwards) - 1} more links go against the order" if len(backwards) > 1 else ""
        message = (f"node {_json_id(keys[dst])} comes before node {_json_id(keys[src])}, which it reads "
                   f"(links[{k}]): the order must be topological{more}")
        raise GraphImportError([Issue(f"graph.order[{position[dst]}]", message)], source)


def check_options(
    name: Any, time_unit_ms: Any, memory_capacity_bytes: Any, d2h_bandwidth_gb_per_s: Any, h2d_bandwidth_gb_per_s: Any
) -> None:
    """Each option's own range, named as the option (and as the keyword argument), not as the profile's field."""

    def refuse(argument: str, problem: str) -> None:
        raise ImportOptionError(f"{OPTIONS[argument]} {problem} ({argument} in Python)")

    def number(value: Any) -> bool:
        return not isinstance(value, bool) and isinstance(value, (int, float))

    if name is not None and not isinstance(name, str):
        refuse("name", f"must be a string, not {name!r}")
    if not number(time_unit_ms) or not (math.isfinite(time_unit_ms) and time_unit_ms > 0):
        refuse("time_unit_ms", f"must be a positive number, not {_shown(time_unit_ms)}")
    if memory_capacity_bytes is not None:
        if isinstance(memory_capacity_bytes, bool) or not isinstance(memory_capacity_bytes, int):
            refuse("memory_capacity_bytes", f"must be a whole number of bytes, not {memory_capacity_bytes!r}")
        if memory_capacity_bytes < 1:
            refuse("memory_capacity_bytes", f"must be at least 1 byte, not {memory_capacity_bytes}")
        if memory_capacity_bytes > MAX_BYTES:
            refuse("memory_capacity_bytes", f"must be at most {MAX_BYTES} bytes ({format_bytes(MAX_BYTES)}), not "
                                            f"{memory_capacity_bytes} bytes ({format_bytes(memory_capacity_bytes)})")
    for argument, value in (("d2h_bandwidth_gb_per_s", d2h_bandwidth_gb_per_s),
                            ("h2d_bandwidth_gb_per_s", h2d_bandwidth_gb_per_s)):
        if value is None:
            continue
        if not number(value) or not math.isfinite(value):
            refuse(argument, f"must be a number of GB/s, not {_shown(value)}")
        if value < MIN_BANDWIDTH_GB_PER_S:
            refuse(argument, f"must be at least {MIN_BANDWIDTH_GB_PER_S:g} GB/s, not {value:g}")
        if value > MAX_BANDWIDTH_GB_PER_S:
            refuse(argument, f"must be at most {MAX_BANDWIDTH_GB_PER_S:g} GB/s, not {value:g}")
    if (d2h_bandwidth_gb_per_s is None) != (h2d_bandwidth_gb_per_s is None):
        given, missing = (("d2h_bandwidth_gb_per_s", "h2d_bandwidth_gb_per_s") if h2d_bandwidth_gb_per_s is None
                          else ("h2d_bandwidth_gb_per_s", "d2h_bandwidth_gb_per_s"))
        # one link alone gives a profile that cannot offload, which a planner later reports as "no bandwidth"
        raise ImportOptionError(f"{OPTIONS[given]} needs {OPTIONS[missing]} too: an offloaded tensor goes out and comes "
                                f"back, so give both links' bandwidths, or neither ({given} and {missing} in Python)")


def _shown(value: Any) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else repr(value)
