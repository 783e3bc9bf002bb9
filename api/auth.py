"""Bearer tokens with names and roles.

  admin    everything, on every job
  trainer  submits jobs and reads, follows, cancels, resumes and deletes its own (others' are 404)
  viewer   reads every job; cannot change anything (403)

Tokens come from MTQ_TOKENS_FILE (JSON or YAML: a list of {name, token, role}, or
{"tokens": [...]}) and from MTQ_API_TOKEN, which is an admin token named "admin". With no
token configured at all, every /admin route answers 401 (fail closed).
"""

import hmac
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from shared.settings import Settings

Role = Literal["admin", "trainer", "viewer"]


class TokenEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.@-]{1,64}$", description="Recorded as the owner of the jobs it creates.")
    token: str = Field(..., min_length=16, description="The bearer token (at least 16 characters).")
    role: Role


@dataclass(frozen=True)
class Principal:
    """Who is asking: the token's name and role."""

    name: str
    role: Role

    def sees(self, owner: str | None) -> bool:
        """Can this principal see what `owner` made (a job, an adapter, a file, a scoring answer)?
        Trainers see only their own."""
        return self.role != "trainer" or owner == self.name

    @property
    def tenant(self) -> str | None:
        """Whose things alone this principal may use: a trainer's own (None: everyone's)."""
        return self.name if self.role == "trainer" else None


def load_tokens(settings: Settings) -> list[TokenEntry]:
    """The tokens as they are now: the file is read at each call (a token added or revoked counts
    at once) and parsed again only when its bytes changed (every request and every access-log
    line asks)."""
    entries = list(_parsed(settings.tokens_file.read_bytes())) if settings.tokens_file is not None else []
    if settings.api_token:
        entries.append(TokenEntry.model_construct(name="admin", token=settings.api_token, role="admin"))
    names = [e.name for e in entries]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise ValueError(f"token names must be unique; repeated: {sorted(duplicates)}")
    return entries


@lru_cache(maxsize=4)
def _parsed(text: bytes) -> tuple[TokenEntry, ...]:
    data = yaml.safe_load(text)  # YAML reads JSON too
    if isinstance(data, dict):
        data = data.get("tokens")
    return tuple(TypeAdapter(list[TokenEntry]).validate_python(data))


def authenticate(entries: list[TokenEntry], presented: str) -> Principal | None:
    """The principal of the presented token, or None. Every token is compared (in constant
    time each), so the time taken says nothing about which one nearly matched."""
    found = None
    for entry in entries:
        if hmac.compare_digest(presented.encode(), entry.token.encode()):
            found = Principal(entry.name, entry.role)
    return found
