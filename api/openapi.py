"""The OpenAPI document states what the server enforces: every operation is checked the same way, new ones too."""

from __future__ import annotations

from typing import Any

ERROR_REF = {"$ref": "#/components/schemas/ErrorBody"}


def _error_response(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": ERROR_REF}}}


def refine_openapi(schema: dict[str, Any]) -> dict[str, Any]:
    """Add what FastAPI cannot know from the routes: every operation that takes a body answers 415 to a body
    that is not JSON (`api.http_rules.require_json_body`)."""
    for item in schema.get("paths", {}).values():
        for operation in item.values():
            if isinstance(operation, dict) and "requestBody" in operation:
                operation.setdefault("responses", {}).setdefault(
                    "415", _error_response("The body was not sent as `Content-Type: application/json`.")
                )
    return schema
