"""The OpenAPI document states what the server enforces, this server's settings and strategies included.

FastAPI writes the models' own constraints; what only the server knows is added
here, so that a client (or schemathesis) reading the document can build only
requests the server accepts, and every request it refuses breaks a rule the
document states:

- every operation that takes a body answers 415 to a body that is not JSON;
- the limits of this server: `time_limit_s`, `workers`, `wait_s` maxima and the
  profile's `maxItems` of nodes (413 names the limit);
- `strategy` is one of the strategies this server has (plugins included), a
  strategy that uses a budget needs `budget_bytes` or `memory_ratio` (not both,
  for any strategy), and one that moves tensors needs a profile with both
  transfer bandwidths;
- operations open without a token (`/healthz`) say so when the rest need one.

What JSON Schema cannot say (node ids unique, inputs and forward_node naming
other nodes of the profile, no cycles, implementation names unique in a node,
stage indices in order) is in the fields' descriptions and checked with the
same JSON path and sentence.
"""

from __future__ import annotations

from typing import Any

from api.settings import Settings
# Imports inside functions here are deferred for start-up time: the models' tables load when the schema is first asked
# for, not when the server starts.

ERROR_REF = {"$ref": "#/components/schemas/ErrorBody"}
JSON_METHODS = ("post", "put", "patch")


def _error_response(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": ERROR_REF}}}


def _nullable_bound(prop: dict[str, Any], key: str, value: float) -> None:
    """Set a bound on the non-null branch of an `anyOf: [{type: ...}, {type: null}]` property (or on the property)."""
    for branch in prop.get("anyOf", [prop]):
        if branch.get("type") in ("integer", "number"):
            branch[key] = value


def _strategy_rule(names: list[str], default_in: bool, then: dict[str, Any]) -> dict[str, Any]:
    """`if strategy is one of names then ...`; an absent strategy counts as the default."""
    condition: dict[str, Any] = {"properties": {"strategy": {"enum": names}}}
    if not default_in:
        condition["required"] = ["strategy"]
    return {"if": condition, "then": then}


def _plan_request(schema: dict[str, Any], settings: Settings, strategies: dict) -> None:
    properties = schema["properties"]
    names = sorted(strategies)
    properties["strategy"]["enum"] = names
    default = properties["strategy"].get("default")
    _nullable_bound(properties["time_limit_s"], "maximum", settings.max_time_limit_s)
    _nullable_bound(properties["workers"], "maximum", settings.max_solver_workers)
    _nullable_bound(properties["wait_s"], "maximum", settings.max_wait_s)
    given = {
        "budget_bytes": {"required": ["budget_bytes"], "properties": {"budget_bytes": {"type": "integer"}}},
        "memory_ratio": {"required": ["memory_ratio"], "properties": {"memory_ratio": {"type": "number"}}},
    }
    rules: list[dict[str, Any]] = [
        {"not": {"required": ["budget_bytes", "memory_ratio"],
                 "properties": {"budget_bytes": {"type": "integer"}, "memory_ratio": {"type": "number"}}}},
    ]
    budgeted = sorted(name for name, info in strategies.items() if info.uses_budget)
    if budgeted:
        rules.append(_strategy_rule(budgeted, default in budgeted, {"anyOf": [given["budget_bytes"], given["memory_ratio"]]}))
    moving = sorted(name for name, info in strategies.items() if info.needs_transfers)
    if moving:
        links = ["d2h_bandwidth_gb_per_s", "h2d_bandwidth_gb_per_s"]
        hardware = {"required": links, "properties": {link: {"type": "number"} for link in links}}
        rules.append(_strategy_rule(moving, default in moving, {
            "properties": {"profile": {"properties": {"hardware": hardware}}}
        }))
    schema["allOf"] = rules
    schema["description"] = (
        f"{schema.get('description', '')} Strategies that use a budget ({', '.join(budgeted)}) need one of "
        f"budget_bytes or memory_ratio; strategies that move tensors ({', '.join(moving)}) need a profile with both "
        "transfer bandwidths."
    ).strip()


def _max_batch_request(schema: dict[str, Any], settings: Settings, strategies: dict) -> None:
    """Names as enums (this server's strategies with a largest batch), its limits, and which input size fits which
    model: what the search's first step would otherwise refuse with a 422."""
    from models.gpus import GPUS
    from models.names import MODEL_NAMES

    properties = schema["properties"]
    properties["model"]["enum"] = list(MODEL_NAMES)
    properties["gpu"]["enum"] = list(GPUS)
    properties["strategies"]["items"]["enum"] = sorted(
        name for name, info in strategies.items() if info.uses_budget or name == "keep-all"
    )
    _nullable_bound(properties["time_limit_s"], "maximum", settings.max_search_time_s)
    _nullable_bound(properties["workers"], "maximum", settings.max_solver_workers)
    _nullable_bound(properties["wait_s"], "maximum", settings.max_wait_s)
    no_value = {"type": "null"}
    images = [name for name in MODEL_NAMES if name != "transformer"]
    schema["allOf"] = [
        {"if": {"properties": {"model": {"const": "transformer"}}},
         "then": {"properties": {"image_size": no_value}},
         "else": {"properties": {"tokens": no_value}}},
        {"if": {"properties": {"model": {"const": "unet"}}},
         "then": {"properties": {"image_size": {"anyOf": [{"type": "integer", "minimum": 16, "multipleOf": 16}, no_value]}}}},
        {"if": {"properties": {"model": {"enum": [name for name in images if name != "unet"]}}},
         "then": {"properties": {"image_size": {"anyOf": [{"type": "integer", "minimum": 32}, no_value]}}}},
    ]
    schema["description"] = (
        f"{schema.get('description', '')} The transformer takes `tokens`, the other models `image_size` (U-Net: a "
        "multiple of 16; the others: at least 32)."
    ).strip()


def refine_openapi(schema: dict[str, Any], settings: Settings, strategies: dict, open_paths: tuple[str, ...]) -> dict[str, Any]:
    """Add to FastAPI's document what only this server knows (see the module docstring)."""
    for path, item in schema.get("paths", {}).items():
        for method, operation in item.items():
            if not isinstance(operation, dict):
                continue
            if "requestBody" in operation:
                operation.setdefault("responses", {}).setdefault(
                    "415", _error_response("The body was not sent as `Content-Type: application/json`.")
                )
            if path in open_paths and "security" in schema:
                operation["security"] = []  # open to all, token or not
    components = schema.get("components", {}).get("schemas", {})
    if "PlanRequest" in components:
        _plan_request(components["PlanRequest"], settings, strategies)
    if "MaxBatchRequest" in components:
        _max_batch_request(components["MaxBatchRequest"], settings, strategies)
    if "GraphProfile" in components:
        nodes = components["GraphProfile"]["properties"]["nodes"]
        nodes["maxItems"] = settings.max_nodes
        nodes["description"] = f"At most {settings.max_nodes} (this server's max_nodes; more is refused with 413)."
    return schema
