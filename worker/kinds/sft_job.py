"""The SFT job kind: supervised fine-tuning with LoRA, DoRA, QLoRA or of the weights themselves
(full), as mlx_lm's trainer does, as a job.

The loss, masked cross-entropy over the trained tokens (mask m: completion tokens, or every
token of a text row; padding never):

    loss = sum_{i,t} m_it * -log p_theta(y_it | y_i,<t) / sum_{i,t} m_it

Rows are tokenised by mlx_lm's own dataset classes (text, messages with tools, prompt/
completion; `mask_prompt` trains only on the completion / last assistant message). The job
around the steps is worker/kinds/supervised_trainer.py's `load` and the job loop
(worker/runtime/job_loop.py).
"""

import types

import mlx.core as mx
from mlx_lm.tuner.datasets import create_dataset

from shared.datasets import DatasetError
from shared.train_specs import SFTJobCreate
from worker.kinds import supervised_trainer
from worker.kinds.supervised_trainer import Trainer
from worker.runtime.logprobs import token_logps
from worker.runtime.models import UnsupportedBase
from worker.runtime.train_core import Rows, cut, pad_rows

# --------------------------------------------------------------------------- the math


def sft_loss(logits: mx.array, targets: mx.array, mask: mx.array) -> mx.array:
    """Masked mean cross-entropy. logits (N, T, V), targets (N, T), mask (N, T) of 0/1."""
    nll = -token_logps(logits, targets)
    return (nll * mask).sum() / mx.maximum(mask.sum(), 1.0)


# --------------------------------------------------------------------------- the trainer


def tokenize_rows(tokenizer, rows: list[dict], mask_prompt: bool, where: str) -> Rows:
    try:
        dataset = create_dataset(rows, tokenizer, types.SimpleNamespace(mask_prompt=mask_prompt))
    except ValueError as e:  # e.g. mask_prompt on text rows
        raise DatasetError(f"{where}: {e}") from None
    tokens, starts = [], []
    for i in range(len(dataset)):
        ids, offset = dataset.process(dataset[i])
        tokens.append(list(ids))
        starts.append(max(int(offset), 1))  # the first token is never a target
    return Rows(tokens, starts)


class SFTTrainer(Trainer):
    def __init__(self, model, tokenizer, spec: SFTJobCreate, train: list[dict], valid: list[dict] | None):
        cfg = spec.config
        self.train_tok, n_cut = cut(tokenize_rows(tokenizer, train, cfg.mask_prompt, "dataset"), cfg.max_seq_length)
        self.valid_tok, n_cut_valid = cut(tokenize_rows(tokenizer, valid, cfg.mask_prompt, "valid_dataset"),
                                          cfg.max_seq_length) if valid else (None, 0)
        self.truncated = n_cut + n_cut_valid
        super().__init__(model, cfg, train, valid)

    def arrays(self, ids: list[int], rows: list[dict]):
        tok = self.train_tok if rows is self.train_rows else self.valid_tok
        batch = pad_rows(Rows([tok.tokens[i] for i in ids], [tok.starts[i] for i in ids]))
        return (batch.inputs, batch.targets, batch.mask), int(batch.mask.sum().item())

    @staticmethod
    def weight(ids: list[int], tokens: int) -> float:
        return float(tokens)  # the loss is a mean over the trained tokens

    @staticmethod
    def loss(model, inputs, targets, mask):
        logits = model(inputs)
        correct = (mx.argmax(logits, axis=-1) == targets) * mask  # TRL's mean_token_accuracy
        return sft_loss(logits, targets, mask), {"mean_token_accuracy": correct.sum() / mx.maximum(mask.sum(), 1.0)}


def load(job, spec: SFTJobCreate, settings):
    """The job's Run (worker/kinds/supervised_trainer.py load): full and quantized bases train a private copy."""
    cfg = spec.config
    if cfg.mxfp8:  # the seed server's field, failing as its job does
        raise UnsupportedBase("mxfp8 mixed-precision training is not supported (mlx_lm has no fp8 training path); "
                              "use qlora for memory savings")
    return supervised_trainer.load(job, spec, settings, SFTTrainer, cfg.fine_tune_type, cfg.quant_bits if cfg.quantized else None)
