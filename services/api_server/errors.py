"""OpenAI-shaped errors: every 4xx/5xx body is {"error": {message, type, param, code}}."""

from __future__ import annotations

import orjson
from starlette.responses import Response

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_exceeded",
          500: "internal_error", 503: "service_unavailable", 504: "timeout"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, error_type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.error_type = error_type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type,
                          "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(orjson.dumps(self.body()), status_code=self.status, media_type="application/json",
                        headers=self.headers)


def error_response(status: int, message: str, **kw: object) -> Response:
    return ApiError(status, message, **kw).response()  # type: ignore[arg-type]
