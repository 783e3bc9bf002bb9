"""GET /metrics: Prometheus metrics of the whole service (prometheus-client's text format).

Unauthenticated from loopback (a Prometheus on the same host, or behind a local proxy that
does its own access control); from anywhere else it needs a bearer token like /admin.
Everything is read from Redis at scrape time, so any API process answers for all workers:
job counts by status, rq queue depths, live workers, and the histograms that the training
processes keep in Redis (shared/metrics.py).
"""


import redis
from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from rq import Queue, Worker

from api.deps import BearerDep, RedisDep, check_token, from_loopback
from shared import lifecycle, metrics
from shared.keys import JOBS_INDEX, job_key

router = APIRouter(tags=["metrics"])
STATUSES = ("queued", "running", *lifecycle.FINISHED)


class RedisCollector:
    """A prometheus-client collector that reads the service's state from Redis."""

    def __init__(self, r: redis.Redis):
        self.r = r

    def collect(self):
        jobs = GaugeMetricFamily("mtq_jobs", "Jobs by status (kept until MTQ_JOB_RETENTION_S expires them).",
                                 labels=["status"])
        counts = dict.fromkeys(STATUSES, 0)
        with self.r.pipeline(transaction=False) as p:
            for job_id in self.r.zrange(JOBS_INDEX, 0, -1):
                p.hget(job_key(job_id.decode()), "status")
            for status in p.execute():
                if status is not None:
                    name = status.decode()
                    counts[name] = counts.get(name, 0) + 1
        for name, n in counts.items():
            jobs.add_metric([name], n)
        yield jobs

        depth = GaugeMetricFamily("mtq_queue_depth", "rq jobs waiting per queue.", labels=["queue"])
        for queue in Queue.all(connection=self.r):
            depth.add_metric([queue.name], queue.count)
        yield depth
        yield GaugeMetricFamily("mtq_workers", "Workers alive (registered with rq, heartbeat not expired).",
                                value=Worker.count(connection=self.r))

        for name, (help_text, _) in metrics.HISTOGRAMS.items():
            buckets, total = metrics.read_histogram(self.r, name)
            yield HistogramMetricFamily(name, help_text, buckets=buckets, sum_value=total)
        for name, help_text in metrics.COUNTERS.items():
            yield CounterMetricFamily(name.removesuffix("_total"), help_text, value=metrics.read_counter(self.r, name))


@router.get("/metrics", response_class=Response, summary="Prometheus metrics (token needed except from loopback)",
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}, 401: {"description": "Not loopback, and no valid token."}})
def prometheus_metrics(request: Request, r: RedisDep, credentials: BearerDep) -> Response:
    if not from_loopback(request):
        check_token(None if credentials is None else credentials.credentials)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RedisCollector(r))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
