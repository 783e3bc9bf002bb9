"""Dependencies shared by the routers: settings, the Redis clients, who is asking."""

import ipaddress
from functools import lru_cache
from typing import Annotated

import redis
import redis.asyncio
from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api import sse
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
    API starts even while Redis is down and answers 503 until it is back. Its short socket
    timeout (MTQ_REDIS_TIMEOUT_S) makes a Redis that stops answering a quick 503 too."""
    return jobstore.connect(get_settings().redis_url, socket_timeout=get_settings().redis_timeout_s)


def _async_client(socket_timeout: float) -> redis.asyncio.Redis:
    # redis.asyncio's pool allows 100 connections by default; each open stream, and each request
    # waiting for a scoring answer, holds one (MTQ_MAX_STREAMS_PER_TOKEN bounds the streams;
    # Redis's maxclients is 10000).
    settings = get_settings()
    return redis.asyncio.Redis.from_url(settings.redis_url, socket_connect_timeout=min(5.0, settings.redis_timeout_s),
                                        socket_timeout=socket_timeout, max_connections=8192)


@lru_cache
def get_async_redis() -> redis.asyncio.Redis:
    """The async routes' client (on the event loop, no thread each), with the short timeout."""
    return _async_client(get_settings().redis_timeout_s)


STREAM_TIMEOUT_S = 30.0  # beyond XREAD BLOCK's wait: hundreds of open streams share one event loop


@lru_cache
def get_stream_redis() -> redis.asyncio.Redis:
    """The event streams' client: each open stream borrows a pooled connection while it waits
    in XREAD BLOCK (sse.BLOCK_MS). The route's own checks before the stream starts use the
    quick client; once it has started, a Redis that stops answering ends it with an error
    event after STREAM_TIMEOUT_S more."""
    return _async_client(sse.BLOCK_MS / 1000 + STREAM_TIMEOUT_S)


def redis_trouble(exc: Exception) -> str:
    """What is wrong with Redis, in words (the 503s' detail)."""
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        return f"it is out of memory (maxmemory): {exc}"
    return str(exc) or type(exc).__name__


# What every /admin route may answer besides its own codes (for the OpenAPI schema).
ADMIN_ERRORS = {
    401: {"model": ErrorBody, "description": "Missing or wrong bearer token."},
    503: {"model": ErrorBody, "description": "Redis is unavailable: down, not answering within MTQ_REDIS_TIMEOUT_S, "
          "or out of memory."},
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


def _node_address(node: str) -> str:
    """An RFC 7239 node ("192.0.2.1", "192.0.2.1:80", "[2001:db8::1]:4711", "unknown") without its port."""
    node = node.strip().strip('"')
    if node.startswith("["):
        return node[1:].partition("]")[0]
    return node.rpartition(":")[0] if node.count(":") == 1 else node


def forwarded_for(request: Request) -> list[str]:
    """The client addresses a proxy put in the request: Forwarded's `for=` (RFC 7239),
    X-Forwarded-For and X-Real-IP."""
    found = []
    for value in request.headers.getlist("forwarded"):
        for element in value.split(","):
            for pair in element.split(";"):
                name, _, node = pair.strip().partition("=")
                if name.lower() == "for":
                    found.append(_node_address(node))
    for name in ("x-forwarded-for", "x-real-ip"):
        found += [part.strip() for value in request.headers.getlist(name) for part in value.split(",")]
    return found


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:  # a proxy's "unknown", an obfuscated name
        return False


def from_loopback(request: Request) -> bool:
    """The client is on this machine: the connection comes from loopback, and so does every
    client address a proxy on this machine forwarded (Forwarded, X-Forwarded-For, X-Real-IP;
    uvicorn also rewrites the connection's address from a trusted X-Forwarded-For)."""
    return (request.client is not None and _loopback(request.client.host)
            and all(_loopback(address) for address in forwarded_for(request)))


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
