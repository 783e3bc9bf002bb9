"""The multi-turn decode (worker/decode/episodes.py) records the log-probs a teacher-forced pass
over the whole conversation gives, and GRPO's loss sees only the model's tokens of it.

The answers here are scripted token lists (a row's turn is answered by fixed tokens that depend
on the row and the turn), so the test is about the decode: rows waiting while others decode,
appended turns of different lengths prefilled into holes of the KV buffers, packing, bounds.
"""

from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.tuner.utils import linear_to_lora_layers

from worker.agentic.conversation import Conversation
from worker.agentic.episode import EpisodeFailed
from worker.decode.draw import SamplingParams
from worker.decode.episodes import Limits, make_episode_step, sample_episodes
from worker.kinds.grpo import grpo_loss
from worker.runtime.logprobs import completion_logprobs, left_pad
from worker.runtime.projection_groups import fuse_shared_inputs

PAD = 7
EOS = list(range(0, 1024, 9))  # about 11% of the vocabulary: turns end after a few tokens
PROMPTS = [[5, 9, 11, 300, 2], [17], [40, 41, 42, 43, 44, 45, 46, 47, 48], [3, 4]]


@pytest.fixture(scope="module")
def model(tiny_model):
    model = mlx_lm.load(str(tiny_model))[0]
    fuse_shared_inputs(model)
    model.freeze()
    mx.random.seed(0)
    linear_to_lora_layers(model, 2, {"rank": 4, "scale": 2.0, "dropout": 0.0})
    for i, (name, b) in enumerate(tree_flatten(model.trainable_parameters())):
        if name.endswith("lora_b"):
            model.update(tree_unflatten([(name, 0.05 * mx.random.normal(b.shape, key=mx.random.key(i)))]))
    model.eval()
    return model


def scripted(lengths):
    """An answer for row r's k-th turn: lengths[(r + k) % len(lengths)] tokens, None once that is 0."""
    calls = {}

    def answer(row, tokens):
        k = calls[row] = calls.get(row, 0) + 1
        n = lengths[(row + k) % len(lengths)]
        return None if n == 0 else [(100 + 13 * row + 7 * k + i) % 1000 + 1 for i in range(n)]

    return answer


def decode(model, answer, max_turns=4, max_tokens=40, episode_len=120, temperature=1.0):
    p = SamplingParams(max_tokens, temperature)
    step = make_episode_step(model, p, EOS, PAD)
    with ThreadPoolExecutor(4) as pool:
        return sample_episodes(model, step, PROMPTS, p, Limits(max_turns, episode_len), EOS, PAD, mx.random.key(3),
                               answer, pool)


def rescore(model, episodes, temperature=1.0):
    """log pi of every token after each prompt, teacher-forced over the whole conversation."""
    s = episodes.samples
    prompts, pad = left_pad(PROMPTS, pad_id=0)
    inputs = mx.concatenate([prompts, s.tokens], axis=1)
    return np.array(completion_logprobs(model, inputs, pad, s.tokens, temperature, 4096))


@pytest.mark.parametrize("lengths", [[3, 11, 0, 5], [1, 30, 2, 0], [6]])
def test_recorded_logprobs_are_a_teacher_forced_rescore_of_the_conversation(model, lengths):
    episodes = decode(model, scripted(lengths))
    s = episodes.samples
    mask = np.array(s.mask)
    turns = [len(t) for t in episodes.turns]
    assert max(turns) >= 2 and episodes.appended_tokens > 0  # turns were answered and appended
    assert len(set(turns)) > 1 or lengths == [6]  # rows of different turn counts (the waits, the holes)
    np.testing.assert_allclose(np.where(mask, rescore(model, episodes), 0), np.array(s.logprobs), atol=3e-5, rtol=1e-5)
    # The appended tokens are in the rows, unmasked for the decode, masked for the loss.
    for r, row_turns in enumerate(episodes.turns):
        for (start, end), (nxt, _) in zip(row_turns, row_turns[1:]):
            assert mask[r, start:end].all() and not mask[r, end:nxt].any() and nxt > end


def test_bounds_end_episodes(model):
    # Every answer goes on: max_turns ends them, or the episode's tokens, or the model's.
    for max_turns, max_tokens, episode_len in [(3, 200, 400), (8, 200, 60), (8, 25, 400)]:
        episodes = decode(model, scripted([4]), max_turns, max_tokens, episode_len)
        mask = np.array(episodes.samples.mask)
        assert all(len(t) <= max_turns for t in episodes.turns)
        assert (mask.sum(axis=1) <= max_tokens).all()
        lengths = [t[-1][1] for t in episodes.turns]
        assert max(lengths) <= episode_len
        assert not np.array(episodes.samples.ended).any()  # each was cut by a bound, none ended on its own
        np.testing.assert_allclose(np.where(mask, rescore(model, episodes), 0), np.array(episodes.samples.logprobs),
                                   atol=3e-5, rtol=1e-5)


def test_an_episode_that_nothing_answers_is_one_turn_and_ended(model):
    episodes = decode(model, lambda row, tokens: None)
    assert all(len(t) == 1 for t in episodes.turns) and episodes.appended_tokens == 0
    mask, ended = np.array(episodes.samples.mask), np.array(episodes.samples.ended)
    last = np.array(episodes.samples.tokens)[np.arange(len(PROMPTS)), mask.sum(axis=1) - 1]
    np.testing.assert_array_equal(ended, np.isin(last, EOS))


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_masked_tokens_add_nothing_to_the_loss_or_its_gradients(loss_type, level):
    """What tools appended (masked) may have any log-probs: the loss and its gradients are the same."""
    rng = np.random.default_rng(0)
    rows, T = 6, 20
    mask = mx.array(rng.random((rows, T)) < 0.6)
    logp = mx.array(rng.normal(-2, 0.5, (rows, T)).astype(np.float32))
    old, ref = (mx.array(rng.normal(-2, 0.5, (rows, T)).astype(np.float32)) for _ in range(2))
    adv = mx.array(rng.normal(0, 1, rows).astype(np.float32))
    kw = dict(loss_type=loss_type, importance_sampling_level=level, epsilon_low=0.2, epsilon_high=0.28, beta=0.04,
              max_completion_len=T)

    def loss(logp, old, ref):
        return grpo_loss(logp, old, ref, adv, mask, **kw)[0]

    grad = mx.grad(loss, argnums=(0, 1, 2))
    noise = mx.array(rng.normal(0, 3, (rows, T)).astype(np.float32))
    changed = [mx.where(mask, a, a + noise) for a in (logp, old, ref)]  # other values at masked tokens only
    assert loss(logp, old, ref).item() == pytest.approx(loss(*changed).item(), abs=1e-6)
    for g, g2 in zip(grad(logp, old, ref), grad(*changed)):
        np.testing.assert_allclose(np.array(g), np.array(g2), atol=1e-6)
        assert not np.array(g)[~np.array(mask)].any()  # no gradient reaches a masked token


def test_a_tokenizer_without_a_chat_template_cannot_hold_a_conversation(tiny_model):
    tokenizer = mlx_lm.load(str(tiny_model))[1]
    assert Conversation(tokenizer, [{"role": "user", "content": "hi"}], None).prompt_tokens()
    tokenizer._tokenizer.chat_template = None
    with pytest.raises(EpisodeFailed, match="chat template"):
        Conversation(tokenizer, [{"role": "user", "content": "hi"}], None)
