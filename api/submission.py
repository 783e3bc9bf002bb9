"""What a job spec must satisfy beyond its schema: the operator's allow-lists and limits
(shared/settings.py), and what the submitting token may use (its own files and reward models).
Checked on create, and on resume with the changed config; each family of kinds
(shared/kinds.py) has its check: `check_spec` GRPO's, `check_datasets` the supervised kinds'.
Both answer 400 (api/routes/job_routes.py FAMILIES says in which form).

Before those checks a new spec is `prepared`: its init_adapter resolved to the job whose
adapter it names (checked against the job's shape: 400; a source this token may not see: 404),
a GRPO job's reward endpoint that is this service's own reward/score route made a
`reward_model` source, scored on the job's worker without HTTP (own_reward_model), and an
export's source resolved to its job and that job's base (export_source)."""

import json
from urllib.parse import parse_qs

from fastapi import HTTPException, Request, status
from fastapi.exceptions import RequestValidationError

from api.auth import Principal
from shared import adapters, graders
from shared.adapters import CONFIG_FILE, HEAD_FILE, WEIGHTS_FILE, adapter_shape, shape_mismatches
from shared.agentic_specs import tool_error
from shared.datasets import FileRef, load_rows, path_error, visible_file
from shared.export_specs import ExportJobCreate
from shared.keys import JOB_ID, adapter_key, job_key
from shared.kinds import KINDS
from shared.model_ids import job_id_of, model_id_error
from shared.reward_specs import (
    EndpointReward, GraderReward, PythonReward, RegexReward, RewardModelReward, disallowed_endpoint_hosts, endpoint_urls,
    parse_reward_url, python_reward_error,
)
from shared.schemas import InitAdapter, JobCreate, prompt_chars
from shared.settings import Settings

REWARD_SCORE_PATH = "/admin/api/fine-tune/reward/score"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def common_errors(spec, settings: Settings) -> list[str]:
    """What every kind's spec must satisfy: the model id's allow-list (a teacher's too), the server's cap on
    stall_timeout_s, and the size the spec takes stored."""
    errors = []
    if error := model_id_error(spec.model_id, settings):
        errors.append(error)
    teacher = getattr(spec, "teacher_model_id", None)  # GKD's, under the same allow-list
    if teacher and (error := model_id_error(teacher, settings)):
        errors.append(f"teacher_model_id: {error}")
    if spec.config.stall_timeout_s > settings.max_stall_timeout_s:
        errors.append(f"config.stall_timeout_s {spec.config.stall_timeout_s:g}; the limit is "
                      f"{settings.max_stall_timeout_s:g} (MTQ_MAX_STALL_TIMEOUT_S)")
    stored = len(spec.model_dump_json(by_alias=True))
    if stored > settings.max_job_bytes:
        errors.append(f"the job takes {stored} bytes stored; the limit is {settings.max_job_bytes} (MTQ_MAX_JOB_BYTES)")
    return errors


def reward_model_error(r, source: RewardModelReward, settings: Settings, who: Principal) -> str | None:
    """A reward_model source names a completed reward job's adapter that the token may use
    (a trainer: its own); the same words whether it is another's or missing."""
    if error := model_id_error(source.model_id, settings):
        return f"reward_model: {error}"
    job_id = adapters.find(r, source.model_id, source.adapter_name)
    owner = None if job_id is None else r.hget(job_key(job_id), "owner")
    if job_id is None or not who.sees(None if owner is None else owner.decode()):
        return f"reward_model: Adapter not found: {source.model_id}/{source.adapter_name}"
    return None


