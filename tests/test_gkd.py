"""GKD (worker/kinds/gkd_job.py): its loss against TRL's generalized_jsd_loss written out in
NumPy (values and gradients), its lmbda draw, and jobs through the real stack: the KL to the
teacher falls against a zero-learning-rate control (and is the KL of the two models computed
here), a teacher of another vocabulary fails the job cleanly, a teacher no worker has leaves it
waiting with the reason, hostile specs are 400s, and kill -9 of the training process resumes
the job with every step once and the same on-policy draws.

The teacher is the tiny model made with another seed (`mtq make-model --seed 1`: the same
tokenizer, other weights), under an MTQ_MODEL_ROOTS root of this module's.
"""

import json
import os
import shutil
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from conftest import ROOT, Stack, kill_when, read_events, running, wait_done, wait_for

from worker.kinds.gkd_job import generalized_jsd, gkd_loss, on_policy_step

GKD = "/admin/api/fine-tune/gkd/jobs"
WORDS = "red blue green stone river cloud apple tree house car road sun".split()
ROWS = [{"prompt": f"Say something about {w}.", "completion": f" {w} is {WORDS[(i + 3) % len(WORDS)]}"}
        for i, w in enumerate(WORDS)]
VALID = ROWS[:4]
CONFIG = dict(lora_layers=-1, lora_rank=8, lora_alpha=4, learning_rate=1e-2, batch_size=4, iters=12,
              max_seq_length=64, max_new_tokens=16, lmbda=0.5, beta=0.0, val_batches=-1, steps_per_eval=12)

# --------------------------------------------------------------------------- the math against NumPy


def np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def trl_gkd_loss(student, teacher, mask, beta, temperature):
    """TRL 1.16's GKDTrainer.generalized_jsd_loss (reduction batchmean, labels' mask) in float64:
    F.kl_div(input, target, log_target=True) is exp(target) * (target - input), elementwise."""
    s, t = np_log_softmax(student / temperature), np_log_softmax(teacher / temperature)

    def kl_div(inp, target):
        return np.exp(target) * (target - inp)

    if beta == 0:
        jsd = kl_div(s, t)
    elif beta == 1:
        jsd = kl_div(t, s)
    else:
        m = np.logaddexp(s + np.log1p(-beta), t + np.log(beta))
        jsd = beta * kl_div(m, t) + (1 - beta) * kl_div(m, s)
    return jsd[mask.astype(bool)].sum() / max(mask.sum(), 1)


rng = np.random.default_rng(0)
STUDENT = rng.normal(0, 2, (2, 5, 11))
TEACHER = rng.normal(0, 2, (2, 5, 11))
MASK = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=np.float64)


def ours(student, teacher, mask, beta, temperature):
    return gkd_loss(generalized_jsd(mx.array(student, dtype=mx.float32), mx.array(teacher, dtype=mx.float32), beta,
                                    temperature), mx.array(mask, dtype=mx.float32))


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_the_loss_is_trls_generalized_jsd(beta, temperature):
    expected = trl_gkd_loss(STUDENT, TEACHER, MASK, beta, temperature)
    assert float(ours(STUDENT, TEACHER, MASK, beta, temperature).item()) == pytest.approx(expected, rel=1e-5)
    # Its gradient in the student's logits, against central differences of the NumPy loss.
    grad = np.array(mx.grad(lambda s: ours(s, TEACHER, MASK, beta, temperature))(mx.array(STUDENT, dtype=mx.float32)))
    numeric = np.zeros_like(STUDENT)
    for i in np.ndindex(STUDENT.shape):
        up, down = STUDENT.copy(), STUDENT.copy()
        up[i] += 1e-6
        down[i] -= 1e-6
        numeric[i] = (trl_gkd_loss(up, TEACHER, MASK, beta, temperature)
                      - trl_gkd_loss(down, TEACHER, MASK, beta, temperature)) / 2e-6
    np.testing.assert_allclose(grad, numeric, rtol=1e-3, atol=1e-5)
    assert not grad[0, 3:].any()  # masked positions get none


