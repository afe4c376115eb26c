"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """A request the server answers with an error object instead of a completion."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_param(param: str, message: str, code: str = "invalid_value") -> ApiError:
    """400 for a parameter with a wrong type or value."""
    return ApiError(400, message, param=param, code=code)


def unsupported(param: str, message: str) -> ApiError:
    """400 for a parameter this server does not implement (refused rather than silently ignored)."""
    return ApiError(400, message, param=param, code="unsupported_parameter")
