"""Reward sources a job can name (validated by the API, computed by worker/rewards/).

Validation that can be done without running anything happens here, so that a bad spec
is a 400 at submission rather than a failed job: an invalid regular expression (RE2
syntax), an invalid JSON schema or one that refers outside itself, a malformed URL.

The operator's allow-lists are checked here too, by both sides (the API at submission,
the worker again before it runs anything): reward hosts (MTQ_REWARD_HOSTS) and python
reward functions (the `mtq.rewards` entry points and MTQ_REWARD_MODULES).
"""

import ipaddress
import re
from importlib.metadata import entry_points
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

REWARD_ENTRY_POINT_GROUP = "mtq.rewards"
REGEX_MAX_MEM = 8 * 2**20  # RE2's memory budget for one compiled pattern
RE2_MAX_REPEAT = 1000
# A counted repetition; RE2 rejects counts above 1000 but silently reads one too large
# for an int (a{4294967296}) as literal text, so those are rejected here.
_REPEAT_RE = re.compile(r"(?<!\\)\{(\d+)(?:,(\d*))?\}")


class _Source(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
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
    target: int | None = Field(None, ge=0, le=10**9, description="If set: reward is -|length - target| instead of length.")


class RegexReward(_Source):
    type: Literal["regex"] = "regex"
    pattern: str = Field(..., description="RE2 syntax (linear-time: no backreferences or lookaround); 1.0 if it matches, else 0.0.")
    mode: Literal["fullmatch", "search"] = "search"

    @field_validator("pattern")
    @classmethod
    def _pattern_compiles(cls, pattern: str) -> str:
        compile_regex(pattern)
        return pattern


# httpx, jsonschema and re2 are imported where they are used: the trainers import the job
# specs (shared/schemas.py) and must run where only MLX and its own dependencies are installed
# (bench/train_step.py on a GPU machine).


def compile_regex(pattern: str) -> "re2._Regexp":
    """The pattern compiled by RE2 (matching time linear in the text); ValueError if RE2 rejects it."""
    import re2

    for m in _REPEAT_RE.finditer(pattern):
        if any(n and int(n) > RE2_MAX_REPEAT for n in m.groups()):
            raise ValueError(f"invalid regular expression: repetition count above {RE2_MAX_REPEAT}: {m.group()[:40]}")
    options = re2.Options()
    options.max_mem = REGEX_MAX_MEM
    options.log_errors = False
    try:
        return re2.compile(pattern, options)
    except re2.error as e:
        message = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise ValueError(f"invalid regular expression (RE2 syntax): {message}") from None


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
            import jsonschema

            try:
                jsonschema.validators.validator_for(schema).check_schema(schema)
            except jsonschema.SchemaError as e:
                raise ValueError(f"invalid JSON schema: {e.message}") from None
            outside = [ref for ref in _schema_refs(schema) if not ref.startswith("#")]
            if outside:
                raise ValueError(f"JSON schema references must stay inside the schema ('#/...'): {outside[0][:200]!r}")
        return schema


def _schema_refs(schema: Any) -> list[str]:
    """Every $ref / $dynamicRef value in the schema (the worker never fetches one either)."""
    refs, stack = [], [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            refs += [v for k, v in node.items() if k in ("$ref", "$dynamicRef", "$recursiveRef") and isinstance(v, str)]
            stack += node.values()
        elif isinstance(node, list):
            stack += node
    return refs


class PythonReward(_Source):
    type: Literal["python"] = "python"
    function: str = Field(
        ..., max_length=200, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="'module:function': an `mtq.rewards` entry point, or in a module of MTQ_REWARD_MODULES.",
    )


class EndpointReward(_Source):
    type: Literal["endpoint"] = "endpoint"
    url: str = Field(..., max_length=2000, description="http(s) URL on a host of MTQ_REWARD_HOSTS; no user:password@.")
    protocol: Literal["per_prompt", "batch"] = Field(
        "per_prompt",
        description="per_prompt: the seed server's POST {prompt, completions} -> {rewards}, one request per group; "
        "batch: one request per step with every group and the prompt items' extra fields.",
    )
    timeout: float | None = Field(None, gt=0, le=3600, description="Seconds per request; defaults to config.reward_timeout.")
    retries: int = Field(3, ge=0, le=10, description="Extra attempts after a connection error, timeout, 429 or 5xx.")
    backoff_s: float = Field(0.2, ge=0, le=10, description="Wait before the first retry; doubles for each later one (capped).")

    @field_validator("url")
    @classmethod
    def _url_parses(cls, url: str) -> str:
        parse_reward_url(url)
        return url


class RewardModelReward(_Source):
    """A reward model trained by a reward job (its adapter + value head), scored on the
    worker itself: no HTTP. Prompts are read as raw text (chat prompts: their contents)."""

    type: Literal["reward_model"] = "reward_model"
    model_id: str = Field(..., min_length=1, max_length=512)
    adapter_name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


RewardSource = Annotated[
    Union[
        LengthReward, RegexReward, ExactMatchReward, ContainsReward, MathAnswerReward,
        JsonValidReward, PythonReward, EndpointReward, RewardModelReward,
    ],
    Field(discriminator="type"),
]


def parse_reward_url(text: str) -> "httpx.URL":
    """The one parser of reward URLs: the API checks, and the worker calls, this same
    httpx.URL. Refused: other schemes, no host, user:password@ (a classic way to make two
    parsers disagree on the host), and backslashes (which some parsers read as '/')."""
    import httpx

    if "\\" in text:
        raise ValueError(f"reward URL {text[:200]!r} contains a backslash")
    try:
        url = httpx.URL(text)
    except (httpx.InvalidURL, TypeError) as e:
        raise ValueError(f"reward URL {text[:200]!r} is not a valid URL: {e}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(f"reward URL {text[:200]!r} is not an http(s) URL")
    if url.userinfo:
        raise ValueError(f"reward URL {text[:200]!r} must not contain user:password@")
    return url


def endpoint_urls(reward: list | None, reward_endpoint: str) -> list[str]:
    """Every reward URL a job would call: its endpoint sources, or config.reward_endpoint when
    it has none (the worker calls config.reward_endpoint only then)."""
    if reward is None:
        return [reward_endpoint] if reward_endpoint else []
    return [s.url for s in reward if isinstance(s, EndpointReward)]


def _networks(allowed_hosts: tuple[str, ...]) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    networks = []
    for entry in allowed_hosts:
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            pass  # a host name
    return networks


def address_allowed(address: str, allowed_hosts: tuple[str, ...]) -> bool:
    """Is this IP address one of MTQ_REWARD_HOSTS's addresses or inside one of its networks?
    (Checked by the worker on every address a reward host resolves to, at call time.)"""
    if "*" in allowed_hosts:
        return True
    ip = ipaddress.ip_address(address.split("%")[0])
    return any(ip.version == net.version and ip in net for net in _networks(allowed_hosts))


def disallowed_endpoint_hosts(urls: list[str], allowed_hosts: tuple[str, ...]) -> list[str]:
    """Error messages for URLs that do not parse, or whose host is neither a name listed in
    MTQ_REWARD_HOSTS nor an address it allows ('*' allows any)."""
    errors = []
    names = {h.lower() for h in allowed_hosts}
    for text in urls:
        try:
            url = parse_reward_url(text)
        except ValueError as e:
            errors.append(str(e))
            continue
        host = url.host.lower()
        try:
            allowed = address_allowed(host, allowed_hosts)
        except ValueError:  # a name, not an address
            allowed = "*" in allowed_hosts or host in names
        if not allowed:
            errors.append(f"reward endpoint host {host!r} is not allowed (MTQ_REWARD_HOSTS={','.join(allowed_hosts)})")
    return errors


def python_reward_error(function: str, allowed_modules: tuple[str, ...]) -> str | None:
    """Why this 'module:function' may not run (None if it may): it must be the value of an
    `mtq.rewards` entry point of an installed package, or in a module of MTQ_REWARD_MODULES
    (a module name or a package prefix). Nothing is imported to decide."""
    module = function.partition(":")[0]
    if any(module == prefix or module.startswith(prefix + ".") for prefix in allowed_modules):
        return None
    if any(ep.value.replace(" ", "") == function for ep in entry_points(group=REWARD_ENTRY_POINT_GROUP)):
        return None
    return (
        f"python reward {function!r}: module {module!r} is not allowed (register the function under the "
        f"'{REWARD_ENTRY_POINT_GROUP}' entry point group, or add the module to MTQ_REWARD_MODULES)"
    )
