"""OpenAI's error envelope for the /v1 routes: `{"error": {"message", "type", "param", "code"}}`.

The official SDK reads the envelope into its exceptions (BadRequestError.param, .code, ...),
and retries 409, 429 and 5xx unless the answer says `x-should-retry: false`: every 4xx here
says so (a conflict does not go away by asking again); a 503 (Redis down) stays retryable.
The routes raise what the rest of the API raises (HTTPException, RequestValidationError,
api/deps.py's 401/403); OpenAIRoute turns it into the envelope.
"""

from typing import Callable

from fastapi import HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError
from redis.exceptions import TimeoutError as RedisTimeoutError

from api.deps import redis_trouble
from api.json_body import JSONBodyRequest

# status -> (OpenAI's error type, code)
TYPES = {400: ("invalid_request_error", None), 401: ("invalid_request_error", "invalid_api_key"),
         403: ("permission_error", None), 404: ("invalid_request_error", "not_found"),
         409: ("invalid_request_error", "conflict"), 413: ("invalid_request_error", "file_too_large"),
         429: ("rate_limit_error", None), 503: ("server_error", "redis_unavailable")}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorEnvelope(BaseModel):
    error: ErrorDetail


class OpenAIError(HTTPException):
    """An HTTPException that names the request's parameter it is about (OpenAI's `param`)."""

    def __init__(self, status_code: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(status_code, message)
        self.param, self.code = param, code


def envelope(status_code: int, message: str, param: str | None = None, code: str | None = None,
             headers: dict | None = None) -> JSONResponse:
    kind, default_code = TYPES.get(status_code, ("invalid_request_error" if status_code < 500 else "server_error", None))
    retry = "true" if status_code in (429, 503) else "false"
    body = ErrorEnvelope(error=ErrorDetail(message=message, type=kind, param=param, code=code or default_code))
    return JSONResponse(body.model_dump(), status_code=status_code, headers={**(headers or {}), "x-should-retry": retry})


def _param(loc: tuple) -> str | None:
    """pydantic's location as OpenAI's dotted `param` (body.method.type -> method.type)."""
    path = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(path) or None


def validation_envelope(exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0]
    message = first["msg"].removeprefix("Value error, ").encode("utf-8", "backslashreplace").decode()
    param = _param(first["loc"])
    return envelope(400, f"{param}: {message}" if param else message, param, "invalid_value" if param else None)


class OpenAIRoute(APIRoute):
    """A /v1 route: a JSON body goes through api/json_body.py's parser (a multipart upload keeps
    its content type: the SDK says what it sends), and every error it raises, its dependencies'
    included (the token check), answers in OpenAI's envelope."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def answer(request: Request) -> Response:
            try:
                return await handler(JSONBodyRequest(request.scope, request.receive))
            except RequestValidationError as e:
                return validation_envelope(e)
            except HTTPException as e:
                headers = {k: v for k, v in (e.headers or {}).items()}
                return envelope(e.status_code, str(e.detail), getattr(e, "param", None), getattr(e, "code", None), headers)
            except (RedisConnectionError, RedisTimeoutError, OutOfMemoryError) as e:
                return envelope(503, f"Redis is unavailable: {redis_trouble(e)}", headers={"Retry-After": "5"})

        return answer


ERRORS = {code: {"model": ErrorEnvelope} for code in (400, 401, 403, 404, 409, 413, 503)}
