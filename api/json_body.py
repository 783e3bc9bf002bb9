"""Request bodies are parsed here: malformed or over-deep JSON is a 400, never a 500.

(Size is bounded before parsing: FastAPI's max_body_size, MTQ_MAX_BODY_BYTES, answers 413
while the body is being read; after parsing, the number of values, MTQ_MAX_JSON_VALUES.
Non-finite numbers and lone surrogates parse, and are then refused by the models'
validation: 400, shared/schemas.py.)
"""

import json
from typing import Any, Callable

from fastapi import HTTPException, Request, Response, status
from fastapi.routing import APIRoute

from api.deps import get_settings
from shared.schemas import TOO_DEEP, json_size_error


def parse_json(body: bytes, max_values: int | None = None) -> Any:
    try:
        value = json.loads(body)
    except RecursionError:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, TOO_DEEP) from None
    except ValueError as e:  # JSONDecodeError, bad UTF-8, an integer of more than 4300 digits
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"malformed JSON body: {e}"[:300]) from None
    if error := json_size_error(value, max_values):
        raise HTTPException(status.HTTP_400_BAD_REQUEST, error)
    return value


class JSONBodyRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            # Counted before any model sees it: validating 300,000 chat messages would hold the
            # event loop for seconds.
            self._json = parse_json(await self.body(), get_settings().max_json_values)
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
