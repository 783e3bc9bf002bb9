"""What a multi-turn GRPO job names besides its prompts (docs/agentic.md): the python tools the
model may call and the OpenEnv environment that drives its episodes, checked by the API
(api/submission.py) and again by the worker (worker/agentic/)."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from shared.reward_specs import allow_listed, parse_reward_url

TOOL_ENTRY_POINT_GROUP = "mtq.tools"


def tool_error(function: str, allowed_modules: tuple[str, ...]) -> str | None:
    """Why this 'module:function' may not be a tool (None if it may): it must be an `mtq.tools`
    entry point of an installed package, or in a module of MTQ_TOOL_MODULES (a module name or a
    package prefix). Nothing is imported to decide."""
    if allow_listed(function, allowed_modules, TOOL_ENTRY_POINT_GROUP):
        return None
    return (
        f"tool {function!r}: module {function.partition(':')[0]!r} is not allowed (register the function under "
        f"the '{TOOL_ENTRY_POINT_GROUP}' entry point group, or add the module to MTQ_TOOL_MODULES)"
    )


class PythonTool(BaseModel):
    """A python function the model may call: 'module:function' in a module of MTQ_TOOL_MODULES
    (or an `mtq.tools` entry point). Its JSON schema is read from its signature and docstring."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["python"] = "python"
    function: str = Field(
        ..., max_length=200, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="'module:function': an `mtq.tools` entry point, or in a module of MTQ_TOOL_MODULES.",
    )


class OpenEnvEnvironment(BaseModel):
    """An OpenEnv environment server (its WebSocket session protocol, openenv-core's client): each
    episode resets it, sends each model turn as an action, and appends its observations."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    type: Literal["openenv"] = "openenv"
    url: str = Field(..., max_length=2000, description="http(s) base URL of the server, on a host of MTQ_REWARD_HOSTS.")
    action_field: str = Field("message", min_length=1, max_length=64, pattern=r"^[A-Za-z_]\w*$",
                              description="The action is {action_field: the model's turn as text}.")
    observation_field: str | None = Field(
        None, max_length=64, pattern=r"^[A-Za-z_]\w*$",
        description="The observation's field shown to the model; null: the observation's fields as JSON.")
    reset: dict = Field(default_factory=dict, description="Keyword arguments of every reset (besides `seed`).")
    role: Literal["user", "tool"] = Field("user", description="The role of the observations' messages.")
    timeout_s: float = Field(30.0, gt=0.0, le=3600.0, description="Seconds per connect, reset or step.")
    reward_weight: float = Field(1.0, ge=-1e6, le=1e6,
                                 description="The episode's summed environment reward, weighted, is added to the "
                                             "job's reward sources (alone when the job names none).")

    @field_validator("url")
    @classmethod
    def _url_parses(cls, url: str) -> str:
        parse_reward_url(url)
        return url
