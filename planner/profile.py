"""The GraphProfile contract: what the planner knows about one training step.

Everything a planner, baseline, simulator or executor needs is here, with the
unit in every field name. Graph-level rules (ids, edges, cycles) are checked
when the document is loaded, so later code can trust it.
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import networkx as nx
from pydantic import ConfigDict, Field, ValidationError, field_validator, model_serializer, model_validator

from planner.errors import Issue, ProfileError
from planner.validation import NumbersAreNumbers, issues_from_validation_error

PROFILE_SCHEMA_VERSION = "1.0"
SUPPORTED_PROFILE_VERSIONS = ("1.0",)

NodeKind = Literal["forward", "loss", "backward"]

# Bounds far beyond any real device, so that sums over a whole step stay finite floats and fit the solver's
# int64 arithmetic: a profile outside them is refused with its path rather than overflowing somewhere later.
MAX_BYTES = 2**50  # 1 PiB for one tensor, workspace or memory figure
MAX_TIME_MS = 1e7  # about 2.8 hours for one operation or transfer latency
MIN_BANDWIDTH_GB_PER_S = 1e-3  # 1 MB/s
MAX_BANDWIDTH_GB_PER_S = 1e6
_RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")

class _Strict(NumbersAreNumbers):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=False)


class Hardware(_Strict):
    """The device the step runs on and its link to host memory."""

    name: str = Field(min_length=1, description="Device name, e.g. 'Tesla P40'.")
    memory_capacity_bytes: int = Field(gt=0, le=MAX_BYTES, description="Device memory in bytes.")
    d2h_bandwidth_gb_per_s: float | None = Field(
        default=None, ge=MIN_BANDWIDTH_GB_PER_S, le=MAX_BANDWIDTH_GB_PER_S,
        description="Device-to-host copy bandwidth, 1e9 bytes per second. None: no offloading.",
    )
    h2d_bandwidth_gb_per_s: float | None = Field(
        default=None, ge=MIN_BANDWIDTH_GB_PER_S, le=MAX_BANDWIDTH_GB_PER_S,
        description="Host-to-device copy bandwidth, 1e9 bytes per second. None: no prefetching.",
    )
    transfer_latency_ms: float = Field(default=0.0, ge=0, le=MAX_TIME_MS, description="Fixed cost added to every transfer.")

    @property
    def can_transfer(self) -> bool:
        return self.d2h_bandwidth_gb_per_s is not None and self.h2d_bandwidth_gb_per_s is not None

    def offload_time_ms(self, size_bytes: int) -> float:
        assert self.d2h_bandwidth_gb_per_s is not None
        return self.transfer_latency_ms + size_bytes / (self.d2h_bandwidth_gb_per_s * 1e6)

    def prefetch_time_ms(self, size_bytes: int) -> float:
        assert self.h2d_bandwidth_gb_per_s is not None
        return self.transfer_latency_ms + size_bytes / (self.h2d_bandwidth_gb_per_s * 1e6)


class FixedMemory(_Strict):
    """Memory resident for the whole step, whatever the plan, and what the optimizer's step adds at its end."""

    inputs_bytes: int = Field(default=0, ge=0, le=MAX_BYTES)
    parameters_bytes: int = Field(default=0, ge=0, le=MAX_BYTES)
    gradients_bytes: int = Field(default=0, ge=0, le=MAX_BYTES)
    optimizer_state_bytes: int = Field(default=0, ge=0, le=MAX_BYTES)
    other_bytes: int = Field(default=0, ge=0, le=MAX_BYTES, description="Framework context, buffers, anything else resident.")
    optimizer_step_bytes: int = Field(
        default=0, ge=0, le=MAX_BYTES,
        description="Temporaries of the optimizer's step (Adam's update, a weight-decay term), on top of the resident "
        "memory above. Held only during the step, after the backward has released every activation, so they count "
        "then and not all step long.",
    )

    @model_serializer(mode="wrap")
    def _without_a_zero_step(self, handler):
        """Left out when 0, as in every profile written before the field: their digests, and the schedules made for
        them, stay valid, and an older mosos still reads what this one writes for them."""
        dumped = handler(self)
        if isinstance(dumped, dict) and not dumped.get("optimizer_step_bytes"):
            dumped.pop("optimizer_step_bytes", None)
        return dumped

    @property
    def total_bytes(self) -> int:
        """Resident all step long (the optimizer step's temporaries are not)."""
        return (
            self.inputs_bytes
            + self.parameters_bytes
            + self.gradients_bytes
            + self.optimizer_state_bytes
            + self.other_bytes
        )