def test_beta_0_is_forward_kl_beta_1_reverse_kl_and_equal_distributions_give_0():
    p, q = np.exp(np_log_softmax(TEACHER)), np.exp(np_log_softmax(STUDENT))
    forward = (p * np.log(p / q)).sum(-1)  # KL(teacher || student)
    reverse = (q * np.log(q / p)).sum(-1)
    assert float(ours(STUDENT, TEACHER, MASK, 0.0, 1.0).item()) == pytest.approx(forward[MASK == 1].mean(), rel=1e-5)
    assert float(ours(STUDENT, TEACHER, MASK, 1.0, 1.0).item()) == pytest.approx(reverse[MASK == 1].mean(), rel=1e-5)
    for beta in (0.0, 0.5, 1.0):
        assert float(ours(TEACHER, TEACHER, MASK, beta, 1.0).item()) == pytest.approx(0.0, abs=1e-6)
    assert float(ours(STUDENT, TEACHER, np.zeros_like(MASK), 0.5, 1.0).item()) == 0.0  # no token: 0, not NaN


@pytest.mark.parametrize("lmbda", [0.0, 0.3, 1.0])
def test_lmbda_is_the_fraction_of_on_policy_steps(lmbda):
    draws = [on_policy_step(lmbda, 3, step) for step in range(1000)]
    assert np.mean(draws) == pytest.approx(lmbda, abs=0.05)
    assert draws == [on_policy_step(lmbda, 3, step) for step in range(1000)]  # a resumed job draws the same


def test_routing_counts_the_teacher_and_takes_a_worker_with_both_models():
    from shared import routing
    from shared.train_specs import GKDJobCreate

    shape = dict(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=1024, act_bytes=4)
    student = {"model_id": "tiny", "shape": shape, "size_bytes": 10**9}
    teacher = {"model_id": "big", "shape": shape, "size_bytes": 3 * 10**9}
    spec = GKDJobCreate(model_id="tiny", teacher_model_id="big", dataset=ROWS)
    summary = routing.spec_summary(spec)
    alone = routing.job_need_gb("gkd", {k: v for k, v in summary.items() if k != "teacher_model_id"}, student)
    assert routing.job_need_gb("gkd", summary, student, teacher=teacher) == pytest.approx(alone + 3)
    assert routing.job_need_gb("gkd", summary, student) is None  # the teacher's size not known yet
    both = {"name": "a", "lanes": ["default"], "memory_gb": 8, "models": [student, teacher]}
    only_student = {"name": "b", "lanes": ["default"], "memory_gb": 64, "models": [student]}
    assert routing.route("gkd", spec, [only_student]).waiting_for_worker == "no live worker has model 'tiny' and teacher 'big'"
    where = routing.route("gkd", spec, [both, only_student], warm=False)
    assert where.waiting_for_worker is None and where.need_gb == pytest.approx(alone + 3)
    assert where.queue == f"default@tiny@{routing.memory_class(alone + 3)}gb"


# --------------------------------------------------------------------------- jobs


def swapped_vocabulary(src, out):
    """The model with two tokens' ids swapped in its tokenizer: as many logits, another vocabulary."""
    shutil.copytree(src, out)
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    (a, i), (b, j) = sorted(vocab.items(), key=lambda kv: kv[1])[300:302]
    vocab[a], vocab[b] = j, i
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    from worker.runtime.make_model import make_model

    s = Stack(tmp_path_factory.mktemp("stack"), tiny_model)
    root = tmp_path_factory.mktemp("teachers")
    s.teacher = make_model(root / "teacher", size="tiny", seed=1)
    s.other_vocabulary = swapped_vocabulary(s.teacher, root / "other-vocabulary")
    s.env["MTQ_MODEL_ROOTS"] += os.pathsep + str(root)
    for started in running(s):
        s.worker = s.start_worker()
        yield started


@pytest.fixture(scope="module")
def client(stack):
    with stack.client() as c:
        yield c


def submit(client, body: dict) -> str:
    res = client.post(GKD, json=body)
    assert res.status_code == 200, res.text
    assert res.json()["kind"] == "gkd" and res.json()["teacher_model_id"] == body["teacher_model_id"]
    return res.json()["job_id"]


def events(stack, job_id: str, kind: str) -> list[dict]:
    return [e for _, e in read_events(stack.redis, job_id, count=100_000) if e["type"] == kind]


