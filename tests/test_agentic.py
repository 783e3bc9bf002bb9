"""Multi-turn GRPO jobs through the real stack (docs/agentic.md): SFT on tool-call transcripts
teaches the call format, a GRPO job from that adapter learns to call a python tool (its reward
rises against an lr-0 control), so does one rewarded by an OpenEnv server alone, and hostile
tools and servers end as bounded, clear outcomes with the worker free afterwards.

The tool is examples/agentic/lookup_tools.py (the docs' example), allowed by MTQ_TOOL_MODULES;
the environment server is tests/openenv_server.py (openenv-core's server classes). The module's
tiny model has a final norm of 16 (make_model's docstring says why: at 1 no adapter can make
its samples confident, so a group has no well-formed episodes to learn from). Its questions are
about three things: with six, the tiny model (2 layers, 64 wide) names the wrong key in most
of its calls, and the reward after a call is left to chance.
"""

import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import ROOT, Stack, free_port, openenv_servers, running, wait_done
from transformers.utils import get_json_schema

from examples.agentic import lookup_tools
from worker.runtime.make_model import make_model

GRPO = "/admin/api/fine-tune/grpo/jobs"
SFT = "/admin/api/fine-tune/jobs"
SCHEMA = get_json_schema(lookup_tools.lookup)
PHRASES = ["What color is the {}?", "Tell me the color of {}.", "Which color has the {}?", "Color of {}?"]
THINGS = ["apple", "sky", "grass"]
TOOLS = [{"type": "python", "function": "examples.agentic.lookup_tools:lookup"}]


def transcript(phrase: str, thing: str) -> dict:
    color = lookup_tools.COLORS[thing]
    return {"tools": [SCHEMA], "messages": [
        {"role": "user", "content": phrase.format(thing)},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "lookup", "arguments": {"key": thing}}}]},
        {"role": "tool", "content": color},
        {"role": "assistant", "content": f"It is {color}."}]}


def guess(phrase: str, thing: str) -> dict:
    """The other half of the SFT rows: no call and no color, so GRPO has a choice to learn."""
    return {"tools": [SCHEMA], "messages": [{"role": "user", "content": phrase.format(thing)},
                                            {"role": "assistant", "content": "I do not know."}]}


@pytest.fixture(scope="module")
def env_server(tmp_path_factory) -> dict[str, str]:
    """{mode: url} of tests/openenv_server.py's lookup and colors games."""
    with openenv_servers(("lookup", "colors"), tmp_path_factory.mktemp("openenv")) as ports:
        yield {mode: f"http://127.0.0.1:{port}" for mode, port in ports.items()}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, env_server):
    s = Stack(tmp_path_factory.mktemp("agentic"), make_model(tmp_path_factory.mktemp("sharp") / "tiny", final_norm=16.0))
    hosts = ",".join(url.removeprefix("http://") for url in env_server.values())
    s.env.update(MTQ_TOOL_MODULES="examples.agentic.lookup_tools,hostile_lookup,noisy_lookup", MTQ_REWARD_HOSTS=hosts, PYTHONPATH=f"{ROOT}{':'}{ROOT / 'tests'}{':'}{s.env['PYTHONPATH']}")
    yield from running(s)


def grpo_spec(**config) -> dict:
    prompts = [{"prompt": PHRASES[i].format(t), "answer": lookup_tools.COLORS[t]} for i, t in enumerate(THINGS)]
    return {"model_id": "tiny", "prompts": prompts, "tools": TOOLS, "reward": [{"type": "contains", "field": "answer"}],
            "config": {"max_turns": 3, "group_size": 8, "batch_size": 3, "iters": 2, "max_completion_len": 96,
                       "max_tool_output_tokens": 16, "temperature": 0.7, "lora_layers": -1, "lora_rank": 16, "lora_alpha": 4, **config}}


def steps_of(stack, job_id, kind="grpo_step"):
    return [e for _, e in stack.events(job_id) if e.get("type") == kind]


