"""Turn pydantic's errors into path + sentence issues that people can act on."""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import BaseModel, ValidationError, ValidationInfo, field_validator

from planner.errors import Issue
from planner.units import format_bytes

_NUMBER_TYPES = (int, float, int | None, float | None)


class NumbersAreNumbers(BaseModel):
    """Base of the contracts' models: no quoted numbers or booleans coerced into sizes, times or ratios."""

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_are_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """A quoted number or a boolean where a size or a time belongs is a mistake, not a number to coerce."""
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and field.annotation in _NUMBER_TYPES and isinstance(value, (bool, str)):
            raise ValueError(f"must be a number, not {type(value).__name__} {value!r}")
        return value


def format_location(location: tuple) -> str:
    path = ""
    for part in location:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += ("." if path else "") + str(part)
    return path


def issues_from_validation_error(error: ValidationError) -> list[Issue]:
    issues: list[Issue] = []
    for detail in error.errors(include_url=False):
        nested = (detail.get("ctx") or {}).get("error")
        nested_issues = getattr(nested, "issues", None)
        if nested_issues:
            prefix = format_location(detail["loc"])
            for issue in nested_issues:
                joined = f"{prefix}.{issue.path}" if prefix and issue.path else prefix or issue.path
                issues.append(Issue(joined, issue.message))
            continue
        message = detail["msg"]
        if message.startswith("Value error, "):
            message = message[len("Value error, ") :]
        if detail["type"] == "extra_forbidden":
            message = "unknown field (check its spelling and the schema)"
        elif detail["type"] == "missing":
            message = "required field is missing"
        elif detail["type"] == "finite_number":
            message = "must be a finite number (not NaN or infinity)"
        elif detail["type"] in _BOUNDS:
            message = _bound_message(detail)
        elif detail["type"] == "int_parsing_size":  # a float beyond 64 bits, such as 1e40
            message = f"is far too large for this field, not {detail.get('input')!r}"
        elif detail["type"] in _KINDS:  # pydantic names Python types ("a valid dictionary or instance of X")
            message = f"must be {_KINDS[detail['type']]}, not {describe(detail.get('input'))}"
        elif detail["type"] == "too_short":  # pydantic: "List should have at least 1 item after validation, not 0"
            least = (detail.get("ctx") or {}).get("min_length", 1)
            given = (detail.get("ctx") or {}).get("actual_length")
            message = f"needs at least {least} item{'s' if least != 1 else ''}" + (
                ", not an empty list" if given == 0 else f", not {given}" if given is not None else "")
        issues.append(Issue(format_location(detail["loc"]), message))
    return issues


_KINDS = {
    "model_type": "a JSON object", "model_attributes_type": "a JSON object", "dict_type": "a JSON object",
    "list_type": "a list", "string_type": "a string",
    "int_type": "a whole number", "int_parsing": "a whole number", "int_from_float": "a whole number",
    "float_type": "a number", "float_parsing": "a number",
    "bool_type": "true or false", "bool_parsing": "true or false",
}


def describe(value: Any) -> str:
    """A JSON value as a person would name it: 'the string "false"', 'the number 1.5', 'true', 'null'."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        digits = len(str(abs(value)))
        return f"an integer of {digits} digits" if digits > 30 else f"the number {value}"
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "Infinity" if value > 0 else "-Infinity"
        return f"the number {value!r}"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:40] + "..."
        return f"the string {json.dumps(shown)}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a JSON object"
    return type(value).__name__


_BOUNDS = {"less_than_equal": "at most", "less_than": "below", "greater_than_equal": "at least", "greater_than": "above"}


def _bound_message(detail: dict) -> str:
    """'must be at most 1125899906842624 (1 PiB), not 1152921504606846976': the bound with its unit, and the value."""
    context = detail.get("ctx") or {}
    bound = next(iter(context.values()), None)
    field = str(detail["loc"][-1]) if detail.get("loc") else ""
    text = f"must be {_BOUNDS[detail['type']]} {bound}"
    if isinstance(bound, int) and bound >= 2**20 and field.endswith("bytes"):
        text += f" ({format_bytes(bound)})"
    elif field.endswith("_ms"):
        text += " ms"
    elif field.endswith("_gb_per_s"):
        text += " GB/s"
    return f"{text}, not {detail.get('input')!r}"
