"""The web page at /ui in headless Chromium, against a real stack: log in with the token,
list jobs, open a running job, read its curves from the DOM (one point per step), cancel and
resume it with the page's buttons; jobs of the other kinds listed with their kind and drawn
with their kind's curves. Screenshots go to test-artifacts/ (TEST_ARTIFACTS_DIR)."""

import json

import httpx
import pytest

from browser import Browser
from conftest import ARTIFACTS, TOKEN, wait_for
from reward_server import serving, slow_rewards

JOBS = "/admin/api/fine-tune/grpo/jobs"
CONFIG = {"iters": 200, "group_size": 2, "batch_size": 1, "max_completion_len": 8, "lora_layers": 2, "lora_rank": 4,
          "lora_alpha": 8.0}


@pytest.fixture
def browser(tmp_path):
    b = Browser(tmp_path / "chromium")
    yield b
    b.close()


def text(browser: Browser, element_id: str) -> str:
    return browser.eval(f"document.getElementById({json.dumps(element_id)}).textContent")


def test_page_logs_in_lists_jobs_draws_live_curves_and_cancels(stack, worker, browser):
    api = stack.client()
    with serving(slow_rewards(0.2)) as server:  # a few steps a second: still running while the page is read
        job_id = api.post(JOBS, json={"model_id": stack.tiny_model.name, "prompts": ["What is 2+2?", "Say hello."],
                                      "config": CONFIG, "reward": [{"type": "endpoint", "url": server.url}]}).json()["job_id"]

        # Login: a wrong token is refused; the right one is kept in the tab's session storage.
        browser.goto(stack.base_url + "/ui")
        browser.wait("!document.getElementById('login').hidden")
        browser.eval("document.getElementById('token').value = 'wrong'; "
                     "document.getElementById('login-form').requestSubmit()")
        browser.wait("document.getElementById('login-error').textContent.includes('refused')")
        browser.eval(f"document.getElementById('token').value = {json.dumps(TOKEN)}; "
                     "document.getElementById('login-form').requestSubmit()")
        row = f"document.querySelector('tr[data-job-id=\"{job_id}\"]')"
        browser.wait(f"{row} && {row}.classList.contains('status-running')")
        assert browser.eval("sessionStorage.getItem('mtq-token')") == TOKEN
        assert "GET /admin/api/jobs?limit=100&view=summary" in stack.logs("api")  # no prompts every 2 s
        browser.goto(stack.base_url + "/ui")  # a reload stays logged in
        browser.wait(f"{row} !== null")

        # The running job's page: its curves grow with the steps, one point per step.
        browser.eval(f"{row}.querySelector('a').click()")
        browser.wait(f"document.getElementById('job-id').textContent === '{job_id}'")
        points = "Number(document.querySelector('.chart[data-metric=\"reward\"]').dataset.points)"

        def caught_up():
            before = api.get(f"{JOBS}/{job_id}").json()["progress"].get("iter", 0)
            shown = browser.eval(points)
            return before >= 3 and shown == before == api.get(f"{JOBS}/{job_id}").json()["progress"].get("iter", 0)

        wait_for(caught_up, 60, "the page's reward curve to show every step", interval=0.05)
        charts = browser.eval("[...document.querySelectorAll('.chart:not([hidden])')].map(c => c.dataset.metric)")
        assert {"reward", "loss", "entropy", "completion length", "learning rate", "rewards by source"} <= set(charts)
        assert browser.eval("document.querySelectorAll('.chart:not([hidden]) canvas').length") == len(charts)
        browser.wait("document.querySelectorAll('#samples table.samples tr').length > 0")  # completions with rewards
        assert json.loads(text(browser, "job-config"))["config"]["iters"] == CONFIG["iters"]
        assert text(browser, "job-status") == "running"
        browser.screenshot(ARTIFACTS / "ui-running-job.png")

        # Cancel with the page's button: the job ends cancelled, and the curve keeps every step it ran.
        browser.eval("document.getElementById('cancel').click()")
        browser.wait("document.getElementById('job-status').textContent === 'cancelled'", timeout=60)
        job = api.get(f"{JOBS}/{job_id}").json()
        assert job["status"] == "cancelled"
        steps = [e for e in stack_events(stack, job_id) if e["type"] == "grpo_step"]
        browser.wait(f"{points} === {len(steps)}")
        assert len(steps) == job["progress"]["iter"]
        assert browser.eval("document.getElementById('resume').disabled") is False

        # Resume with the page's button: queued (or running) again.
        browser.eval("document.getElementById('resume').click()")
        wait_for(lambda: api.get(f"{JOBS}/{job_id}").json()["status"] in ("queued", "running"), 30, "resumed")
        browser.wait("['queued', 'running'].includes(document.getElementById('job-status').textContent)")
        browser.screenshot(ARTIFACTS / "ui-resumed-job.png")
        api.post(f"{JOBS}/{job_id}/cancel")
        stack.wait_job(job_id)
    api.close()


