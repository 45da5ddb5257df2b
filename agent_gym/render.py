"""Chat rendering with token continuity.

A policy-gradient update is only correct if the tokens it trains on are the tokens the
sampler produced, in the context the sampler saw. Re-rendering the whole conversation from
text each turn breaks that twice: decoding and re-encoding a sampled completion need not
give back the same tokens, and it costs O(conversation) per turn. So a multi-turn prompt
grows by extension only::

    next prompt = previous prompt
                + the sampled completion, verbatim
                + the template's closing tokens the sampler did not emit (e.g. the "\\n"
                  after "<|im_end|>")
                + the rendering of the new messages and the next generation prompt

The new messages are rendered through the tokenizer's own chat template, in the context of
the episode's opening messages and the last assistant turn only: the work per turn depends
on the size of that turn, not on the turn index. Each turn checks that the template, given
the new messages, still renders the last assistant turn exactly as before (prefix
extension); a template that rewrites history (for example one that strips earlier reasoning)
is refused at construction or raises :class:`HistoryRewriteError` mid-episode, because
token-continuous training on it is impossible.

This is exact for templates that render each message from itself and its neighbours:
ChatML (SmolLM2, Qwen with tools) and Llama 3; ``tests/test_render.py`` checks it token for
token against ``apply_chat_template``.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = Mapping[str, Any]

_MARK = "\u2063probe-answer\u2063"


def window_messages(
    messages: Sequence[Message], opening: int, turns: int | None
) -> list[dict[str, Any]]:
    """The chat a policy is shown under a history window of ``turns`` turns.

    Keeps the ``opening`` messages (the task: system prompt and first user message) and
    the last ``turns`` turns, a turn being an assistant message and the env's answers to
    it, as ALFWorld agents commonly do to stay inside a model's context. ``None`` keeps
    everything. Eval policies and the trainers both cut here, so a trained policy is
    evaluated on the prompts it was trained on. Linear in the chat's length.
    """
    if turns is None:
        return [dict(m) for m in messages]
    if turns < 1:
        raise ValueError(f"a history window keeps at least 1 turn, got {turns}")
    starts = [i for i in range(opening, len(messages)) if messages[i]["role"] == "assistant"]
    if len(starts) <= turns:
        return [dict(m) for m in messages]
    keep = starts[len(starts) - turns]
    return [dict(m) for m in messages[:opening]] + [dict(m) for m in messages[keep:]]


class TemplateError(ValueError):
    """The chat template cannot produce token-continuous multi-turn prompts."""


class HistoryRewriteError(TemplateError):
    """Adding messages changed how the template renders earlier ones."""


class ChatRenderer:
    """Renders chats to prompt tokens through one tokenizer's chat template.

    Args:
        tokenizer: a Hugging Face tokenizer with a ``chat_template``.
        template_kwargs: extra variables for the template (e.g. ``enable_thinking``).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(f"{type(tokenizer).__name__} has no chat_template")
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.closing_text = self._probe_closing()
        self.closing_tokens = self.encode(self.closing_text)
        special = set(tokenizer.all_special_ids)
        stops = [t for t in self.closing_tokens if t in special][:1]
        if not stops and tokenizer.eos_token_id is not None:
            stops = [tokenizer.eos_token_id]
        if not stops:
            raise TemplateError("cannot tell which token ends an assistant turn")
        self.stop_tokens: list[int] = stops
        self._probe_history()

    # ------------------------------------------------------------------ text level
    def render_text(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        generation_prompt: bool,
    ) -> str:
        """The template's text for ``messages`` (with the assistant header if asked)."""
        return self.tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tools=[dict(t) for t in tools] if tools else None,
            tokenize=False,
            add_generation_prompt=generation_prompt,
            **self.template_kwargs,
        )

    def encode(self, text: str) -> list[int]:
        """Tokens of template text; special tokens in it are already spelled out."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # ------------------------------------------------------------------ token level
    def prompt(
        self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        """Full render of a chat plus the generation prompt: O(conversation)."""
        return self.encode(self.render_text(messages, tools, generation_prompt=True))

    def closing_overlap(self, completion: Sequence[int]) -> int:
        """How many leading closing tokens the completion already ends with."""
        closing = self.closing_tokens
        for k in range(min(len(closing), len(completion)), 0, -1):
            if list(completion[-k:]) == closing[:k]:
                return k
        return 0

    def completion_text(self, completion: Sequence[int]) -> str:
        """The assistant's text: the completion without the closing tokens it emitted."""
        kept = len(completion) - self.closing_overlap(completion)
        return self.tokenizer.decode(list(completion[:kept]), skip_special_tokens=False)

    def is_finished(self, completion: Sequence[int]) -> bool:
        """Whether the sampler ended the turn itself (emitted a stop token)."""
        return bool(completion) and completion[-1] in self.stop_tokens

    def continuation(
        self,
        opening: Sequence[Message],
        completion: Sequence[int],
        new_messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Tokens to append after a sampled completion: O(this turn), not O(history).

        Returns the closing tokens the sampler did not emit, then the new messages and the
        next generation prompt. ``opening`` is the episode's first messages (the context
        the template needs for system prompts and tool blocks).
        """
        if not new_messages:
            raise ValueError("a continuation needs at least one new message")
        text = self.completion_text(completion)
        base = [*opening, {"role": "assistant", "content": text}]
        before = self.render_text(base, tools, generation_prompt=False)
        after = self.render_text([*base, *new_messages], tools, generation_prompt=True)
        if not after.startswith(before):
            raise HistoryRewriteError(
                "the chat template renders the last assistant turn differently once new "
                f"messages follow it:\n  alone: {before[-200:]!r}\n  then:  "
                f"{after[: len(before)][-200:]!r}"
            )
        if not before.endswith(self.closing_text):
            raise TemplateError(
                f"the assistant turn does not end with the closing text {self.closing_text!r}"
            )
        missing = self.closing_tokens[self.closing_overlap(completion) :]
        return missing + self.encode(after[len(before) :])

    # ------------------------------------------------------------------ probing
    def _probe_closing(self) -> str:
        probe = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
        header = self.render_text(probe, generation_prompt=True)
        answered = self.render_text(
            [*probe, {"role": "assistant", "content": _MARK}], generation_prompt=False
        )
        if not answered.startswith(header + _MARK):
            raise TemplateError(
                "the generation prompt is not how the template begins an assistant turn: "
                f"{header[-80:]!r} vs {answered[len(header) - 80 :][:120]!r}"
            )
        return answered[len(header) + len(_MARK) :]

    def _probe_history(self) -> None:
        """Refuse templates whose rendering of a message depends on later messages."""
        chat = [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "U1"},
            {"role": "assistant", "content": "<think>r</think>A1"},
            {"role": "user", "content": "U2"},
            {"role": "assistant", "content": "A2"},
            {"role": "user", "content": "U3"},
        ]
        previous = ""
        for end in range(1, len(chat) + 1):
            text = self.render_text(chat[:end], generation_prompt=False)
            if not text.startswith(previous):
                raise HistoryRewriteError(
                    f"the chat template rewrites earlier turns when message {end} is added "
                    "(e.g. it strips reasoning from past assistant turns), so sampled "
                    "tokens cannot be kept verbatim"
                )
            previous = text


@dataclass
class Conversation:
    """One branch's growing prompt: its tokens and the chat they render.

    ``tokens`` always ends with a generation prompt; ``append`` takes the sampled
    completion and the environment's reply and extends it. Branches from one prompt are
    ``fork()``-ed copies.
    """

    renderer: ChatRenderer
    opening: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    tokens: list[int]
    messages: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def start(
        cls,
        renderer: ChatRenderer,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> Conversation:
        opening = [dict(m) for m in messages]
        tool_list = [dict(t) for t in tools or ()]
        return cls(renderer, opening, tool_list, renderer.prompt(opening, tool_list), list(opening))

    def fork(self) -> Conversation:
        return Conversation(
            self.renderer, self.opening, self.tools, list(self.tokens), list(self.messages)
        )

    def windowed(self, turns: int) -> Conversation:
        """This chat under a history window of ``turns`` (``window_messages``), rendered
        afresh. The new prompt does not extend the old one: a window cut is where token
        continuity restarts, and the trainers train the tokens before and after it as
        separate sequences."""
        messages = window_messages(self.messages, len(self.opening), turns)
        return Conversation(self.renderer, self.opening, self.tools,
                            self.renderer.prompt(messages, self.tools or None), messages)

    def append(self, completion: Sequence[int], new_messages: Sequence[Message]) -> list[int]:
        """Extend the prompt by one sampled turn and the env's reply; returns the prompt."""
        tail = self.renderer.continuation(self.opening, completion, new_messages, self.tools)
        self.messages.append(
            {"role": "assistant", "content": self.renderer.completion_text(completion)}
        )
        self.messages.extend(dict(m) for m in new_messages)
        self.tokens.extend(completion)
        self.tokens.extend(tail)
        return self.tokens


