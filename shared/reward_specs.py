"""Reward sources a job can name (validated by the API, computed by worker/rewards/).

Validation that can be done without running anything happens here, so that a bad spec
is a 400 at submission rather than a failed job: an invalid regular expression (RE2
syntax), an invalid JSON schema or one that refers outside itself, a malformed URL.

The operator's allow-lists are checked here too, by both sides (the API at submission,
the worker again before it runs anything): reward hosts (MTQ_REWARD_HOSTS) and python
reward functions (the `mtq.rewards` entry points and MTQ_REWARD_MODULES).
"""

import functools
import ipaddress
import re
import socket
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Annotated, Any, Literal, Union
from urllib.parse import unquote

from pydantic import BaseModel, ConfigDict, Field, field_validator

from shared.graders import Grader
from shared.model_ids import MODEL_ID_RE

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
            if schema_expansion(schema) > MAX_SCHEMA_EXPANSION:
                raise ValueError(f"the JSON schema expands to more than {MAX_SCHEMA_EXPANSION} subschemas with its $refs "
                                 "followed: checking a value would take that long")
        return schema


REF_KEYS = ("$ref", "$dynamicRef", "$recursiveRef")
# Subschemas a value may be checked against, every $ref followed where it is used: a bound at
# submission. (The check itself also runs within config.reward_timeout: worker/rewards/scorer.py.)
MAX_SCHEMA_EXPANSION = 10_000


def _schema_refs(schema: Any) -> list[str]:
    """Every $ref / $dynamicRef value in the schema (the worker never fetches one either)."""
    refs, stack = [], [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            refs += [v for k, v in node.items() if k in REF_KEYS and isinstance(v, str)]
            stack += node.values()
        elif isinstance(node, list):
            stack += node
    return refs


def schema_expansion(schema: Any) -> int:
    """How many subschemas the schema amounts to with each $ref replaced by what it points at
    ('#', '#/json/pointer', '#anchor'), once per use; a $ref inside its own expansion (a
    recursive schema) counts 1, the value's depth bounds it. Stops soon after MAX_SCHEMA_EXPANSION."""
    anchors = {f"#{node[key]}": node for node in _subschemas(schema) for key in ("$anchor", "$dynamicAnchor")
               if isinstance(node.get(key), str)}
    sizes: dict[str, int] = {}

    def target(ref: str) -> Any:
        if ref in anchors:
            return anchors[ref]
        if not ref.startswith("#/") and ref != "#":
            return None
        node = schema
        for part in ref[2:].split("/") if ref != "#" else []:  # a JSON pointer, in a URI fragment
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict):
                node = node.get(part)
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def size(node: Any, expanding: frozenset[str]) -> int:
        total = 1
        for key, value in (node.items() if isinstance(node, dict) else enumerate(node)):
            if key in REF_KEYS and isinstance(value, str) and isinstance(node, dict):
                if value in expanding or target(value) is None:
                    total += 1
                else:
                    if value not in sizes:
                        sizes[value] = size(target(value), expanding | {value})
                    total += sizes[value]
            elif isinstance(value, (dict, list)):
                total += size(value, expanding)
            if total > MAX_SCHEMA_EXPANSION:
                break
        return total

    try:
        return size(schema, frozenset())
    except RecursionError:  # $refs chained deeper than Python's stack: far too many in any case
        return MAX_SCHEMA_EXPANSION + 1


def _subschemas(schema: Any):
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            yield node
            stack += node.values()
        elif isinstance(node, list):
            stack += node


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
    model_id: str = Field(..., min_length=1, max_length=512, pattern=MODEL_ID_RE.pattern)
    adapter_name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class GraderReward(_Source):
    """An OpenAI grader (shared/graders.py) as a reward: each completion is the grader's
    `sample.output_text`, its prompt item's fields the grader's `item`."""

    type: Literal["grader"] = "grader"
    grader: Grader


