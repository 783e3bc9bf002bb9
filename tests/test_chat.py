"""Chat and text completions (/v1/chat/completions, /v1/completions, /v1/models), driven by the
official `openai` SDK against the real stack: a fine-tuned model answers what mlx_lm generates
with its base and adapter (greedy), streamed or not; owners' models stay theirs; requests of
two owners are answered while a training job runs on the only worker, without changing what it
trains; what is not served is a 400 naming it."""

import io
import json
import subprocess
import sys
import tarfile
import threading

import httpx
import openai
import pytest
from mlx_lm import generate, load
from mlx_lm.sample_utils import make_sampler

from conftest import ROOT, TOKEN, Stack, read_events, running, wait_done, wait_for

OTHER = "team-b-token-0123456789"
ROWS = [{"messages": [{"role": "user", "content": f"Colour {i}?"}, {"role": "assistant", "content": "red red red"}]}
        for i in range(4)]
QUESTION = [{"role": "user", "content": "Colour 9?"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    s = Stack(tmp_path_factory.mktemp("chat"), tiny_model)
    s.env["MTQ_SERVE_TURN_S"] = "0.3"  # a long answer spans several turns sooner
    s.use_tokens([{"name": "reader", "token": "reader-token-0123456789", "role": "viewer"},
                  {"name": "team-b", "token": OTHER, "role": "trainer"}])
    yield from running(s)


def sdk(stack, key: str = TOKEN) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=key, max_retries=0, _strict_response_validation=True)


@pytest.fixture(scope="module")
def fine_tuned(stack, worker, tmp_path_factory) -> tuple[str, str]:
    """A succeeded /v1 supervised job's fine-tuned model, and its adapter downloaded."""
    client = sdk(stack)
    f = client.files.create(file=("t.jsonl", "\n".join(json.dumps(r) for r in ROWS).encode()), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(model="tiny", training_file=f.id, suffix="chat", seed=3, hyperparameters={
        "n_epochs": 4, "batch_size": 2, "learning_rate_multiplier": 2000.0})
    job = wait_for(lambda: (j := client.fine_tuning.jobs.retrieve(job.id)).status in ("succeeded", "failed") and j,
                   240, "the job", interval=0.3)
    assert job.status == "succeeded", job.error
    out = tmp_path_factory.mktemp("adapter")
    with stack.client() as c:
        archive = c.get(f"/admin/api/fine-tune/adapters/{job.fine_tuned_model}/download")
        assert archive.status_code == 200
    with tarfile.open(fileobj=io.BytesIO(archive.content)) as t:
        for m in t.getmembers():
            if m.isfile():
                (out / m.name.rsplit("/", 1)[-1]).write_bytes(t.extractfile(m).read())
    return job.fine_tuned_model, str(out)


def greedy(model_dir: str, adapter: str | None, prompt, max_tokens: int) -> str:
    model, tokenizer = load(model_dir, adapter_path=adapter)
    if isinstance(prompt, list):
        prompt = tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
    return generate(model, tokenizer, prompt=prompt, max_tokens=max_tokens, sampler=make_sampler(0.0))


def test_a_fine_tuned_model_answers_as_mlx_lm_with_its_adapter(stack, fine_tuned):
    name, adapter = fine_tuned
    client = sdk(stack)
    expected = greedy(str(stack.tiny_model), adapter, QUESTION, 24)
    assert expected != greedy(str(stack.tiny_model), None, QUESTION, 24)  # the adapter changes the answer
    answer = client.chat.completions.create(model=name, messages=QUESTION, max_tokens=24, temperature=0)
    assert answer.model == name and answer.object == "chat.completion"
    assert answer.choices[0].message.content == expected
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.usage.completion_tokens <= 24
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=name, messages=QUESTION, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected and len([c for c in chunks if c.choices and c.choices[0].delta.content]) >= 2
    assert chunks[-1].usage.completion_tokens == answer.usage.completion_tokens
    # the base model, by its own name; a text completion as mlx_lm completes the same text
    base = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=24, temperature=0)
    assert base.choices[0].message.content == greedy(str(stack.tiny_model), None, QUESTION, 24)
    text = client.completions.create(model=name, prompt="Once upon a time", max_tokens=20, temperature=0)
    assert text.choices[0].text == greedy(str(stack.tiny_model), adapter, "Once upon a time", 20)
    # /v1/models: the base model and the token's own fine-tuned one; another trainer sees only the base
    assert {m.id for m in client.models.list()} >= {"tiny", name}
    assert client.models.retrieve(name).owned_by == "org-admin"
    other = sdk(stack, OTHER)
    assert [m.id for m in other.models.list()] == ["tiny"]
    with pytest.raises(openai.NotFoundError):
        other.chat.completions.create(model=name, messages=QUESTION)
    with pytest.raises(openai.NotFoundError):
        other.models.retrieve(name)


def test_sampling_choices_stops_and_limits(stack, worker):
    client = sdk(stack)
    greedy_text = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=30, temperature=0)
    full = greedy_text.choices[0].text
    assert greedy_text.choices[0].finish_reason == "length" and greedy_text.usage.completion_tokens == 30
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.find(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=30, temperature=0, stop=stop, stream=True) if c.choices)
    assert streamed == cut.choices[0].text  # a stream never sends the stop string, nor text after it
    n = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=16, n=3, temperature=1.5, seed=5)
    assert [c.index for c in n.choices] == [0, 1, 2] and len({c.message.content for c in n.choices}) > 1
    again = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=16, n=3, temperature=1.5, seed=5)
    assert [c.message.content for c in again.choices] == [c.message.content for c in n.choices]  # the seed's draws
    scored = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=8, temperature=0, logprobs=True)
    tokens = scored.choices[0].logprobs.content
    assert len(tokens) == 8 and all(t.logprob <= 0 for t in tokens)
    assert "".join(t.token for t in tokens).strip() == scored.choices[0].message.content.strip()


