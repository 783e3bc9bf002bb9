"""`mtq dashboard`: rq-dashboard on the stack's Redis (REDIS_URL).

It shows the queues, the workers and every attempt of every job; each running attempt's
`meta` holds the training job's progress (step/total, reward, loss, ETA, model), which the
worker's supervisor copies there from the job record (worker/supervisor.py).

Bound to 127.0.0.1 by default. Bound to any other address it requires HTTP basic auth with
the user `mtq` and the admin token (MTQ_API_TOKEN) as the password, and refuses to start
without one: the dashboard can delete and requeue rq jobs.
"""

import os

from shared.settings import load_settings

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def run_dashboard(host: str, port: int) -> int:
    settings = load_settings()
    env = {"RQ_DASHBOARD_REDIS_URL": settings.redis_url}
    if host not in LOOPBACK:
        if not settings.api_token:
            print("mtq dashboard: binding to a non-loopback address needs MTQ_API_TOKEN (basic auth password)")
            return 2
        env.update(RQ_DASHBOARD_USERNAME="mtq", RQ_DASHBOARD_PASSWORD=settings.api_token)
    os.environ.update(env)  # rq-dashboard reads RQ_DASHBOARD_*: secrets stay out of argv
    from rq_dashboard.cli import run

    return run.main(args=["--bind", host, "--port", str(port)], auto_envvar_prefix="RQ_DASHBOARD",
                    standalone_mode=False) or 0