class Implementation(_Strict):
    """One way to compute a node, e.g. one cuDNN convolution algorithm."""

    name: str = Field(min_length=1)
    time_ms: float = Field(ge=0, le=MAX_TIME_MS)
    workspace_bytes: int = Field(default=0, ge=0, le=MAX_BYTES)
    arena_workspace_bytes: int | None = Field(
        default=None, ge=0, le=MAX_BYTES,
        description="Of workspace_bytes, the part a step writing into its planned arena places there (values the "
        "node makes and drops inside it); the rest the kernel allocates for itself beside the arena (a cuDNN "
        "workspace, a convolution's result before its copy into the arena), so an arena slot for it would stay "
        "empty. Omitted: all of it. Planned addresses give the workspace this much; the peak counts all of it.",
    )

    @model_validator(mode="after")
    def _arena_part_within_workspace(self) -> "Implementation":
        if self.arena_workspace_bytes is not None and self.arena_workspace_bytes > self.workspace_bytes:
            raise ValueError(f"arena_workspace_bytes ({self.arena_workspace_bytes}) is more than workspace_bytes "
                             f"({self.workspace_bytes}): it is the part of the workspace placed in the arena")
        return self

    @model_serializer(mode="wrap")
    def _without_an_unset_arena_part(self, handler):
        """Left out when not given, as in every profile written before the field: their digests, and the schedules
        made for them, stay valid, and an older mosos still reads what this one writes for them."""
        dumped = handler(self)
        if isinstance(dumped, dict) and dumped.get("arena_workspace_bytes", 0) is None:
            dumped.pop("arena_workspace_bytes")
        return dumped

    @property
    def placed_workspace_bytes(self) -> int:
        """What planned addresses place of the workspace: its arena part where the profile says, else all of it."""
        return self.workspace_bytes if self.arena_workspace_bytes is None else self.arena_workspace_bytes


class Node(_Strict):
    """One operator of the training step; it produces one tensor."""

    id: str = Field(min_length=1, description="Stable id, unique in the profile.")
    name: str = Field(default="", description="Readable name; defaults to the id.")
    kind: NodeKind
    op_type: str = Field(default="op")
    output_bytes: int = Field(ge=0, le=MAX_BYTES, description="Size of the tensor this node produces.")
    extra_saved_bytes: int = Field(
        default=0,
        ge=0,
        le=MAX_BYTES,
        description="Bytes saved for backward beyond the output (pooling indices, masks, statistics); "
        "they live and move with the output.",
    )
    module: str | None = Field(default=None, description="Qualified name of the model module it came from.")
    forward_node: str | None = Field(
        default=None,
        description="For a backward node: the forward (or loss) node of this profile it differentiates. Several "
        "backward nodes may share one (a convolution's filter-gradient and data-gradient nodes); between them they "
        "read at least one tensor of the forward pass.",
    )
    inputs: list[str] = Field(
        default_factory=list,
        description="Ids of the other nodes of this profile whose tensors this node reads; the graph has no cycles.",
    )
    implementations: list[Implementation] = Field(
        description="At least one; names unique within the node.", json_schema_extra={"minItems": 1}
    )
    draws_random: bool = Field(
        default=False, strict=True,
        description="It draws random numbers (a dropout): the first computations of such nodes keep the order they "
        "are listed in, so that each draws the numbers the step draws for it.",
    )

    @model_serializer(mode="wrap")
    def _without_not_random(self, handler):
        """Left out when false, as in every profile written before the field: their digests, and the schedules made
        for them, stay valid, and an older mosos still reads what this one writes for them."""
        dumped = handler(self)
        if isinstance(dumped, dict) and not dumped.get("draws_random"):
            dumped.pop("draws_random", None)
        return dumped

    @field_validator("implementations")
    @classmethod
    def _at_least_one(cls, value: list[Implementation]) -> list[Implementation]:
        if not value:
            raise ValueError("a node needs at least one implementation (time and workspace)")
        names = [impl.name for impl in value]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"implementation names must be unique within a node; repeated: {duplicates}")
        return value

    @property
    def size_bytes(self) -> int:
        """What keeping, moving or freeing this node's tensor costs."""
        return self.output_bytes + self.extra_saved_bytes

    @property
    def fastest(self) -> Implementation:
        return min(self.implementations, key=lambda impl: (impl.time_ms, impl.workspace_bytes))

    @property
    def smallest_workspace(self) -> Implementation:
        return min(self.implementations, key=lambda impl: (impl.workspace_bytes, impl.time_ms))

    def implementation(self, name: str) -> Implementation:
        for impl in self.implementations:
            if impl.name == name:
                return impl
        raise KeyError(name)

    @property
    def label(self) -> str:
        return self.name or self.id


