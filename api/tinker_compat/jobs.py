"""A Tinker session's jobs: one per (session, base model), made when the session first needs
the model (shared/session_specs.py), and the owner checks every Tinker route makes.

A session, run, sampler or future another trainer token made is a 404, as a job is
(api/auth.py); a call for a run whose job has ended is a 409 that says what to do.
"""

from fastapi import HTTPException, status

from api.auth import Principal
from shared import jobstore, sessions
from shared.keys import job_key
from shared.model_ids import model_id_error
from shared.session_specs import SessionConfig, SessionJobCreate
from shared.settings import Settings


def not_found(what: str) -> HTTPException:
    return HTTPException(status.HTTP_404_NOT_FOUND, f"{what} not found")


def session_or_404(r, sid: str, who: Principal) -> dict[str, str]:
    found = sessions.get_session(r, sid)
    if found is None or not who.sees(found["owner"]):
        raise not_found(f"session {sid!r}")
    if "finished_at" in found:
        raise HTTPException(status.HTTP_409_CONFLICT, f"session {sid!r} is finished; create a new one")
    return found


def job_for(r, sid: str, base_model: str, who: Principal, settings: Settings) -> str:
    """The session's job on base_model: the one it has, unless that one ended, else a new one
    (queued: routed to a worker that has the model and the memory)."""
    if error := model_id_error(base_model, settings):
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"base_model: {error}")
    job_id = sessions.session_jobs(r, sid).get(base_model)
    if job_id is not None and jobstore.get_status(r, job_id) in ("queued", "running"):
        return job_id
    spec = SessionJobCreate(model_id=base_model, session_id=sid,
                            config=SessionConfig(idle_timeout_s=settings.session_idle_timeout_s))
    job = jobstore.create_job(r, spec, owner=who.name, tenant=who.tenant)
    sessions.set_session_job(r, sid, base_model, job.job_id)
    return job.job_id


def live_job(r, job_id: str) -> str:
    """The job, if it still serves calls; else a 409 naming why it ended."""
    state = jobstore.get_status(r, job_id)
    if state in ("queued", "running"):
        return job_id
    error = (r.hget(job_key(job_id), "error") or b"").decode()
    raise HTTPException(status.HTTP_409_CONFLICT, ended(job_id, state, error))


def ended(job_id: str, state: str | None, error: str) -> str:
    """Why calls for a session's job fail once it ended: its weights and optimizer state were in
    its worker's memory."""
    why = f"{state}: {error}" if error else (state or "deleted")
    return (f"the session's job {job_id} ended ({why}); its models' state in memory is gone: load the last "
            "save_state into a new training client (create_training_client_from_state)")


def run_or_404(r, model_id: str, who: Principal) -> dict:
    run = sessions.get_run(r, model_id)
    if run is None or not who.sees(run["owner"]):
        raise not_found(f"model {model_id!r}")
    return run


def checkpoint_or_404(r, path: str, who: Principal) -> tuple[dict, str, str]:
    """(the run, its model id, the checkpoint id) of a tinker:// path this token may use."""
    try:
        model_id, checkpoint_id = sessions.parse_path(path)
    except ValueError as e:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, str(e)) from None
    run = run_or_404(r, model_id, who)
    if checkpoint_id not in sessions.checkpoints(r, model_id):
        raise not_found(f"checkpoint {path!r}")
    return run, model_id, checkpoint_id

