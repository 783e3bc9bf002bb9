"""Reward sources a job can name (validated by the API, computed by worker/rewards.py).

Validation that can be done without running anything happens here, so that a bad spec
is a 422 at submission rather than a failed job: an invalid regular expression, an
invalid JSON schema, a malformed 'module:function'. (Whether that module can be
imported is only known on the worker, at job start.)
"""

import re
from typing import Annotated, Any, Literal, Union

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, HttpUrl, field_validator


class _Source(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # No '/' in names: they become part of the metric key rewards/<name>/mean.
    name: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="Name used in metrics (rewards/<name>/mean); defaults to the type.",
    )
    weight: float = Field(
        1.0, allow_inf_nan=False,
        description="Weight of this source in the summed reward (negative = penalty).",
    )

    @property
    def metric_name(self) -> str:
        return self.name or self.type  # type: ignore[attr-defined]


class LengthReward(_Source):
    type: Literal["length"] = "length"
    unit: Literal["chars", "tokens"] = "chars"
    target: int | None = Field(None, ge=0, description="If set: reward is -|length - target| instead of length.")


class RegexReward(_Source):
    type: Literal["regex"] = "regex"
    pattern: str = Field(..., max_length=2000, description="Python `re` syntax; 1.0 if it matches, else 0.0.")
    mode: Literal["fullmatch", "search"] = "search"

    @field_validator("pattern")
    @classmethod
    def _pattern_compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"invalid regular expression: {e}") from None
        return pattern


class ExactMatchReward(_Source):
    type: Literal["exact_match"] = "exact_match"
    field: str = Field("answer", description="Prompt item field holding the reference answer.")
    strip: bool = Field(True, description="Ignore leading/trailing whitespace.")
    case_sensitive: bool = True


class ContainsReward(_Source):
    type: Literal["contains"] = "contains"
    field: str = Field("answer", description="Prompt item field holding the text the completion must contain.")
    strip: bool = Field(True, description="Ignore the reference's leading/trailing whitespace.")
    case_sensitive: bool = True


class MathAnswerReward(_Source):
    type: Literal["math_answer"] = "math_answer"
    field: str = Field("answer", description="Prompt item field holding the expected number.")
    tolerance: float = Field(1e-6, ge=0, allow_inf_nan=False, description="Relative and absolute tolerance.")


class JsonValidReward(_Source):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["json_valid"] = "json_valid"
    json_schema: dict[str, Any] | None = Field(None, alias="schema", description="Optional JSON schema the value must satisfy.")

    @field_validator("json_schema")
    @classmethod
    def _schema_is_valid(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is not None:
            try:
                jsonschema.validators.validator_for(schema).check_schema(schema)
            except jsonschema.SchemaError as e:
                raise ValueError(f"invalid JSON schema: {e.message}") from None
        return schema


class PythonReward(_Source):
    type: Literal["python"] = "python"
    function: str = Field(..., pattern=r"^[\w.]+:[\w]+$", description="'module:function', importable on the worker.")


class EndpointReward(_Source):
    type: Literal["endpoint"] = "endpoint"
    url: HttpUrl
    protocol: Literal["per_prompt", "batch"] = Field(
        "per_prompt",
        description="per_prompt: the seed server's POST {prompt, completions} -> {rewards}, one request per group; "
        "batch: one request per step with every group and the prompt items' extra fields.",
    )
    timeout: float | None = Field(None, gt=0, le=3600, description="Seconds per request; defaults to config.reward_timeout.")
    retries: int = Field(3, ge=0, le=10, description="Extra attempts after a connection error, timeout, 429 or 5xx.")
    backoff_s: float = Field(0.2, ge=0, le=10, description="Wait before the first retry; doubles for each later one (capped).")


RewardSource = Annotated[
    Union[
        LengthReward, RegexReward, ExactMatchReward, ContainsReward, MathAnswerReward,
        JsonValidReward, PythonReward, EndpointReward,
    ],
    Field(discriminator="type"),
]


def endpoint_urls(reward: list | None, reward_endpoint: str) -> list[str]:
    """Every reward URL a job would call: config.reward_endpoint and the endpoint sources."""
    urls = [reward_endpoint] if reward_endpoint else []
    urls += [str(s.url) for s in reward or [] if isinstance(s, EndpointReward)]
    return urls


def disallowed_endpoint_hosts(urls: list[str], allowed_hosts: tuple[str, ...]) -> list[str]:
    """Error messages for URLs whose host is not in MTQ_REWARD_HOSTS ('*' allows any)."""
    from urllib.parse import urlsplit

    if "*" in allowed_hosts:
        return []
    errors = []
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            errors.append(f"reward endpoint {url!r} is not an http(s) URL")
        elif parts.hostname not in allowed_hosts:
            errors.append(
                f"reward endpoint host {parts.hostname!r} is not allowed (MTQ_REWARD_HOSTS={','.join(allowed_hosts)})"
            )
    return errors