class Provenance(_Strict):
    """Where the numbers came from, so nobody mistakes an estimate for a measurement."""

    source: Literal["measured", "estimated", "imported", "handmade"]
    device: str | None = None
    measured_at: datetime | None = Field(default=None, description="When it was measured: RFC 3339, with its offset.")
    estimator: str | None = Field(default=None, description="Model and version that estimated the figures.")
    repeats: int | None = Field(default=None, ge=1)
    spread_percent: float | None = Field(default=None, ge=0)
    tool: str | None = Field(default=None, description="Tool and version that wrote the profile.")
    model_structure_sha256: str | None = Field(
        default=None, description="Hash of the model's captured graph, so a replay can refuse another model."
    )
    input_signature: str | None = Field(default=None, description="Dtypes and shapes of the inputs it was measured with.")
    target_signature: str | None = Field(default=None, description="Dtypes and shapes of the targets, if any.")
    notes: str | None = None

    @field_validator("measured_at", mode="before")
    @classmethod
    def _rfc3339(cls, value: Any) -> Any:
        """What the schema's `date-time` promises and nothing else: not a number of seconds, not a bare date, not a
        time without its offset (pydantic would read all three)."""
        if value is None or isinstance(value, datetime):
            return value
        if not isinstance(value, str) or not _RFC3339.match(value):
            raise ValueError(f"must be a date and time with its offset (RFC 3339), e.g. 2024-05-01T12:00:00Z, not {value!r}")
        return value


class GraphValidationError(ValueError):
    """Carries graph-level issues through pydantic with their own JSON paths."""

    def __init__(self, issues: list[Issue]):
        self.issues = issues
        super().__init__("; ".join(str(i) for i in issues))


