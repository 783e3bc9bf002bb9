"""Dependencies shared by the routers: settings, the Redis client, the admin token check."""

import hmac
from functools import lru_cache
from typing import Annotated

import redis
from fastapi import Depends, HTTPException, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from shared import jobstore
from shared.settings import Settings, load_settings


@lru_cache
def get_settings() -> Settings:
    return load_settings()


@lru_cache
def get_redis() -> redis.Redis:
    """One client (and connection pool) for the whole app; it connects lazily, so the
    API starts even while Redis is down and answers 503 until it is back."""
    return jobstore.connect(get_settings().redis_url)


SettingsDep = Annotated[Settings, Depends(get_settings)]
RedisDep = Annotated[redis.Redis, Depends(get_redis)]

# auto_error=False: we answer a missing header ourselves, with the same 401 as a wrong one.
# Declaring the scheme also gives /docs its "Authorize" button.
_bearer = HTTPBearer(auto_error=False, description="The server's MTQ_API_TOKEN.")


def _unauthorized(detail: str) -> HTTPException:
    return HTTPException(status.HTTP_401_UNAUTHORIZED, detail, headers={"WWW-Authenticate": "Bearer"})


def require_token(
    settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """Every /admin route needs `Authorization: Bearer $MTQ_API_TOKEN`."""
    if not settings.api_token:
        # Fail closed: an unset token must not mean "no auth".
        raise _unauthorized("the server has no API token configured (set MTQ_API_TOKEN); /admin is disabled")
    # compare_digest: the time taken must not reveal how much of the token matched.
    if credentials is None or not hmac.compare_digest(
        credentials.credentials.encode(), settings.api_token.encode()
    ):
        raise _unauthorized("missing or invalid bearer token")
