"""The OpenAI-compatible fine-tuning API (/v1), driven by the official `openai` SDK against the
real stack: files, jobs of each method (supervised, dpo, reinforcement with graders), paging,
events, checkpoints, pause and resume, cancel, the error classes, and graders/run."""

import json
import subprocess
import sys

import openai
import pytest

from conftest import ROOT, TOKEN, Stack, running, wait_for

TERMINAL = ("succeeded", "failed", "cancelled")
SFT_ROWS = [{"messages": [{"role": "user", "content": f"Colour {i}?"}, {"role": "assistant", "content": "red"}]}
            for i in range(4)]
DPO_ROWS = [{"input": {"messages": [{"role": "user", "content": f"Sky {i}?"}]},
             "preferred_output": [{"role": "assistant", "content": "blue"}],
             "non_preferred_output": [{"role": "assistant", "content": "green"}]} for i in range(4)]
RFT_ROWS = [{"messages": [{"role": "user", "content": f"Say something {i}"}], "target": "y"} for i in range(4)]


def jsonl(rows: list[dict]) -> bytes:
    return "\n".join(json.dumps(r) for r in rows).encode() + b"\n"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    s = Stack(tmp_path_factory.mktemp("openai"), tiny_model)
    s.env.update(MTQ_PYTHON_GRADERS="1", MTQ_PYTHON_GRADER_TIMEOUT_S="2")
    s.use_tokens([{"name": "reader", "token": "reader-token-0123456789", "role": "viewer"},
                  {"name": "team-b", "token": "team-b-token-0123456789", "role": "trainer"}])
    yield from running(s)


def sdk(stack, strict: bool = True, key: str = TOKEN) -> openai.OpenAI:
    # strict: every answer must parse as the SDK's own types; `paused` is not among its statuses.
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=key, max_retries=0,
                         _strict_response_validation=strict)


def upload(client, rows, name="train.jsonl"):
    return client.files.create(file=(name, jsonl(rows)), purpose="fine-tune")


def wait(client, job_id: str, statuses=TERMINAL, timeout: float = 300):
    return wait_for(lambda: (j := client.fine_tuning.jobs.retrieve(job_id)).status in statuses and j, timeout,
                    f"job {job_id} to reach {statuses}", interval=0.3)