RewardSource = Annotated[
    Union[
        LengthReward, RegexReward, ExactMatchReward, ContainsReward, MathAnswerReward,
        JsonValidReward, PythonReward, EndpointReward, RewardModelReward, GraderReward,
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


@dataclass(frozen=True)
class RewardHosts:
    """MTQ_REWARD_HOSTS, read: host names, IP networks (an address is a /32 or /128), `*`, and
    exact `host:port` entries (`[v6]:port` for an IPv6 address; `localhost:port` stands for
    127.0.0.1 and ::1 at that port)."""

    names: frozenset[str]
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]
    exact: frozenset[tuple[str, int]]  # (a lower-case name or a normalised address, port)
    anything: bool  # `*`: any name, any address but this host's own


@functools.lru_cache
def reward_hosts(entries: tuple[str, ...]) -> RewardHosts:
    names, networks, exact = set(), [], set()
    for entry in entries:
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
            continue
        except ValueError:
            pass
        host, sep, port = entry.rpartition(":")
        if sep and port.isdigit() and host:
            host = host.lower().removeprefix("[").removesuffix("]")
            for one in ("127.0.0.1", "::1") if host == "localhost" else (host,):
                exact.add((_normal(one), int(port)))
        elif entry != "*":
            names.add(entry.lower())
    return RewardHosts(frozenset(names), tuple(networks), frozenset(exact), "*" in entries)


def _normal(host: str) -> str:
    """An address as one spelling (an IPv4-mapped IPv6 address as the IPv4 one); a name lower-case."""
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return host.lower()
    return str(ip.ipv4_mapped or ip) if ip.version == 6 else str(ip)


def this_host(address: str) -> bool:
    """Does the address reach this machine: loopback, unspecified (0.0.0.0 is this host), link-local
    (cloud metadata services live there), or one of this machine's own addresses (a socket binds
    to it)?"""
    ip = ipaddress.ip_address(_normal(address))
    if ip.is_loopback or ip.is_unspecified or ip.is_link_local or ip in ipaddress.ip_network("0.0.0.0/8"):
        return True
    with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((str(ip), 0))
        except OSError:
            return False
    return True


def address_allowed(address: str, port: int, allowed_hosts: tuple[str, ...]) -> bool:
    """May a reward call connect to this IP address at this port? (Checked by the worker on every
    address a reward host resolves to, at call time, and by the API on an address in a URL.)
    This host's own addresses only as an exact address:port entry: a reward call must never
    reach a local admin service (rq-dashboard, Redis, the API); any other address also when a
    network of MTQ_REWARD_HOSTS holds it, or with `*`."""
    hosts = reward_hosts(allowed_hosts)
    if (_normal(address), port) in hosts.exact:
        return True
    if this_host(address):
        return False
    ip = ipaddress.ip_address(_normal(address))
    return hosts.anything or any(ip.version == net.version and ip in net for net in hosts.networks)


def url_port(url: "httpx.URL") -> int:
    return url.port or (443 if url.scheme == "https" else 80)


def disallowed_endpoint_hosts(urls: list[str], allowed_hosts: tuple[str, ...]) -> list[str]:
    """Error messages for URLs that do not parse, or whose host MTQ_REWARD_HOSTS does not allow:
    an address, as address_allowed says; a name, listed (or `*`, or listed exactly with the
    port), except localhost, which needs an exact entry. (The worker checks the addresses a
    name resolves to when it calls.)"""
    hosts = reward_hosts(allowed_hosts)
    errors = []
    for text in urls:
        try:
            url = parse_reward_url(text)
        except ValueError as e:
            errors.append(str(e))
            continue
        host, port = url.host.lower(), url_port(url)
        try:
            allowed = address_allowed(host, port, allowed_hosts)
        except ValueError:  # a name, not an address
            local = host == "localhost" or host.endswith(".localhost")
            allowed = (host, port) in hosts.exact or (not local and (hosts.anything or host in hosts.names))
        if not allowed:
            errors.append(f"reward endpoint {host}:{port} is not allowed (MTQ_REWARD_HOSTS={','.join(allowed_hosts)}; "
                          "this host's own addresses only as an exact host:port)")
    return errors


def allow_listed(function: str, allowed_modules: tuple[str, ...], group: str) -> bool:
    """May this 'module:function' run: is it the value of an entry point of `group` of an
    installed package, or in a module of allowed_modules (module names or package prefixes)?
    Nothing is imported to decide."""
    module = function.partition(":")[0]
    if any(module == prefix or module.startswith(prefix + ".") for prefix in allowed_modules):
        return True
    return any(ep.value.replace(" ", "") == function for ep in entry_points(group=group))


def python_reward_error(function: str, allowed_modules: tuple[str, ...]) -> str | None:
    """Why this 'module:function' may not run as a reward (None if it may): it must be an
    `mtq.rewards` entry point or in a module of MTQ_REWARD_MODULES."""
    if allow_listed(function, allowed_modules, REWARD_ENTRY_POINT_GROUP):
        return None
    return (
        f"python reward {function!r}: module {function.partition(':')[0]!r} is not allowed (register the function "
        f"under the '{REWARD_ENTRY_POINT_GROUP}' entry point group, or add the module to MTQ_REWARD_MODULES)"
    )
