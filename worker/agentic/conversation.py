"""One episode's conversation as the chat template renders it, and the tokens that answer a
model turn: what the template puts between the model's end-of-turn token and the next
assistant turn. The model's own tokens are never re-tokenised: the template renders the
conversation with and without the new messages, and only the difference is tokenised, so the
row's tokens stay those the model drew."""

from worker.agentic.episode import CHARS_PER_TOKEN, EpisodeFailed


class TemplateMisfit(EpisodeFailed):
    """The chat template does not render a conversation as a prefix of its continuation."""


class Conversation:
    def __init__(self, tokenizer, messages: list[dict], tools: list[dict] | None):
        if not getattr(tokenizer, "chat_template", None):
            raise EpisodeFailed("multi-turn jobs render their conversations with the tokenizer's chat template, "
                                "and this model's tokenizer has none")
        self.tokenizer, self.messages, self.tools = tokenizer, list(messages), tools or None

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def prompt_tokens(self) -> list[int]:
        text = self.render(self.messages, True)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def answer_tokens(self, turn_text: str, eos_text: str, replies: list[dict], cut: int) -> list[int]:
        """The model said turn_text (its turn ended with eos_text); `replies` answer it. Returns
        the tokens after the model's EOS up to the next assistant turn's start, each reply's
        content cut to `cut` tokens first. Records the turn and the replies."""
        replies = [dict(m, content=self.cut(m["content"], cut)) for m in replies]
        turn = {"role": "assistant", "content": turn_text}
        before = self.render([*self.messages, turn], False)
        after = self.render([*self.messages, turn, *replies], True)
        end = before.rfind(eos_text)
        if end < 0 or not after.startswith(before):
            raise TemplateMisfit("the chat template does not render the conversation turn by turn (a conversation's "
                                 "text is not the start of its continuation's), so its turns cannot be appended")
        self.messages += [turn, *replies]
        text = before[end + len(eos_text):] + after[len(before):]
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def cut(self, text: str, tokens: int) -> str:
        text = text[:tokens * CHARS_PER_TOKEN]  # the tools and environment cut already; no huge text is tokenised
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return text if len(ids) <= tokens else self.tokenizer.decode(ids[:tokens]) + " [cut]"
