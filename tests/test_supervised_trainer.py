"""The supervised kinds' trainer (worker/kinds/supervised_trainer.py) on the tiny model in this process:
what the job tests do not see from outside (gradient accumulation, gradient checkpointing,
DoRA, the reference policy, the shared model left clean for the next job)."""

import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.tuner.dora import DoRALinear
from mlx_lm.tuner.lora import LoRALinear

from shared.train_specs import DPOJobCreate, SFTJobCreate, quantization
from worker.kinds.dpo_job import DPOTrainer
from worker.kinds.sft_job import SFTTrainer
from worker.runtime.adapter_layers import attach_adapter, lora_disabled, remove_adapter_layers
from worker.runtime.logprobs import sequence_logps, token_logps
from worker.runtime.models import gradient_checkpointing
from worker.runtime.projection_groups import PAIR
from worker.runtime.train_core import Rows, TrainState

ROWS = [{"prompt": "Q0?", "completion": "red apple"}, {"prompt": "Q1?", "completion": "blue stone"}]
Q4 = quantization(4, "affine")  # a qlora job's base: 4-bit affine
BASE = dict(lora_layers=-1, lora_rank=4, lora_alpha=4, learning_rate=1e-2, batch_size=2, iters=3, mask_prompt=True)


@pytest.fixture(scope="module")
def lm(tiny_model):
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(tiny_model))
    yield model, tokenizer
    remove_adapter_layers(model)


def sft(lm, rows=ROWS, fine_tune_type="lora", **config) -> SFTTrainer:
    model, tokenizer = lm
    spec = SFTJobCreate(model_id="tiny", dataset=rows, config={**BASE, "fine_tune_type": fine_tune_type, **config})
    mx.random.seed(0)
    attach_adapter(model, spec.config, fine_tune_type)
    return SFTTrainer(model, tokenizer, spec, rows, rows)


def weights(model) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in tree_flatten(model.trainable_parameters())}


def test_gradient_checkpointing_changes_nothing_but_memory_and_is_undone(lm):
    plain = sft(lm)
    plain_metrics = plain.step(TrainState())
    plain_weights = weights(plain.module)
    layer_class = type(lm[0].layers[0])
    call = layer_class.__call__
    checkpointed = sft(lm)
    with gradient_checkpointing(lm[0], True):
        assert layer_class.__call__ is not call
        metrics = checkpointed.step(TrainState())
    assert layer_class.__call__ is call  # other jobs get the class as it was
    assert metrics["loss"] == pytest.approx(plain_metrics["loss"], rel=1e-5)
    for name, w in weights(checkpointed.module).items():
        np.testing.assert_allclose(w, plain_weights[name], rtol=1e-4, atol=1e-6)


def test_gradient_accumulation_averages_micro_batches(lm):
    """Two micro-batches of one row each, with the same number of trained tokens, make the
    same update as one batch of both (the optimizer sees the mean gradient)."""
    rows = [{"prompt": "Q0?", "completion": "red"}, {"prompt": "Q1?", "completion": "sun"}]
    one = sft(lm, rows, batch_size=2)
    trained = [len(t) - s for t, s in zip(one.train_tok.tokens, one.train_tok.starts)]
    assert trained[0] == trained[1]
    m1 = one.step(TrainState())
    w1 = weights(one.module)
    two = sft(lm, rows, batch_size=1, grad_accumulation_steps=2)
    m2 = two.step(TrainState())
    assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-5) and m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-4)
    for name, w in weights(two.module).items():
        np.testing.assert_allclose(w, w1[name], rtol=1e-4, atol=1e-6)


def test_dora_trains_and_the_shared_model_is_left_without_adapters(lm):
    trainer = sft(lm, fine_tune_type="dora")
    model = lm[0]
    assert any(isinstance(m, DoRALinear) for _, m in model.named_modules())
    before = weights(model)
    trainer.step(TrainState())
    assert any(not np.allclose(before[k], v) for k, v in weights(model).items())
    remove_adapter_layers(model)  # what the job does at its end
    assert not any(isinstance(m, (LoRALinear, DoRALinear)) for _, m in model.named_modules())