def spec_errors(r, spec: JobCreate, settings: Settings, who: Principal) -> list[str]:
    errors = common_errors(spec, settings)
    errors += disallowed_endpoint_hosts(endpoint_urls(spec.reward, spec.config.reward_endpoint), settings.reward_hosts)
    if spec.environment is not None:  # the worker connects to it as to a reward endpoint, under the same rules
        errors += [f"environment: {e}" for e in disallowed_endpoint_hosts([spec.environment.url], settings.reward_hosts)]
    for source in spec.reward or []:
        if isinstance(source, PythonReward) and (error := python_reward_error(source.function, settings.reward_modules)):
            errors.append(error)
        if isinstance(source, RegexReward) and len(source.pattern) > settings.max_regex_chars:
            errors.append(f"regex reward: pattern of {len(source.pattern)} characters; the limit is {settings.max_regex_chars} (MTQ_MAX_REGEX_CHARS)")
        if isinstance(source, RewardModelReward) and (error := reward_model_error(r, source, settings, who)):
            errors.append(error)
        if isinstance(source, GraderReward):  # its score_model graders' reward models, checked as reward_model's
            for model_id, adapter_name in graders.reward_models(source.grader):
                if error := reward_model_error(r, RewardModelReward(model_id=model_id, adapter_name=adapter_name),
                                               settings, who):
                    errors.append(error)
    errors += [error for tool in spec.tools or [] if (error := tool_error(tool.function, settings.tool_modules))]
    if len(spec.prompts) > settings.max_prompts:
        errors.append(f"{len(spec.prompts)} prompts; the limit is {settings.max_prompts} (MTQ_MAX_PROMPTS)")
    for name in ("prompts", "validation_prompts"):
        chars = [prompt_chars(p) for p in getattr(spec, name) or []]
        too_long = [i for i, n in enumerate(chars) if n > settings.max_prompt_chars]
        if too_long:
            errors.append(f"{name}[{too_long[0]}] has {chars[too_long[0]]} characters; the limit is {settings.max_prompt_chars} (MTQ_MAX_PROMPT_CHARS)")
    lengths = [prompt_chars(p) for p in spec.prompts]
    # Work per step: every row holds a prompt and a completion. Characters stand in for
    # tokens here (the API has no tokenizer); the worker checks real token counts against
    # the model's context before the first step.
    cfg = spec.config
    rows = cfg.batch_size * cfg.group_size
    after = cfg.episode_len if spec.multi_turn else cfg.max_completion_len
    step_tokens = rows * (max(lengths) + after)
    if step_tokens > settings.max_step_tokens:
        errors.append(
            f"a step would hold about {step_tokens} tokens (batch_size x group_size rows x (longest prompt + "
            f"max_completion_len, or a multi-turn job's max_episode_len)); the limit is {settings.max_step_tokens} (MTQ_MAX_STEP_TOKENS)"
        )
    return errors


def check_spec(r, spec: JobCreate, settings: Settings, who: Principal, loc: tuple = ("body",)) -> None:
    """A GRPO spec's errors as a RequestValidationError, shaped like pydantic's own (the app
    answers it with 400: api/main.py)."""
    errors = spec_errors(r, spec, settings, who)
    if errors:
        raise RequestValidationError([{"loc": loc, "msg": msg, "type": "value_error"} for msg in errors])


def check_datasets(r, spec, settings: Settings, who: Principal, loc: tuple = ("body",)) -> None:
    """What the schema cannot see: common_errors, paths under MTQ_DATA_ROOTS, uploaded files
    that exist, are the token's to use (a trainer: its own; another's reads as missing) and
    whose rows fit the kind, row counts (400s)."""
    errors = common_errors(spec, settings)
    for name in ("dataset", "valid_dataset"):
        ref = getattr(spec, name)
        if isinstance(ref, str) and (error := path_error(ref, settings)):
            errors.append(error)
        elif isinstance(ref, FileRef):
            meta = visible_file(r, ref.file_id, who)
            if meta is None:
                errors.append(f"{name}: file {ref.file_id} not found")
            elif meta.get("purpose") == "adapter":
                errors.append(f"{name}: file {ref.file_id} is an adapter (purpose adapter), not a dataset")
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


