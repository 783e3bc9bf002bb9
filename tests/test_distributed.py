"""One job across several workers (docs/distributed.md): gang scheduling and data-parallel
training over mx.distributed's ring backend, with real worker processes over loopback on the
CPU. This machine has 2 cores and ring's socket threads busy-poll, so the gangs here have two
ranks; the 3-worker test checks the waiting and its count, not a 3-rank run.

A gang's step must be the step of one worker for the same global batch: the losses and the
adapter agree to within the reduction-order tolerance measured here (TOLERANCE)."""

import io
import json
import os
import signal
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from conftest import Stack, running, wait_done, wait_for

SFT = "/admin/api/fine-tune/jobs"
GRPO = "/admin/api/fine-tune/grpo/jobs"
ROWS = [{"prompt": f"Q{i}?", "completion": c} for i, c in enumerate(
    ["red apple", "blue river and sea", "green", "a yellow sun over hills", "black cat", "white snow falls"])]
SFT_CONFIG = dict(lora_layers=-1, lora_rank=8, lora_alpha=4, learning_rate=1e-2, batch_size=4, iters=4,
                  steps_per_report=1, steps_per_save=2, seed=3)
# Relative (Euclidean norm) differences allowed between a gang's result and one worker's: the
# sums' order differs. Measured on this machine (printed by the tests): losses ~1e-6; the adapter
# after 4 Adam steps ~1.4e-4 (Adam's m / sqrt(v) turns a near-zero gradient's rounding into a step).
LOSS_TOLERANCE, ADAPTER_TOLERANCE = 1e-5, 1e-3


def advertisement(name: str, **more) -> dict:
    return {"name": name, "models": [{"model_id": "tiny"}], "lanes": ["default"], "memory_gb": 8.0, "device": "cpu",
            "gang_address": f"127.0.0.1:{5000 + len(name)}", "current_job": None, **more}


def test_a_gang_job_counts_the_free_workers_that_can_run_it_and_its_leader_picks_them():
    from shared import routing
    from shared.train_specs import SFTJobCreate
    from worker.supervisor import gang_claims as gangs

    spec = SFTJobCreate(model_id="tiny", dataset=ROWS, config={**SFT_CONFIG, "workers": 2})
    live = [advertisement("a"), advertisement("b", current_job="j1"), advertisement("c", gang_address=None),
            advertisement("d", models=[{"model_id": "other"}])]
    busy = routing.route("sft", spec, live, finished=lambda job_id: False)
    assert busy.waiting_for_worker == ("needs 2 free workers that can run it at once (config.workers); "
                                       "has 1 (a) of 3 live that can run it")
    assert gangs.pick("a", list(busy.free), 2) is None
    done = routing.route("sft", spec, live, finished=lambda job_id: True)  # b's job has ended meanwhile
    assert done.waiting_for_worker is None and not done.queue.startswith("default@worker:")  # no warm own queue
    assert [w["name"] for w in gangs.pick("b", list(done.free), 2)] == ["b", "a"]  # the leader is rank 0
    gpu = [advertisement("a"), advertisement("b", device="gpu")]
    assert gangs.pick("a", list(routing.route("sft", spec, gpu).free), 2) is None  # one device kind per gang
    assert gangs.hostfile([advertisement("a"), advertisement("bb")]) == [["127.0.0.1:5001"], ["127.0.0.1:5002"]]


def test_workers_is_bounded_and_refused_where_a_gang_would_change_the_loss():
    from pydantic import ValidationError

    from shared.schemas import MAX_GANG, GRPOConfig
    from shared.train_specs import DPOConfig, KTOConfig, ORPOConfig, SFTConfig

    assert SFTConfig().workers == GRPOConfig().workers == 1 and DPOConfig(workers=2).workers == 2
    for bad in (lambda: SFTConfig(workers=5, batch_size=4), lambda: GRPOConfig(workers=MAX_GANG + 1, batch_size=64),
                lambda: SFTConfig(workers=0), lambda: KTOConfig(workers=2), lambda: ORPOConfig(workers=2)):
        with pytest.raises(ValidationError):
            bad()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    s = Stack(tmp_path_factory.mktemp("gang"), tiny_model)
    # The multi-turn test's tool (conftest puts the repository's root on PYTHONPATH).
    s.env.update(MTQ_LEASE_TTL="2", MTQ_GANG_JOIN_S="60", MTQ_TOOL_MODULES="examples.agentic.lookup_tools")
    yield from running(s)


@pytest.fixture(scope="module")
def pair(stack):
    """Two workers: a gang of two, or two solo jobs."""
    procs = [stack.start_worker("--name", name) for name in ("gang-a", "gang-b")]
    yield procs
    for p in procs:
        stack.stop_proc(p)


