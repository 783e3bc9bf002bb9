"""worker.runtime.make_model writes a random Qwen3 model directory that mlx_lm loads and runs."""

import hashlib
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx_lm.sample_utils import make_sampler

from worker.runtime.make_model import SIZES, make_model

CHAT = [{"role": "user", "content": "hi"}]


def file_hashes(d: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return mlx_lm.load(str(tiny_model), return_config=True)


def test_files_and_config(tiny_model):
    names = {f.name for f in tiny_model.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert config["tie_word_embeddings"] is True
    assert "quantization" not in config
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert config[key] == SIZES["tiny"][key]


def test_loads_and_generates(loaded):
    model, tokenizer, config = loaded
    assert model.model.embed_tokens.weight.shape == (config["vocab_size"], config["hidden_size"])
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    text = mlx_lm.generate(model, tokenizer, prompt=prompt, max_tokens=12)
    assert isinstance(text, str) and text
    sampled = mlx_lm.generate(model, tokenizer, prompt=prompt, max_tokens=12, sampler=make_sampler(temp=1.0))
    assert sampled


def test_random_model_does_not_stop_at_once(loaded):
    """Greedy decoding should not pick EOS as the first token (it would make every completion empty)."""
    model, tokenizer, _ = loaded
    for content in ["hi", "What is 2 + 2?", "Write a JSON object."]:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        first = mx.argmax(model(mx.array([prompt]))[0, -1]).item()
        assert first not in tokenizer.eos_token_ids


def test_tokenizer(loaded):
    _, tokenizer, config = loaded
    text = 'Solve 12 + 34 = x.\n\ndef add(a, b):\n    return {"sum": a + b}  # café, 中文, 😀'
    ids = tokenizer.encode(text)
    assert len(ids) < len(text.encode())  # BPE merged something
    assert tokenizer.decode(ids) == text

    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    vocab = tokenizer.get_vocab()
    assert len(vocab) == config["vocab_size"] == SIZES["tiny"]["vocab_size"]
    # Special tokens come after the BPE vocabulary, as in Qwen.
    n = config["vocab_size"]
    assert [vocab[t] for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [n - 3, n - 2, n - 1]
    assert tokenizer.eos_token_ids == {vocab["<|im_end|>"]} and config["eos_token_id"] == vocab["<|im_end|>"]
    # Special tokens are single ids in text.
    assert tokenizer.encode("<|im_start|>user")[0] == vocab["<|im_start|>"]


def test_chat_template(loaded):
    _, tokenizer, _ = loaded
    rendered = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


def test_transformers_autotokenizer(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert "<|im_start|>assistant" in tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)


def test_same_seed_same_bytes_other_seed_other_weights(tiny_model, tmp_path):
    again = make_model(tmp_path / "again", size="tiny", seed=0)
    assert file_hashes(again) == file_hashes(tiny_model)

    other = file_hashes(make_model(tmp_path / "other", size="tiny", seed=1))
    base = file_hashes(tiny_model)
    assert other["model.safetensors"] != base["model.safetensors"]
    # The tokenizer depends only on the size.
    assert other["tokenizer.json"] == base["tokenizer.json"]
    w0 = mx.load(str(tiny_model / "model.safetensors"))
    w1 = mx.load(str(tmp_path / "other" / "model.safetensors"))
    assert w0.keys() == w1.keys()
    assert not mx.array_equal(w0["model.layers.0.self_attn.q_proj.weight"], w1["model.layers.0.self_attn.q_proj.weight"])


@pytest.mark.parametrize("bits, mode, group_size", [(4, "affine", 64), (8, "affine", 64), (6, "affine", 64),
                                                    (4, "mxfp4", 32)])
def test_quantized_loads_and_generates(tmp_path, bits, mode, group_size):
    out = make_model(tmp_path / f"q{bits}", size="tiny", quantize=bits, seed=0, quantize_mode=mode)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": group_size, "bits": bits, "mode": mode}

    model, tokenizer = mlx_lm.load(str(out))
    # All linear layers and the (tied) embedding are quantized: tiny's dims are multiples of 64.
    modules = [m for _, m in model.named_modules()]
    assert not any(type(m) in (nn.Linear, nn.Embedding) for m in modules)
    quantized = [m for m in modules if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    assert len(quantized) == 1 + 7 * SIZES["tiny"]["num_hidden_layers"]
    assert all((m.bits, m.group_size, m.mode) == (bits, group_size, mode) for m in quantized)
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    assert mlx_lm.generate(model, tokenizer, prompt=prompt, max_tokens=8)


def test_unknown_size(tmp_path):
    with pytest.raises(ValueError, match="unknown size"):
        make_model(tmp_path / "x", size="huge")
