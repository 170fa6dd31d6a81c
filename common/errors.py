"""The error a client gets for a request the server refuses, whichever stage refuses it:
an HTTP status and an OpenAI-style body (message, type, param, code)."""

from __future__ import annotations

from typing import Any

from common.messages import ErrorReply

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 408: "RequestTimeoutError", 413: "RequestTooLargeError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}
RETRY_AFTER_S = 1


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or ERROR_TYPES.get(status, "BadRequestError")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status}}

    def headers(self) -> dict[str, str]:
        """A 503 is temporary (queue full, a stage restarting): say when to come back."""
        return {"Retry-After": str(RETRY_AFTER_S)} if self.status == 503 else {}

    def reply(self, rid: str) -> ErrorReply:
        """The message that carries this error to the request's gateway."""
        return ErrorReply(rid, self.status, self.message, self.kind, self.param)
