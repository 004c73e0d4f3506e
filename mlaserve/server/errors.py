"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, for every route.

Routes raise `APIError`; the handlers installed by `install_handlers` turn it, request-validation
failures, unknown routes and unexpected exceptions into that shape, so a client sees one error
format whatever went wrong, and the server keeps serving.
"""

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("mlaserve.server")


class APIError(Exception):
    """An error to send to the client. status: 400 bad request, 401 auth, 404 unknown model/route."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def from_validation_error(err: ValidationError | RequestValidationError) -> APIError:
    """The first pydantic complaint as a 400 naming the field (dotted path) and what was wrong."""
    first = err.errors()[0]
    param = _param_name(first.get("loc", ()))
    message = first.get("msg", "invalid request")
    if param:
        message = f"{param}: {message}"
        if "input" in first and not isinstance(first["input"], dict):
            message += f" (got {first['input']!r})"
    code = "invalid_json" if first.get("type") == "json_invalid" else "invalid_value"
    return APIError(message, param=param, code=code)


_TYPE_TAGS = ("str", "int", "float", "bool", "list", "dict", "none")


def _param_name(loc) -> str | None:
    """("messages", 0, "role") -> "messages.0.role". pydantic's union-member tags ("str",
    "list[int]", "function-after[...]", a model's class name) are not parameters: skipped."""
    parts = []
    for p in loc:
        if p == "body" and not parts:
            continue
        if isinstance(p, str) and (p.split("[")[0] in _TYPE_TAGS or "[" in p or "-" in p or p[:1].isupper()):
            continue
        parts.append(str(p))
    return ".".join(parts) or None


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return from_validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return APIError(message, status=exc.status_code, type=kind).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error serving %s %s", request.method, request.url.path)
        return APIError(f"internal error: {type(exc).__name__}: {exc}", status=500, type="server_error").response()
