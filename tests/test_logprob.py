"""Log-prob scoring (POST /admin/api/fine-tune/logprob) against the real stack: the answers
equal a direct mlx_lm computation (conversations' at their assistant tokens too), match the
GRPO job's own sampling log-probs, come with an adapter or without, from an idle worker or one
busy training (without disturbing it)."""


import types

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.utils import load_tokenizer

from conftest import Stack, read_events, running, wait_for
from worker.agentic.conversation import Conversation
from worker.runtime.score_requests import Refused, conversation_row

JOBS = "/admin/api/fine-tune/grpo/jobs"
LOGPROB = "/admin/api/fine-tune/logprob"
PROMPTS = ["What is 2+2?", "Say hello to the queue.", "Count to three"]
COMPLETIONS = ["4", " hello there, queue!", " one two three and more words here"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    """The API waits 3 s for an answer before saying 202 (the default is 20 s)."""
    s = Stack(tmp_path_factory.mktemp("stack"), tiny_model)
    s.env["MTQ_SCORE_WAIT_S"] = "3"
    yield from running(s)


def test_no_worker_answers_202_then_the_id_resolves(stack, request):
    with stack.client() as c:
        resp = c.post(LOGPROB, json={"model_id": stack.tiny_model.name, "prompt": "hi", "completion": " there"})
        assert resp.status_code == 202, resp.text
        request_id = resp.json()["id"]
        assert resp.headers["location"].endswith(request_id)
        assert c.get(f"{LOGPROB}/{request_id}").status_code == 202
        request.getfixturevalue("worker")  # the module's worker starts only now (and serves the later tests)
        answer = wait_for(lambda: (a := c.get(f"{LOGPROB}/{request_id}")).status_code == 200 and a, 60, "the answer")
    assert answer.json()["token_count"] >= 1 and len(answer.json()["per_token"]) == answer.json()["token_count"]
    with stack.client() as c:
        assert c.get(f"{LOGPROB}/{'0' * 32}").status_code == 404


@pytest.fixture(scope="module")
def tiny(stack):
    return mlx_lm.load(str(stack.tiny_model))


def direct(model, tokenizer, prompt_ids, completion, temperature=1.0):
    """Per-token log p(completion token | everything before it): one forward, log-softmax."""
    ids = list(tokenizer.encode(completion, add_special_tokens=False))
    logits = model(mx.array([prompt_ids + ids]))[0].astype(mx.float32) / temperature
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    start = len(prompt_ids) - 1
    return [logp[start + i, t].item() for i, t in enumerate(ids)]


def post(stack, body):
    with stack.client() as c:
        return c.post(LOGPROB, json=body)


def assert_close(answer, expected):
    assert answer["token_count"] == len(expected) == len(answer["per_token"])
    assert max(abs(a - b) for a, b in zip(answer["per_token"], expected)) < 1e-4
    assert abs(answer["logprob"] - sum(expected)) < 1e-4 * max(1, len(expected))


def test_single_and_batch_equal_a_direct_computation(stack, worker, tiny):
    model, tokenizer = tiny
    before = stack.metrics().get('mtq_score_request_seconds_count{}', 0)
    one = post(stack, {"model_id": stack.tiny_model.name, "prompt": PROMPTS[1], "completion": COMPLETIONS[1]})
    assert one.status_code == 200, one.text
    assert set(one.json()) >= {"logprob", "token_count", "per_token"}
    assert_close(one.json(), direct(model, tokenizer, list(tokenizer.encode(PROMPTS[1])), COMPLETIONS[1]))

    for temperature in (None, 2.0):
        body = {"model_id": stack.tiny_model.name, "items": [{"prompt": p, "completion": c} for p, c in zip(PROMPTS, COMPLETIONS)]}
        if temperature:
            body["temperature"] = temperature
        many = post(stack, body)
        assert many.status_code == 200, many.text
        results = many.json()["results"]
        assert len(results) == 3
        for p, c, answer in zip(PROMPTS, COMPLETIONS, results):  # padded together, each equal to its own
            assert_close(answer, direct(model, tokenizer, list(tokenizer.encode(p)), c, temperature or 1.0))
    assert stack.metrics()['mtq_score_request_seconds_count{}'] - before == 3  # /metrics counts the requests


def test_chat_prompts_are_tokenised_with_the_template_on_request(stack, worker, tiny):
    model, tokenizer = tiny
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    resp = post(stack, {"model_id": stack.tiny_model.name, "use_chat_template": True,
                        "items": [{"prompt": messages, "completion": "4<|im_end|>"}]})
    assert resp.status_code == 200, resp.text
    prompt_ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    assert_close(resp.json()["results"][0], direct(model, tokenizer, prompt_ids, "4<|im_end|>"))


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def conversation(reply: str = "sunny, 21C") -> list[dict]:
    """docs/agentic.md's tool conversation: a call, the tool's reply, the answer."""
    call = {"type": "function", "id": "c0", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": reply, "tool_call_id": "c0"}, {"role": "assistant", "content": "Sunny, 21C."}]


def assistant_turns(tokenizer, ids: list[int]) -> list[list[int]]:
    """The positions of each assistant turn's own tokens in ChatML: after its
    '<|im_start|>assistant\n', up to and with its '<|im_end|>\n'."""
    header = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    end = tokenizer.encode("<|im_end|>\n", add_special_tokens=False)
    turns, i = [], 0
    while i < len(ids):
        if ids[i:i + len(header)] == header:
            j = i + len(header)
            while ids[j:j + len(end)] != end:
                j += 1
            turns.append(list(range(i + len(header), j + len(end))))
            i = j + len(end)
        else:
            i += 1
    return turns


def direct_conversation(model, tokenizer, messages, tools, temperature=1.0) -> list[float]:
    """log p of every assistant token given all before it, from one forward over the conversation
    as the chat template renders it."""
    ids = list(tokenizer.apply_chat_template(messages, tools=tools, tokenize=True))
    logits = model(mx.array([ids]))[0].astype(mx.float32) / temperature
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return [logp[t - 1, ids[t]].item() for turn in assistant_turns(tokenizer, ids) for t in turn]


def test_a_conversation_is_scored_at_its_assistant_tokens(stack, worker, tiny):
    """Mixed with a prompt/completion item, at two temperatures, and in the single form: the
    assistant turns' tokens (tool call, answer, each end of turn) as a direct computation gives them."""
    model, tokenizer = tiny
    for temperature in (None, 2.0):
        body = {"model_id": stack.tiny_model.name, "items": [{"messages": conversation(), "tools": TOOLS},
                                                             {"prompt": PROMPTS[0], "completion": COMPLETIONS[0]}]}
        resp = post(stack, {**body, "temperature": temperature} if temperature else body)
        assert resp.status_code == 200, resp.text
        chat, plain = resp.json()["results"]
        expected = direct_conversation(model, tokenizer, conversation(), TOOLS, temperature or 1.0)
        assert len(expected) > 40 and chat["token_count"] == len(expected)
        assert max(abs(a - b) for a, b in zip(chat["per_token"], expected)) < 1e-5
        assert abs(chat["logprob"] - sum(expected)) < 1e-4
        assert_close(plain, direct(model, tokenizer, list(tokenizer.encode(PROMPTS[0])), COMPLETIONS[0], temperature or 1.0))
    single = post(stack, {"model_id": stack.tiny_model.name, "messages": conversation(), "tools": TOOLS})
    assert single.status_code == 200, single.text
    assert_close(single.json(), direct_conversation(model, tokenizer, conversation(), TOOLS))


def test_a_tool_reply_changes_the_scores_after_it_not_the_tokens_scored(stack, worker, tiny):
    _, tokenizer = tiny
    resp = post(stack, {"model_id": stack.tiny_model.name, "items": [
        {"messages": conversation(), "tools": TOOLS}, {"messages": conversation("rain, 9C and wind"), "tools": TOOLS}]})
    assert resp.status_code == 200, resp.text
    a, b = resp.json()["results"]
    ids = list(tokenizer.apply_chat_template(conversation(), tools=TOOLS, tokenize=True))
    call = len(assistant_turns(tokenizer, ids)[0])  # the first assistant turn, before the reply
    assert a["token_count"] == b["token_count"]
    # Equal up to float noise: the two rows are one padded batch, and BLAS may sum a row's
    # products in another order where the rows' lengths differ (about 5e-7 seen).
    assert a["per_token"][:call] == pytest.approx(b["per_token"][:call], abs=1e-5)
    assert all(abs(x - y) > 1e-4 for x, y in zip(a["per_token"][call:], b["per_token"][call:]))


def test_a_grpo_episode_masks_the_newline_after_a_turns_eos(tiny):
    """Where the route's tokens (SFT's) and an episode's differ: the template's newline after the
    model's <|im_end|> comes with the tools' reply, which the episode masks."""
    _, tokenizer = tiny
    chat = Conversation(tokenizer, conversation()[:2], TOOLS)
    appended = chat.answer_tokens("<tool_call>x</tool_call>", "<|im_end|>", [{"role": "tool", "content": "sunny"}], 16)
    assert tokenizer.decode(appended).startswith("\n<|im_start|>user\n<tool_response>")


def test_conversations_that_cannot_be_scored_are_400s(stack):
    """Checked by the API as SFT rows are (shared/datasets.py), before any worker sees them."""
    user, answer = {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}
    cases = [
        ({"messages": [user]}, "body: Value error, no assistant message of weight 1"),
        ({"items": [{"messages": [user, {**answer, "weight": 0}]}]}, "items.0: Value error, no assistant message of weight 1"),
        ({"messages": [answer]}, "the first message is the assistant's"),
        ({"messages": [{**user, "tool_calls": []}, answer]}, "'messages[0].tool_calls': only assistant messages call tools"),
        ({"messages": [user, answer], "tools": [{"name": "f"}]}, "'tools[0]' must be {type: \"function\""),
        ({"items": [{"messages": [user, answer], "completion": "x"}]}, "items.0.completion: Extra inputs are not permitted"),
        ({"messages": [{**user, "content": "x" * 262_145}, answer]}, "MTQ_MAX_STEP_TOKENS"),
    ]
    for body, detail in cases:
        resp = post(stack, {"model_id": stack.tiny_model.name, **body})
        assert resp.status_code == 400 and detail in resp.json()["detail"], (body, resp.text[:300])


def test_a_template_that_cannot_render_the_conversation_is_refused(stack):
    """The worker's side (400s, as multi-turn GRPO fails its job): no chat template, one that
    does not render turn by turn, one that raises on the messages."""
    item = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
    with pytest.raises(Refused, match="chat template, and this model's tokenizer has none") as e:
        conversation_row(types.SimpleNamespace(chat_template=None), item)
    assert e.value.status == 400
    tokenizer = load_tokenizer(stack.tiny_model)
    for template, error in [("{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
                             "does not render this conversation incrementally"),
                            ("{{ raise_exception('no such role') }}", "no such role")]:
        tokenizer._tokenizer.chat_template = template
        with pytest.raises(Refused, match=error) as e:
            conversation_row(tokenizer, item)
        assert e.value.status == 400


def test_errors_as_the_seed_server(stack, worker):
    cases = [
        ({"prompt": "a", "completion": "b"}, 400, "model_id is required"),
        ({"model_id": stack.tiny_model.name, "prompt": "a"}, 400, "completion is required"),
        ({"model_id": stack.tiny_model.name, "prompt": "a", "completion": ""}, 400, "completion is required"),
        ({"model_id": "no-such-model", "prompt": "a", "completion": "b"}, 404, "Model not found: no-such-model"),
        ({"model_id": stack.tiny_model.name, "prompt": "a", "completion": "b", "adapter_name": "nope"}, 404,
         f"Adapter not found: {stack.tiny_model.name}/nope"),
        ({"model_id": stack.tiny_model.name, "items": []}, 400, "items"),
        ({"model_id": stack.tiny_model.name, "prompt": "a", "completion": "b", "temperature": 0}, 400, "temperature"),
    ]
    for body, code, detail in cases:
        resp = post(stack, body)
        assert resp.status_code == code and detail in resp.json()["detail"], (body, resp.status_code, resp.text)


def run_grpo(stack, **config) -> dict:
    spec = {"model_id": stack.tiny_model.name, "prompts": PROMPTS,
            "config": {"group_size": 4, "batch_size": 2, "max_completion_len": 6, "iters": 2, "lora_layers": 2,
                       "learning_rate": 5e-2, "temperature": 1.0, "use_chat_template": False, **config}}
    if "adapter_name" in config:
        spec["adapter_name"] = spec["config"].pop("adapter_name")
    with stack.client() as c:
        resp = c.post(JOBS, json=spec)
    assert resp.status_code == 200, resp.text
    job = stack.wait_job(resp.json()["job_id"], timeout=120)
    assert job["status"] == "completed", job["error"]
    return job


def test_with_an_adapter_equals_mlx_lm_with_that_adapter(stack, worker, tmp_path):
    """The downstream trainer's loop: a GRPO job, its adapter downloaded through the API into a
    directory of its own (no access to the worker's disk), loaded with mlx_lm; the endpoint's
    log-probs with adapter_name equal the local computation."""
    import io
    import tarfile

    job = run_grpo(stack, adapter_name="lp-adapter")
    with stack.client() as c:
        archive = c.get(f"{JOBS}/{job['job_id']}/adapter")
    assert archive.status_code == 200
    local = tmp_path / "lp-adapter"
    with tarfile.open(fileobj=io.BytesIO(archive.content)) as tar:
        tar.extractall(local, filter="data")
    model, tokenizer = mlx_lm.load(str(stack.tiny_model), adapter_path=str(local))
    base, _ = mlx_lm.load(str(stack.tiny_model))
    body = {"model_id": stack.tiny_model.name, "adapter_name": "lp-adapter",
            "items": [{"prompt": p, "completion": c} for p, c in zip(PROMPTS, COMPLETIONS)]}
    resp = post(stack, body)
    assert resp.status_code == 200, resp.text
    for p, c, answer in zip(PROMPTS, COMPLETIONS, resp.json()["results"]):
        expected = direct(model, tokenizer, list(tokenizer.encode(p)), c)
        assert_close(answer, expected)
        assert max(abs(a - b) for a, b in zip(expected, direct(base, tokenizer, list(tokenizer.encode(p)), c))) > 1e-4
    without = post(stack, {**body, "adapter_name": None}).json()["results"][2]  # the base model again
    assert_close(without, direct(base, tokenizer, list(tokenizer.encode(PROMPTS[2])), COMPLETIONS[2]))


def test_grpo_sampling_logprobs_equal_the_endpoint(stack, worker):
    """At temperature 1, the log-probs the job recorded while sampling its first step (LoRA
    still zero: the base model) are what the endpoint answers for the same prompt and text."""
    job = run_grpo(stack, seed=3)
    first = [e for _, e in read_events(stack.redis, job["job_id"], count=1000) if e["type"] == "samples"][0]
    items, recorded = [], []
    for b, group in enumerate(first["completions"]):
        for completion, n, logprob in zip(group, first["token_counts"][b], first["logprobs"][b]):
            if completion:
                items.append({"prompt": PROMPTS[first["prompt_indices"][b]], "completion": completion})
                recorded.append((n, logprob))
    answers = post(stack, {"model_id": stack.tiny_model.name, "items": items}).json()["results"]
    # A completion's text can encode to other tokens than were sampled (BPE merges across
    # token boundaries); where the token counts agree, the sums must.
    same_tokens = [(a, r) for a, r in zip(answers, recorded) if a["token_count"] == r[0]]
    matching = [a for a, r in same_tokens if abs(a["logprob"] - r[1]) < 1e-4 * r[0]]
    assert matching and len(matching) >= len(same_tokens) / 2, (same_tokens, len(items))


def test_a_busy_worker_answers_between_steps_without_disturbing_its_job(stack, worker):
    config = {"iters": 30, "max_completion_len": 48, "seed": 11, "learning_rate": 1e-2}
    baseline = run_grpo(stack, **config)
    with stack.client() as c:
        history_alone = c.get(f"{JOBS}/{baseline['job_id']}/history").json()["history"]

    with stack.client() as c:
        job_id = c.post(JOBS, json={"model_id": stack.tiny_model.name, "prompts": PROMPTS, "config": {
            "group_size": 4, "batch_size": 2, "lora_layers": 2, "temperature": 1.0, "use_chat_template": False,
            **config}}).json()["job_id"]

    def iters():
        return [e["iter"] for _, e in read_events(stack.redis, job_id, count=10_000) if e["type"] == "grpo_step"]

    wait_for(lambda: len(iters()) >= 3, 120, "the job to be a few steps in")
    waits = []
    for _ in range(3):
        before = len(iters())
        resp = post(stack, {"model_id": stack.tiny_model.name, "prompt": PROMPTS[0], "completion": COMPLETIONS[0]})
        assert resp.status_code == 200, resp.text
        waits.append(len(iters()) - before)
    job = stack.wait_job(job_id, timeout=120)
    assert job["status"] == "completed", job["error"]
    # Answered at the first turn between steps after it arrived: the step running when it was
    # sent, one more if it missed that step's turn by a hair, and one that ends while the
    # answer travels back; a request the busy worker did not serve would wait out the job.
    assert waits and max(waits) <= 3, waits
    assert len(iters()) == 30 and min(len(iters()) - w for w in waits) < 30  # while the job was running

    with stack.client() as c:
        history = c.get(f"{JOBS}/{job_id}/history").json()["history"]
    drop = ("step_time",)
    assert [{k: v for k, v in h.items() if k not in drop} for h in history] == \
           [{k: v for k, v in h.items() if k not in drop} for h in history_alone]