def test_what_is_not_served_is_a_400_and_models_are_checked(stack, worker):
    client = sdk(stack)
    for kwargs, param in [({"frequency_penalty": 0.5}, "frequency_penalty"), ({"top_logprobs": 2, "logprobs": True},
                          "top_logprobs"), ({"max_tokens": 10**6}, "max_tokens"), ({"n": 9}, "n"),
                          ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f"}}]},
                           "tool_choice"), ({"response_format": {"type": "json_object"}}, "response_format"),
                          ({"logprobs": True, "stream": True}, "logprobs")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=QUESTION, **kwargs)
        assert e.value.param == param, (kwargs, e.value.message)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "robot", "content": "x"}])
    assert e.value.param == "messages"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=QUESTION)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="ft:tiny:org-admin:x:abc123", messages=QUESTION)
    with pytest.raises(openai.PermissionDeniedError):  # a viewer reads; it does not use the workers
        sdk(stack, "reader-token-0123456789").chat.completions.create(model="tiny", messages=QUESTION)
    with pytest.raises(openai.BadRequestError, match="context"):  # the worker's refusal, as a status
        client.completions.create(model="tiny", prompt="word " * 5000, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="context"):
        list(client.completions.create(model="tiny", prompt="word " * 5000, max_tokens=4, stream=True))
    with httpx.Client(base_url=stack.base_url, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        for body in ({"model": "tiny"}, {"model": "tiny", "messages": "hi"}, {"model": "tiny", "messages": [],
                     "temperature": 9}, [1, 2]):
            resp = c.post("/v1/chat/completions", json=body)
            assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error", resp.text


def test_two_owners_are_answered_while_a_job_trains_and_it_trains_the_same(stack, worker):
    spec = {"model_id": "tiny", "dataset": ROWS, "config": {"iters": 60, "batch_size": 2, "seed": 4,
                                                            "learning_rate": 1e-3, "lora_layers": 2}}
    path = "/admin/api/fine-tune/jobs"

    def history(job_id):
        with stack.client() as c:
            return [{k: v for k, v in h.items() if k not in ("step_time", "tokens_per_second", "iterations_per_second",
                                                              "peak_memory_gb", "trained_tokens_per_second")}
                    for h in c.get(f"{path}/{job_id}/history").json()["history"]]

    with stack.client() as c:
        alone = c.post(path, json=spec).json()["job_id"]
    wait_done(stack, path, alone)
    with stack.client() as c:
        job_id = c.post(path, json=spec).json()["job_id"]

    def steps():
        return sum(e["type"] == "sft_step" for _, e in read_events(stack.redis, job_id, count=10_000))

    wait_for(lambda: steps() >= 2, 120, "the job to be a few steps in")
    answers, errors = {}, []

    def ask(i, key):
        try:
            answers[i] = (steps(), sdk(stack, key).chat.completions.create(
                model="tiny", messages=QUESTION, max_tokens=12, temperature=0), steps())
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i, k)) for i, k in enumerate((TOKEN, OTHER) * 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    wait_done(stack, path, job_id)
    assert not errors and len(answers) == 6, errors
    for before, answer, after in answers.values():
        assert answer.choices[0].message.content == greedy(str(stack.tiny_model), None, QUESTION, 12)
        # answered within a few steps (of about 25 ms here), while it trained
        assert after - before <= 10 and after < 60, (before, after)
    assert history(job_id) == history(alone)
    rows = {k: v for k, v in stack.metrics().items() if k.startswith("mtq_completion_batch_rows_bucket")}
    one = rows['mtq_completion_batch_rows_bucket{"le": "1.0"}']
    assert rows['mtq_completion_batch_rows_bucket{"le": "+Inf"}'] > one  # requests were decoded together


def test_mtq_chat(stack, fine_tuned):
    name, adapter = fine_tuned

    def mtq_chat(*args, stdin=""):
        done = subprocess.run([sys.executable, "-m", "cli.main", "chat", *args], cwd=ROOT, env=stack.env, input=stdin,
                              capture_output=True, text=True, timeout=120)
        return done.returncode, done.stdout, done.stderr

    expected = greedy(str(stack.tiny_model), adapter, QUESTION, 12)
    job = "ftjob-" + name.rsplit(":", 1)[1]
    for model in (name, job):
        assert mtq_chat(model, "-p", QUESTION[0]["content"], "--max-tokens", "12", "--temperature", "0") == \
               (0, expected + "\n", "")
    # a conversation: each line a turn, the history sent with the next
    code, out, err = mtq_chat(name, "--max-tokens", "12", "--temperature", "0",
                              stdin=f"{QUESTION[0]['content']}\nAnd again?\n")
    assert code == 0 and out.startswith("> " + expected + "\n> "), (out, err)
    history = [*QUESTION, {"role": "assistant", "content": expected}, {"role": "user", "content": "And again?"}]
    assert out.endswith(greedy(str(stack.tiny_model), adapter, history, 12) + "\n> ")
    code, out, err = mtq_chat("no-such-model", "-p", "hi")
    assert code == 1 and "does not exist" in err


def test_a_stream_whose_client_goes_away_is_ended(stack, worker):
    with httpx.Client(base_url=stack.base_url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "Once upon a time", "stream": True,
                                                        "max_tokens": 4000, "temperature": 0}) as resp:
            assert resp.status_code == 200
            first = next(resp.iter_lines())
            request_id = json.loads(first.removeprefix("data: "))["id"].removeprefix("cmpl-")
    record = f"mtq:score:{request_id}"
    wait_for(lambda: stack.redis.hget(record, "status") == b"done", 30, "the worker to end the request")
    assert stack.redis.hget(record, "cancelled") == b"1"
    assert json.loads(stack.redis.hget(record, "result"))["completion_tokens"] < 4000