class GraphProfile(_Strict):
    """A profiled (or estimated, or imported) training step."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, json_schema_extra={"title": "GraphProfile"})

    schema_version: str = Field(
        default=PROFILE_SCHEMA_VERSION, description="Version of this contract.",
        json_schema_extra={"enum": list(SUPPORTED_PROFILE_VERSIONS)},
    )
    name: str = Field(min_length=1, description="What was profiled, e.g. 'vgg19 batch 144 on P40'.")
    hardware: Hardware
    fixed_memory: FixedMemory = Field(default_factory=FixedMemory)
    nodes: list[Node] = Field(min_length=1)
    provenance: Provenance

    @field_validator("schema_version")
    @classmethod
    def _known_version(cls, value: str) -> str:
        if value not in SUPPORTED_PROFILE_VERSIONS:
            raise ValueError(
                f"unknown profile schema version {value!r}; this mosos reads {', '.join(SUPPORTED_PROFILE_VERSIONS)}"
            )
        return value

    @model_validator(mode="after")
    def _check_graph(self) -> "GraphProfile":
        issues = check_graph(self.nodes)
        if issues:
            raise GraphValidationError(issues)
        return self

    # Derived views. Profiles are treated as immutable once loaded.

    @cached_property
    def node_by_id(self) -> dict[str, Node]:
        return {node.id: node for node in self.nodes}

    @cached_property
    def order(self) -> list[str]:
        """Execution order: a topological order that keeps the listed order where it can."""
        return execution_order(self.nodes)

    @cached_property
    def position(self) -> dict[str, int]:
        return {node_id: index for index, node_id in enumerate(self.order)}

    @cached_property
    def loss_ids(self) -> list[str]:
        """The loss nodes: every backward node's first computation comes after them (the backward pass starts from
        the loss)."""
        return [node_id for node_id in self.order if self.node_by_id[node_id].kind == "loss"]

    @cached_property
    def drawing_order(self) -> list[str]:
        """The nodes that draw random numbers, in the order they draw (their first computations keep it)."""
        return [node_id for node_id in self.order if self.node_by_id[node_id].draws_random]

    @cached_property
    def consumers(self) -> dict[str, list[str]]:
        readers: dict[str, list[str]] = {node.id: [] for node in self.nodes}
        for node_id in self.order:
            for source in dict.fromkeys(self.node_by_id[node_id].inputs):
                readers[source].append(node_id)
        return readers

    @property
    def fixed_bytes(self) -> int:
        return self.fixed_memory.total_bytes

    @cached_property
    def _digest(self) -> str:
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def digest(self) -> str:
        """Canonical hash: two profiles with the same content have the same digest."""
        return self._digest

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> "GraphProfile":
        """A copy whose derived views are recomputed, so an update never leaves them stale."""
        copy = super().model_copy(update=update, deep=deep)
        for name in _DERIVED_VIEWS:
            copy.__dict__.pop(name, None)
        return copy

    def to_json(self, indent: int | None = 1) -> str:
        return self.model_dump_json(indent=indent, exclude_none=True)


# "_memory_aware_order": kept there by planner.cpsat.reorder.memory_aware_order
_DERIVED_VIEWS = ("node_by_id", "order", "position", "loss_ids", "drawing_order", "consumers", "_digest",
                  "_memory_aware_order")


def check_graph(nodes: list[Node]) -> list[Issue]:
    """Graph-level rules that a single node cannot check on its own."""
    issues: list[Issue] = []
    index_of: dict[str, int] = {}
    for i, node in enumerate(nodes):
        if node.id in index_of:
            issues.append(
                Issue(f"nodes[{i}].id", f"duplicate node id {node.id!r} (first used by nodes[{index_of[node.id]}])")
            )
        else:
            index_of[node.id] = i
    for i, node in enumerate(nodes):
        for k, source in enumerate(node.inputs):
            if source not in index_of:
                issues.append(Issue(f"nodes[{i}].inputs[{k}]", f"node {node.id!r} reads {source!r}, which is not a node"))
            elif source == node.id:
                issues.append(Issue(f"nodes[{i}].inputs[{k}]", f"node {node.id!r} reads its own output"))
    if issues:
        return issues
    graph = nx.DiGraph()
    graph.add_nodes_from(node.id for node in nodes)
    graph.add_edges_from((source, node.id) for node in nodes for source in node.inputs)
    try:
        cycle = nx.find_cycle(graph)
    except nx.NetworkXNoCycle:
        cycle = None
    if cycle:
        names = [edge[0] for edge in cycle] + [cycle[0][0]]
        first = index_of[cycle[-1][1]]
        issues.append(
            Issue(f"nodes[{first}].inputs", "the graph has a cycle: " + " -> ".join(repr(n) for n in names))
        )
        return issues
    kinds = {node.id: node.kind for node in nodes}
    # A forward node's backward may be several nodes (a convolution's filter and data gradients): between them
    # they read the forward pass, though one of them alone (the data gradient: dy and the weights) may not.
    reads_forward_pass: dict[str, bool] = {}
    for node in nodes:
        if node.forward_node is not None:
            reads = any(kinds[source] != "backward" for source in node.inputs)
            reads_forward_pass[node.forward_node] = reads_forward_pass.get(node.forward_node, False) or reads
    for i, node in enumerate(nodes):
        if node.forward_node is None:
            continue
        if node.kind != "backward":
            issues.append(Issue(f"nodes[{i}].forward_node", f"only backward nodes differentiate a forward node; {node.id!r} is {node.kind}"))
        elif node.forward_node not in index_of:
            issues.append(Issue(f"nodes[{i}].forward_node", f"{node.forward_node!r} is not a node"))
        elif kinds[node.forward_node] == "backward":
            issues.append(Issue(f"nodes[{i}].forward_node", f"{node.forward_node!r} is a backward node, not a forward one"))
        elif not reads_forward_pass[node.forward_node]:
            issues.append(
                Issue(
                    f"nodes[{i}].inputs",
                    f"backward node {node.id!r} claims to differentiate {node.forward_node!r} "
                    "but neither it nor another backward node of that forward node reads a tensor of the forward pass",
                )
            )
    return issues


def execution_order(nodes: list[Node]) -> list[str]:
    rank = {node.id: i for i, node in enumerate(nodes)}
    graph = nx.DiGraph()
    graph.add_nodes_from(rank)
    graph.add_edges_from((source, node.id) for node in nodes for source in node.inputs)
    return list(nx.lexicographical_topological_sort(graph, key=rank.__getitem__))


def parse_profile(data: Any, source: str | None = None) -> GraphProfile:
    """Validate a decoded JSON document; every problem comes back as path + sentence."""
    if not isinstance(data, dict):
        raise ProfileError([Issue("", f"a profile is a JSON object, not {type(data).__name__}")], source)
    version = data.get("schema_version", PROFILE_SCHEMA_VERSION)
    if version not in SUPPORTED_PROFILE_VERSIONS:
        raise ProfileError(
            [
                Issue(
                    "schema_version",
                    f"unknown profile schema version {version!r}; this mosos reads "
                    f"{', '.join(SUPPORTED_PROFILE_VERSIONS)}",
                )
            ],
            source,
        )
    try:
        return GraphProfile.model_validate(data)
    except ValidationError as error:
        raise ProfileError(issues_from_validation_error(error), source) from None


def load_profile(path: str | Path) -> GraphProfile:
    path = Path(path)
    return parse_profile(read_json(path, ProfileError), str(path))


class _DuplicateKey(ValueError):
    pass


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    """JSON allows a key twice in one object and Python keeps the last value: a request with `memory_ratio` twice
    was planned at whichever came last, silently."""
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        twice = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise _DuplicateKey(f"the key {twice!r} appears twice in one object: which value is meant?")
    return value


def json_problem(raw: bytes | str) -> tuple[Any, str | None]:
    """Decode JSON text (UTF-8, or UTF-16/32 with its BOM): (value, None), or (None, a sentence on what is wrong)."""
    try:
        return json.loads(raw, object_pairs_hook=_refuse_duplicate_keys), None
    except json.JSONDecodeError as error:
        return None, f"not valid JSON: {error.msg} at line {error.lineno} column {error.colno}"
    except UnicodeDecodeError as error:
        return None, f"not UTF-8 text: byte {error.object[error.start:error.start + 1]!r} at offset {error.start}"
    except RecursionError:
        return None, "not valid JSON here: nested too deeply"
    except _DuplicateKey as error:
        return None, f"not valid here: {error}"
    except ValueError as error:
        if "digits" in str(error):  # Python's limit on integer literals
            return None, "a number has more digits than any size or time can (more than 4300)"
        return None, f"not valid JSON: {error}"


def read_json(path: Path, error_type: type) -> Any:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        if str(path) == "-":  # the shell convention for standard input, which these commands do not read
            raise error_type([Issue("", "'-' (standard input) is not read here: give the file's path")], "-") from None
        raise error_type([Issue("", "file not found")], str(path)) from None
    except IsADirectoryError:
        raise error_type([Issue("", "is a directory, not a JSON file")], str(path)) from None
    except OSError as error:
        raise error_type([Issue("", f"cannot read the file: {error.strerror}")], str(path)) from None
    value, problem = json_problem(raw)
    if problem is not None:
        raise error_type([Issue("", problem)], str(path))
    return value