def submit(client, path: str, body: dict) -> str:
    res = client.post(path, json=body)
    assert res.status_code == 200, res.text
    return res.json()["job_id"]


def step_losses(stack, job_id: str, kind: str) -> list[float]:
    return [e["loss"] for _, e in stack.events(job_id) if e["type"] == f"{kind}_step"]


def adapter(client, adapter_name: str) -> dict[str, np.ndarray]:
    res = client.get(f"/admin/api/fine-tune/adapters/tiny/{adapter_name}/download")
    assert res.status_code == 200, res.text
    with tarfile.open(fileobj=io.BytesIO(res.content)) as tar:
        blob = tar.extractfile(next(m for m in tar.getmembers() if m.name.endswith("adapters.safetensors"))).read()
    return safetensors.numpy.load(blob)


def rel_diff(a, b) -> float:
    """|a - b| / |b| (Euclidean norms)."""
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


def adapter_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return rel_diff(np.concatenate([a[k].ravel() for k in sorted(a)]), np.concatenate([b[k].ravel() for k in sorted(b)]))


def test_sft_on_a_gang_of_two_equals_one_worker(stack, client, pair):
    """A gang of two trains as one worker does, and its ranks leave no hostfile behind (in the
    training process's temporary directory, the kernel cache: worker/supervisor/kernel_cache.py)."""
    hostfiles = Path(os.environ["MTQ_KERNEL_CACHE"])
    before = set(hostfiles.glob("mtq-gang-*"))
    body = {"model_id": "tiny", "dataset": ROWS}
    solo = submit(client, SFT, {**body, "adapter_name": "sft-solo", "config": SFT_CONFIG})
    wait_done(stack, SFT, solo)
    gang = submit(client, SFT, {**body, "adapter_name": "sft-gang", "config": {**SFT_CONFIG, "workers": 2}})
    job = wait_done(stack, SFT, gang)
    started = [e for _, e in stack.events(gang) if e["type"] == "started"]
    assert [e.get("rank") for e in started] == [0] and started[0]["gang_size"] == 2
    a, b = step_losses(stack, gang, "sft"), step_losses(stack, solo, "sft")
    assert len(a) == len(b) == SFT_CONFIG["iters"]
    loss_diff = rel_diff(a, b)
    weight_diff = adapter_diff(adapter(client, "sft-gang"), adapter(client, "sft-solo"))
    print(f"\nSFT gang of 2 vs 1 worker: losses {a} vs {b}; max relative difference: losses {loss_diff:.2e}, "
          f"adapter {weight_diff:.2e}")
    assert b[0] != b[-1]  # it learned: the comparison is not of constants
    assert loss_diff < LOSS_TOLERANCE and weight_diff < ADAPTER_TOLERANCE
    assert job["worker"] in ("gang-a", "gang-b")
    assert set(hostfiles.glob("mtq-gang-*")) == before


PROMPTS = ["Tell me", "A long prompt about rivers and seas", "Why", "Count to three please"]
GRPO_CONFIG = dict(batch_size=4, group_size=2, max_completion_len=8, iters=3, learning_rate=5e-3, lora_layers=-1,
                   lora_alpha=4, scale_rewards="batch", seed=5, checkpoint_every=2, eval_interval=2, eval_samples=2)


def test_grpo_on_a_gang_of_two_equals_one_worker(stack, client, pair):
    """Each rank samples and scores every other prompt's group, padded and drawn as in the whole
    batch; scale_rewards "batch" needs every rank's rewards, the loss every rank's tokens. Rank 0
    alone evaluates the validation prompts, the others waiting: the solo job's evaluations."""
    body = {"model_id": "tiny", "prompts": PROMPTS, "validation_prompts": ["Name a river", "Why"]}
    solo = submit(client, GRPO, {**body, "adapter_name": "grpo-solo", "config": GRPO_CONFIG})
    wait_done(stack, GRPO, solo)
    gang = submit(client, GRPO, {**body, "adapter_name": "grpo-gang", "config": {**GRPO_CONFIG, "workers": 2}})
    wait_done(stack, GRPO, gang)
    evals = {j: [(e["iter"], e["val_reward"]) for _, e in stack.events(j) if e["type"] == "eval"] for j in (solo, gang)}
    assert [i for i, _ in evals[solo]] == [0, 1, 2, 3] and evals[gang] == evals[solo]
    steps = {j: [e for _, e in stack.events(j) if e["type"] == "grpo_step"] for j in (solo, gang)}
    a, b = ([e["loss"] for e in steps[j]] for j in (gang, solo))
    assert len(a) == len(b) == GRPO_CONFIG["iters"]
    rewards, norms = ([[e[k] for e in steps[j]] for j in (gang, solo)] for k in ("reward", "grad_norm"))
    # On-policy GRPO's loss is the mean of normalised advantages, 0 up to rounding: compared
    # absolutely; the gradient's norm, which every rank's rows make, relatively.
    loss_diff = float(np.max(np.abs(np.subtract(a, b))))
    norm_diff, weight_diff = rel_diff(*norms), adapter_diff(adapter(client, "grpo-gang"), adapter(client, "grpo-solo"))
    print(f"\nGRPO gang of 2 vs 1 worker: rewards {rewards[0]} vs {rewards[1]}; grad norms {norms[0]} vs {norms[1]}; "
          f"differences: losses {loss_diff:.1e} (absolute), grad norms {norm_diff:.2e}, adapter {weight_diff:.2e}")
    assert rewards[0] == rewards[1]  # the same completions were sampled
    assert loss_diff < 1e-6 and norm_diff < LOSS_TOLERANCE and weight_diff < ADAPTER_TOLERANCE