def test_tool_calls_are_read_with_the_tokenizers_syntax_and_held_back_from_a_stream(tiny_model):
    """The answer's text in the tool-call syntax becomes tool_calls; a stream never shows it."""
    from mlx_lm import load

    from worker.runtime.completions import Batch, Choice, Pending
    _, tokenizer = load(str(tiny_model))
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    text = 'Let me see. <tool_call>\n{"name": "lookup", "arguments": {"q": "x"}}\n</tool_call>'
    tokens = list(tokenizer.encode(text, add_special_tokens=False))
    request = {"model_id": "tiny", "tools": tools, "n": 1, "stream": True}
    cut = next(n for n in range(len(tokens)) if "<tool_" in tokenizer.decode(tokens[:n]))
    partial = Pending("r", request, [1], [Choice(tokens[:cut])], 100)
    whole = Pending("r", request, [1], [Choice(tokens, finish="stop")], 100)
    batch = Batch(None, tokenizer, [tokenizer.eos_token_id], [partial, whole], until=0)
    assert batch.sendable(partial, partial.choices[0]) == "Let me see. "  # held back: the start of a call
    assert batch.sendable(whole, whole.choices[0]) == "Let me see. "
    answer = batch.answer(whole)["choices"][0]
    assert answer["finish_reason"] == "tool_calls" and answer["text"] == "Let me see. "
    assert answer["tool_calls"] == [{"name": "lookup", "arguments": json.dumps({"q": "x"})}]
    broken = Pending("r", request, [1], [Choice(list(tokenizer.encode('<tool_call>{"nam</tool_call>')), finish="stop")], 9)
    assert batch.answer(broken)["choices"][0] == {"text": '<tool_call>{"nam</tool_call>', "finish_reason": "stop"}