def test_page_lists_every_kind_and_draws_each_kind_s_curves(stack, worker, browser):
    """An SFT job (validated: its val_loss is drawn beside the loss, from the eval events) and a
    DPO job, finished: listed with their kind and headline metric; each job page draws the
    curves of its kind (shared/kinds.py, read through GET /admin/api/kinds), a point per step."""
    from shared.kinds import KINDS

    rows = [{"prompt": "Q0?", "completion": "red apple"}, {"prompt": "Q1?", "completion": "blue river"}]
    small = {"iters": 3, "batch_size": 2, "lora_layers": 2, "lora_rank": 4, "steps_per_report": 1}
    with stack.client() as api:
        sft = api.post(KINDS["sft"].prefix, json={"model_id": "tiny", "dataset": rows, "valid_dataset": rows,
                                                  "config": small}).json()["job_id"]
        dpo = api.post(KINDS["dpo"].prefix, json={"model_id": "tiny", "config": small, "preference_pairs": [
            {"prompt": "Sky?", "chosen": "blue", "rejected": "green"}, {"prompt": "Grass?", "chosen": "green", "rejected": "red"}],
        }).json()["job_id"]
        for job_id, kind in ((sft, "sft"), (dpo, "dpo")):
            wait_for(lambda: api.get(f"{KINDS[kind].prefix}/{job_id}").json()["status"] == "completed", 120, kind)

    browser.goto(stack.base_url + "/ui")
    browser.eval(f"sessionStorage.setItem('mtq-token', {json.dumps(TOKEN)})")
    browser.goto(stack.base_url + "/ui")
    for job_id, kind in ((sft, "sft"), (dpo, "dpo")):
        row = f"document.querySelector('tr[data-job-id=\"{job_id}\"]')"
        browser.wait(f"{row} && {row}.classList.contains('status-completed')")
        cells = browser.eval(f"[...{row}.querySelectorAll('td')].map(td => td.textContent)")
        assert cells[1] == kind and cells[5] == "3/3" and cells[6].startswith("loss "), cells

    for job_id, kind, points in ((sft, "sft", 4), (dpo, "dpo", 3)):  # SFT: an evaluation before the first step too
        browser.eval(f"location.hash = '#/job/{job_id}'")
        browser.wait(f"document.getElementById('job-kind').textContent === '{kind}'")
        loss = "document.querySelector('.chart[data-metric=\"loss\"]')"
        browser.wait(f"{loss} && {loss}.dataset.points === '{points}'")
        browser.wait("[...document.querySelectorAll('.chart')].every(c => c.hidden || c.querySelector('canvas'))")
        shown = browser.eval("[...document.querySelectorAll('.chart:not([hidden])')].map(c => c.dataset.metric)")
        assert shown == [c.title for c in KINDS[kind].charts], shown
        assert browser.eval(f"{loss}.dataset.series") == ("loss val_loss" if kind == "sft" else "loss")
        assert browser.eval("document.getElementById('samples-box').hidden") is True  # GRPO's completions only
        browser.screenshot(ARTIFACTS / f"ui-{kind}-job.png")


