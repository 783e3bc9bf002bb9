"""Make a random-weight Qwen3 model directory that mlx_lm loads like a real checkpoint.

Tests and benchmarks need a model without downloading one. The directory written here has
the same files as an mlx_lm.convert output of a Qwen3 checkpoint:

    config.json               model_type "qwen3" (+ "quantization" when quantized)
    model.safetensors         weights, saved by mlx_lm.utils.save_model
    model.safetensors.index.json
    tokenizer.json            a byte-level BPE (Qwen2 pipeline) trained on a built-in corpus
    tokenizer_config.json     special tokens + ChatML chat template, eos <|im_end|>
    special_tokens_map.json

Everything is deterministic: the same (size, quantize, seed) gives byte-identical files.
The tokenizer depends only on the size (its vocab size), never on the seed, so models of
one size made with different seeds share a tokenizer and differ only in weights.

    python -m worker.runtime.make_model OUT_DIR [--size tiny|small|qwen3-0.6b] [--quantize 2|3|4|5|6|8]
        [--quantize-mode affine|mxfp4|mxfp8] [--seed 0]
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import qwen3
from mlx_lm.utils import quantize_model, save_config, save_model
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from shared.train_specs import AFFINE_BITS, QUANT_MODES, quantization

# Qwen's special tokens. Like Qwen they come after the BPE vocabulary (the last 3 ids).
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

# Qwen2/Qwen3 pre-tokenizer: letters group into words, each digit stands alone.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen-style ChatML; with `tools`, Qwen3's tool branches (without its thinking ones): the
# tools' schemas in the system turn, an assistant's `tool_calls` as <tool_call> JSON blocks, and
# `tool` messages as <tool_response> blocks of one user turn. Without tools it renders exactly
# plain ChatML. "<tool_call>" is plain text here, not a token of its own.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first and tools %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

INIT_STD = 0.02

_COMMON = dict(
    model_type="qwen3",
    architectures=["Qwen3ForCausalLM"],
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    hidden_act="silu",
    attention_bias=False,
)

# vocab_size is the target of BPE training; the model's vocab is exactly the tokenizer's.
SIZES: dict[str, dict] = {
    # Every matmul input dim is a multiple of 64 so that every bits and mode quantizes all layers.
    "tiny": dict(_COMMON, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=1024,
                 torch_dtype="float32"),
    "small": dict(_COMMON, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=32, intermediate_size=768, vocab_size=4096,
                  torch_dtype="float32"),
    # Qwen3-0.6B's shapes, but with a 16384 vocab instead of 151936 (the corpus is small).
    "qwen3-0.6b": dict(_COMMON, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                       vocab_size=16384, max_position_embeddings=40960, torch_dtype="bfloat16"),
}

_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


# ---------------------------------------------------------------------------- corpus

_SUBJECTS = """the cat|a dog|my friend|the teacher|our team|the model|this function|the server|
a student|the river|the old man|every child|the robot|her brother|the market|the scientist|
the queue|a worker|the compiler|the garden""".replace("\n", "").split("|")
_VERBS = """runs|reads|writes|builds|finds|loves|counts|computes|returns|sends|sees|opens|closes|
explains|solves|learns|trains|checks|answers|measures|grows|moves|saves|loads|prints""".replace("\n", "").split("|")
_OBJECTS = """the ball|a book|the answer|every number|the data|a letter|the door|the result|
a simple question|the last value|two apples|the whole list|a long story|the small box|the key|
the weights|a new job|the report|some water|the final score""".replace("\n", "").split("|")
_ADVERBS = """quickly|slowly|carefully|again|today|yesterday|always|never|often|together|
correctly|quietly|twice|early|late|here|there|now|soon|finally""".replace("\n", "").split("|")
_CONNECTORS = ["because", "although", "while", "after", "before", "so", "but", "and", "when", "if"]
_WORDS = """time year people way day thing world life hand part place case week company system
program question work government number night point home water room mother area money story
fact month lot right study book eye job word business issue side kind head house service
friend father power hour game line end member law car city community name president team
minute idea kid body information back parent face others level office door health person art
war history party result change morning reason research girl guy moment air teacher force
education value matrix vector tensor gradient batch epoch loss reward policy sample token
prompt answer reason step proof theorem equation variable function method class object string
integer float list dictionary array index query cache memory thread process signal error
warning message request response header status client server network packet stream buffer
file folder path config option setting model layer weight bias norm scale group adapter
learning rate optimizer schedule checkpoint metric score accuracy precision recall""".split()
_NAME_ONSETS = ["b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v",
                "w", "z", "br", "ch", "dr", "gr", "kl", "pr", "sh", "st", "th", "tr"]
_NAME_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "io", "ou", "y"]
_NAME_CODAS = ["", "n", "r", "s", "l", "m", "x", "nd", "rt", "st", "ck", "sh"]


def _pseudo_word(rng: random.Random, syllables: int) -> str:
    """Made-up words (names, identifiers) give BPE enough distinct strings to reach large vocabs."""
    return "".join(rng.choice(_NAME_ONSETS) + rng.choice(_NAME_VOWELS) + rng.choice(_NAME_CODAS)
                   for _ in range(syllables))


def _english(rng: random.Random) -> str:
    s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ADVERBS)}"
    if rng.random() < 0.5:
        s += f", {rng.choice(_CONNECTORS)} {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
    if rng.random() < 0.3:
        s = f"{_pseudo_word(rng, rng.randint(2, 3)).capitalize()} said that {s}"
    return s[0].upper() + s[1:] + rng.choice([".", ".", ".", "!", "?", ";"])


def _math(rng: random.Random) -> str:
    a, b = rng.randint(0, 999), rng.randint(1, 99)
    op, value = rng.choice([("+", a + b), ("-", a - b), ("*", a * b), ("/", round(a / b, 3))])
    form = rng.randrange(4)
    if form == 0:
        return f"What is {a} {op} {b}? The answer is {value}."
    if form == 1:
        return f"Solve for x: {b}x + {a} = {a + 3 * b}. Step 1: subtract {a}. Step 2: divide by {b}. So x = 3."
    if form == 2:
        return f"<think>{a} {op} {b} = {value}</think>\n<answer>{value}</answer>"
    return f"Let f(x) = {b}x^2 - {a}. Then f(2) = {4 * b - a} and f'(x) = {2 * b}x."


def _identifier(rng: random.Random) -> str:
    parts = [rng.choice(_VERBS).rstrip("s"), rng.choice(_WORDS), _pseudo_word(rng, 1)][: rng.randint(2, 3)]
    if rng.random() < 0.5:
        return "_".join(parts)
    return parts[0] + "".join(p.capitalize() for p in parts[1:])


def _code(rng: random.Random) -> str:
    name, arg, other = _identifier(rng), _identifier(rng), _identifier(rng)
    n = rng.randint(0, 99)
    form = rng.randrange(4)
    if form == 0:
        return (f"def {name}({arg}, {other}={n}):\n    \"\"\"Return the {rng.choice(_WORDS)}.\"\"\"\n"
                f"    if {arg} is None:\n        return []\n    return [{arg}[i] + {other} for i in range(len({arg}))]\n")
    if form == 1:
        return f"for (let i = 0; i < {n}; i++) {{\n  {name}.push({arg}[i] * {n % 7 + 2});\n}}\n"
    if form == 2:
        return f"class {name[0].upper() + name[1:]}:\n    def __init__(self, {arg}: int = {n}) -> None:\n        self.{arg} = {arg}\n"
    return f"{name} = {{'{arg}': {n}, '{other}': [{n}, {n * 2}], 'ok': True}}  # {rng.choice(_WORDS)}\n"


def _json(rng: random.Random) -> str:
    obj = {
        rng.choice(_WORDS): rng.randint(0, 9999),
        _identifier(rng): _pseudo_word(rng, 2),
        "tags": [rng.choice(_WORDS) for _ in range(rng.randint(1, 3))],
        "ok": rng.random() < 0.5,
        "score": round(rng.random(), 3),
    }
    return json.dumps(obj)


def make_corpus(n_lines: int = 12000, seed: int = 1234) -> list[str]:
    """A deterministic English/math/code/JSON text corpus (no downloads)."""
    rng = random.Random(seed)
    makers = [_english, _english, _math, _code, _json]
    return [rng.choice(makers)(rng) for _ in range(n_lines)]


# ---------------------------------------------------------------------------- tokenizer

@functools.lru_cache(maxsize=8)
def build_tokenizer(vocab_size: int) -> str:
    """Train a Qwen2-style byte-level BPE; returns tokenizer.json text (cached: same input, same output).

    The BPE part gets vocab_size - 3 entries and the 3 special tokens are appended after it,
    as in Qwen's vocabulary.
    """
    tok = Tokenizer(models.BPE(byte_fallback=False, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=1,
        show_progress=False,
        # All 256 byte symbols are in the vocab so any text (any language, emoji) encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(make_corpus(), trainer=trainer)
    bpe_size = tok.get_vocab_size()
    if bpe_size != vocab_size - len(SPECIAL_TOKENS):
        raise RuntimeError(f"corpus too small: BPE reached {bpe_size} tokens, wanted {vocab_size - 3}")
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok.to_str(pretty=True)


def tokenizer_config(token_ids: dict[str, int]) -> dict:
    """tokenizer_config.json as Qwen ships it (transformers' Qwen2Tokenizer reads tokenizer.json)."""
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(token_ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                "single_word": False, "special": True}
            for t in SPECIAL_TOKENS
        },
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def special_tokens_map() -> dict:
    return {"additional_special_tokens": [IM_START, IM_END], "eos_token": IM_END, "pad_token": ENDOFTEXT}