def kl_to_teacher(student_dir, teacher_dir, adapter_path=None) -> float:
    """KL(teacher || student) per completion token of VALID (EOS included), from both models'
    full logits here: what the job's val_loss is with beta 0."""
    import mlx_lm

    from worker.runtime.logprobs import pair_tokens

    student, tokenizer = mlx_lm.load(str(student_dir), adapter_path=adapter_path)
    teacher, _ = mlx_lm.load(str(teacher_dir))
    total, n = 0.0, 0
    for row in VALID:
        tokens, start = pair_tokens(tokenizer, row["prompt"], row["completion"])
        x = mx.array([tokens[:-1]])
        s, t = (np_log_softmax(np.array(m(x)[0, start - 1:], dtype=np.float64)) for m in (student, teacher))
        total += (np.exp(t) * (t - s)).sum()
        n += len(tokens) - start
    return total / n


def test_gkd_lowers_the_kl_to_the_teacher_and_a_zero_lr_control_does_not(stack, client):
    body = {"model_id": "tiny", "teacher_model_id": str(stack.teacher), "dataset": ROWS, "valid_dataset": VALID}
    learned = submit(client, {**body, "config": CONFIG})
    frozen = submit(client, {**body, "config": {**CONFIG, "learning_rate": 0.0, "iters": 3, "steps_per_eval": 3}})
    done = wait_done(stack, GKD, learned)
    wait_done(stack, GKD, frozen)
    steps, evals = events(stack, learned, "gkd_step"), events(stack, learned, "eval")
    control = events(stack, frozen, "eval")
    print("\nGKD loss, on_policy, completion length by step:",
          [(e["iter"], round(e["loss"], 5), e["on_policy"], e["completions/mean_length"]) for e in steps],
          "\nval_loss (KL to the teacher) by eval:", [(e["iter"], round(e["val_loss"], 5)) for e in evals])
    assert {e["on_policy"] for e in steps} == {0.0, 1.0}  # lmbda 0.5: the student's samples and the rows'
    assert all(e["on_policy"] == on_policy_step(0.5, 0, e["iter"] - 1) for e in steps)
    assert {"loss", "entropy", "grad_norm", "learning_rate", "completions/mean_length"} <= set(steps[-1])
    # Before training the student is its base: val_loss is the two models' KL as computed here.
    assert evals[0]["iter"] == 0 and evals[0]["val_loss"] == pytest.approx(kl_to_teacher(stack.tiny_model, stack.teacher),
                                                                           rel=1e-3)
    assert evals[-1]["val_loss"] < 0.9 * evals[0]["val_loss"]  # measured: 0.0248 -> 0.020
    assert evals[-1]["val_loss"] == pytest.approx(kl_to_teacher(stack.tiny_model, stack.teacher, done["adapter_path"]),
                                                  rel=1e-3)
    assert len({round(e["val_loss"], 7) for e in control}) == 1  # lr 0: the student stays its base
    # The worker keeps both models loaded: the second job found them so.
    assert events(stack, frozen, "model_ready")[0]["cached"] is True

    def loaded() -> dict:
        return {m["model_id"]: m["loaded"] for m in client.get("/admin/api/fine-tune/models").json()}

    wait_for(lambda: loaded()["tiny"] and loaded()[str(stack.teacher)], 10, "both models advertised as loaded")


def test_a_teacher_of_another_vocabulary_a_missing_one_or_a_prompt_too_long_fails_the_job(stack, client):
    job = submit(client, {"model_id": "tiny", "teacher_model_id": str(stack.other_vocabulary), "dataset": ROWS,
                          "config": {**CONFIG, "iters": 2}})
    failed = wait_done(stack, GKD, job, status="failed")
    assert "another vocabulary" in failed["error"] and "tokenizer" in failed["error"]
    assert "Traceback" not in failed["error"]
    long_prompt = {"prompt": " ".join(WORDS * 4), "completion": " red"}
    job = submit(client, {"model_id": "tiny", "teacher_model_id": str(stack.teacher), "dataset": [*ROWS, long_prompt],
                          "config": {**CONFIG, "iters": 2}})
    failed = wait_done(stack, GKD, job, status="failed")
    assert failed["error"].startswith(f"dataset[{len(ROWS)}]: its prompt is") and "max_seq_length (64)" in failed["error"]
    # A worker with the student takes the job from the student's queue; without the teacher it fails it.
    job = submit(client, {"model_id": "tiny", "teacher_model_id": "no-such-teacher", "dataset": ROWS})
    failed = wait_done(stack, GKD, job, status="failed")
    assert failed["error"] == "teacher_model_id: model not found: 'no-such-teacher' (no model of that name in the models directory)"