# --------------------------------------------------------------------------- SFT rows with tools and weights

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = {"role": "assistant", "content": None,
        "tool_calls": [{"type": "function", "id": "call_0", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
TOOL_ROW = {"tools": TOOLS, "messages": [
    {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}, CALL,
    {"role": "tool", "content": "sunny, 21C", "tool_call_id": "call_0"}, {"role": "assistant", "content": "Sunny, 21C."}]}
USER, ANSWER = {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Sunny."}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'


def runs(tokenizer, tokens: list[int], mask: list[int]) -> tuple[list[str], list[str]]:
    """The texts of the runs of trained tokens, and of the runs of the others."""
    from itertools import groupby

    out = ([], [])
    for on, run in groupby(zip(tokens, mask), key=lambda p: p[1]):
        out[1 - on].append(tokenizer.decode([t for t, _ in run]))
    return out


def test_a_tool_conversation_trains_exactly_its_assistant_messages(lm):
    """Without mask_prompt, a row with tools trains on its assistant messages only: the tool
    call and the answer, each with its end of turn; not the system turn with the tools' schemas,
    the user's question, the tool's result or the assistant turns' headers. Its tokens are
    mlx_lm's (the chat template with tools=), and the batch's mask is the row's."""
    from worker.kinds.sft_job import tokenize_rows

    _, tokenizer = lm
    trainer = sft(lm, [TOOL_ROW], mask_prompt=False)
    tokens, mask = trainer.train_tok.tokens[0], trainer.train_tok.masks[0]
    assert tokens == tokenizer.apply_chat_template(TOOL_ROW["messages"], tools=TOOLS, return_dict=False)
    trained, other = runs(tokenizer, tokens, mask)
    assert trained == [CALL_TEXT, "Sunny, 21C.<|im_end|>\n"]
    assert len(other) == 2 and '"name": "get_weather"' in other[0] and "Be brief." in other[0]
    assert other[0].endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    assert other[1] == "<|im_start|>user\n<tool_response>\nsunny, 21C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    (_, _, batch_mask), n = trainer.arrays([0], trainer.train_rows)
    assert np.array(batch_mask[0]).tolist()[:len(tokens) - 1] == mask[1:] and n == sum(mask)
    assert trainer.step(TrainState())["loss"] > 0
    as_object = {**CALL, "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    row = {**TOOL_ROW, "messages": [*TOOL_ROW["messages"][:2], as_object, *TOOL_ROW["messages"][3:]]}
    assert tokenize_rows(tokenizer, [row], trainer.cfg, "dataset").tokens == [tokens]  # arguments as an object render alike


@pytest.mark.parametrize("row,setting,on", [
    ({"messages": [USER, ANSWER], "tools": TOOLS}, None, True),
    ({"messages": [USER, CALL]}, None, True),
    ({"messages": [USER, {"role": "tool", "content": "x"}, ANSWER]}, None, True),
    ({"messages": [USER, {**ANSWER, "weight": 1}]}, None, True),
    ({"messages": [USER, ANSWER, USER, ANSWER]}, None, True),
    ({"messages": [USER, ANSWER], "tools": []}, None, False),
    ({"messages": [USER, ANSWER]}, None, False),
    ({"messages": [USER, ANSWER]}, True, True),
    ({"messages": [USER, ANSWER], "tools": TOOLS}, False, False),
    ({"prompt": "p", "completion": "c"}, None, False),
])
def test_which_rows_train_on_their_assistant_messages_only(row, setting, on):
    """assistant_only_loss None (the default): the messages rows with tools, a tool call, a tool
    message, a weight or several assistant messages; true: every messages row; false: none."""
    from shared.datasets import assistant_only

    assert assistant_only(row, setting) is on


def test_weight_0_masks_an_assistant_message_and_several_turns_train_each_assistant(lm):
    _, tokenizer = lm
    weighted = {**TOOL_ROW, "messages": [*TOOL_ROW["messages"][:2], {**CALL, "weight": 0}, TOOL_ROW["messages"][3],
                                         {**TOOL_ROW["messages"][4], "weight": 1}]}
    two_turns = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                              {"role": "user", "content": "Colour?"}, {"role": "assistant", "content": "red"}]}
    for mask_prompt in (False, True):  # mask_prompt: the last assistant message alone of mlx_lm's rows, not of these
        tok = sft(lm, [weighted, two_turns], mask_prompt=mask_prompt).train_tok
        assert runs(tokenizer, tok.tokens[0], tok.masks[0])[0] == ["Sunny, 21C.<|im_end|>\n"]
        assert runs(tokenizer, tok.tokens[1], tok.masks[1])[0] == ["Hello.<|im_end|>\n", "red<|im_end|>\n"]
    # assistant_only_loss false: every row as mlx_lm's ChatDataset (without mask_prompt: every token)
    tok = sft(lm, [TOOL_ROW, {"messages": two_turns["messages"][:2]}], mask_prompt=False, assistant_only_loss=False).train_tok
    assert tok.masks is None and tok.starts == [1, 1]
    # true: a row of one turn too (as mask_prompt would)
    tok = sft(lm, [{"messages": two_turns["messages"][:2]}], mask_prompt=False, assistant_only_loss=True).train_tok
    assert runs(tokenizer, tok.tokens[0], tok.masks[0])[0] == ["Hello.<|im_end|>\n"]


@pytest.mark.parametrize("mask_prompt", [False, True])
def test_rows_without_tools_weights_or_turns_are_tokenised_by_mlx_lm_as_before(lm, mask_prompt):
    """Rows of one assistant turn, without tools or weights, are mlx_lm's dataset classes' (no
    per-token mask); next to a tool row they keep their tokens, and their mask is their start on."""
    from mlx_lm.tuner.datasets import create_dataset

    from worker.kinds.sft_job import tokenize_rows
    from worker.runtime.train_core import pad_rows

    _, tokenizer = lm
    chat = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Q{i}?"},
                          {"role": "assistant", "content": "red apple"}]} for i in range(2)]
    for rows in (chat, ROWS):
        spec = SFTJobCreate(model_id="tiny", dataset=rows, config={**BASE, "mask_prompt": mask_prompt})
        dataset = create_dataset(rows, tokenizer, spec.config)
        want = [dataset.process(dataset[i]) for i in range(len(rows))]
        got = tokenize_rows(tokenizer, rows, spec.config, "dataset")
        assert got.masks is None and got.tokens == [list(t) for t, _ in want] and got.starts == [max(o, 1) for _, o in want]
    mixed = tokenize_rows(tokenizer, [chat[0], TOOL_ROW], spec.config, "dataset")
    plain = tokenize_rows(tokenizer, chat[:1], spec.config, "dataset")
    assert mixed.tokens[0] == plain.tokens[0] and mixed.starts[0] == plain.starts[0]
    assert np.array_equal(np.array(pad_rows(Rows(mixed.tokens[:1], mixed.starts[:1], mixed.masks[:1])).mask),
                          np.array(pad_rows(plain).mask))


