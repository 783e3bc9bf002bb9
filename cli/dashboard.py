"""`mtq dashboard`: rq-dashboard on the stack's Redis (REDIS_URL).

It shows the queues, the workers and every attempt of every job; each running attempt's
`meta` holds the training job's progress (step/total, reward, loss, ETA, model), which the
worker's supervisor copies there from the job record (worker/supervisor/supervisor.py).

Bound to 127.0.0.1 by default. On every address, loopback included, it asks for HTTP basic
auth with the user `mtq` and the admin token (MTQ_API_TOKEN) as the password, and refuses to
start without one: the dashboard can delete and requeue rq jobs, and anything on this machine
(a reward server a job names, say) can reach loopback.
"""

import os

from shared.settings import load_settings


def run_dashboard(host: str, port: int) -> int:
    settings = load_settings()
    if not settings.api_token:
        print("mtq dashboard: needs MTQ_API_TOKEN (the basic auth password, user mtq)")
        return 2
    # rq-dashboard reads RQ_DASHBOARD_*: secrets stay out of argv.
    os.environ.update(RQ_DASHBOARD_REDIS_URL=settings.redis_url, RQ_DASHBOARD_USERNAME="mtq",
                      RQ_DASHBOARD_PASSWORD=settings.api_token)
    from rq_dashboard.cli import run

    return run.main(args=["--bind", host, "--port", str(port)], auto_envvar_prefix="RQ_DASHBOARD",
                    standalone_mode=False) or 0
