"""While Redis is down the API answers 503 with a clear JSON detail (never 500), and
recovers by itself when Redis is back. (Its own module, so its own stack: it stops Redis.)"""

import httpx

JOBS = "/admin/api/fine-tune/grpo/jobs"


def test_503_while_redis_is_down_then_200_again(stack):
    with stack.client() as c:
        res = c.post(JOBS, json={"model_id": "tiny", "prompts": ["hi"]})
        assert res.status_code == 200, res.text
        job_id = res.json()["job_id"]

        stack.redis_server.stop()
        try:
            calls = [
                ("GET", f"{JOBS}/{job_id}", None),
                ("GET", JOBS, None),
                ("POST", JOBS, {"model_id": "tiny", "prompts": ["hi"]}),
                ("POST", f"{JOBS}/{job_id}/cancel", None),
                ("DELETE", f"{JOBS}/{job_id}", None),
                ("GET", f"{JOBS}/{job_id}/stream", None),
            ]
            for method, path, body in calls:
                res = c.request(method, path, json=body)
                assert res.status_code == 503, (method, path, res.text)
                assert res.json()["detail"].startswith("Redis is unavailable: "), res.text

            health = httpx.get(stack.base_url + "/healthz")
            assert health.status_code == 503
            body = health.json()
            assert body["status"] == "unavailable" and body["redis"] is False
            assert body["detail"].startswith("Redis is unavailable")
        finally:
            stack.redis_server.start()  # same port and data dir (append-only file): the job is still there

        assert httpx.get(stack.base_url + "/healthz").json() == {"status": "ok", "redis": True}
        res = c.get(f"{JOBS}/{job_id}")
        assert res.status_code == 200, res.text
        assert res.json()["status"] == "queued"
