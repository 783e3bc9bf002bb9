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


def test_routing_and_admission_size_a_gang_member_for_its_share_of_the_batch():
    """A member of a gang holds its share of a step's examples (GRPO: every N-th, rank 0 the most,
    ceil(B / N); a supervised kind by speed, at most 1.5 times that: routing.max_share), so a
    worker that runs that share is capable, though the whole batch would not fit it."""
    from shared import routing
    from shared.schemas import JobCreate
    from shared.train_specs import SFTJobCreate
    from worker.supervisor import admission

    shape = dict(layers=28, hidden=1024, intermediate=3072, heads=16, kv_heads=8, head_dim=128, vocab=16384, act_bytes=2)
    model = {"model_id": "big", "shape": shape, "size_bytes": 1_200_000_000}
    live = [advertisement(name, models=[model], memory_gb=8.0) for name in ("a", "b")]
    solo, gang = (SFTJobCreate(model_id="big", dataset=ROWS, config={"batch_size": 8, "max_seq_length": 2048, "workers": n})
                  for n in (1, 2))
    alone, shared = routing.route("sft", solo, live), routing.route("sft", gang, live)
    print(f"\nSFT of 8 rows of 2048 tokens: {alone.need_gb:.1f} GB on one worker, {shared.need_gb:.1f} GB a member")
    assert alone.need_gb > 8 and "the largest live worker that can run it has 8 GB" in alone.waiting_for_worker
    assert shared.need_gb < 8 and shared.waiting_for_worker is None and [w["name"] for w in shared.free] == ["a", "b"]
    here = admission.Here("a", 8.0, "gpu", {routing.model_key("big"): model})
    assert admission.does_not_fit(None, here, "j", "rq-j", "sft", routing.spec_summary(gang)) is None  # no Redis call: it fits
    odd = JobCreate(model_id="big", prompts=PROMPTS + ["one more"], config={"batch_size": 5, "group_size": 4, "workers": 2})
    assert routing.member_step(routing.spec_summary(odd))["rows"] == 3 * 4  # rank 0: prompts 0, 2 and 4, G rows each


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
    # The per-source reward metrics, the lengths and the entropy are the whole step's, every rank's rows.
    gathered = [k for k in steps[solo][0] if k.startswith(("rewards/", "completions/", "entropy", "n_samples"))]
    assert {"rewards/length/mean", "rewards/length/std", "entropy", "completions/mean_length"} <= set(gathered), gathered
    differences = {k: rel_diff([e[k] for e in steps[gang]], [e[k] for e in steps[solo]]) for k in gathered}
    print(f"GRPO gang of 2 vs 1 worker, step metrics' relative differences: {differences}")
    assert max(differences.values()) < LOSS_TOLERANCE, differences


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


def test_a_gang_runs_on_workers_that_fit_its_share_though_not_the_whole_batch(stack, client, pair):
    """Per-share sizing with the real workers: an SFT batch whose rows (max_seq_length, chosen
    from the pair's advertised memory and the model's advertised shape) need more than the
    pair's memory class waits on one worker, naming its need; as a gang of two, each member
    sized for its share of the rows (routing.max_share), the API routes it to a queue the pair serves and their admission
    takes it (the rows are short: the step itself is small)."""
    from shared import routing
    from shared.train_specs import SFTJobCreate

    live = [w for w in client.get("/admin/api/workers").json() if w["name"] in ("gang-a", "gang-b")]
    memory, model = min(w["memory_gb"] for w in live), live[0]["models"][0]

    def need_class(length: int, gang: int) -> int:
        spec = SFTJobCreate(model_id="tiny", dataset=ROWS, config={"batch_size": 4, "max_seq_length": length,
                                                                   "workers": gang})
        return routing.memory_class(routing.job_need_gb("sft", routing.spec_summary(spec), model, "cpu"))
    length = next(n for n in range(1024, 131_073, 1024) if need_class(n, 1) > memory)
    assert need_class(length, 2) <= memory, (length, memory)
    config = {**SFT_CONFIG, "iters": 2, "max_seq_length": length}
    solo = submit(client, SFT, {"model_id": "tiny", "dataset": ROWS, "adapter_name": "too-big", "config": config})
    waiting = client.get(f"{SFT}/{solo}").json()["waiting_for_worker"]
    assert waiting and waiting.startswith("needs about"), waiting
    gang = submit(client, SFT, {"model_id": "tiny", "dataset": ROWS, "adapter_name": "its-share",
                                "config": {**config, "workers": 2}})
    assert client.get(f"{SFT}/{gang}").json()["waiting_for_worker"] is None
    try:
        assert wait_done(stack, SFT, gang, timeout=120)["failed_attempts"] == 0
        print(f"\nmax_seq_length {length}: one worker needs a {need_class(length, 1)} GB class, a member "
              f"{need_class(length, 2)} GB; the pair has {memory:g} GB")
    finally:
        assert client.post(f"{SFT}/{solo}/cancel").status_code == 200


