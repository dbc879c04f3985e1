"""A pair's prompts as token ids, and the config a reply to them decodes with.

A prompt is text, token ids, or chat messages that the pair's chat template renders (a str with
`chat`: one user turn). A reasoning model (`reasoning.ReasoningFormat.for_template`) thinks
before it answers, so a grammar given for a chat reply holds for the answer after the thinking
and leaves the thinking free (`reply_grammar`), as vLLM's and llama.cpp's servers do with
structured output for reasoning models; `constrain_thinking` puts it on the whole reply. The
server (`runtime/completions`), `Pair.generate` and the command line take this one rule.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .errors import InputError
from .generation import GenerationConfig, Prompt, prompt_ids
from .grammar import Grammar
from .reasoning import ReasoningFormat, Thinking
from .text import Tokenizer

__all__ = ["Prompts", "reply_grammar"]


def reply_grammar(grammar: Grammar | None, reasoning: ReasoningFormat | None, rendered: str,
                  constrain_thinking: bool) -> Grammar | None:
    """The grammar a chat reply decodes with: `grammar` after the thinking block of a
    reasoning model (`reasoning`; None: not one, or its thinking is not read apart), required
    when the `rendered` prompt opened the block; `grammar` as it is with `constrain_thinking`,
    for a plain model, or when none is given."""
    if grammar is None or reasoning is None or constrain_thinking:
        return grammar
    return grammar.after(Thinking(reasoning, reasoning.opened_by(rendered)))


@dataclass
class Prompts:
    """How a pair turns prompts into token ids: its tokenizer, vocabulary size, the chat
    template variables every chat it renders gets (e.g. Qwen3's `enable_thinking`), and the
    reasoning format its template's model writes (None: not a reasoning model)."""

    tokenizer: Tokenizer
    vocab_size: int
    template_variables: dict[str, Any] = field(default_factory=dict)
    reasoning: ReasoningFormat | None = None

    @classmethod
    def of(cls, tokenizer: Tokenizer, vocab_size: int) -> Prompts:
        return cls(tokenizer, vocab_size,
                   reasoning=ReasoningFormat.for_template(tokenizer.chat_template))

    def prepare(self, prompt: Prompt, config: GenerationConfig
                ) -> tuple[list[int], GenerationConfig]:
        """The prompt's ids and the config its reply decodes with (`reply_grammar` for a
        chat this renders; `config` as it is otherwise)."""
        text = self.chat_text(prompt, config.chat)
        if text is None:
            return self.encode(prompt, chat=config.chat), config
        return self.rendered(text, config)

    def chat_text(self, prompt: Prompt, chat: bool = False) -> str | None:
        """The prompt as the chat template renders it, for chat messages (or a str with
        `chat`); None for a plain prompt or token ids."""
        messages = self._messages(prompt, chat)
        if messages is None:
            return None
        return self.tokenizer.render_chat(messages, variables=self.template_variables)

    def rendered(self, text: str, config: GenerationConfig) -> tuple[list[int], GenerationConfig]:
        """`prepare` for a chat prompt already rendered by the chat template (with tools, say:
        `tool_prompt.ToolPlan.prompt_text`)."""
        grammar = reply_grammar(config.grammar, self.reasoning, text, config.constrain_thinking)
        ids = self.tokenizer.encode_rendered(text)
        return ids, (config if grammar is config.grammar else replace(config, grammar=grammar))

    def encode(self, prompt: Prompt, *, chat: bool = False) -> list[int]:
        """Token ids of a plain prompt, or of chat messages rendered by the chat template (a
        prompt of token ids is checked and taken as it is)."""
        if (given := prompt_ids(prompt)) is not None:
            if chat:
                raise InputError("a prompt of token ids does not go through the chat template; "
                                 "send text or messages, or drop chat")
            return self.check_ids(given)
        messages = self._messages(prompt, chat)
        if messages is not None:
            return self.tokenizer.encode_chat(messages, variables=self.template_variables)
        assert isinstance(prompt, str)  # neither ids nor messages
        ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        if not ids:
            raise InputError("the prompt encodes to no tokens; pass some text")
        return ids

    def conversation_ids(self, prompt: Prompt, reply: str | Mapping[str, Any], *,
                         chat: bool = False) -> list[int]:
        """The tokens the next prompt of a conversation starts with, once `prompt` was answered
        with `reply`, as a client re-sending the conversation will tokenize it: chat messages
        (or a str prompt with `chat`) rendered by the chat template with the reply as the
        assistant's message (its text, or the message itself: a reasoning model's answer with
        its `reasoning_content`, say) and no generation prompt (the next message follows), or
        a plain prompt followed by the reply's text. What `Pair.prefill_ahead` takes (a reply's
        generated tokens may differ from how its text tokenizes, "\\n\\n" as one token against
        two, say)."""
        message = {"role": "assistant", "content": reply} if isinstance(reply, str) else reply
        text = str(message.get("content") or "")
        if (given := prompt_ids(prompt)) is not None:
            return given + self.tokenizer.encode(text)
        messages = self._messages(prompt, chat)
        if messages is None:
            assert isinstance(prompt, str)
            return self.encode(prompt + text)
        ids = self.tokenizer.encode_chat([*messages, message],
                                         add_generation_prompt=False,
                                         variables=self.template_variables)
        if not ids:
            raise InputError("the conversation encodes to no tokens")
        return ids

    def check_ids(self, ids: Sequence[int]) -> list[int]:
        """`ids` as a list of ints, each checked to be in the vocabulary.

        Raises:
            InputError: not a sequence of ids, an id outside the vocabulary, or none.
        """
        if isinstance(ids, str | bytes) or not isinstance(ids, Sequence | np.ndarray):
            raise InputError(f"expected a list of token ids, got {type(ids).__name__}")
        out = []
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int | np.integer) or \
                    not 0 <= t < self.vocab_size:
                raise InputError(f"token id {t!r} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")
            out.append(int(t))
        if not out:
            raise InputError("the prompt has no tokens")
        return out

    @staticmethod
    def _messages(prompt: Prompt, chat: bool) -> list[Any] | None:
        """The messages the chat template renders for `prompt` (None: it is not a chat).

        Raises:
            InputError: an empty str prompt.
        """
        if isinstance(prompt, str):
            if not prompt:
                raise InputError("the prompt is empty; pass some text")
            return [{"role": "user", "content": prompt}] if chat else None
        if prompt_ids(prompt) is not None:
            return None
        return list(prompt)
