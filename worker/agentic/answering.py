"""What answers the model's turns in a multi-turn GRPO job: its tools (worker/agentic/tools.py)
and its environment (worker/agentic/environment.py), one RowEpisode per row of a step, holding
the row's conversation (worker/agentic/conversation.py) and what the episode counted.

A turn with tool calls is answered by the tools; a turn without, by the environment's step (the
turn is its action), or, with no environment, it ends the episode."""

import math
from concurrent.futures import ThreadPoolExecutor

from worker.agentic.conversation import Conversation
from worker.runtime.logprobs import eos_token_ids


class Answerer:
    """The job's tools and environment, for the whole job (closed with it)."""

    def __init__(self, tokenizer, cfg, toolbox=None, environment=None):
        """toolbox: a worker/agentic/tools.py Toolbox; environment: a worker/agentic/environment.py
        Environment (either None)."""
        self.tokenizer, self.cfg, self.toolbox, self.environment = tokenizer, cfg, toolbox, environment
        self.tools = toolbox.schemas if toolbox is not None else None
        self.eos_ids = set(eos_token_ids(tokenizer))
        # Episodes' starts and answers run here: tool calls and environment steps block on I/O.
        self.pool = ThreadPoolExecutor(cfg.tool_parallelism, thread_name_prefix="mtq-answer")

    def conversation(self, messages: list[dict]) -> Conversation:
        return Conversation(self.tokenizer, messages, self.tools)

    def episode(self, messages: list[dict], seed: int) -> "RowEpisode":
        return RowEpisode(self, self.conversation(messages), seed)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        for part in (self.toolbox, self.environment):
            if part is not None:
                part.close()


class RowEpisode:
    """One row's episode: its conversation, its tools' and environment's episodes, and counts."""

    def __init__(self, answerer: Answerer, conversation: Conversation, seed: int):
        self.answerer, self.conversation = answerer, conversation
        self.prompt_messages = len(conversation.messages)
        self.tools = answerer.toolbox.episode() if answerer.toolbox is not None else None
        self.environment = answerer.environment.episode(seed) if answerer.environment is not None else None
        self.turns = self.tool_calls = self.tool_errors = 0  # turns: set once the episode is decoded
        self.env_reward = math.nan  # the sum of the environment's rewards; NaN while it gave none

    def start(self) -> list[int]:
        """The row's prompt tokens: its prompt and the environment's first observation."""
        if self.environment is not None:
            self.conversation.messages += self.environment.start()
            self.prompt_messages = len(self.conversation.messages)
        return self.conversation.prompt_tokens()

    def answer(self, turn_tokens: list[int]) -> list[int] | None:
        """The tokens that answer the model's turn (which ends with its EOS), or None: the episode is done."""
        tok = self.answerer.tokenizer
        eos = turn_tokens[-1:] if turn_tokens[-1] in self.answerer.eos_ids else []  # none where a bound cut the turn
        text = tok.decode(turn_tokens[:len(turn_tokens) - len(eos)], skip_special_tokens=False)
        reply = self.tools.after_turn(text) if self.tools is not None else None
        if reply is not None and reply.tool_calls:
            self.tool_calls += reply.tool_calls
            self.tool_errors += reply.tool_errors
        elif self.environment is not None:
            reply = self.environment.after_turn(text)
            if reply.reward is not None:
                self.env_reward = (0.0 if math.isnan(self.env_reward) else self.env_reward) + float(reply.reward)
        if reply is None or reply.done or not reply.messages or not eos:  # not eos: a bound cut the turn, the episode ends
            self.conversation.messages.append({"role": "assistant", "content": text})
            return None
        eos_text = tok.decode(eos, skip_special_tokens=False)
        return self.conversation.answer_tokens(text, eos_text, reply.messages, self.answerer.cfg.max_tool_output_tokens)

    def after_prompt(self) -> list[dict]:
        """The conversation after the prompt (the samples event shows it)."""
        return self.conversation.messages[self.prompt_messages:]

    def close(self) -> None:
        for part in (self.tools, self.environment):
            if part is not None:
                part.close()