def test_a_member_that_took_another_job_refuses_the_gangs_claim_at_once_and_no_attempt_is_spent(stack, client, pair):
    """A worker that takes a job holds itself for it (worker/supervisor/gang_claims.py hold): a
    leader's claim made just after, before it could see the worker busy, is refused in the same
    atomic step, naming the worker, and claims no one; the gang job waits, not started, and runs
    once the worker is free, with no attempt counted and no MTQ_GANG_JOIN_S wait."""
    from worker.supervisor import gang_claims

    solo = submit(client, SFT, {"model_id": "tiny", "dataset": ROWS, "adapter_name": "busy",
                                "config": {**SFT_CONFIG, "iters": 5000, "steps_per_save": 5000}})
    busy = wait_for(lambda: (j := client.get(f"{SFT}/{solo}").json())["status"] == "running" and j["worker"], 60,
                    "the solo job to start")
    free = next(name for name in ("gang-a", "gang-b") if name != busy)
    assert gang_claims.claimed_by(stack.redis, busy) == solo
    assert gang_claims.claim(stack.redis, [free, busy], "another-job", 60) == (None, busy)
    assert gang_claims.claimed_by(stack.redis, free) is None  # all or none
    gang = submit(client, SFT, {"model_id": "tiny", "dataset": ROWS, "adapter_name": "sft-after-busy",
                                "config": {**SFT_CONFIG, "workers": 2, "iters": 2}})
    time.sleep(1)
    assert client.get(f"{SFT}/{gang}").json()["status"] == "queued"
    assert client.post(f"{SFT}/{solo}/cancel").status_code == 200
    t0 = time.monotonic()
    job = wait_done(stack, SFT, gang, timeout=120)
    print(f"\nthe gang job completed {time.monotonic() - t0:.1f}s after its member was free")
    assert job["failed_attempts"] == 0 and not [e for _, e in stack.events(gang) if e["type"] == "requeued"]
    assert time.monotonic() - t0 < 55  # no join timeout (MTQ_GANG_JOIN_S 60) on the way
    wait_for(lambda: not any(gang_claims.claimed_by(stack.redis, n) for n in ("gang-a", "gang-b")), 10,
             "the workers' holds to be dropped")


def test_the_reconciler_drops_a_rank_job_left_on_the_queue_of_a_member_that_is_gone(stack, pair):
    """A gang's leader pushed a rank job on a member's own queue, and the member died: the
    reconciler (any live worker's heartbeat) deletes it, so it neither lingers nor runs when a
    worker of that name returns."""
    from rq import Queue
    from rq.job import Job

    from shared import routing
    from worker.supervisor import gang_claims

    queue = Queue(routing.own_queue("default", "gang-gone"), connection=stack.redis)
    rank_job = queue.enqueue_call(gang_claims.RANK_JOB_FUNC, args=("gone", 1, 1, [["127.0.0.1:1"], ["127.0.0.1:2"]],
                                                                   "gone:0"), job_id="gone-e1-rank1", timeout=-1)
    wait_for(lambda: not Job.exists(rank_job.id, connection=stack.redis) and queue.count == 0, 20,
             "the reconciler to drop the rank job")


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


def test_a_warm_shutdown_of_a_rank_checkpoints_the_gang_first_so_no_step_is_redone(stack, client, pair):
    """SIGTERM to the `mtq worker` of rank 1: the ranks agree before the next step (one sum across
    them) to stop, rank 0 checkpoints that step and hands the job back (no attempt counted), and
    the next gang resumes from it: every step's event once. Last in the module: it replaces a
    worker of the pair."""
    iters = 30
    config = {**SFT_CONFIG, "workers": 2, "iters": iters, "steps_per_save": 1000}  # no periodic checkpoint
    job_id = submit(client, SFT, {"model_id": "tiny", "dataset": ROWS, "adapter_name": "sft-warm", "config": config})
    by_name = dict(zip(("gang-a", "gang-b"), pair))
    job = wait_for(lambda: (j := client.get(f"{SFT}/{job_id}").json())["status"] == "running" and
                   (j["progress"] or {}).get("iter", 0) >= 3 and j, 120, "step 3 on a gang")
    member = next(name for name in by_name if name != job["worker"])
    os.kill(by_name[member].pid, signal.SIGTERM)
    assert by_name[member].wait(40) == 0
    requeued = [e for _, e in stack.events(job_id) if e["type"] == "requeued"]
    assert [(e["counted"], e["reason"]) for e in requeued] == [(False, "a worker of its gang shutting down")], requeued
    replacement = stack.start_worker("--name", member)
    try:
        job = wait_done(stack, SFT, job_id, timeout=120)
    finally:
        stack.stop_proc(replacement)
    steps = [e["iter"] for _, e in stack.events(job_id) if e["type"] == "sft_step"]
    resumed = [e["from_step"] for _, e in stack.events(job_id) if e["type"] == "resumed"]
    print(f"\nwarm shutdown of rank 1: resumed from step {resumed}; {len(steps) - len(set(steps))} steps redone")
    assert len(resumed) == 1 and resumed[0] >= 3 and job["failed_attempts"] == 0, stack.events(job_id)
    assert len(steps) == len(set(steps)) == iters  # no step redone