class ContinuedPrompts:
    """Token-continuous prompts for callers that hand over the whole chat every turn.

    An eval policy is given each turn's transcript as messages, not tokens, and answers many
    episodes at once. Rendering that transcript whole every turn cost O(conversation) per
    turn and re-encoded sampled text, so the prompt could differ from the tokens the sampler
    produced (training never does that: ``Conversation``). Here each answered chat is
    remembered as its ``Conversation`` and sampled completion, keyed by the chat's content
    up to and including the reply; when a later chat starts with one of them, its prompt is
    that conversation extended by the messages after the reply, exactly as the trainers'
    rollouts extend theirs. Only the key is computed from the whole chat (a hash; the
    rendering and tokenising are per turn). A chat it does not know (a first turn, a resumed
    or windowed transcript, one evicted) is rendered whole: always correct, only slower.
    """

    def __init__(self, renderer: ChatRenderer, capacity: int = 4096) -> None:
        self.renderer = renderer
        self.capacity = capacity
        # Identical chats (several rollouts of one task) share a key: one entry each.
        self._answered: OrderedDict[str, list[tuple[Conversation, list[int]]]] = OrderedDict()
        self._size = 0

    def conversation(
        self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> Conversation:
        """The conversation whose ``tokens`` are the prompt for ``messages``."""
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        if 0 <= last < len(messages) - 1:
            entries = self._answered.get(_chat_key(messages[: last + 1], tools))
            if entries:
                conversation, completion = entries.pop()
                self._size -= 1
                conversation.append(completion, messages[last + 1 :])
                return conversation
        return Conversation.start(self.renderer, messages, tools)

    def answered(self, conversation: Conversation, completion: Sequence[int]) -> None:
        """Remember that ``completion`` was sampled from ``conversation``'s prompt."""
        text = self.renderer.completion_text(completion)
        chat = [*conversation.messages, {"role": "assistant", "content": text}]
        key = _chat_key(chat, conversation.tools)
        self._answered.setdefault(key, []).append((conversation, list(completion)))
        self._answered.move_to_end(key)
        self._size += 1
        while self._size > self.capacity:  # episodes that ended leave their last turn
            _, evicted = self._answered.popitem(last=False)
            self._size -= len(evicted)


def _chat_key(messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None) -> str:
    chat = json.dumps([[dict(m) for m in messages], [dict(t) for t in tools or ()]],
                      sort_keys=True, ensure_ascii=True)
    return hashlib.sha256(chat.encode()).hexdigest()
