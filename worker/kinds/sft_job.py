"""The SFT job kind: supervised fine-tuning with LoRA, DoRA, QLoRA or of the weights themselves
(full), as mlx_lm's trainer does, as a job.

The loss (`loss_type`), a mean over the trained tokens (mask m: completion tokens, assistant
messages' tokens, or every token of a text row; padding never), of each token's

    nll:  -log p_it                      (p_it = p_theta(y_it | y_i,<t))
    dft:  -log p_it * sg(p_it)           (TRL's Dynamic Fine-Tuning; sg: no gradient through it)

    loss = sum_{i,t} m_it * l_it / sum_{i,t} m_it

chunked_nll is nll with the vocabulary projection and log-softmax taken CHUNK positions at a
time, each chunk's logits recomputed in the backward pass (mx.checkpoint): the [tokens,
vocabulary] logits never exist whole, the loss and gradients are nll's.

(`packing`: the micro-batch's rows end to end, each attending only to itself: the same terms,
worker/runtime/packing.py.)

Rows are tokenised by mlx_lm's own dataset classes (text, messages with tools, prompt/
completion; `mask_prompt` trains only on the completion / last assistant message), except the
messages rows that train on their assistant messages only (shared/datasets.py
`assistant_only`: by default those with tools, tool calls or results, weights or several
assistant messages): `assistant_tokens` renders them with the chat template and masks every
token but those of their assistant messages of weight 1. The job around the steps is
worker/kinds/supervised_trainer.py's `load` and the job loop (worker/runtime/job_loop.py).
"""

import types

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tuner.datasets import create_dataset

from shared.datasets import DatasetError, assistant_only, sft_loss_error
from shared.train_specs import SFTConfig, SFTJobCreate
from worker.kinds import supervised_trainer
from worker.kinds.supervised_trainer import Trainer
from worker.runtime.logprobs import token_logps
from worker.runtime.packing import check_packable, pack_rows, packed_logits
from worker.runtime.train_core import Rows, cut, pad_rows

# --------------------------------------------------------------------------- the math


# Positions per chunk of chunked_nll. How many chunks are alive at once is MLX's scheduler's: the peak
# grows with the chunk (bench/chunked_nll.py on a CPU: 1.0 GB of a 151,936 vocabulary's, not its 3.7).
CHUNK = 32


def token_losses(logps: mx.array, loss_type: str) -> mx.array:
    """Each token's loss from its log-prob: nll's -log p, or dft's -log p * sg(p)."""
    if loss_type == "dft":
        return -logps * mx.stop_gradient(mx.exp(logps))
    return -logps


def masked_mean(values: mx.array, mask: mx.array) -> mx.array:
    return (values * mask).sum() / mx.maximum(mask.sum(), 1.0)


def output_head(model: nn.Module) -> tuple[nn.Module, str]:
    """(module, method) whose call on model.model's hidden states gives the model's logits, for
    chunked_nll: the lm_head, or a tied embedding's as_linear. UnsupportedBase for a model whose
    logits are something else (e.g. soft-capped): checked on a few tokens."""
    inner = getattr(model, "model", None)
    if "lm_head" in model:
        head = (model["lm_head"], "__call__")
    elif inner is not None and hasattr(getattr(inner, "embed_tokens", None), "as_linear"):
        head = (inner.embed_tokens, "as_linear")
    else:
        raise UnsupportedBase("loss_type chunked_nll needs a model with an lm_head or a tied embedding")
    probe = mx.array([[1, 2, 3]])
    if not mx.allclose(getattr(head[0], head[1])(inner(probe)), model(probe), rtol=1e-4, atol=1e-4).item():
        raise UnsupportedBase("loss_type chunked_nll: this model's logits are not its head's projection of its "
                              "hidden states; use loss_type nll")
    return head


def chunked_token_logps(head: tuple[nn.Module, str], hidden: mx.array, targets: mx.array,
                        chunk: int = CHUNK) -> tuple[mx.array, mx.array]:
    """token_logps(head(hidden), targets) and whether each target is the argmax, CHUNK positions at
    a time. Each chunk is checkpointed with the head's trainable weights as inputs (as mlx_lm's
    grad_checkpoint), so its backward pass recomputes its logits instead of keeping them."""
    module, method = head
    params = module.trainable_parameters()
    h, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)

    def piece(t):  # the targets a constant: checkpoint differentiates every input
        def logps(params, h):
            module.update(params)
            logits = getattr(module, method)(h).astype(mx.float32)
            return token_logps(logits, t), (mx.argmax(logits, axis=-1) == t).astype(mx.float32)
        return mx.checkpoint(logps)

    parts = []
    for i in range(0, t.shape[0], chunk):
        # Each chunk after the one before (mx.depends): else MLX may compute them all at once.
        hi = mx.depends(h[i:i + chunk], parts[-1][0]) if parts else h[i:i + chunk]
        parts.append(piece(t[i:i + chunk])(params, hi))
    return (mx.concatenate([p[0] for p in parts]).reshape(targets.shape),
            mx.concatenate([p[1] for p in parts]).reshape(targets.shape))


# --------------------------------------------------------------------------- the trainer