def check_export(r, spec: ExportJobCreate, settings: Settings, who: Principal, loc: tuple = ("body",)) -> None:
    """An export's common_errors (its source was checked as it was prepared: export_source; on
    resume, one that is gone since fails the job, saying so)."""
    errors = common_errors(spec, settings)
    if errors:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, "; ".join(errors))


# --------------------------------------------------------------------------- preparing a new spec


def refuse_resume(r, spec, settings: Settings, who: Principal, loc: tuple = ("body",)) -> None:
    """A session's job (shared/session_specs.py) is not resumed: its clients' state was in its
    worker's memory. The client loads its last save_state in a new one (docs/sessions.md)."""
    raise RequestValidationError([{"loc": loc, "msg": "a training session's job does not resume: its clients' state "
                                   "was in its worker's memory; load the last save_state in a new session",
                                   "type": "value_error"}])


def prepared(r, spec, who: Principal, request: Request):
    """The spec as it is stored: init_adapter resolved, this service's reward/score as a reward model,
    an export's source resolved."""
    if getattr(spec, "init_adapter", None) is not None:  # an export has none
        spec = spec.model_copy(update={"init_adapter": resolved_init_adapter(r, spec, who)})
    if isinstance(spec, JobCreate):
        spec = with_own_reward_model(spec, own_addresses(request))
    if isinstance(spec, ExportJobCreate):
        spec = export_source(r, spec, who)
    return spec


def export_source(r, spec: ExportJobCreate, who: Principal) -> ExportJobCreate:
    """The export with its source as the job's id (an OpenAI id or ft: name resolved) and its
    model_id as that job's base, after checking that this token may see the job (else 404, the
    words of a job that is not there, as a download's), that it has completed (409) and that
    what it stored is an adapter of a language model (400; 404 once it is gone)."""
    job_id = job_id_of(spec.source) or spec.source
    # Never a key of another shape (mtq:job:<id>:events...): a source that is no job id is no job.
    raw_spec, owner, job_status = (r.hmget(job_key(job_id), "spec", "owner", "status") if JOB_ID.fullmatch(job_id)
                                   else (None,) * 3)
    if raw_spec is None or not who.sees(owner and owner.decode()):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"source: Job not found: {spec.source[:100]}")
    if job_status != b"completed":
        raise HTTPException(status.HTTP_409_CONFLICT, f"source: job {job_id} is {job_status.decode()}; only a "
                            "completed job's adapter can be exported")
    names = {name.decode() for name in r.hkeys(adapter_key(job_id))}
    if not names:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"source: Adapter not found for job: {job_id} (it stored "
                            "none, or it was deleted, or expired after MTQ_JOB_RETENTION_S)")
    if WEIGHTS_FILE not in names:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"source: job {job_id} stored a whole model (a full "
                            "fine-tune's or an export's), not an adapter to fuse: download it as it is (mtq download)")
    if HEAD_FILE in names:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"source: job {job_id} is a reward model: its value head "
                            "has no place in an mlx_lm language model, so there is no model to export")
    try:
        model_id = json.loads(raw_spec)["model_id"]
    except (ValueError, KeyError, TypeError):
        raise HTTPException(status.HTTP_409_CONFLICT, f"source: job {job_id}'s stored record cannot be read") from None
    if spec.quantize and spec.quant_bits is None and spec.quant_mode is None and not (
            json.loads(raw_spec).get("config") or {}).get("qat_enable"):
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"quantize: job {job_id} did not train with QAT "
                            "(qat_enable): give quant_bits or quant_mode")
    if spec.model_id is not None and spec.model_id != model_id:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"model_id: job {job_id}'s adapter was trained on "
                            f"{model_id!r}, not {spec.model_id!r} (leave model_id out: it is the source's)")
    return spec.model_copy(update={"source": job_id, "model_id": model_id})