def test_rloo_with_its_kl_penalty_on_a_gang_of_two_equals_one_worker(stack, client, pair):
    """RLOO's baselines, KL penalties and normalize_advantages are the whole step's: each rank's
    KL penalties are summed into the whole batch of rewards (worker/kinds/rloo.py). num_iterations
    2: the second update's loss is not 0 (an on-policy RLOO loss is)."""
    path = "/admin/api/fine-tune/rloo/jobs"
    config = {k: v for k, v in GRPO_CONFIG.items() if k not in ("scale_rewards", "eval_interval", "eval_samples")}
    config.update(beta=0.05, normalize_advantages=True, num_iterations=2)
    solo = submit(client, path, {"model_id": "tiny", "prompts": PROMPTS, "adapter_name": "rloo-solo", "config": config})
    wait_done(stack, path, solo)
    gang = submit(client, path, {"model_id": "tiny", "prompts": PROMPTS, "adapter_name": "rloo-gang",
                                 "config": {**config, "workers": 2}})
    wait_done(stack, path, gang)
    steps = {j: [e for _, e in stack.events(j) if e["type"] == "rloo_step"] for j in (solo, gang)}
    (a, b), (kl_a, kl_b) = ([[e[k] for e in steps[j]] for j in (gang, solo)] for k in ("loss", "kl"))
    loss_diff, kl_diff = rel_diff(a, b), rel_diff(kl_a, kl_b)
    weight_diff = adapter_diff(adapter(client, "rloo-gang"), adapter(client, "rloo-solo"))
    print(f"\nRLOO gang of 2 vs 1 worker: losses {a} vs {b}, kl {kl_a} vs {kl_b}; differences: losses {loss_diff:.2e}, "
          f"kl {kl_diff:.2e}, adapter {weight_diff:.2e}")
    assert [e["reward"] for e in steps[gang]] == [e["reward"] for e in steps[solo]]  # the same completions
    assert len(a) == config["iters"] and min(abs(x) for x in b) > 1e-4 and kl_b[-1] != 0
    assert loss_diff < 1e-4 and kl_diff < 1e-4 and weight_diff < ADAPTER_TOLERANCE


def test_xpo_on_a_gang_of_two_equals_one_worker(stack, client, pair):
    """XPO (worker/kinds/online_dpo.py): each rank samples its prompts' completions with the policy
    and with the reference, the judge's scores of the whole step come together, and the DPO loss
    (a mean over pairs) sums across ranks: one worker's steps."""
    xpo = "/admin/api/fine-tune/xpo/jobs"
    config = dict(batch_size=4, max_completion_len=8, iters=3, learning_rate=5e-3, lora_layers=-1, lora_alpha=4, seed=5)
    solo = submit(client, xpo, {"model_id": "tiny", "prompts": PROMPTS, "adapter_name": "xpo-solo", "config": config})
    wait_done(stack, xpo, solo)
    gang = submit(client, xpo, {"model_id": "tiny", "prompts": PROMPTS, "adapter_name": "xpo-gang",
                                "config": {**config, "workers": 2}})
    wait_done(stack, xpo, gang)
    steps = {j: [e for _, e in stack.events(j) if e["type"] == "xpo_step"] for j in (solo, gang)}
    scores, losses = ([[e[k] for e in steps[j]] for j in (gang, solo)] for k in ("objective/model_scores", "loss"))
    weight_diff = adapter_diff(adapter(client, "xpo-gang"), adapter(client, "xpo-solo"))
    print(f"\nXPO gang of 2 vs 1 worker: losses {losses[0]} vs {losses[1]}; adapter difference {weight_diff:.2e}")
    assert scores[0] == scores[1] and len(scores[0]) == 3  # the same completions were sampled and judged
    assert rel_diff(*losses) < LOSS_TOLERANCE and weight_diff < ADAPTER_TOLERANCE and losses[1][0] != losses[1][-1]