def assistant_tokens(tokenizer, row: dict) -> tuple[list[int], list[int]]:
    """A messages row's tokens (as mlx_lm's ChatDataset makes them) and its mask: 1 for the
    tokens of each assistant message of weight 1, 0 for the others. An assistant message
    messages[i]'s tokens are those that messages[:i+1] renders past messages[:i] with the
    generation prompt: its content, tool calls and end of turn, not the template's header of the
    turn. DatasetError unless the first renders as a prefix of the second, and the second of the
    whole conversation."""
    messages, tools = row["messages"], row.get("tools")

    def render(part: list[dict], generation_prompt: bool = False) -> list[int]:
        return list(tokenizer.apply_chat_template(part, tools=tools, add_generation_prompt=generation_prompt,
                                                  return_dict=False))

    tokens = render(messages)
    mask = [0] * len(tokens)
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or m.get("weight", 1) == 0:
            continue
        begin, end = render(messages[:i], True), render(messages[:i + 1])
        for part, name, whole, whole_name in ((begin, f"messages[:{i}] with the generation prompt", end, f"messages[:{i + 1}]"),
                                              (end, f"messages[:{i + 1}]", tokens, "the whole conversation")):
            if whole[:len(part)] != part:
                raise DatasetError(f"the chat template does not render this conversation incrementally ({name} is not "
                                   f"a prefix of {whole_name}), so its assistant tokens cannot be found")
        mask[len(begin):len(end)] = [1] * (len(end) - len(begin))
    return tokens, mask


def tokenize_rows(tokenizer, rows: list[dict], cfg: SFTConfig, where: str) -> Rows:
    try:
        dataset = create_dataset(rows, tokenizer, types.SimpleNamespace(mask_prompt=cfg.mask_prompt))
    except ValueError as e:  # e.g. mask_prompt on text rows
        raise DatasetError(f"{where}: {e}") from None
    tokens, starts, masks = [], [], []
    for i, row in enumerate(rows):
        if error := sft_loss_error(row, cfg.assistant_only_loss):  # rows of files and paths, checked only here
            raise DatasetError(f"{where}[{i}]: {error}")
        if assistant_only(row, cfg.assistant_only_loss):
            try:
                ids, mask = assistant_tokens(tokenizer, row)
            except DatasetError as e:  # log-prob scoring says the same without this hint
                raise DatasetError(f"{where}[{i}]: {e}; assistant_only_loss false trains on every token") from None
            offset = next((t for t, on in enumerate(mask) if on), len(mask))
        else:
            ids, offset = dataset.process(dataset[i])
            mask = None
        tokens.append(list(ids))
        starts.append(max(int(offset), 1))  # the first token is never a target
        masks.append(mask)
    if all(m is None for m in masks):
        return Rows(tokens, starts)
    return Rows(tokens, starts, [m if m is not None else [0] * s + [1] * (len(t) - s)
                                 for t, s, m in zip(tokens, starts, masks)])


class SFTTrainer(Trainer):
    # Positions per packed sequence; None: the micro-batch's longest row's, so that a packed batch is never wider
    # than the padded one (MLX's attention computes a sequence's every query-key pair, masked or not: longer
    # sequences of short rows would cost more attention than they save). bench/packing.py compares max_seq_length.
    pack_to: int | None = None
    chunk = CHUNK  # chunked_nll's (a test sets fewer)

    def __init__(self, model, tokenizer, spec: SFTJobCreate, train: list[dict], valid: list[dict] | None):
        cfg = spec.config
        self.train_tok, n_cut = cut(tokenize_rows(tokenizer, train, cfg, "dataset"), cfg.max_seq_length)
        self.valid_tok, n_cut_valid = cut(tokenize_rows(tokenizer, valid, cfg, "valid_dataset"),
                                          cfg.max_seq_length) if valid else (None, 0)
        self.truncated = n_cut + n_cut_valid
        if cfg.packing:
            check_packable(model)
        self.head = output_head(model) if cfg.loss_type == "chunked_nll" else None
        super().__init__(model, cfg, train, valid)

    def arrays(self, ids: list[int], rows: list[dict]):
        """A micro-batch's rows padded, or packed (cfg.packing: the same rows, each with its positions
        and segment, so the same loss; worker/runtime/packing.py) into sequences of pack_to positions."""
        tok = self.train_tok if rows is self.train_rows else self.valid_tok
        rows = Rows([tok.tokens[i] for i in ids], [tok.starts[i] for i in ids],
                    None if tok.masks is None else [tok.masks[i] for i in ids])
        if self.cfg.packing:
            batch = pack_rows(rows, self.pack_to or max(len(t) for t in rows.tokens) - 1)
            return (batch.inputs, batch.targets, batch.mask, batch.positions, batch.segments), int(batch.mask.sum().item())
        batch = pad_rows(rows)
        return (batch.inputs, batch.targets, batch.mask), int(batch.mask.sum().item())

    @staticmethod
    def weight(ids: list[int], tokens: int) -> float:
        return float(tokens)  # the loss is a mean over the trained tokens

    def loss(self, model, inputs, targets, mask, *packed):
        if self.head is not None:  # chunked_nll
            hidden = packed_logits(model, inputs, *packed, hidden=True) if packed else model.model(inputs)
            logps, correct = chunked_token_logps(self.head, hidden, targets, self.chunk)
        else:
            logits = packed_logits(model, inputs, *packed) if packed else model(inputs)
            logps, correct = token_logps(logits, targets), mx.argmax(logits, axis=-1) == targets
        loss = masked_mean(token_losses(logps, self.cfg.loss_type), mask)
        return loss, {"mean_token_accuracy": masked_mean(correct, mask)}  # TRL's mean_token_accuracy


def load(job, spec: SFTJobCreate, settings):
    """The job's Run (worker/kinds/supervised_trainer.py load): full and quantized bases train a private copy."""
    cfg = spec.config
    return supervised_trainer.load(job, spec, settings, SFTTrainer, cfg.fine_tune_type, cfg.base_quantization)