def test_files_and_errors(stack):
    client = sdk(stack)
    ids = [upload(client, rows, f"{i}.jsonl").id for i, rows in enumerate((SFT_ROWS, DPO_ROWS, RFT_ROWS))]
    f = client.files.retrieve(ids[1])
    assert (f.object, f.purpose, f.status, f.filename, f.bytes) == ("file", "fine-tune", "processed", "1.jsonl",
                                                                    len(jsonl(DPO_ROWS)))
    assert isinstance(f.created_at, int) and f.expires_at > f.created_at
    assert client.files.content(ids[0]).read() == jsonl(SFT_ROWS)
    # limit=1, page after page to the end: every file once, newest first
    assert [x.id for x in client.files.list(limit=1)] == ids[::-1]
    page = client.files.list(limit=2)
    assert page.has_more and len(page.data) == 2
    # a 400 names the first bad line and the parameter
    bad = jsonl(SFT_ROWS[:2]) + b'{"messages": [{"role": "robot", "content": "x"}]}\n'
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("bad.jsonl", bad), purpose="fine-tune")
    assert "line 3" in e.value.message and e.value.param == "file" and e.value.code == "invalid_file_format"
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("x.jsonl", jsonl(SFT_ROWS)), purpose="batch")
    assert e.value.param == "purpose"
    mixed = jsonl(SFT_ROWS[:1] + DPO_ROWS[:1])
    with pytest.raises(openai.BadRequestError, match="line 2"):
        client.files.create(file=("mixed.jsonl", mixed), purpose="fine-tune")
    deleted = client.files.delete(ids[2])
    assert (deleted.id, deleted.deleted, deleted.object) == (ids[2], True, "file")
    with pytest.raises(openai.NotFoundError) as e:
        client.files.retrieve(ids[2])
    assert e.value.body["code"] == "not_found"
    with pytest.raises(openai.AuthenticationError):
        sdk(stack, key="wrong").files.list()
    with pytest.raises(openai.PermissionDeniedError):  # a viewer token reads only
        upload(sdk(stack, key="reader-token-0123456789"), SFT_ROWS)
    other = sdk(stack, key="team-b-token-0123456789")  # a trainer token sees its own files only
    theirs = upload(other, SFT_ROWS).id
    assert [f.id for f in other.files.list()] == [theirs]
    with pytest.raises(openai.NotFoundError):
        other.files.retrieve(ids[0])
    with pytest.raises(openai.BadRequestError, match="not found"):
        other.fine_tuning.jobs.create(model="tiny", training_file=ids[0])
    other.files.delete(theirs)
    with pytest.raises(openai.NotFoundError):
        client.fine_tuning.jobs.retrieve("ftjob-nope")
    with pytest.raises(openai.BadRequestError) as e:  # a file of the wrong format for the method
        client.fine_tuning.jobs.create(model="tiny", training_file=ids[1], method={"type": "supervised"})
    assert e.value.param == "training_file"
    # OpenAI's wandb integration: the job reports to wandb (docs/trackers.md), in that project
    job = client.fine_tuning.jobs.create(model="tiny", training_file=ids[0], integrations=[
        {"type": "wandb", "wandb": {"project": "colours", "name": "run-1"}}])
    assert job.integrations[0].wandb.project == "colours"
    spec = json.loads(stack.redis.hget(f"mtq:job:{job.id.removeprefix('ftjob-')}", "spec"))
    assert {k: spec["config"][k] for k in ("report_to", "run_name", "wandb_project")} == {
        "report_to": ["wandb"], "run_name": "run-1", "wandb_project": "colours"}
    client.fine_tuning.jobs.cancel(job.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.fine_tuning.jobs.create(model="tiny", training_file=ids[0], integrations=[
            {"type": "neptune", "neptune": {"project": "p"}}])
    assert "integrations" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.fine_tuning.jobs.create(model="tiny", training_file=ids[0], method={
            "type": "reinforcement", "reinforcement": {"grader": {"type": "text_similarity", "name": "s", "input": "a",
                                                                  "reference": "b", "evaluation_metric": "cosine"}}})
    assert "cosine" in e.value.message and e.value.param.startswith("method.reinforcement.grader")


def test_supervised_files_take_weight_0_on_assistant_messages_only(stack):
    """An assistant message's weight 0 or 1 is accepted and reaches the job's SFT rows (whose loss
    then leaves weight-0 messages out: tests/test_supervised_trainer.py); weight on another message
    is a 400 naming the line, and a row of only weight-0 assistant messages, which would train
    nothing, is refused when the job is created. Tool calls and results are taken as the SFT
    routes' rows take them (a malformed call is a 400 naming the line), not in reinforcement prompts."""
    client = sdk(stack)
    rows = [{"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": f"Colour {i}?"},
                          {"role": "assistant", "content": "blue", "weight": 0}, {"role": "user", "content": "Again?"},
                          {"role": "assistant", "content": "red", "weight": 1}]} for i in range(2)]
    job = client.fine_tuning.jobs.create(model="tiny", training_file=upload(client, rows).id)
    spec = json.loads(stack.redis.hget(f"mtq:job:{job.id.removeprefix('ftjob-')}", "spec"))
    assert spec["dataset"] == [{"messages": [{"role": "system", "content": "Be brief."}, *r["messages"][1:]]} for r in rows]
    client.fine_tuning.jobs.cancel(job.id)
    on_user = [rows[0], {"messages": [{"role": "user", "content": "Hi", "weight": 0}, {"role": "assistant", "content": "x"}]}]
    with pytest.raises(openai.BadRequestError) as e:
        upload(client, on_user)
    assert "line 2: 'messages[0].weight' must be 0 or 1, on an assistant message" in e.value.message and e.value.param == "file"
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "sky"}'}}
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
    calling = [{"messages": [{"role": "user", "content": "Sky?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": "call_1", "content": "blue"},
                             {"role": "assistant", "content": "blue", "weight": 1}], "tools": tools}]
    job = client.fine_tuning.jobs.create(model="tiny", training_file=upload(client, calling).id)
    assert json.loads(stack.redis.hget(f"mtq:job:{job.id.removeprefix('ftjob-')}", "spec"))["dataset"] == calling
    client.fine_tuning.jobs.cancel(job.id)
    with pytest.raises(openai.BadRequestError) as e:  # a tool call in a reinforcement prompt
        client.fine_tuning.jobs.create(model="tiny", training_file=upload(client, calling).id, method={
            "type": "reinforcement", "reinforcement": {"grader": {"type": "string_check", "name": "s", "input": "a",
                                                                  "reference": "a", "operation": "eq"}}})
    assert "without tool calls" in e.value.message and e.value.param == "training_file"
    bad = {**call, "function": {"name": "lookup", "arguments": "{not json"}}
    with pytest.raises(openai.BadRequestError, match=r"line 1: 'messages\[1\].tool_calls\[0\].function.arguments' is a string but not JSON"):
        upload(client, [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [bad]}]}])
    nothing = upload(client, [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x", "weight": 0}]}])
    with pytest.raises(openai.BadRequestError) as e:
        client.fine_tuning.jobs.create(model="tiny", training_file=nothing.id)
    assert "no assistant message of weight 1" in e.value.message and e.value.param == "training_file"


def test_supervised_and_dpo_jobs(stack, worker, tmp_path):
    client = sdk(stack)
    sft_file, dpo_file = upload(client, SFT_ROWS).id, upload(client, DPO_ROWS).id
    # The deprecated top-level hyperparameters mean supervised.
    sft = client.fine_tuning.jobs.create(model="tiny", training_file=sft_file, validation_file=sft_file, suffix="colours", seed=7,
                                         hyperparameters={"n_epochs": 2, "batch_size": 2}, metadata={"team": "a"})
    dpo = client.fine_tuning.jobs.create(model="tiny", training_file=dpo_file, metadata={"team": "b"}, method={
        "type": "dpo", "dpo": {"hyperparameters": {"beta": 0.2, "n_epochs": 1}}})
    assert sft.status == "queued" and sft.method.type == "supervised" and sft.seed == 7
    assert sft.hyperparameters.n_epochs == 2 and sft.hyperparameters.learning_rate_multiplier == 1.0
    assert dpo.method.dpo.hyperparameters.beta == 0.2 and dpo.method.dpo.hyperparameters.batch_size == 4
    sft, dpo = wait(client, sft.id), wait(client, dpo.id)
    assert (sft.status, dpo.status) == ("succeeded", "succeeded"), (sft.error, dpo.error)
    assert sft.fine_tuned_model == f"ft:tiny:org-admin:colours:{sft.id.removeprefix('ftjob-')}"
    assert isinstance(sft.finished_at, int) and sft.trained_tokens > 0 and sft.error is None
    # list: limit=1 page by page, newest first; metadata filters
    assert [j.id for j in client.fine_tuning.jobs.list(limit=1)][:2] == [dpo.id, sft.id]
    assert [j.id for j in client.fine_tuning.jobs.list(metadata={"team": "a"})] == [sft.id]
    # events: newest first, `after` exclusive
    events = client.fine_tuning.jobs.list_events(sft.id, limit=100).data
    assert events[0].message.startswith("The job has successfully completed")
    assert [e.created_at for e in events] == sorted((e.created_at for e in events), reverse=True)
    metrics = [e for e in events if e.type == "metrics"]
    assert [e.data["step"] for e in metrics] == [4, 3, 2, 1] and all("train_loss" in e.data for e in metrics)
    # validation_file: an evaluation after the first step and every epoch (2 steps), as OpenAI names it
    assert [e.data["step"] for e in metrics if "valid_loss" in e.data] == [4, 2, 1]
    second = client.fine_tuning.jobs.list_events(sft.id, after=events[0].id, limit=1)
    assert second.data[0].id == events[1].id and second.has_more
    with pytest.raises(openai.BadRequestError) as e:
        client.fine_tuning.jobs.list_events(sft.id, after="ftevent-x")
    assert e.value.param == "after"
    # checkpoints: one per epoch (steps 2 and 4), newest first, with the step's metrics
    ckpts = client.fine_tuning.jobs.checkpoints.list(sft.id).data
    assert [c.step_number for c in ckpts] == [4, 2]
    assert ckpts[0].metrics.train_loss is not None and ckpts[1].metrics.valid_loss is not None
    assert ckpts[0].fine_tuned_model_checkpoint.startswith(sft.fine_tuned_model)
    # result_files: the metrics CSV
    results = client.files.retrieve(sft.result_files[0])
    assert results.purpose == "fine-tune-results"
    csv = client.files.content(results.id).read().decode().splitlines()
    assert csv[0].startswith("step,train_loss") and len(csv) == 5
    # the fine-tuned model's name is what `mtq download` takes
    for job in (sft, dpo):
        name = job.fine_tuned_model
        out = tmp_path / name.rsplit(":", 1)[-1]
        done = subprocess.run([sys.executable, "-m", "cli.main", "download", name, str(out)], cwd=ROOT, env=stack.env,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert (out / "adapters.safetensors").stat().st_size > 0
    # ... and the log-prob route: the same scores as with its base model and adapter named
    with stack.client() as c:
        by_name = c.post("/admin/api/fine-tune/logprob", json={"model_id": sft.fine_tuned_model, "prompt": "Colour?",
                                                                "completion": "red"})
        assert by_name.status_code == 200, by_name.text
        adapter = by_name.json()["adapter_name"]
        direct = c.post("/admin/api/fine-tune/logprob", json={"model_id": "tiny", "adapter_name": adapter,
                                                               "prompt": "Colour?", "completion": "red"}).json()
        assert adapter.startswith("colours-") and by_name.json()["logprob"] == direct["logprob"]
        archive = c.get(f"/admin/api/fine-tune/adapters/{sft.fine_tuned_model}/download")  # ... and the adapter routes
        assert archive.status_code == 200 and archive.headers["content-type"] == "application/gzip"
        assert c.get(f"/admin/api/fine-tune/adapters/{sft.fine_tuned_model}x/download").status_code == 404
        wrong = c.post("/admin/api/fine-tune/logprob", json={"model_id": sft.fine_tuned_model.replace("colours", "x"),
                                                              "prompt": "Colour?", "completion": "red"})
        assert wrong.status_code == 404
    with pytest.raises(openai.ConflictError) as e:  # a succeeded job cannot be cancelled; the SDK does not retry
        client.fine_tuning.jobs.cancel(sft.id)
    assert e.value.response.headers["x-should-retry"] == "false"
    # A record this version cannot read (another version's, say) is a 409; it does not break the list.
    stack.redis.hset(f"mtq:job:{dpo.id.removeprefix('ftjob-')}", "spec", "{}")
    with pytest.raises(openai.ConflictError, match="cannot be loaded"):
        client.fine_tuning.jobs.retrieve(dpo.id)
    assert sft.id in [j.id for j in client.fine_tuning.jobs.list()]


def test_pause_resume_continues_from_checkpoint(stack, worker):
    client, loose = sdk(stack), sdk(stack, strict=False)
    file_id = upload(client, SFT_ROWS).id
    job = client.fine_tuning.jobs.create(model="tiny", training_file=file_id, method={
        "type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 25, "batch_size": 1}}})
    # A checkpoint per epoch of 4 steps: the pause below comes while most of the 100 steps are to run
    # (12 one-step epochs once finished between the first checkpoint and the pause).
    wait_for(lambda: client.fine_tuning.jobs.checkpoints.list(job.id).data, 240, "a first checkpoint", interval=0.2)
    paused = loose.fine_tuning.jobs.pause(job.id)
    assert paused.status == "paused"
    with pytest.raises(openai.APIResponseValidationError):  # the SDK's status literal has no `paused`
        client.fine_tuning.jobs.retrieve(job.id)
    resumed = client.fine_tuning.jobs.resume(job.id)
    assert resumed.status == "queued"
    done = wait(client, job.id)
    assert done.status == "succeeded", done.error
    resumes = [e for e in client.fine_tuning.jobs.list_events(job.id, limit=1000).data if e.data.get("from_step")]
    assert resumes and resumes[0].data["from_step"] >= 1
    cancelled = client.fine_tuning.jobs.create(model="tiny", training_file=file_id)
    assert client.fine_tuning.jobs.cancel(cancelled.id).status == "cancelled"
    # An OpenAI model name that no worker has waits, as any job does, and says so.
    waiting = client.fine_tuning.jobs.create(model="gpt-4o-mini", training_file=file_id)
    event = client.fine_tuning.jobs.list_events(waiting.id).data[0]
    assert waiting.status == "queued" and event.level == "warn" and "gpt-4o-mini" in event.message
    assert client.fine_tuning.jobs.cancel(waiting.id).status == "cancelled"


# Of the tiny model's 16-token completions at temperature 0.1, about one in six holds a "y".
ILIKE_Y = {"type": "string_check", "name": "has y", "operation": "ilike", "input": "{{ sample.output_text }}",
           "reference": "{{ item.target }}"}


VALID_ROWS = [{"messages": [{"role": "user", "content": f"Write a word {i}"}], "target": "y"} for i in range(3)]


def test_reinforcement_with_string_check_beats_lr0_control(stack, worker):
    """... on its training rows and on a validation file's (OpenAI's valid_reward_mean and
    full_valid_mean_reward, every eval_interval steps); the lr-0 control's evaluations are all
    the same (the same weights, and an evaluation's own random key)."""
    client = sdk(stack)
    file_id, valid_id = upload(client, RFT_ROWS).id, upload(client, VALID_ROWS, "valid.jsonl").id

    def job(multiplier: float):
        return client.fine_tuning.jobs.create(model="tiny", training_file=file_id, validation_file=valid_id, seed=3, method={
            "type": "reinforcement", "reinforcement": {"grader": ILIKE_Y, "hyperparameters": {
                "n_epochs": 6, "batch_size": 4, "learning_rate_multiplier": multiplier, "compute_multiplier": 2,
                "eval_interval": 2, "eval_samples": 2,
                "max_completion_tokens": 16, "temperature": 0.1}}})  # the last two: local extensions

    learned, control = job(5000.0), job(0.0)
    # The SDK's MultiGrader types `graders` as one grader; OpenAI's docs (and this API) take
    # name -> grader, so the job echoes a method the strict types refuse.
    loose = sdk(stack, strict=False)
    multi = loose.fine_tuning.jobs.create(model="tiny", training_file=file_id, method={
        "type": "reinforcement", "reinforcement": {"grader": {
            "type": "multi", "name": "m", "calculate_output": "0.5 * a + 0.5 * p",  # p: 1, when the sandbox runs it
            "graders": {"a": ILIKE_Y, "p": {"type": "python", "name": "p", "source": "def grade(s, i):\n    return 1.0"}}},
            "hyperparameters": {"n_epochs": 1, "batch_size": 4, "max_completion_tokens": 8}}})
    rewards, valid = {}, {}
    for j in (learned, control, multi):
        done = wait(loose, j.id)
        assert done.status == "succeeded", done.error
        events = loose.fine_tuning.jobs.list_events(j.id, limit=1000).data
        steps = sorted((e.data for e in events if e.type == "metrics"), key=lambda s: s["step"])
        rewards[j.id] = [s["reward"] for s in steps]
        assert all(s["train_mean_reward"] == s["scores"]["train_reward_mean"] == s["reward"] for s in steps)
        # The evaluation before the first step is an `eval` message event; the others are in their steps' metrics.
        valid[j.id] = {e.data["iter"]: e.data["val_reward"] for e in events if e.message == "eval" and e.data["iter"] == 0}
        valid[j.id].update({s["step"]: s["full_valid_mean_reward"] for s in steps if "full_valid_mean_reward" in s})
        assert all(s["scores"]["valid_reward_mean"] == valid[j.id].get(s["step"]) for s in steps)
    mean = lambda r: sum(r) / len(r)  # noqa: E731
    for name, j in (("learned", learned), ("lr-0 control", control)):
        print(f"\nreward per step, {name}: " + " ".join(f"{r:.3f}" for r in rewards[j.id]) + f" (mean {mean(rewards[j.id]):.3f})"
              f"; validation reward by step: {valid[j.id]}")
    assert rewards[learned.id][0] == rewards[control.id][0]  # the same first step: same seed, same model
    assert mean(rewards[learned.id]) > mean(rewards[control.id]) + 0.2, rewards
    assert list(valid[learned.id]) == list(valid[control.id]) == [0, 1, 2, 4, 6] and valid[multi.id] == {}
    assert len(set(valid[control.id].values())) == 1 and valid[learned.id][0] == valid[control.id][0]
    assert valid[learned.id][6] > valid[control.id][6] + 0.2, valid
    assert all(0.5 <= r <= 1.0 for r in rewards[multi.id])


def run_grader(client, grader: dict, sample: str, item: dict | None = None):
    return client.fine_tuning.alpha.graders.run(grader=grader, model_sample=sample, item=item or {})


def test_graders_run(stack):
    client = sdk(stack, strict=False)
    check = {"type": "string_check", "name": "s", "input": "{{ sample.output_text }}", "reference": "{{ item.answer.text }}"}
    for operation, sample, expected in (("eq", "Paris", 1.0), ("eq", "paris", 0.0), ("ne", "paris", 1.0),
                                        ("like", "in Paris.", 1.0), ("like", "in paris.", 0.0), ("ilike", "in PARIS", 1.0)):
        got = run_grader(client, {**check, "operation": operation}, sample, {"answer": {"text": "Paris"}})
        assert got.reward == expected, (operation, sample)
    missing = run_grader(client, {**check, "operation": "eq"}, "x", {})
    assert missing.reward == 0.0 and missing.metadata.errors.invalid_variable_error
    as_json = run_grader(client, {**check, "operation": "eq", "input": "{{ sample.output_json.city }}"}, '{"city": "Paris"}',
                         {"answer": {"text": "Paris"}})
    assert as_json.reward == 1.0
    similar = {"type": "text_similarity", "name": "t", "input": "{{ sample.output_text }}", "reference": "the cat sat on the mat"}
    scores = {m: run_grader(client, {**similar, "evaluation_metric": m}, "the cat sat on the mat").reward
              for m in ("fuzzy_match", "bleu", "gleu", "rouge_1", "rouge_2", "rouge_l")}
    assert all(abs(v - 1.0) < 1e-9 for v in scores.values()), scores
    huge = run_grader(client, {**similar, "evaluation_metric": "rouge_l", "reference": "w " * 9000}, "w " * 9000)
    assert huge.reward == 0.0 and huge.metadata.errors.other_error  # bounded, not minutes of Python
    partial = {m: run_grader(client, {**similar, "evaluation_metric": m}, "the dog sat on a mat").reward
               for m in ("fuzzy_match", "gleu", "rouge_1", "rouge_l")}
    assert all(0.0 < v < 1.0 for v in partial.values()), partial
    assert abs(partial["rouge_1"] - 4 / 6) < 1e-9  # 4 of 6 unigrams shared, both ways
    for metric in ("cosine", "meteor"):
        with pytest.raises(openai.BadRequestError, match=metric):
            run_grader(client, {**similar, "evaluation_metric": metric}, "x")
    multi = {"type": "multi", "name": "m", "graders": {"a": {**check, "operation": "eq"}, "b": {**check, "operation": "ilike"}},
             "calculate_output": "2 ^ 2 * a + sqrt(b) - min(a, b) / 4"}
    got = run_grader(client, multi, "PARIS", {"answer": {"text": "Paris"}})
    assert got.reward == 1.0 and got.sub_rewards == {"a": 0.0, "b": 1.0}
    for formula in ("__import__('os')", "a.real", "a if b else 1", "[a]", "a @ b", "lambda: 1", "'x'"):
        with pytest.raises(openai.BadRequestError, match="calculate_output"):
            client.fine_tuning.alpha.graders.validate(grader={**multi, "calculate_output": formula})
    assert client.fine_tuning.alpha.graders.validate(grader=multi).grader.type == "multi"
    with pytest.raises(openai.BadRequestError, match="judge model"):
        client.fine_tuning.alpha.graders.validate(grader={"type": "label_model", "name": "l", "model": "tiny", "input": [],
                                                          "labels": ["a"], "passing_labels": ["a"]})
    with pytest.raises(openai.BadRequestError, match="model_id>/<adapter_name"):  # OpenAI's judge models: none here
        client.fine_tuning.alpha.graders.validate(grader={"type": "score_model", "name": "j", "model": "gpt-4o",
                                                          "input": []})


@pytest.mark.parametrize("source, why", [
    ("import socket\ndef grade(s, i):\n    socket.create_connection(('127.0.0.1', 1))\n    return 1.0", "socket"),
    ("def grade(s, i):\n    open('/tmp/mtq-grader-escape', 'w').write('x')\n    return 1.0", "inside its directory"),
    ("def grade(s, i):\n    while True:\n        pass", "time limit"),
    ("def grade(s, i):\n    raise ValueError('no')", "ValueError"),
    ("def grade(s, i):\n    return len(bytearray(2 << 30))", "MemoryError"),
    ("import subprocess\ndef grade(s, i):\n    return float(subprocess.run(['true']).returncode)", "not allowed"),
])
def test_python_grader_sandbox(stack, source, why):
    got = run_grader(sdk(stack, strict=False), {"type": "python", "name": "p", "source": source}, "x")
    assert got.reward == 0.0 and why in got.metadata.errors.python_grader_runtime_error_details


def test_python_grader_scores(stack):
    source = ("def grade(sample, item):\n    open('scratch.txt', 'w').write('ok')\n"
              "    return float(sample['output_text'] == item['answer'])")
    client = sdk(stack, strict=False)
    assert run_grader(client, {"type": "python", "name": "p", "source": source}, "4", {"answer": "4"}).reward == 1.0
    assert run_grader(client, {"type": "python", "name": "p", "source": source}, "5", {"answer": "4"}).reward == 0.0


def test_score_model_grader_is_a_reward_model(stack, worker):
    """A score_model grader names a reward job's adapter: graders/run asks a worker for its score,
    squashed into `range`; a reinforcement job trains on it."""
    with stack.client() as c:
        made = c.post("/admin/api/fine-tune/reward/jobs", json={"model_id": "tiny", "adapter_name": "judge", "preference_pairs": [
            {"prompt": "Q?", "chosen": "yes", "rejected": "no"}], "config": {"iters": 2, "batch_size": 1, "lora_layers": -1}})
        assert made.status_code == 200, made.text
    wait_for(lambda: stack.redis.hget(f"mtq:job:{made.json()['job_id']}", "status") == b"completed", 240, "the reward job")
    client = sdk(stack, strict=False)
    judge = {"type": "score_model", "name": "j", "model": "tiny/judge", "range": [-2, 3],
             "input": [{"role": "user", "content": "Is {{ item.q }} answered by {{ sample.output_text }}?"}]}
    a, b = (run_grader(client, judge, text, {"q": "Q?"}).reward for text in ("yes", "no"))
    assert -2 < a < 3 and -2 < b < 3 and a != b
    assert run_grader(client, judge, "yes", {"q": "Q?"}).reward == a  # the same sample, the same score
    with pytest.raises(openai.NotFoundError):
        run_grader(client, {**judge, "model": "tiny/nobody"}, "yes", {"q": "Q?"})
    file_id = upload(client, RFT_ROWS).id
    method = {"type": "reinforcement", "reinforcement": {"grader": {**judge, "input": [
        {"role": "user", "content": "{{ item.target }}"}]}, "hyperparameters": {"n_epochs": 1, "max_completion_tokens": 4}}}
    with pytest.raises(openai.BadRequestError, match="Adapter not found"):
        client.fine_tuning.jobs.create(model="tiny", training_file=file_id, method={**method, "reinforcement": {
            **method["reinforcement"], "grader": {**judge, "model": "tiny/nobody"}}})
    job = client.fine_tuning.jobs.create(model="tiny", training_file=file_id, method=method)
    done = wait(client, job.id)
    assert done.status == "succeeded", done.error
    rewards = [e.data["reward"] for e in client.fine_tuning.jobs.list_events(job.id).data if e.type == "metrics"]
    assert rewards and all(-2 < r < 3 for r in rewards)


def test_python_graders_are_off_unless_the_operator_turns_them_on(stack, tmp_path):
    """Without MTQ_PYTHON_GRADERS=1 the API refuses a python grader (graders/run, validate, a
    job), and so does a worker's scorer."""
    import httpx

    from conftest import free_port
    from shared.reward_specs import GraderReward
    from worker.rewards.batch import RewardError
    from worker.rewards.scorer import RewardScorer

    port = free_port()
    api = stack.spawn("api-off", "api", env={**stack.env, "MTQ_PYTHON_GRADERS": "0", "MTQ_API_PORT": str(port)})
    try:
        def up() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, 30, "the second API")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=TOKEN, max_retries=0)
        grader = {"type": "python", "name": "p", "source": "def grade(s, i):\n    return 1.0"}
        for call in (lambda: run_grader(client, grader, "x"),
                     lambda: client.fine_tuning.alpha.graders.validate(grader=grader),
                     lambda: client.fine_tuning.jobs.create(model="tiny", training_file=upload(client, RFT_ROWS).id, method={
                         "type": "reinforcement", "reinforcement": {"grader": grader}})):
            with pytest.raises(openai.BadRequestError, match="MTQ_PYTHON_GRADERS"):
                call()
    finally:
        stack.stop_proc(api)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MTQ_PYTHON_GRADERS", raising=False)
        with pytest.raises(RewardError, match="MTQ_PYTHON_GRADERS"):
            RewardScorer([GraderReward(grader=grader)], "job")
