"""Which model ids a job may name: the API checks at submission, the worker again before loading.

A model_id is one of
  - a name: a directory under MTQ_MODELS_DIR ("tiny");
  - a Hugging Face id, org/name ("Qwen/Qwen3-0.6B"): a directory of that path under
    MTQ_MODELS_DIR if there is one, else the hub (or its local cache);
  - an absolute path under one of the operator's MTQ_MODEL_ROOTS.
Nothing else: no relative paths, no '..', so a job can neither read a model from nor write
its adapter ($MTQ_HOME/adapters/<model_id>/...) to anywhere the operator did not choose.
"""

import os
import re
from pathlib import Path

from shared.settings import Settings

MODEL_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
# Matched whole (fullmatch, or pydantic's pattern): Python's `$` also matches before a final newline.
MODEL_ID_RE = re.compile(rf"^(?:{MODEL_NAME}|{MODEL_NAME}/{MODEL_NAME}|/[^\x00]*)$")


def under_roots(path: Path, roots: tuple[Path, ...]) -> bool:
    return any(path == root or root in path.parents for root in roots)


def model_id_error(model_id: str, settings: Settings) -> str | None:
    """Why this model_id is not allowed (None if it is). Looks at the text only (the API
    may not share the workers' file system); the worker also resolves symlinks."""
    if not MODEL_ID_RE.fullmatch(model_id) or ".." in Path(model_id).parts:
        return f"model_id {model_id[:200]!r}: not a model name, a Hugging Face id (org/name), or an absolute path"
    if model_id.startswith("/") and not under_roots(Path(os.path.normpath(model_id)), settings.model_roots):
        return f"model_id {model_id[:200]!r}: absolute paths are allowed only under MTQ_MODEL_ROOTS"
    return None


OPENAI_JOB_PREFIX = "ftjob-"  # a job's id in the OpenAI-compatible API (/v1): ftjob-<job id>


def job_id_of(openai_id: str) -> str | None:
    """The project's job id of `ftjob-<id>`, or of a fine-tuned model's name `ft:...:<id>`
    (the API's /v1 and the client's commands both take either)."""
    if openai_id.startswith("ft:"):
        openai_id = OPENAI_JOB_PREFIX + openai_id.rsplit(":", 1)[-1]
    return openai_id.removeprefix(OPENAI_JOB_PREFIX) if openai_id.startswith(OPENAI_JOB_PREFIX) else None
