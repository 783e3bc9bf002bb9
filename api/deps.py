"""Dependencies shared by the routers: settings, the Redis clients, who is asking."""

import ipaddress
from functools import lru_cache
from typing import Annotated

import redis
import redis.asyncio
from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.auth import Principal, TokenEntry, authenticate, load_tokens
from shared import jobstore
from shared.schemas import ErrorBody
from shared.settings import Settings, load_settings


@lru_cache
def get_settings() -> Settings:
    return load_settings()


@lru_cache
def get_tokens() -> list[TokenEntry]:
    return load_tokens(get_settings())


@lru_cache
def get_redis() -> redis.Redis:
    """One client (and connection pool) for the whole app; it connects lazily, so the
    API starts even while Redis is down and answers 503 until it is back."""
    return jobstore.connect(get_settings().redis_url)


@lru_cache
def get_async_redis() -> redis.asyncio.Redis:
    """The event streams' client: each open stream borrows a pooled connection while it
    waits in XREAD BLOCK, on the event loop, without a thread of its own."""
    # redis.asyncio's pool allows 100 connections by default; each open stream holds one
    # (the per-token cap, MTQ_MAX_STREAMS_PER_TOKEN, bounds them; Redis's maxclients is 10000).
    return redis.asyncio.Redis.from_url(
        get_settings().redis_url, socket_connect_timeout=5, socket_timeout=30, max_connections=8192
    )


# What every /admin route may answer besides its own codes (for the OpenAPI schema).
ADMIN_ERRORS = {
    401: {"model": ErrorBody, "description": "Missing or wrong bearer token."},
    503: {"model": ErrorBody, "description": "Redis is unavailable."},
}

SettingsDep = Annotated[Settings, Depends(get_settings)]
RedisDep = Annotated[redis.Redis, Depends(get_redis)]
AsyncRedisDep = Annotated[redis.asyncio.Redis, Depends(get_async_redis)]

# auto_error=False: we answer a missing header ourselves, with the same 401 as a wrong one.
# Declaring the scheme also gives /docs its "Authorize" button.
_bearer = HTTPBearer(auto_error=False, description="A token of MTQ_TOKENS_FILE, or MTQ_API_TOKEN (admin).")


UNAUTHORIZED = "Admin authentication required"  # the seed server's words for a missing or wrong key


def _unauthorized(detail: str) -> HTTPException:
    return HTTPException(status.HTTP_401_UNAUTHORIZED, detail, headers={"WWW-Authenticate": "Bearer"})


BearerDep = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def from_loopback(request: Request) -> bool:
    """The client is on this machine (uvicorn puts a trusted proxy's X-Forwarded-For here)."""
    try:
        return request.client is not None and ipaddress.ip_address(request.client.host).is_loopback
    except ValueError:
        return False


def query_token(request: Request) -> str | None:
    """`?key=` / `?api_key=`, as the seed server accepts them: from a client on this machine
    only (a token in a URL ends up in logs and browser history; over loopback it stays here)."""
    if not from_loopback(request):
        return None
    return request.query_params.get("key") or request.query_params.get("api_key")


async def require_token(request: Request, credentials: BearerDep) -> Principal:
    """Every /admin route needs `Authorization: Bearer <token>` (or, from loopback, `?key=`);
    returns whose token it is."""
    return check_token(credentials.credentials if credentials is not None else query_token(request))


def check_token(presented: str | None) -> Principal:
    tokens = get_tokens()
    if not tokens:
        # Fail closed: no token configured must not mean "no auth".
        raise _unauthorized(f"{UNAUTHORIZED}: the server has no API token configured (set MTQ_API_TOKEN or "
                            "MTQ_TOKENS_FILE); /admin is disabled")
    principal = None if presented is None else authenticate(tokens, presented)
    if principal is None:
        raise _unauthorized(UNAUTHORIZED)
    return principal


PrincipalDep = Annotated[Principal, Depends(require_token)]


async def require_writer(principal: PrincipalDep) -> Principal:
    """Routes that change something: admin and trainer tokens only."""
    if principal.role == "viewer":
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"token {principal.name!r} has the viewer role: it can only read")
    return principal


WriterDep = Annotated[Principal, Depends(require_writer)]