TOOL_PROMPTS = ["What color is the apple?", "Color of snow?", "Color of sky?", "hi"]
GREETINGS = ["hi", "hello", "hey there", "good morning"]
TOOL_CONFIG = {"batch_size": 4, "group_size": 2, "max_turns": 2, "max_completion_len": 32, "max_tool_output_tokens": 8,
               "temperature": 0.0, "beta": 0.1, "iters": 2, "learning_rate": 5e-3, "lora_layers": -1, "lora_rank": 8,
               "lora_alpha": 4, "seed": 5}


def opens_a_call(question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def test_multi_turn_grpo_with_a_tool_on_a_gang_of_two_equals_one_worker(stack, client, pair):
    """Episodes with a tool (max_turns 2) on a gang of two against one worker.

    The tiny random model never writes a tool call by itself, and with a final norm of 1 no
    adapter makes it write the whole call format (worker/runtime/make_model.py says why;
    tests/test_agentic.py uses a model made with final_norm 16). So a short SFT job teaches it to open a
    `<tool_call>` block and end its turn: both GRPO jobs start from that adapter,
    their first step's episodes call the tool, get an error answer (a block left open) appended
    to the row, and decode a second turn. Greedy decoding samples the same text on a rank as on
    one worker (a temperature above 0 would not: the decode's keys follow the schedule of the
    whole decode, worker/decode/episodes.py). The G greedy episodes of a prompt are alike, so
    every advantage is 0; beta > 0 gives the loss its KL term over the model's tokens only,
    which a rank that trained on the appended tokens (a lost mask) would change. The episode
    metrics are the whole step's (every rank's episodes summed); with this model a step's
    episodes all behave alike, so rank 0's share alone would read the same: the test cannot
    tell that case apart."""
    t0 = time.monotonic()
    questions = [q.format(t) for q in ("What color is the {}?", "Color of {}?") for t in ("apple", "snow", "sky", "coal")]
    rows = [opens_a_call(q, "<tool_call>") for q in questions] + [opens_a_call(q, "Hello!") for q in GREETINGS]
    sft = submit(client, SFT, {"model_id": "tiny", "dataset": rows, "adapter_name": "tool-sft", "config": {
        "lora_layers": -1, "lora_rank": 8, "lora_alpha": 4, "learning_rate": 1e-2, "batch_size": 12, "iters": 200,
        "mask_prompt": True, "steps_per_report": 40}})
    wait_done(stack, SFT, sft)
    body = {"model_id": "tiny", "prompts": TOOL_PROMPTS, "init_adapter": {"job_id": sft},
            "tools": [{"type": "python", "function": "examples.agentic.lookup_tools:lookup"}]}
    solo = submit(client, GRPO, {**body, "adapter_name": "tools-solo", "config": TOOL_CONFIG})
    wait_done(stack, GRPO, solo)
    gang = submit(client, GRPO, {**body, "adapter_name": "tools-gang", "config": {**TOOL_CONFIG, "workers": 2}})
    wait_done(stack, GRPO, gang)
    steps = {j: [e for _, e in stack.events(j) if e["type"] == "grpo_step"] for j in (gang, solo)}
    assert len(steps[gang]) == len(steps[solo]) == TOOL_CONFIG["iters"]
    seen = {k: [[e[k] for e in steps[j]] for j in (gang, solo)]
            for k in ("reward", "turns/mean", "tool_calls/mean", "tool_errors/mean", "loss", "grad_norm")}
    loss_diff, norm_diff = rel_diff(*seen["loss"]), rel_diff(*seen["grad_norm"])
    weight_diff = adapter_diff(adapter(client, "tools-gang"), adapter(client, "tools-solo"))
    print(f"\nmulti-turn GRPO gang of 2 vs 1 worker: {seen}; differences: losses {loss_diff:.2e}, "
          f"grad norms {norm_diff:.2e}, adapter {weight_diff:.2e}; {time.monotonic() - t0:.1f} s")
    # The multi-turn path ran: episodes called the tool (a block left open: an error answer) and
    # had a second turn; the metrics count the episodes' turns (the solo job's conversations).
    assert max(seen["tool_calls/mean"][1]) > 0 and max(seen["tool_errors/mean"][1]) > 0
    conversations = [e["conversations"] for _, e in stack.events(solo) if e["type"] == "samples"]
    turns = [float(np.mean([sum(m["role"] == "assistant" for m in c) for group in step for c in group]))
             for step in conversations]
    assert turns == seen["turns/mean"][1] and max(turns) == 2
    for k in ("reward", "turns/mean", "tool_calls/mean", "tool_errors/mean"):
        assert seen[k][0] == seen[k][1], k  # the same episodes were sampled, and counted on every rank
    assert min(seen["loss"][1]) > 0 and min(seen["grad_norm"][1]) > 0  # the KL term: not a comparison of zeros
    assert loss_diff < LOSS_TOLERANCE and norm_diff < LOSS_TOLERANCE and weight_diff < ADAPTER_TOLERANCE


def training_pid(supervisor_pid: int) -> int | None:
    """The training process of a worker (its supervisor's multiprocessing child), if running."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == supervisor_pid and b"spawn_main" in cmdline:
            return int(stat.parent.name)
    return None


def test_a_killed_or_stopped_rank_ends_the_gangs_attempt_and_the_job_resumes_on_a_new_gang(stack, client, pair):
    iters = 30  # far past the second signal's step: a loaded machine once finished 12 before it landed
    config = {**SFT_CONFIG, "workers": 2, "iters": iters, "steps_per_save": 2, "stall_timeout_s": 4, "max_attempts": 3}
    job_id = submit(client, SFT, {"model_id": "tiny", "dataset": ROWS, "adapter_name": "sft-chaos", "config": config})
    by_name = dict(zip(("gang-a", "gang-b"), pair))

    def at_step(n):
        return lambda: (j := client.get(f"{SFT}/{job_id}").json())["status"] == "running" and \
            (j["progress"] or {}).get("iter", 0) >= n and j
    for n, sig in ((3, signal.SIGKILL), (9, signal.SIGSTOP)):
        job = wait_for(at_step(n), 120, f"step {n} on a gang")
        leader = job["worker"]
        member = next(name for name in by_name if name != leader)
        victim, other = training_pid(by_name[member].pid), training_pid(by_name[leader].pid)
        os.kill(victim, sig)  # rank 1's training process
        t0 = time.monotonic()
        wait_for(lambda: training_pid(by_name[leader].pid) != other, 30, "the other rank's process to be ended")
        print(f"\n{sig.name} of rank 1: rank 0's training process ended after {time.monotonic() - t0:.1f}s")
    job = wait_done(stack, SFT, job_id)
    requeued = [e for _, e in stack.events(job_id) if e["type"] == "requeued"]
    assert [e["counted"] for e in requeued] == [True, True], requeued
    assert job["failed_attempts"] == 2
    resumed = [e["from_step"] for _, e in stack.events(job_id) if e["type"] == "resumed"]
    assert len(resumed) == 2 and all(step >= 2 for step in resumed), resumed
    history = client.get(f"{SFT}/{job_id}/history").json()["history"]
    assert [h["step"] for h in history] == list(range(1, iters + 1))


def test_a_gang_of_three_waits_on_two_workers_naming_what_it_lacks_and_starts_when_a_third_joins(stack, client, pair):
    config = {**SFT_CONFIG, "workers": 3, "iters": 2}
    job_id = submit(client, SFT, {"model_id": "tiny", "dataset": ROWS, "adapter_name": "sft-three", "config": config})
    waiting = wait_for(lambda: client.get(f"{SFT}/{job_id}").json()["waiting_for_worker"], 20, "waiting_for_worker")
    assert "needs 3 free workers" in waiting and "has 2 (gang-a, gang-b)" in waiting, waiting
    time.sleep(3)  # the two workers keep taking it and putting it back: never started
    job = client.get(f"{SFT}/{job_id}").json()
    assert job["status"] == "queued" and not job["started_at"], job
    # Routed so from its creation on: each retry is silent (an event only when what it waits for changes).
    assert not [e for _, e in stack.events(job_id) if e["type"] in ("waiting", "rerouted")]
    third = stack.start_worker("--name", "gang-c")
    try:
        t0 = time.monotonic()
        job = wait_done(stack, SFT, job_id, timeout=120)
        print(f"\na gang of three ran {config['iters']} steps in {time.monotonic() - t0:.1f}s after the third worker joined")
        assert sorted(json.loads(stack.redis.hget(f"mtq:job:{job_id}", "gang"))) == ["gang-a", "gang-b", "gang-c"]
        assert job["failed_attempts"] == 0 and len(step_losses(stack, job_id, "sft")) == config["iters"]
    finally:
        stack.stop_proc(third)