def test_rows_that_cannot_be_masked_fail_when_the_job_tokenises_them(tiny_model):
    """The rows of files and paths, checked only there: one that would train no token, one that
    the chat template does not render incrementally."""
    from mlx_lm.utils import load_tokenizer

    from shared.datasets import DatasetError
    from shared.train_specs import SFTConfig
    from worker.kinds.sft_job import tokenize_rows

    tokenizer = load_tokenizer(tiny_model)
    with pytest.raises(DatasetError, match=r"^valid_dataset\[1\]: no assistant message of weight 1"):
        tokenize_rows(tokenizer, [TOOL_ROW, {"messages": [USER, {**ANSWER, "weight": 0}]}], SFTConfig(), "valid_dataset")
    tokenizer._tokenizer.chat_template = (  # the count of messages first: no rendering is a prefix of a longer one's
        "{{ messages | length }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(DatasetError, match=r"^dataset\[0\]: the chat template does not render this conversation "
                                           r"incrementally \(messages\[:1\] with the generation prompt is not a prefix of messages\[:2\]\)"):
        tokenize_rows(tokenizer, [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
                                                {"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]}],
                      SFTConfig(), "dataset")


@pytest.mark.parametrize("row,config,error", [
    ({"messages": [USER, {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{x"}}]}]},
     {}, "dataset[0]: 'messages[1].tool_calls[0].function.arguments' is a string but not JSON"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [{"function": {"name": "", "arguments": {}}}]}]},
     {}, "dataset[0]: 'messages[1].tool_calls[0].function.name' must be a non-empty string"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": []}]}, {}, "dataset[0]: 'messages[1].tool_calls' must be a non-empty list"),
    ({"messages": [{**USER, "tool_calls": CALL["tool_calls"]}]}, {}, "'messages[0].tool_calls': only assistant messages call tools"),
    ({"messages": [USER, {"role": "assistant", "content": None}]}, {}, "'messages[1]' must be {role: system|user|assistant|tool, content: string}"),
    ({"messages": [USER, {"role": "tool", "content": "x", "tool_call_id": 3}]}, {}, "'messages[1].tool_call_id' must be a non-empty string"),
    ({"messages": [USER, {"role": "tool", "content": "x", "name": ""}]}, {}, "'messages[1].name' must be a non-empty string"),
    ({"messages": [USER, {"role": "tool", "content": None}]}, {}, "'messages[1]' must be {role: system|user|assistant|tool, content"),
    ({"messages": [{**USER, "weight": 0}]}, {}, "'messages[0].weight' must be 0 or 1, on an assistant message"),
    ({"messages": [USER, {"role": "assistant", "content": "x", "weight": 0.5}]}, {}, "'messages[1].weight' must be 0 or 1"),
    ({"messages": [USER], "tools": [{"name": "f"}]}, {}, "'tools[0]' must be {type: \"function\", function: {name"),
    ({"messages": [USER, {"role": "assistant", "content": "x", "weight": 0}]}, {},
     "dataset[0]: no assistant message of weight 1: the row would train no token"),
    ({"messages": [USER, {"role": "tool", "content": "x"}]}, {}, "dataset[0]: no assistant message of weight 1"),
    ({"messages": [{"role": "assistant", "content": "x"}, USER, {"role": "assistant", "content": "y"}]}, {},
     "dataset[0]: the first message is the assistant's"),
    ({"messages": [USER, {"role": "assistant", "content": "x", "weight": 0}, {"role": "assistant", "content": "y"}]},
     {"assistant_only_loss": False}, "dataset[0]: weight 0 needs assistant_only_loss"),
    ({"prompt": "p", "completion": "c"}, {"assistant_only_loss": True}, "dataset[0]: assistant_only_loss needs messages rows"),
    ({"text": "t"}, {"assistant_only_loss": True}, "dataset[0]: assistant_only_loss needs messages rows"),
])
def test_tool_and_weight_rows_are_checked_with_clear_errors(row, config, error):
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as e:
        SFTJobCreate(model_id="tiny", dataset=[row], config=config)
    assert error in str(e.value)


def dpo(lm, pairs, **config) -> DPOTrainer:
    model, tokenizer = lm
    spec = DPOJobCreate(model_id="tiny", preference_pairs=pairs,
                        config={**{k: v for k, v in BASE.items() if k != "mask_prompt"}, **config})
    mx.random.seed(0)
    attach_adapter(model, spec.config)
    return DPOTrainer(model, tokenizer, spec, pairs, None)


PAIRS = [{"prompt": f"Q{i}?", "chosen": "yes good " * (i + 1), "rejected": "no bad"} for i in range(4)]


def test_dpo_reference_is_the_model_with_lora_off(lm):
    """After some training the reference log-probs a batch gets are the model's with the LoRA
    off, computed here afresh, while the policy's moved."""
    model, _ = lm
    trainer = dpo(lm, PAIRS[:2])
    for _ in range(3):
        trainer.step(TrainState())
    (inputs, targets, mask, ref), _ = trainer.arrays([0, 1], trainer.train_rows)
    with lora_disabled(model):
        fresh = sequence_logps(token_logps(model(inputs), targets), mask)
    np.testing.assert_allclose(np.array(ref), np.array(fresh), rtol=1e-5)
    policy = sequence_logps(token_logps(model(inputs), targets), mask)
    assert not np.allclose(np.array(policy), np.array(ref))  # the policy moved, the reference did not


def test_dpo_computes_each_reference_once_and_a_resume_keeps_them(lm):
    """Each pair's reference log-probs are computed at its first step only; a job resumed from a
    checkpoint has them from the checkpoint (computes none of them again) and takes the same
    steps as one that never stopped."""
    from worker.runtime import checkpoints

    straight = dpo(lm, PAIRS, iters=4)
    state = TrainState()
    losses = [straight.step(state)["loss"] for _ in range(4)]  # two epochs of two batches of two pairs
    assert straight.reference.computed == 4
    first = dpo(lm, PAIRS, iters=4)
    state = TrainState()
    for _ in range(2):
        first.step(state)
    blobs = checkpoints.to_blobs(checkpoints.snapshot(first.module, first.optimizer, state, first.reference))
    first.step(state)  # the snapshot holds the tables as they were at step 2
    resumed = dpo(lm, PAIRS, iters=4)
    state = checkpoints.restore(resumed.module, resumed.optimizer, {k.encode(): v for k, v in blobs.items()},
                                resumed.reference)
    np.testing.assert_array_equal(resumed.reference.tables["train"], first.reference.tables["train"])
    assert [resumed.step(state)["loss"] for _ in range(2)] == pytest.approx(losses[2:], rel=1e-6)
    assert resumed.reference.computed == 0
    # Resumed with another loss_type: every loss type keeps sums (IPO divides them by the token counts), so the
    # checkpoint's tables serve it; tables of other values (IPO's per-token means, before) would be computed again.
    ipo = dpo(lm, PAIRS, iters=4, loss_type=["ipo", "sigmoid"])
    checkpoints.restore(ipo.module, ipo.optimizer, {k.encode(): v for k, v in blobs.items()}, ipo.reference)
    np.testing.assert_array_equal(ipo.reference.tables["train"], first.reference.tables["train"])
    fresh = dpo(lm, PAIRS, iters=4, loss_type="ipo")
    fresh.reference.restore({"train/mean": mx.array(first.reference.tables["train"])})
    assert np.isnan(fresh.reference.tables["train"]).all()


@pytest.mark.parametrize("kind", ["sft", "dpo", "reward"])
def test_the_compiled_step_equals_the_uncompiled_one(lm, kind):
    """The step compiled with its optimizer and random state (worker/kinds/supervised_trainer.py make_step)
    trains as the plain one: the same losses, gradient norms and weights, with LoRA dropout and
    gradient accumulation (SFT), a learning-rate schedule and clipped gradients."""
    from shared.train_specs import RewardJobCreate
    from worker.kinds.reward_model_job import RewardTrainer

    model, tokenizer = lm
    config = {**{k: v for k, v in BASE.items() if k != "mask_prompt"}, "lora_dropout": 0.1, "iters": 3,
              "lr_schedule": {"name": "cosine_decay", "arguments": [1e-2, 3], "warmup": 1}, "max_grad_norm": 0.5}
    runs = []
    for compiled in (False, True):
        if kind == "sft":
            trainer = sft(lm, batch_size=1, grad_accumulation_steps=2, lora_dropout=0.1, iters=3, max_grad_norm=0.5)
        elif kind == "dpo":
            trainer = dpo(lm, PAIRS, **config)
        else:
            mx.random.seed(0)
            spec = RewardJobCreate(model_id="tiny", preference_pairs=PAIRS, config=config)
            attach_adapter(model, spec.config)
            trainer = RewardTrainer(model, tokenizer, spec, PAIRS, None)
        trainer.compiled = compiled
        state = TrainState()
        metrics = [trainer.step(state) for _ in range(3)]
        runs.append((metrics, weights(trainer.module)))
    (plain, plain_weights), (compiled, compiled_weights) = runs
    for a, b in zip(plain, compiled):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["learning_rate"] == pytest.approx(a["learning_rate"], rel=1e-6)
    assert plain[0]["loss"] != plain[2]["loss"] and max(m["grad_norm"] for m in plain) > 0.5  # it trained, clipped
    for name, w in compiled_weights.items():
        np.testing.assert_allclose(w, plain_weights[name], rtol=1e-4, atol=1e-6)


def test_kto_kl_estimate_scores_each_prompt_with_the_previous_row_s_completion(lm):
    """After some training, a batch's z0 is the mean of policy minus reference (LoRA off)
    log-probs of the rotated pairs, each scored here one row at a time from its own tokens."""
    from shared.train_specs import KTOJobCreate
    from worker.kinds.kto_job import KTOTrainer

    model, tokenizer = lm
    rows = [{"prompt": "Q0?", "completion": "red apple", "label": True}, {"prompt": "Q1?", "completion": "no", "label": False},
            {"prompt": "Tell me.", "completion": "blue stone river", "label": True}]
    spec = KTOJobCreate(model_id="tiny", dataset=rows, config={**{k: v for k, v in BASE.items() if k != "mask_prompt"},
                                                               "batch_size": 3, "learning_rate": 5e-2,
                                                               # the optimizer this was measured with (mlx_lm's)
                                                               "bias_correction": False, "max_grad_norm": None})
    mx.random.seed(0)
    attach_adapter(model, spec.config)
    trainer = KTOTrainer(model, tokenizer, spec, rows, None)
    for _ in range(3):
        trainer.step(TrainState())

    def logp(prompt: str, completion: str) -> float:
        tokens = tokenizer.encode(prompt) + tokenizer.encode(completion, add_special_tokens=False) + [tokenizer.eos_token_id]
        start = len(tokenizer.encode(prompt))
        logps = token_logps(model(mx.array([tokens[:-1]])), mx.array([tokens[1:]]))[0]
        return float(logps[start - 1:].sum().item())

    ids = [2, 0, 1]
    (*_, kl), _ = trainer.arrays(ids, rows)
    pairs = [(rows[2]["prompt"], rows[1]["completion"]), (rows[0]["prompt"], rows[2]["completion"]),
             (rows[1]["prompt"], rows[0]["completion"])]
    policy = [logp(*p) for p in pairs]
    with lora_disabled(model):
        reference = [logp(*p) for p in pairs]
    assert float(kl.item()) == pytest.approx(max(0.0, float(np.mean(np.subtract(policy, reference)))), rel=1e-4, abs=1e-6)
    assert float(kl.item()) > 0.01  # the policy moved (measured z0: 0.11): the check above is not 0 == 0


def test_full_fine_tuning_is_bounded_and_quantized_bases_are_refused(tiny_model, tmp_path, monkeypatch):
    """private_base (a full / qlora job's own copy of the model) refuses, before reading any weight,
    a model above MTQ_FULL_FINETUNE_MAX_GB for full, and a base quantized already."""
    from shared.settings import load_settings
    from worker.runtime.make_model import make_model
    from worker.runtime.models import UnsupportedBase, private_base

    quantized = make_model(tmp_path / "tiny-q8", size="tiny", quantize=8)
    monkeypatch.setenv("MTQ_MODELS_DIR", str(tiny_model.parent))
    monkeypatch.setenv("MTQ_MODEL_ROOTS", str(tmp_path))
    monkeypatch.setenv("MTQ_FULL_FINETUNE_MAX_GB", "0.0005")  # the tiny model's weights: 0.56 MB
    with pytest.raises(UnsupportedBase, match=r"its weights are 0.000559 GB, above MTQ_FULL_FINETUNE_MAX_GB \(0.0005 GB"):
        private_base("tiny", load_settings(), "full", None)
    model, _, _, quantization = private_base("tiny", load_settings(), "lora", Q4)  # the bound is full's only
    assert quantization == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert type(model.layers[0].mlp.up_proj).__name__ == "QuantizedLinear"
    monkeypatch.setenv("MTQ_FULL_FINETUNE_MAX_GB", "0.001")
    assert private_base("tiny", load_settings(), "full", None)[3] is None
    with pytest.raises(UnsupportedBase, match="is already quantized"):
        private_base(str(quantized), load_settings(), "lora", Q4)


def test_the_step_benchmark_imports_only_mlx_and_its_dependencies():
    """bench/train_step.py (and so the trainers) must run where only MLX's wheels are installed
    (the H200): no package beyond what mlx, mlx_lm, numpy, pydantic, transformers and tokenizers
    import themselves (no redis, rq, httpx, re2, jsonschema)."""
    import subprocess
    import sys

    from conftest import ROOT

    code = """
import runpy, sys
def tops():
    return {m.split('.')[0] for m in sys.modules if m.split('.')[0] not in sys.stdlib_module_names and not m.startswith('_')}
import mlx.core, mlx.nn, mlx.optimizers, mlx_lm, mlx_lm.tuner.trainer, mlx_lm.tuner.datasets, mlx_lm.utils
import numpy, pydantic, annotated_types, transformers, tokenizers
allowed = tops() | {"shared", "worker"}
sys.argv = ["bench/train_step.py", "--help"]
try:
    runpy.run_path("bench/train_step.py", run_name="__main__")
except SystemExit:
    pass
print(sorted(tops() - allowed))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "MTQ_OPENBLAS": "0"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


# --------------------------------------------------------------------------- the optimizer


def update_size(lm, **config) -> tuple[float, dict]:
    """The largest change of any trainable weight in one SFT step, and the step's metrics."""
    trainer = sft(lm, **config)
    before = weights(trainer.module)
    metrics = trainer.step(TrainState())
    return max(float(np.abs(w - before[k]).max()) for k, w in weights(trainer.module).items()), metrics


def test_the_supervised_kinds_step_with_trls_adamw_or_on_request_mlx_lms(lm):
    """One step from LoRA B = 0 (A gets no gradient yet): bias-corrected AdamW moves each weight
    by about lr (m / sqrt(v) = sign(g)); MLX's AdamW without bias correction (mlx_lm's, the seed
    server's) by 0.1 / sqrt(0.001) = 3.16 lr."""
    trl, _ = update_size(lm)
    mlx_lm_like, _ = update_size(lm, bias_correction=False, max_grad_norm=None)
    assert trl == pytest.approx(1e-2, rel=1e-3) and mlx_lm_like == pytest.approx(1e-2 * 0.1 / 0.001 ** 0.5, rel=1e-3)


def test_gradients_are_clipped_to_max_grad_norm_and_their_norm_is_reported_before(lm):
    """With eps 1 an Adam step is about lr * g (not sign(g)): it shows the gradient's size, so clipping."""
    free, metrics = update_size(lm, adam_epsilon=1.0, max_grad_norm=None)
    clipped, clipped_metrics = update_size(lm, adam_epsilon=1.0, max_grad_norm=1e-3)
    assert clipped_metrics["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5) and metrics["grad_norm"] > 0.01
    assert clipped <= 1e-2 * 1e-3 * 1.001 and free > 10 * clipped


@pytest.mark.parametrize("scheduler", ["constant", "linear", "cosine"])
def test_learning_rate_schedules_are_transformers_ones(scheduler):
    """transformers' get_{constant,linear,cosine}_schedule_with_warmup, written out, at every update."""
    import math

    from shared.train_specs import TrainConfig
    from worker.runtime.train_core import learning_rate_schedule

    lr, warm, total = 0.1, 3, 10
    schedule = learning_rate_schedule(TrainConfig(learning_rate=lr, lr_scheduler=scheduler, warmup_steps=warm), total)
    for k in range(total):
        progress = (k - warm) / (total - warm)
        want = lr * k / warm if k < warm else {"constant": lr, "linear": lr * (1 - progress),
                                                "cosine": lr * 0.5 * (1 + math.cos(math.pi * progress))}[scheduler]
        assert float(schedule(mx.array(k))) == pytest.approx(want, abs=1e-7), k
    with pytest.raises(ValueError, match="not both"):
        TrainConfig(lr_schedule={"name": "cosine_decay", "arguments": [1e-3, 10]}, warmup_steps=2)


def test_a_job_s_lora_product_runs_in_the_model_s_dtype_with_float32_weights(lm):
    """attach_adapter's layers (adapter_layers.py InputDtypeLoRALinear): on a bfloat16 input the
    LoRA product is bfloat16 (mlx_lm's LoRALinear promotes it to float32, 1.7x slower on CUDA),
    the weights and their gradients stay float32; on float32 the output is mlx_lm's, bit for bit."""
    model, _ = lm
    trainer = sft(lm)
    layer = model.layers[0].self_attn.q_proj
    assert isinstance(layer, LoRALinear) and layer.lora_a.dtype == mx.float32
    layer.lora_b = mx.random.normal(layer.lora_b.shape) * 0.1  # B starts at zero: make the product count
    x = mx.random.normal((2, 3, layer.lora_a.shape[0]))
    np.testing.assert_array_equal(np.array(layer(x)), np.array(LoRALinear.__call__(layer, x)))
    xb = x.astype(mx.bfloat16)
    y, theirs = layer(xb), LoRALinear.__call__(layer, xb)
    base = layer.linear(xb)
    ours_z = (xb @ layer.lora_a.astype(mx.bfloat16)) @ layer.lora_b.astype(mx.bfloat16)
    np.testing.assert_array_equal(np.array(y.astype(mx.float32)),
                                  np.array((base + (layer.scale * ours_z).astype(mx.bfloat16)).astype(mx.float32)))
    np.testing.assert_allclose(np.array(y.astype(mx.float32)), np.array(theirs.astype(mx.float32)), rtol=2e-2, atol=2e-2)
    grads = nn.value_and_grad(layer, lambda x: layer(x).astype(mx.float32).sum())(xb)[1]
    assert {k: v.dtype for k, v in tree_flatten(grads)} == {k: mx.float32 for k in PAIR}  # its group's (pair_inputs)
    assert np.isfinite(trainer.step(TrainState())["loss"])