# ---------------------------------------------------------------------------- model

def model_config(size: str, vocab_size: int, token_ids: dict[str, int]) -> dict:
    config = dict(SIZES[size], vocab_size=vocab_size)
    config["bos_token_id"] = token_ids[ENDOFTEXT]  # as in Qwen3's config.json
    config["eos_token_id"] = token_ids[IM_END]
    return config


def init_weights(model, seed: int, dtype) -> dict[str, mx.array]:
    """Normal(0, 0.02) for every matrix, ones for the RMSNorm scales (as nn.RMSNorm starts).

    Tensor i (in sorted-name order) draws from numpy's PCG64 seeded with (seed, i): the values
    depend only on the seed and the size, not on dict order or thread count. numpy rather than
    mx.random: on a CPU numpy's draws are the faster (docs/performance.md, "Random weights"),
    which matters for qwen3-0.6b's 440M values.
    """
    shapes = {name: p.shape for name, p in tree_flatten(model.parameters())}
    weights = {}
    for i, name in enumerate(sorted(shapes)):
        if name.endswith("norm.weight"):
            weights[name] = mx.ones(shapes[name], dtype=dtype)
        else:
            values = np.random.default_rng([seed, i]).standard_normal(shapes[name], dtype=np.float32)
            values *= np.float32(INIT_STD)
            weights[name] = mx.array(values).astype(dtype)
        # Evaluate as we go so peak memory stays at one float32 tensor beyond the weights.
        mx.eval(weights[name])
    return weights


