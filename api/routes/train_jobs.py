"""The supervised kinds' job routes (the seed server's paths), each built by api/routes/job_routes.py,
and what their submissions must satisfy beyond the schema."""

from fastapi import HTTPException, status

from api.routes.job_routes import JobKind, job_router
from shared import train_jobs
from shared.datasets import FileRef, file_meta, load_rows, path_error
from shared.model_ids import model_id_error
from shared.train_specs import DPOJobCreate, ORPOJobCreate, RewardJobCreate, SFTJobCreate, TrainJob


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
    rows = spec.config.batch_size * (2 if spec.row_format == "preference" else 1)  # chosen + rejected
    if rows * spec.config.max_seq_length > settings.max_step_tokens:
        errors.append(f"a micro-batch could hold {rows * spec.config.max_seq_length} tokens (batch_size x "
                      f"{'2 x ' if rows > spec.config.batch_size else ''}max_seq_length); the limit is "
                      f"{settings.max_step_tokens} (MTQ_MAX_STEP_TOKENS)")
    if len(getattr(spec, "preference_pairs", None) or []) > settings.max_prompts:
        errors.append(f"preference_pairs: {len(spec.preference_pairs)} rows; the limit is {settings.max_prompts} (MTQ_MAX_PROMPTS)")
    if errors:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, "; ".join(errors))


def train_kind(spec_model, prefix: str, tag: str, what: str) -> JobKind:
    return JobKind(kind=spec_model.kind, prefix=prefix, tag=tag, what=what, spec_model=spec_model, job_model=TrainJob,
                   create=train_jobs.create_job, from_hash=train_jobs.job_or_unreadable,
                   with_overrides=train_jobs.with_config_overrides, resume=train_jobs.resume_job, check=check_datasets)


ROUTERS = [job_router(train_kind(*args)) for args in (
    (SFTJobCreate, "/admin/api/fine-tune/jobs", "SFT jobs", "an SFT job"),
    (DPOJobCreate, "/admin/api/fine-tune/dpo/jobs", "DPO jobs", "a DPO job"),
    (ORPOJobCreate, "/admin/api/fine-tune/orpo/jobs", "ORPO jobs", "an ORPO job"),
    (RewardJobCreate, "/admin/api/fine-tune/reward/jobs", "Reward-model jobs", "a reward-model job"),
)]