@pytest.fixture(scope="module")
def sft_adapter(stack, worker) -> dict:
    """An SFT job on tool-call transcripts and as many guesses (assistant-only loss): its init_adapter."""
    rows = [row(p, t) for p in PHRASES for t in THINGS for row in (transcript, guess)]
    with stack.client() as c:
        res = c.post(SFT, json={"model_id": "tiny", "dataset": rows, "adapter_name": "tool-sft",
                                "config": {"lora_layers": -1, "lora_rank": 16, "lora_alpha": 4, "learning_rate": 1e-2,
                                           "batch_size": 8, "iters": 200, "steps_per_report": 50}})
    assert res.status_code == 200, res.text
    return {"init_adapter": {"job_id": wait_done(stack, SFT, res.json()["job_id"], timeout=400)["job_id"]}}


def against_control(stack, spec: dict, name: str) -> tuple[list[dict], dict]:
    """The steps of `spec` at lr 3e-4, which must beat an lr-0 control's over the last 5 of 10
    steps (reward by 0.15, tool calls per episode by 0.15), and its last samples event. The
    control stays where SFT left it: its adapter is the SFT job's, weight for weight."""
    learned = stack.submit({**spec, "config": {**spec["config"], "learning_rate": 3e-4}, "adapter_name": name})
    control = stack.submit({**spec, "config": {**spec["config"], "learning_rate": 0.0}, "adapter_name": f"{name}-lr0"})
    jobs = {job_id: wait_done(stack, GRPO, job_id, timeout=600) for job_id in (learned, control)}
    steps, flat = steps_of(stack, learned), steps_of(stack, control)
    for lr, run in (("lr 3e-4", steps), ("lr 0", flat)):
        print(f"\n{name} {lr}: rewards {[round(s['reward'], 3) for s in run]}; "
              f"tool calls {[round(s['tool_calls/mean'], 2) for s in run]}")
    assert len(steps) == len(flat) == spec["config"]["iters"] == 10
    late = {k: (np.mean([s[k] for s in steps[5:]]), np.mean([s[k] for s in flat[5:]])) for k in ("reward", "tool_calls/mean")}
    print("last 5 steps' means, lr 3e-4 vs lr 0:", {k: tuple(round(float(x), 3) for x in v) for k, v in late.items()})
    assert late["reward"][0] > late["reward"][1] + 0.15 and late["tool_calls/mean"][0] > late["tool_calls/mean"][1] + 0.15
    sft = mx.load(str(Path(wait_done(stack, SFT, spec["init_adapter"]["job_id"])["adapter_path"]) / "adapters.safetensors"))
    kept = mx.load(str(Path(jobs[control]["adapter_path"]) / "adapters.safetensors"))
    assert sft.keys() == kept.keys() and all(mx.array_equal(sft[k], kept[k]).item() for k in sft)
    return steps, [e for _, e in stack.events(learned) if e.get("type") == "samples"][-1]


def test_sft_teaches_the_call_format_and_grpo_learns_to_call_the_tool(stack, worker, sft_adapter):
    """After SFT about a third of the episodes call the tool, and only those can name the color.
    GRPO at lr 3e-4 raises both the calls and the reward; at lr 0 both stay where they were."""
    steps, samples = against_control(stack, {**grpo_spec(iters=10), **sft_adapter}, "tool-grpo")
    assert {"turns/mean", "tool_calls/mean", "tool_errors/mean"} <= set(steps[0])
    called = [c for group in samples["conversations"] for c in group if any(m["role"] == "tool" for m in c)]
    assert called and "<tool_call>" in called[0][0]["content"]
    assert any(m["role"] == "tool" and m["content"] in lookup_tools.COLORS.values() for c in called for m in c)


