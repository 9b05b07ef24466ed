"""Errors the API answers with, all in one JSON shape (`ErrorBody`)."""

from __future__ import annotations

from planner.errors import Issue


class ApiError(Exception):
    def __init__(
        self,
        status_code: int,
        error: str,
        message: str,
        *,
        issues: list[Issue] | None = None,
        limit: str | None = None,
        limit_value: float | None = None,
        headers: dict[str, str] | None = None,
    ):
        self.status_code = status_code
        self.error = error
        self.message = message
        self.issues = issues or []
        self.limit = limit
        self.limit_value = limit_value
        self.headers = headers or {}
        super().__init__(message)

    def __reduce__(self):
        """Pickled whole, so that an error raised in a request process reaches the server intact."""
        return _rebuild_api_error, (
            self.status_code, self.error, self.message, self.issues, self.limit, self.limit_value, self.headers,
        )

    def body(self) -> dict:
        return {
            "error": self.error,
            "message": self.message,
            "issues": [{"path": issue.path, "message": issue.message} for issue in self.issues],
            "limit": self.limit,
            "limit_value": self.limit_value,
        }


def _rebuild_api_error(status_code, error, message, issues, limit, limit_value, headers) -> ApiError:
    return ApiError(status_code, error, message, issues=issues, limit=limit, limit_value=limit_value, headers=headers)


def invalid(issues: list[Issue], what: str = "request") -> ApiError:
    lines = "; ".join(str(issue) for issue in issues)
    return ApiError(422, "invalid_request", f"invalid {what}: {len(issues)} problem(s): {lines}", issues=issues)


def over_limit(status_code: int, path: str, message: str, limit: str, value: float) -> ApiError:
    return ApiError(
        status_code, "limit_exceeded", f"{path or 'request'}: {message}", issues=[Issue(path, message)], limit=limit, limit_value=value
    )


class BodyTooLarge(Exception):
    """Raised while reading a body past max_body_bytes; answered with 413."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        super().__init__(f"the request body is larger than this server's limit max_body_bytes = {limit_bytes} bytes")