def test_page_shows_a_multi_turn_job_s_conversations_as_text(stack, browser):
    """A samples event with `conversations` (a multi-turn GRPO job's episodes): each shown
    completion's messages in order, each with its role, styled by role, their contents as text
    (HTML in them is not markup), a long one scrolling; a samples event without them as before.
    The episode metrics of the step events are drawn. The events are written into the stream of
    a job no worker takes (a lane none serves), as the worker writes them (shared/events.py)."""
    from shared import lifecycle
    from shared.events import append_event

    with stack.client() as api:
        job_id = api.post(JOBS, json={"model_id": stack.tiny_model.name, "prompts": ["Find the answer."],
                                      "config": {**CONFIG, "iters": 3, "queue": "ui-only"},
                                      "reward": [{"type": "length"}]}).json()["job_id"]
    hostile = '<img src=x onerror="window.injected = 1"><b>bold</b> & <script>window.injected = 2</script>'
    long = "\n".join(f"line {i}" for i in range(200))
    episode = [{"role": "assistant", "content": 'search("answer")'}, {"role": "tool", "content": hostile},
               {"role": "user", "content": long}, {"role": "assistant", "content": "The answer is 4."}]
    short = [{"role": "assistant", "content": "4"}]
    append_event(stack.redis, job_id, {"type": "samples", "iter": 0, "prompt_indices": [0],
                                       "completions": [["plain <i>text</i>", "two"]], "rewards": [[0.5, None]]})

    browser.goto(stack.base_url + "/ui")
    browser.eval(f"sessionStorage.setItem('mtq-token', {json.dumps(TOKEN)})")
    browser.goto(f"{stack.base_url}/ui#/job/{job_id}")
    browser.wait("document.getElementById('samples').textContent.startsWith('step 0')")
    rows = "[...document.querySelectorAll('#samples table.samples tr')]"
    # Without conversations: as before, a reward and the completion's text per row.
    assert browser.eval(f"{rows}.map(r => [...r.querySelectorAll('td')].map(td => td.textContent))") == [
        ["0.5", "plain <i>text</i>"], ["", "two"]]
    assert browser.eval("document.querySelectorAll('#samples .conversation, #samples i').length") == 0

    append_event(stack.redis, job_id, {"type": "grpo_step", "iter": 1, "total_iters": 3, "reward": 0.5, "loss": 0.1,
                                       "turns/mean": 2.5, "tool_calls/mean": 1.5, "tool_errors/mean": 0.5,
                                       "env_reward": 0.25})
    append_event(stack.redis, job_id, {"type": "samples", "iter": 1, "prompt_indices": [0],
                                       "completions": [["The answer is 4.", "4"]], "rewards": [[1.0, 0.0]],
                                       "conversations": [[episode, short]]})
    browser.wait("document.getElementById('samples').textContent.startsWith('step 1')")
    messages = (f"{rows}.map(r => [...r.querySelectorAll('.conversation > .message')].map(m => "
                "[m.dataset.role, m.querySelector('.role').textContent, m.querySelector('pre.content').textContent]))")
    assert browser.eval(messages) == [[[m["role"], m["role"], m["content"]] for m in episode],
                                      [["assistant", "assistant", "4"]]]
    assert browser.eval(f"{rows}.map(r => r.querySelector('td').textContent)") == ["1", "0"]
    # The tool's HTML is text: no element made of it, nothing of it ran.
    assert browser.eval("document.querySelectorAll('#samples img, #samples b, #samples script').length") == 0
    assert browser.eval("window.injected === undefined") is True
    # Each role its own look; the long observation scrolls in its box.
    looks = browser.eval("Object.fromEntries([...document.querySelectorAll('#samples .message')].map(m => "
                         "[m.dataset.role, getComputedStyle(m).backgroundColor + getComputedStyle(m).borderLeftColor]))")
    assert len(set(looks.values())) == 3, looks
    user = "document.querySelector('#samples .message[data-role=\"user\"] pre.content')"
    assert browser.eval(f"{user}.scrollHeight > {user}.clientHeight && getComputedStyle({user}).overflowY") == "auto"
    # The step's episode metrics, drawn.
    for title, series in (("turns and tool calls", "turns/mean tool_calls/mean tool_errors/mean"),
                          ("environment reward", "env_reward")):
        chart = f"document.querySelector('.chart[data-metric=\"{title}\"]')"
        browser.wait(f"{chart} && !{chart}.hidden && {chart}.dataset.points === '1' "
                     f"&& {chart}.querySelector('canvas') !== null")
        assert browser.eval(f"{chart}.dataset.series") == series
    browser.eval("document.getElementById('samples-box').scrollIntoView()")
    browser.screenshot(ARTIFACTS / "ui-multi-turn-samples.png")
    assert stack.get_job(job_id)["status"] == "queued"  # nothing but the events above wrote to it
    lifecycle.cancel(stack.redis, job_id)


def stack_events(stack, job_id: str) -> list[dict]:
    from conftest import read_events

    return [e for _, e in read_events(stack.redis, job_id)]


def test_static_files_are_only_the_listed_ones(stack):
    assert httpx.get(stack.base_url + "/ui").headers["content-type"].startswith("text/html")
    assert httpx.get(stack.base_url + "/ui/uPlot.iife.min.js").status_code == 200
    for name in ("../main.py", "..%2Fmain.py", "vendor", "routes"):
        assert httpx.get(stack.base_url + "/ui/" + name).status_code == 404