def test_grpo_learns_from_an_openenv_environments_reward(stack, worker, sft_adapter, env_server):
    """The colors game asks for the color of a thing it draws (after the job's system prompt), and
    its reward is the job's only one: as with the contains reward, lr 3e-4 learns to call the tool
    that knows, lr 0 does not."""
    spec = {**grpo_spec(iters=10), **sft_adapter, "reward": None,
            "environment": {"type": "openenv", "url": env_server["colors"], "observation_field": "prompt",
                            "reset": {"things": THINGS}},
            "prompts": [[{"role": "system", "content": "Answer with a color."}]] * len(THINGS)}
    steps, samples = against_control(stack, spec, "env-grpo")
    assert all("env_reward" in s for s in steps)
    rewarded = [c for group, rewards in zip(samples["conversations"], samples["rewards"]) for c, r in zip(group, rewards)
                if r == 1.0]
    assert any(m["role"] == "tool" and m["content"] in lookup_tools.COLORS.values() for c in rewarded for m in c)


def test_an_openenv_environment_drives_episodes_and_rewards_them(stack, worker, env_server):
    spec = {"model_id": "tiny", "prompts": ["Play the game."], "environment": {"type": "openenv", "url": env_server["lookup"]},
            "config": {"group_size": 4, "batch_size": 1, "iters": 2, "max_completion_len": 16, "max_turns": 1}}
    job = wait_done(stack, GRPO, stack.submit(spec), timeout=300)
    steps = steps_of(stack, job["job_id"])
    assert len(steps) == 2 and "env_reward" in steps[0]
    samples = [e for _, e in stack.events(job["job_id"]) if e.get("type") == "samples"][-1]
    assert all(r is not None for group in samples["rewards"] for r in group)  # the environment rewarded each episode


def test_an_environment_on_a_host_not_allowed_is_refused(stack):
    url = f"http://127.0.0.1:{free_port()}"
    with stack.client() as c:  # allowed host:port, nothing listening
        spec = {"model_id": "tiny", "prompts": ["Play."], "environment": {"type": "openenv", "url": url, "timeout_s": 2},
                "config": {"group_size": 2, "batch_size": 1, "iters": 1, "max_completion_len": 8}}
        res = c.post(GRPO, json=spec)
    assert res.status_code == 400 and "MTQ_REWARD_HOSTS" in res.text  # refused before it is queued


# The noisy tool's 100 MB take 0.1 s idle but passed 1 s on a loaded 2-core CI: it gets the default 10 s.
@pytest.mark.parametrize("tool, timeout, expect", [("hostile_lookup:lookup", 1.0, "timed out"),
                                                   ("noisy_lookup:lookup", 10.0, "red")])
def test_a_hostile_tool_is_a_message_to_the_model_and_the_worker_takes_the_next_job(stack, worker, sft_adapter, tool,
                                                                                   timeout, expect):
    spec = {**grpo_spec(iters=1, tool_timeout_s=timeout, max_tool_calls=2), **sft_adapter}
    spec["tools"] = [{"type": "python", "function": tool}]
    t0 = time.monotonic()
    job = wait_done(stack, GRPO, stack.submit(spec), timeout=300)
    samples = [e for _, e in stack.events(job["job_id"]) if e.get("type") == "samples"][-1]
    answers = [m["content"] for group in samples["conversations"] for c in group for m in c if m["role"] == "tool"]
    assert answers and any(expect in a for a in answers), answers
    assert all(len(a) <= 16 * 8 + 64 for a in answers)  # cut to max_tool_output_tokens
    print(f"\n{tool}: job took {time.monotonic() - t0:.1f} s; a tool answer: {answers[0][:80]!r}")
    plain = stack.submit({"model_id": "tiny", "prompts": ["hi"], "config": {"iters": 1, "group_size": 2, "batch_size": 1,
                                                                              "max_completion_len": 4}})
    wait_done(stack, GRPO, plain, timeout=120)


def test_tools_not_allowed_and_bad_episode_configs_are_clear_400s(stack):
    with stack.client() as c:
        for spec, words in [
            ({**grpo_spec(), "tools": [{"type": "python", "function": "os:system"}]}, "MTQ_TOOL_MODULES"),
            ({**grpo_spec(), "tools": None}, "needs tools or an environment"),
            ({**grpo_spec(max_turns=1)}, "max_turns to 2 or more"),
            ({**grpo_spec(stop=["x"])}, "stop strings"),
        ]:
            res = c.post(GRPO, json=spec)
            assert res.status_code in (400, 422) and words in res.text, res.text
