"""The training process's turns at the scoring queues (shared/scoring.py): between two steps of
a job (the queue of the model it trains), or while idle (the queues of its worker's models).
Each claimed request is served by its type: log-probs and rewards by
worker/runtime/score_requests.py, a completion's batch by worker/runtime/completions.py.

While a step waits on another server (a reward endpoint), the wait runs on a helper thread and
the main thread (MLX's) keeps taking turns (while_serving): a server that asks this service for
rewards or log-probs on the job's model (the seed's RL loop through a bridge) is answered by the
very worker that waits on it.
"""

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from shared import scoring
from shared.routing import model_key, served_models
from shared.settings import Settings
from shared.workers import get_worker
from worker.runtime import completions, score_requests

T = TypeVar("T")
SLICE_S = 0.25  # one scoring request's turn; what is left of it waits for the next
QUEUES_REREAD_S = 5.0  # an idle process re-reads which models its worker offers this often
WAITING_LOOK_S = 0.05  # while_serving: how long one look waits for a request before checking the call


def serve_waiting(r, settings: Settings, model_id: str | None = None, queues: list[str] | None = None,
                  wait_s: float = 0.0) -> int:
    """Serve requests in turn for at most MTQ_SERVE_TURN_S: those for `model_id` (a busy
    process, between two steps), or those of `queues` (an idle one: the queues of its worker's
    models, idle_queues; waiting up to wait_s for the first). A scoring request gets at most
    SLICE_S a turn; a completion's batch (several owners' requests) the rest of the budget.
    Returns how many turns were served."""
    deadline = time.monotonic() + settings.serve_turn_s
    served = 0
    while time.monotonic() < deadline:
        if model_id is not None:
            queue = model_key(model_id)
            claimed = scoring.claim(r, queue)
        else:
            queue = scoring.wait_for_ready(r, queues or [], wait_s if served == 0 else 0.0)
            claimed = None if queue is None else scoring.claim(r, queue, woken=True)
        if claimed is None:
            break
        if claimed[1].get("type") == "generate":
            completions.serve(r, settings, queue, claimed, until=deadline)
        else:
            score_requests.serve_one(r, settings, *claimed, until=min(deadline, time.monotonic() + SLICE_S))
        served += 1
    return served


def idle_queues(r, worker: str, settings: Settings) -> list[str]:
    """The scoring queues an idle process of `worker` serves: those of the models its worker
    offers (its advertisement: shared/workers.py), and with --hub the hub's."""
    advertised = get_worker(r, worker) or {}
    return sorted(served_models(advertised)) + ([scoring.HUB] if settings.hub else [])


def while_serving(call: Callable[[], T], serve_turn: Callable[[], object]) -> T:
    """call()'s result (or its exception), called on a helper thread while this thread takes
    serve_turn() turns (each bounded as serve_waiting bounds them) until it returns."""
    with ThreadPoolExecutor(1, thread_name_prefix="mtq-waiting") as pool:
        future = pool.submit(call)
        while not future.done():
            serve_turn()
        return future.result()