def resolved_init_adapter(r, spec, who: Principal) -> InitAdapter:
    """The init_adapter with the job it names (an upload: as it is), after checking that its
    shape is the job's (400 naming the fields) and that this token may see it (else 404)."""
    init, cfg = spec.init_adapter, spec.config
    if init.file_id is not None:
        meta = visible_file(r, init.file_id, who)
        if meta is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"init_adapter: file {init.file_id} not found")
        if meta.get("purpose") != "adapter":
            raise HTTPException(status.HTTP_400_BAD_REQUEST, f"init_adapter: file {init.file_id} is not an adapter "
                                "(upload it with ?purpose=adapter)")
        where, shape = f"file {init.file_id}", adapter_shape(meta["adapter"]["config"], meta["adapter"])
    else:
        job_id = init.job_id or adapters.find(r, init.model_id, init.adapter_name)
        raw_spec, owner, job_status = r.hmget(job_key(job_id), "spec", "owner", "status") if job_id else (None,) * 3
        config = job_id and r.hget(adapter_key(job_id), CONFIG_FILE)
        if not config or job_status != b"completed" or not who.sees(owner and owner.decode()):
            what = f"job {init.job_id}" if init.job_id else f"{init.model_id}/{init.adapter_name}"
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"init_adapter: Adapter not found: {what}")
        source = json.loads(raw_spec)
        if source["model_id"] != spec.model_id:
            raise HTTPException(status.HTTP_400_BAD_REQUEST, f"init_adapter: job {job_id}'s adapter was trained on "
                                f"{source['model_id']!r}, this job's model is {spec.model_id!r}")
        init = InitAdapter(job_id=job_id, model_id=source["model_id"], adapter_name=source["adapter_name"])
        where, shape = f"job {job_id}'s adapter", adapter_shape(json.loads(config))
    errors = shape_mismatches(cfg, getattr(cfg, "fine_tune_type", "lora"), shape)
    if errors:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"init_adapter: {where} does not fit this job: " + "; ".join(errors))
    return init


def own_addresses(request: Request) -> set[tuple[str, int]]:
    """(host, port) pairs that reach this API: the one the client used, and loopback on the
    port this server listens on."""
    url = request.url
    own = {(url.hostname or "", url.port or (443 if url.scheme == "https" else 80))}
    server = request.scope.get("server")
    if server:
        own |= {(host, server[1]) for host in LOOPBACK}
    return own


def own_reward_model(url: str, own: set[tuple[str, int]]) -> RewardModelReward | None:
    """The reward model a reward URL names, if it is this service's reward/score route
    (`?model_id=M&adapter_name=A` names it: the seed's {prompt, completions} body has no room)."""
    try:
        parsed = parse_reward_url(url)
    except ValueError:
        return None  # the checks below say why
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    if parsed.path.rstrip("/") != REWARD_SCORE_PATH or (parsed.host.lower(), port) not in own:
        return None
    query = {k: v[0] for k, v in parse_qs(parsed.query.decode()).items()}
    if not query.get("model_id") or not query.get("adapter_name"):
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"reward endpoint {url}: this service's reward/score route as a "
                            "reward endpoint needs ?model_id=...&adapter_name=... (the reward model to score with)")
    try:
        return RewardModelReward(model_id=query["model_id"], adapter_name=query["adapter_name"], name="endpoint")
    except ValueError as e:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"reward endpoint {url}: {e}") from None


def with_own_reward_model(spec: JobCreate, own: set[tuple[str, int]]) -> JobCreate:
    """The spec with each reward endpoint of this service's reward/score as the reward model it names."""
    if spec.reward is None:
        source = spec.config.reward_endpoint and own_reward_model(spec.config.reward_endpoint, own)
        return spec.model_copy(update={"reward": [source]}) if source else spec
    sources = []
    for s in spec.reward:
        mine = own_reward_model(s.url, own) if isinstance(s, EndpointReward) else None
        sources.append(s if mine is None else mine.model_copy(update={"name": s.name or "endpoint", "weight": s.weight}))
    return spec.model_copy(update={"reward": sources})
