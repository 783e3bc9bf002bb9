"""What a job spec must satisfy beyond its schema: the operator's allow-lists and limits
(shared/settings.py). Checked on create, and on resume with the changed config; each family
of kinds (shared/kinds.py) has its check: `check_spec` GRPO's, `check_datasets` the
supervised kinds'. Both answer 400 (api/routes/job_routes.py FAMILIES says in which form)."""

from fastapi import HTTPException, status
from fastapi.exceptions import RequestValidationError

from shared.datasets import FileRef, file_meta, load_rows, path_error
from shared.kinds import KINDS
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


def check_spec(r, spec: JobCreate, settings: Settings, loc: tuple = ("body",)) -> None:
    """A GRPO spec's errors as a RequestValidationError, shaped like pydantic's own (the app
    answers it with 400: api/main.py)."""
    errors = spec_errors(spec, settings)
    if errors:
        raise RequestValidationError([{"loc": loc, "msg": msg, "type": "value_error"} for msg in errors])


def check_datasets(r, spec, settings, loc: tuple = ("body",)) -> None:
    """What the schema cannot see: the model id's allow-list, paths under MTQ_DATA_ROOTS,
    uploaded files that exist and whose rows fit the kind, row counts (400s)."""
    errors = []
    if error := model_id_error(spec.model_id, settings):
        errors.append(error)
    for name in ("dataset", "valid_dataset"):
        ref = getattr(spec, name)
        if isinstance(ref, str) and (error := path_error(ref, settings)):
            errors.append(error)
        elif isinstance(ref, FileRef):
            if file_meta(r, ref.file_id) is None:
                errors.append(f"{name}: file {ref.file_id} not found")
            else:
                try:
                    rows = load_rows(r, ref, settings, spec.row_format, name)
                    if len(rows) > settings.max_prompts:
                        errors.append(f"{name}: {len(rows)} rows; the limit is {settings.max_prompts} (MTQ_MAX_PROMPTS)")
                except ValueError as e:
                    errors.append(str(e))
        elif isinstance(ref, list) and len(ref) > settings.max_prompts:
            errors.append(f"{name}: {len(ref)} rows; the limit is {settings.max_prompts} (MTQ_MAX_PROMPTS)")
    rows = spec.config.batch_size * KINDS[spec.kind].rows_per_example  # a preference pair: chosen + rejected
    if rows * spec.config.max_seq_length > settings.max_step_tokens:
        errors.append(f"a micro-batch could hold {rows * spec.config.max_seq_length} tokens (batch_size x "
                      f"{'2 x ' if rows > spec.config.batch_size else ''}max_seq_length); the limit is "
                      f"{settings.max_step_tokens} (MTQ_MAX_STEP_TOKENS)")
    if len(getattr(spec, "preference_pairs", None) or []) > settings.max_prompts:
        errors.append(f"preference_pairs: {len(spec.preference_pairs)} rows; the limit is {settings.max_prompts} (MTQ_MAX_PROMPTS)")
    if errors:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, "; ".join(errors))