@pytest.mark.parametrize("change,words", [
    ({"teacher_model_id": "/etc"}, "MTQ_MODEL_ROOTS"),
    ({"teacher_model_id": "../up"}, "teacher_model_id"),
    ({"teacher_model_id": None}, "teacher_model_id"),
    ({"dataset": [{"prompt": "only a prompt"}]}, "GKD rows are {prompt, completion}"),
    ({"config": {"lmbda": 1.5}}, "lmbda"),
    ({"config": {"beta": -0.1}}, "beta"),
    ({"config": {"max_new_tokens": 64, "max_seq_length": 64}}, "max_new_tokens"),
    ({"config": {"workers": 2}}, "workers"),
])
def test_hostile_specs_are_400(stack, client, change, words):
    body = {"model_id": "tiny", "teacher_model_id": str(stack.teacher), "dataset": ROWS, **change}
    res = client.post(GKD, json=body)
    assert res.status_code == 400 and words in res.text, res.text


def test_kill_9_of_the_training_process_resumes_with_every_step_once_and_the_same_draws(stack, client, tmp_path):
    """Submitted by `mtq submit --kind gkd --teacher ... --dataset FILE` (the rows uploaded)."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps(r) for r in ROWS))
    sets = [f"{k}={v}" for k, v in {**CONFIG, "iters": 16, "steps_per_save": 2, "learning_rate": 1e-3}.items()]
    env = dict({k: v for k, v in stack.env.items() if k != "REDIS_URL"}, MTQ_API_URL=stack.base_url, COLUMNS="200")
    res = subprocess.run([sys.executable, "-m", "cli.main", "submit", "--kind", "gkd", "--model", "tiny", "--teacher",
                          str(stack.teacher), "--dataset", str(rows), "--set", *sets], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "(gkd, queued)" in res.stdout, res.stdout + res.stderr
    job = res.stdout.split("submitted job ")[1].split()[0]
    assert client.get(f"{GKD}/{job}").json()["dataset"].startswith("file-")
    child = wait_for(lambda: events(stack, job, "started"), 120, "the start")[-1]["pid"]
    kill_when(lambda: (client.get(f"{GKD}/{job}").json()["checkpoint_step"] or 0) >= 4, child, "a checkpoint")
    done = wait_done(stack, GKD, job, timeout=180)
    assert done["failed_attempts"] == 1 and done["resumed_from"] >= 4 and done["progress"]["iter"] == 16
    history = client.get(f"{GKD}/{job}/history").json()["history"]
    assert [h["step"] for h in history] == list(range(1, 17))  # every step once
    # Steps run twice (after the checkpoint, before the kill) drew the same rows and samples: the same loss.
    by_iter: dict[int, list[float]] = {}
    for e in events(stack, job, "gkd_step"):
        assert e["on_policy"] == on_policy_step(0.5, 0, e["iter"] - 1)
        by_iter.setdefault(e["iter"], []).append(e["loss"])
    assert all(max(v) == pytest.approx(min(v), rel=1e-4) for v in by_iter.values())


def test_a_cancel_stops_the_students_sampling(stack):
    """In the training process's code, without a worker: should_stop, asked between decode chunks, ends the step."""
    import mlx_lm

    from shared.train_specs import GKDJobCreate
    from worker.kinds.gkd_job import GKDTrainer
    from worker.runtime.adapter_layers import attach_adapter
    from worker.runtime.train_core import Cancelled, TrainState

    model, tokenizer = mlx_lm.load(str(stack.tiny_model))
    teacher, teacher_tokenizer = mlx_lm.load(str(stack.teacher))
    spec = GKDJobCreate(model_id="tiny", teacher_model_id=str(stack.teacher), dataset=ROWS,
                        config={**CONFIG, "lmbda": 1.0, "max_new_tokens": 48})
    attach_adapter(model, spec.config)
    asked = []
    trainer = GKDTrainer(model, tokenizer, spec, ROWS, None, teacher, teacher_tokenizer, lambda: asked.append(1) or True)
    with pytest.raises(Cancelled):
        trainer.step(TrainState())
    assert asked == [1]  # after the first chunk of tokens, not at the end of the decode
