"""rq-dashboard (`mtq dashboard`) on the stack's Redis: queues, workers, and a running job whose
rq meta holds its training progress, read through rq-dashboard's own JSON endpoints."""

import base64
import json
import subprocess
import sys

import httpx

from conftest import ARTIFACTS, ROOT, TOKEN, free_port, wait_for

AUTH = {"Authorization": "Basic " + base64.b64encode(f"mtq:{TOKEN}".encode()).decode()}  # on loopback too


def test_dashboard_shows_queue_workers_and_a_running_jobs_progress(stack, workers, tmp_path):
    port = free_port()
    dash = stack.spawn("dashboard", "dashboard", "--port", str(port))
    base = f"http://127.0.0.1:{port}/0/data"
    wait_for(lambda: _get(f"{base}/queues.json"), 60, "rq-dashboard")
    worker = workers()
    job_id = stack.submit({"model_id": stack.tiny_model.name, "prompts": ["What is 2+2?", "Say hello."],
                           "config": {"iters": 100_000, "group_size": 2, "batch_size": 2, "max_completion_len": 16}})
    wait_for(lambda: (stack.get_job(job_id)["progress"].get("iter") or 0) >= 2, 120, "a few steps")
    queue = stack.rq_queue(job_id).name  # routed by model and memory (shared/routing.py)
    assert queue == f"default@{stack.tiny_model.name}@1gb"

    def meta():
        listed = _get(f"{base}/jobs/{queue}/started/10/asc/1.json")
        ids = [j["id"] for j in (listed or {}).get("jobs", []) if job_id in j["id"]]
        info = ids and _get(f"{base}/job/{ids[0]}.json")
        m = json.loads(info["metadata"]) if info else {}
        return m.get("mtq_job_id") == job_id and m.get("reward") is not None and (info, m)

    info, m = wait_for(meta, 60, "the job's progress in its rq meta")
    step, total = m["step"].split("/")
    assert int(step) >= 1 and total == "100000" and m["phase"] in ("sampling", "scoring", "updating", "checkpointing")
    assert stack.tiny_model.name in info["description"] and job_id in info["description"]
    queues = {q["name"]: q for q in _get(f"{base}/queues.json")["queues"]}
    assert queue in queues
    [shown] = _get(f"{base}/workers.json")["workers"]
    assert queue in shown["queues"]  # the queues it listens to name the models it can load

    # As a person sees it: rq-dashboard's job page in headless Chromium shows the progress.
    from browser import Browser

    browser = Browser(tmp_path / "chromium")
    try:
        browser.send("Network.enable")
        browser.send("Network.setExtraHTTPHeaders", headers=AUTH)
        browser.goto(f"http://127.0.0.1:{port}/0/view/job/{info['id']}")
        browser.wait("document.getElementById('job-data').textContent.includes('mtq_job_id')")
        shown = browser.eval("document.getElementById('job-data').textContent")
        assert job_id in shown and '"step"' in shown and '"reward"' in shown, shown
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        browser.screenshot(ARTIFACTS / "rq-dashboard-running-job.png")
    finally:
        browser.close()
    with stack.client() as c:
        c.post(f"/admin/api/fine-tune/grpo/jobs/{job_id}/cancel")
    stack.stop_proc(dash)
    assert worker.poll() is None


def test_dashboard_refuses_to_start_without_a_token(stack):
    env = dict(stack.env, MTQ_API_TOKEN="", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "cli.main", "dashboard", "--port", str(free_port())],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "MTQ_API_TOKEN" in proc.stdout


def _get(url):
    try:
        resp = httpx.get(url, headers=AUTH, timeout=5)
        return resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def test_print_service_gives_a_systemd_unit_and_a_launchd_plist(stack):
    import configparser
    import plistlib

    env = dict(stack.env, PYTHONPATH=str(ROOT))
    out = {kind: subprocess.run([sys.executable, "-m", "cli.main", "worker", "--print-service", kind, "--name", "mac-2"],
                                cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
           for kind in ("systemd", "launchd")}
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read_string(out["systemd"])
    assert unit["Service"]["Restart"] == "always" and "cli.main worker" in unit["Service"]["ExecStart"]
    assert "--name mac-2" in unit["Service"]["ExecStart"]
    assert f"REDIS_URL={stack.env['REDIS_URL']}" in out["systemd"]
    plist = plistlib.loads(out["launchd"].encode())
    assert plist["KeepAlive"] is True and plist["ProgramArguments"][-2:] == ["--name", "mac-2"]
    assert plist["EnvironmentVariables"]["REDIS_URL"] == stack.env["REDIS_URL"]
