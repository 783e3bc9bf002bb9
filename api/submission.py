"""What a job spec must satisfy beyond its schema: the operator's allow-lists and limits
(shared/settings.py). Checked on create, and on resume with the changed config."""

from fastapi.exceptions import RequestValidationError

from shared.model_ids import model_id_error
from shared.reward_specs import PythonReward, RegexReward, disallowed_endpoint_hosts, endpoint_urls, python_reward_error
from shared.schemas import JobCreate, prompt_chars
from shared.settings import Settings


def spec_errors(spec: JobCreate, settings: Settings) -> list[str]:
    errors = []
    if error := model_id_error(spec.model_id, settings):
        errors.append(error)
    errors += disallowed_endpoint_hosts(endpoint_urls(spec.reward, spec.config.reward_endpoint), settings.reward_hosts)
    for source in spec.reward or []:
        if isinstance(source, PythonReward) and (error := python_reward_error(source.function, settings.reward_modules)):
            errors.append(error)
        if isinstance(source, RegexReward) and len(source.pattern) > settings.max_regex_chars:
            errors.append(f"regex reward: pattern of {len(source.pattern)} characters; the limit is {settings.max_regex_chars} (MTQ_MAX_REGEX_CHARS)")
    if len(spec.prompts) > settings.max_prompts:
        errors.append(f"{len(spec.prompts)} prompts; the limit is {settings.max_prompts} (MTQ_MAX_PROMPTS)")
    lengths = [prompt_chars(p) for p in spec.prompts]
    too_long = [i for i, n in enumerate(lengths) if n > settings.max_prompt_chars]
    if too_long:
        errors.append(f"prompts[{too_long[0]}] has {lengths[too_long[0]]} characters; the limit is {settings.max_prompt_chars} (MTQ_MAX_PROMPT_CHARS)")
    # Work per step: every row holds a prompt and a completion. Characters stand in for
    # tokens here (the API has no tokenizer); the worker checks real token counts against
    # the model's context before the first step.
    cfg = spec.config
    rows = cfg.batch_size * cfg.group_size
    step_tokens = rows * (max(lengths) + cfg.max_completion_len)
    if step_tokens > settings.max_step_tokens:
        errors.append(
            f"a step would hold about {step_tokens} tokens (batch_size x group_size rows x (longest prompt + "
            f"max_completion_len)); the limit is {settings.max_step_tokens} (MTQ_MAX_STEP_TOKENS)"
        )
    return errors


def check_spec(spec: JobCreate, settings: Settings, loc: tuple = ("body",)) -> None:
    """Raise the errors as a RequestValidationError: a 422 shaped like pydantic's own."""
    errors = spec_errors(spec, settings)
    if errors:
        raise RequestValidationError([{"loc": loc, "msg": msg, "type": "value_error"} for msg in errors])