def build_model(config: dict, seed: int):
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    weights = init_weights(model, seed, _DTYPES[config["torch_dtype"]])
    model.update(tree_unflatten(list(weights.items())))
    return model


def quantize_weights(model, config: dict, bits: int, mode: str = "affine"):
    """mlx_lm.convert's path: quantize_model adds "quantization" (and the HF alias
    "quantization_config") to the config, which mlx_lm.load uses to rebuild the layers.
    bits in an MX mode must be the mode's own (shared/train_specs.py quantization)."""
    q = quantization(bits, mode)
    if bits not in AFFINE_BITS or q["bits"] != bits:
        raise ValueError(f"quantize must be one of {AFFINE_BITS} (affine), 4 (mxfp4) or 8 (mxfp8), got {bits} ({mode})")
    return quantize_model(model, config, **q)


# ---------------------------------------------------------------------------- write

def make_model(out_dir: str | Path, size: str = "tiny", quantize: int | None = None, seed: int = 0,
               final_norm: float = 1.0, quantize_mode: str = "affine") -> Path:
    """Write a random-weight Qwen3 model directory for mlx_lm.load; returns its path.

    final_norm: the last RMSNorm's scale. At 1, tied Normal(0, 0.02) embeddings keep a tiny
    model's logits within about +-1.3 (sqrt(64) * 0.02 * sqrt(64)), and no adapter can widen
    that (LoRA leaves norms and embeddings alone): its SFT loss stops near 5.7 nats and every
    sample is near-uniform. A pretrained model's logits span far more; tests that need an
    adapter to make sampling confident (tests/test_agentic.py) use 16.
    """
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {sorted(SIZES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer_json = build_tokenizer(SIZES[size]["vocab_size"])
    vocab = json.loads(tokenizer_json)
    token_ids = {t["content"]: t["id"] for t in vocab["added_tokens"]}
    vocab_size = len(vocab["model"]["vocab"]) + len(token_ids)

    config = model_config(size, vocab_size, token_ids)
    model = build_model(config, seed)
    model.model.norm.weight = model.model.norm.weight * final_norm
    if quantize:
        model, config = quantize_weights(model, config, quantize, quantize_mode)

    save_model(out, model, donate_model=True)
    save_config(config, out / "config.json")
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    _write_json(out / "tokenizer_config.json", tokenizer_config(token_ids))
    _write_json(out / "special_tokens_map.json", special_tokens_map())
    return out


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--quantize", type=int, choices=AFFINE_BITS, default=None)
    p.add_argument("--quantize-mode", choices=sorted(QUANT_MODES), default="affine")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    start = time.perf_counter()
    out = make_model(args.out_dir, args.size, args.quantize, args.seed, quantize_mode=args.quantize_mode)
    size_mb = sum(f.stat().st_size for f in out.iterdir()) / 1e6
    print(f"wrote {out} ({size_mb:.1f} MB) in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
