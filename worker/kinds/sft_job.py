"""The SFT job kind: supervised fine-tuning with LoRA, DoRA, QLoRA or of the weights themselves
(full), as mlx_lm's trainer does, as a job.

The loss, masked cross-entropy over the trained tokens (mask m: completion tokens, assistant
messages' tokens, or every token of a text row; padding never):

    loss = sum_{i,t} m_it * -log p_theta(y_it | y_i,<t) / sum_{i,t} m_it

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
from mlx_lm.tuner.datasets import create_dataset

from shared.datasets import DatasetError, assistant_only, sft_loss_error
from shared.train_specs import SFTConfig, SFTJobCreate
from worker.kinds import supervised_trainer
from worker.kinds.supervised_trainer import Trainer
from worker.runtime.logprobs import token_logps
from worker.runtime.packing import check_packable, pack_rows, packed_logits
from worker.runtime.train_core import Rows, cut, pad_rows

# --------------------------------------------------------------------------- the math


def sft_loss(logits: mx.array, targets: mx.array, mask: mx.array) -> mx.array:
    """Masked mean cross-entropy. logits (N, T, V), targets (N, T), mask (N, T) of 0/1."""
    nll = -token_logps(logits, targets)
    return (nll * mask).sum() / mx.maximum(mask.sum(), 1.0)


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

    def __init__(self, model, tokenizer, spec: SFTJobCreate, train: list[dict], valid: list[dict] | None):
        cfg = spec.config
        self.train_tok, n_cut = cut(tokenize_rows(tokenizer, train, cfg, "dataset"), cfg.max_seq_length)
        self.valid_tok, n_cut_valid = cut(tokenize_rows(tokenizer, valid, cfg, "valid_dataset"),
                                          cfg.max_seq_length) if valid else (None, 0)
        self.truncated = n_cut + n_cut_valid
        if cfg.packing:
            check_packable(model)
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

    @staticmethod
    def loss(model, inputs, targets, mask, *packed):
        logits = packed_logits(model, inputs, *packed) if packed else model(inputs)
        correct = (mx.argmax(logits, axis=-1) == targets) * mask  # TRL's mean_token_accuracy
        return sft_loss(logits, targets, mask), {"mean_token_accuracy": correct.sum() / mx.maximum(mask.sum(), 1.0)}


def load(job, spec: SFTJobCreate, settings):
    """The job's Run (worker/kinds/supervised_trainer.py load): full and quantized bases train a private copy."""
    cfg = spec.config
    return supervised_trainer.load(job, spec, settings, SFTTrainer, cfg.fine_tune_type, cfg.base_quantization)
