"""Request bodies are parsed here: malformed or over-deep JSON is a 400, never a 500.

(Size is bounded before parsing: FastAPI's max_body_size, MTQ_MAX_BODY_BYTES, answers 413
while the body is being read. Non-finite numbers and lone surrogates parse, and are then
refused by the models' validation: 400, shared/schemas.py.)
"""

import json
from typing import Any, Callable

from fastapi import HTTPException, Request, Response, status
from fastapi.routing import APIRoute

MAX_JSON_DEPTH = 32


def json_depth(value: Any) -> int:
    depth, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, (dict, list)):
            depth = max(depth, level)
            stack += [(v, level + 1) for v in (node.values() if isinstance(node, dict) else node)]
    return depth


def parse_json(body: bytes) -> Any:
    try:
        value = json.loads(body)
    except RecursionError:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:  # JSONDecodeError, bad UTF-8, an integer of more than 4300 digits
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"malformed JSON body: {e}"[:300]) from None
    if json_depth(value) > MAX_JSON_DEPTH:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return value


class JSONBodyRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json(await self.body())
        return self._json


def as_json(scope: dict) -> dict:
    """The request's scope with a JSON content type: a body is JSON whatever the client says it
    is, as the seed server reads it (curl's -d sends application/x-www-form-urlencoded)."""
    headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
    return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}


class JSONBodyRoute(APIRoute):
    """A route whose body is JSON, parsed by parse_json (FastAPI's own parsing answers 422
    for malformed JSON and lets a RecursionError become a 500)."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def with_checked_json(request: Request) -> Response:
            return await handler(JSONBodyRequest(as_json(request.scope), request.receive))

        return with_checked_json
