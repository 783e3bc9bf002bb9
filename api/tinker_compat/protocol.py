"""What the Tinker SDK speaks: its credentials, its request bodies, its errors.

The SDK sends its key as `X-API-Key` and refuses, before sending, a key that does not start
with `tml-`: a project token (api/auth.py) is given to it as `tml-<token>`, and a token
that itself starts with `tml-` works as it is. Roles and owners are the tokens' own.

Errors are JSON `{"detail": ...}` (the SDK reads the status into its exceptions:
BadRequestError, NotFoundError...) with `x-should-retry: false` on every 4xx: the SDK retries
409 and 429 otherwise, and a refused call does not pass by asking again. A 400 always has a
body: the SDK takes an empty one for a proxy's refusal and retries it.
"""

from typing import Annotated, Callable

from fastapi import Depends, HTTPException, Request, Response, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict

from api.auth import Principal
from api.deps import check_token
from api.json_body import JSONBodyRequest

KEY_PREFIX = "tml-"


async def require_key(request: Request) -> Principal:
    key = request.headers.get("x-api-key")
    if key is None:
        return check_token(None)
    try:
        return check_token(key)
    except HTTPException:
        if not key.startswith(KEY_PREFIX):
            raise
        return check_token(key.removeprefix(KEY_PREFIX))


async def require_key_writer(who: Annotated[Principal, Depends(require_key)]) -> Principal:
    if who.role == "viewer":
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"token {who.name!r} has the viewer role: it can only read")
    return who


class Body(BaseModel):
    """A request body: what the SDK sends besides the fields a route reads (its `type`, its
    version, fields of later versions) is ignored."""
    model_config = ConfigDict(extra="ignore")


KeyDep = Annotated[Principal, Depends(require_key)]
KeyWriterDep = Annotated[Principal, Depends(require_key_writer)]


class ErrorBody(BaseModel):
    detail: str


# What a route may answer besides its 200, for the OpenAPI schema (the routers' `responses`).
ERRORS = {code: {"model": ErrorBody} for code in (400, 401, 403, 404, 409, 413, 503)}


def error(status_code: int, detail: str, headers: dict | None = None) -> JSONResponse:
    retry = {} if status_code >= 500 else {"x-should-retry": "false"}
    return JSONResponse({"detail": detail}, status_code=status_code, headers={**(headers or {}), **retry})


class TinkerRoute(APIRoute):
    """A /api/v1 route: a JSON body through api/json_body.py's parser (a protobuf body is read
    by its route), its errors as error() answers them."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def answer(request: Request) -> Response:
            try:
                return await handler(JSONBodyRequest(request.scope, request.receive))
            except RequestValidationError as e:
                where = lambda loc: ".".join(str(p) for p in loc if p != "body")  # noqa: E731
                return error(400, "; ".join(f"{where(x['loc'])}: {x['msg']}" if where(x["loc"]) else x["msg"]
                                            for x in e.errors()))
            except HTTPException as e:
                return error(e.status_code, str(e.detail), dict(e.headers or {}))

        return answer
