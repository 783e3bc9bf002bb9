"""What the workers measure, for the API's Prometheus /metrics, through Redis.

The API never imports MLX or runs jobs, so the workers keep these histograms in Redis: one
hash per metric with a count per bucket (not cumulative), `sum` and `count`. A training
process buffers its observations (`recorder`) and adds them in one pipeline after each step
(`flush`); the API's collector (api/routes/metrics.py) reads the hashes at each scrape.
"""

import bisect
import logging
import threading
from dataclasses import dataclass, field

import redis

log = logging.getLogger(__name__)

# name -> (help, bucket upper bounds); +Inf is implied.
HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "mtq_step_seconds": ("Time of one GRPO step (sampling, scoring, update).",
                         (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)),
    "mtq_tokens_per_second": ("Sampled completion tokens per second of sampling, one observation per step.",
                              (10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 25000)),
    "mtq_scoring_seconds": ("Time to score one step's completions (every reward source).",
                            (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)),
    "mtq_score_request_seconds": ("Time a worker takes to answer one log-prob or reward-score request.",
                                  (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)),
    "mtq_completion_batch_rows": ("Rows (choices of chat or text completions) a worker decodes together in one turn.",
                                  (1, 2, 4, 8, 16)),
    "mtq_reward_endpoint_seconds": ("Time of one request to a reward endpoint (each attempt).",
                                    (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)),
}
# name -> help; monotonically increasing counts.
COUNTERS: dict[str, str] = {
    "mtq_reward_endpoint_errors_total": "Failed reward endpoint attempts (refused, timed out, HTTP errors, bad answers).",
}


def metric_key(name: str) -> str:
    return f"mtq:metrics:{name}"


def bucket_field(name: str, value: float) -> str:
    """The bucket a value falls in: the index of the first bound >= value (len(bounds) = +Inf)."""
    return str(bisect.bisect_left(HISTOGRAMS[name][1], value))


@dataclass
class Recorder:
    observations: list[tuple[str, float]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    # A reward endpoint's wait runs on a helper thread while the main thread serves (and flushes).
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def observe(self, name: str, value: float) -> None:
        assert name in HISTOGRAMS, name
        with self.lock:
            self.observations.append((name, float(value)))

    def count(self, name: str, n: int = 1) -> None:
        assert name in COUNTERS, name
        with self.lock:
            self.counts[name] = self.counts.get(name, 0) + n

    def flush(self, r: redis.Redis) -> None:
        """Add what was measured since the last flush. Best effort: metrics never fail a job."""
        with self.lock:
            observations, counts = self.observations, self.counts
            self.observations, self.counts = [], {}
        if not observations and not counts:
            return
        try:
            with r.pipeline(transaction=False) as p:
                for name, value in observations:
                    p.hincrby(metric_key(name), bucket_field(name, value), 1)
                    p.hincrbyfloat(metric_key(name), "sum", value)
                    p.hincrby(metric_key(name), "count", 1)
                for name, n in counts.items():
                    p.incrby(metric_key(name), n)
                p.execute()
        except redis.RedisError as e:
            log.warning("metrics not recorded (redis: %s)", e)


recorder = Recorder()  # the training process's


def read_histogram(r: redis.Redis, name: str) -> tuple[list[tuple[str, float]], float]:
    """Prometheus form: cumulative [(le, count)], ending with +Inf, and the sum."""
    h = {k.decode(): v for k, v in r.hgetall(metric_key(name)).items()}
    bounds = HISTOGRAMS[name][1]
    buckets, total = [], 0
    for i, le in enumerate([*map(float, bounds), float("inf")]):
        total += int(h.get(str(i), 0))
        buckets.append(("+Inf" if le == float("inf") else repr(le), total))
    return buckets, float(h.get("sum", 0.0))


def read_counter(r: redis.Redis, name: str) -> int:
    return int(r.get(metric_key(name)) or 0)