def test_a_seeded_choice_draws_the_same_alone_batched_and_across_turns(tiny_model):
    """Each choice draws with keys of its own (completions.choice_keys, a key per token): the
    same tokens alone in one turn, cut after a turn and continued from its tokens, and batched
    behind another request's rows."""
    import numpy as np
    from mlx_lm import load

    from worker.decode.draw import SamplingParams
    from worker.decode.sampling import make_decode_step
    from worker.decode.serving import decode
    from worker.runtime.completions import Choice, Pending, choice_keys
    model, _ = load(str(tiny_model))
    params = SamplingParams(max_tokens=40, temperature=1.5)
    step = make_decode_step(model, params, [-1], 0)  # no EOS: every row draws its whole limit

    def run(prompts, keys, turns=0):
        got, calls = [[] for _ in prompts], []

        def on_chunk(tokens, _):
            calls.append(1)
            for g, t in zip(got, tokens):
                g += t
            return None if len(calls) == turns else np.zeros(len(prompts), dtype=bool)
        decode(model, step, prompts, keys, params, [-1], on_chunk)
        return [g[:len(k)] for g, k in zip(got, keys)]

    keys = choice_keys(Pending("a", {"seed": 5}, [1, 2, 3], [Choice(), Choice()], 40))
    assert [k.tolist() for k in keys] == [k.tolist() for k in choice_keys(Pending("a", {"seed": 5}, [1], [
        Choice(), Choice()], 40))] and keys[0].tolist() != keys[1].tolist()
    [alone] = run([[1, 2, 3]], [keys[1]])
    [first] = run([[1, 2, 3]], [keys[1]], turns=2)  # the first token, a chunk, and the turn ends
    [rest] = run([[1, 2, 3] + first], [keys[1][len(first):]])
    assert 0 < len(first) < 40 and first + rest == alone
    other = choice_keys(Pending("b", {"seed": 9}, [7, 7, 7], [Choice()], 30))
    assert run([[7, 7, 7], [1, 2, 3]], [other[0], keys[1]])[1] == alone


def test_a_long_answer_goes_on_over_several_turns(stack, worker):
    """A completion longer than a worker's turn keeps its tokens and continues from them at the
    next turn: the same greedy text as in one go. (1200 tokens: a quiet 2-core machine decoded
    400 in one turn of 0.3 s.)"""
    turns = lambda: stack.metrics().get('mtq_completion_batch_rows_count{}', 0)  # noqa: E731
    before = turns()
    client = sdk(stack)
    answer = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=1200, temperature=0)
    assert answer.usage.completion_tokens == 1200 and turns() - before >= 2, turns() - before
    assert answer.choices[0].text == greedy(str(stack.tiny_model), None, "Once upon a time", 1200)


def test_the_migration_pages_example_runs_as_is(stack, worker, capsys):
    """docs/from-openai.md's code block, with the server's address, a token and the tiny model."""
    page = (ROOT / "docs" / "from-openai.md").read_text()
    code = page.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "docs/from-openai.md", "exec"), {"BASE_URL": stack.base_url + "/v1", "TOKEN": TOKEN,
                                                        "MODEL": "tiny"})
    printed = capsys.readouterr().out.splitlines()
    # the last print: the model's name, then its answer (which may hold newlines of its own)
    assert printed[0].startswith("The job has successfully completed")
    assert any(line.startswith("ft:tiny:org-admin:colours:") for line in printed[1:]), printed
