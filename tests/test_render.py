"""Token continuity of multi-turn prompts, checked against ``apply_chat_template``."""

from __future__ import annotations

from typing import Any

import pytest

from agent_gym.render import (
    ChatRenderer,
    ContinuedPrompts,
    Conversation,
    HistoryRewriteError,
    TemplateError,
)
from tests.helpers.chat_templates import (
    QWEN_TOOLS,
    REWRITES_BEFORE_TOOL,
    STRIPS_REASONING,
    llama3_tokenizer,
    smollm2_tokenizer,
    with_template,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python code and return its output.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string"}},
                "required": ["code"],
            },
        },
    }
]
OPENING = [
    {"role": "system", "content": "You solve problems with tools."},
    {"role": "user", "content": "What is 12 * 34? Answer in \\boxed{}."},
]
REPLIES = [
    '<tool_call>\n{"name": "python", "arguments": {"code": "print(12*34)"}}\n</tool_call>',
    "Let me double-check: 12 × 34 = 408 — café ✓ 数学",
    "Hmm.\n\nOne more line\twith a tab",
    "So the answer is \\boxed{408}.",
]
OBSERVATIONS = [
    [{"role": "tool", "content": "408"}],
    [{"role": "user", "content": "Are you sure?"}],
    [{"role": "tool", "content": "ok"}, {"role": "tool", "content": "second result"}],
]


def reference(tokenizer: Any, messages: list[dict], tools: list[dict] | None) -> list[int]:
    out = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=True, add_generation_prompt=True
    )
    return list(out["input_ids"] if hasattr(out, "keys") else out)


FAMILIES = {
    "chatml-smollm2": (smollm2_tokenizer, None),
    "qwen-with-tools": (lambda: with_template(QWEN_TOOLS), TOOLS),
    "llama3": (llama3_tokenizer, TOOLS),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> tuple[Any, list[dict] | None]:
    make, tools = FAMILIES[request.param]
    return make(), tools


@pytest.mark.parametrize("cut_turn", [None, 1])
def test_incremental_prompt_equals_full_render(family: tuple, cut_turn: int | None) -> None:
    tokenizer, tools = family
    renderer = ChatRenderer(tokenizer)
    conversation = Conversation.start(renderer, OPENING, tools)
    assert conversation.tokens == reference(tokenizer, OPENING, tools)
    for turn, (reply, observation) in enumerate(zip(REPLIES, OBSERVATIONS, strict=False)):
        completion = renderer.encode(reply)
        if turn != cut_turn:  # the sampler emitted its stop token; a cut turn did not
            completion += renderer.stop_tokens
        previous = list(conversation.tokens)
        prompt = conversation.append(completion, observation)
        assert prompt[: len(previous)] == previous
        assert prompt[len(previous) : len(previous) + len(completion)] == completion
        assert prompt == reference(tokenizer, conversation.messages, tools), f"turn {turn}"


def test_sampled_tokens_are_kept_verbatim() -> None:
    tokenizer = smollm2_tokenizer()
    renderer = ChatRenderer(tokenizer)
    conversation = Conversation.start(renderer, OPENING)
    # A tokenization the tokenizer would never produce for this text.
    odd = renderer.encode("Hel") + renderer.encode("lo") + renderer.stop_tokens
    assert odd[:-1] != renderer.encode("Hello")
    start = len(conversation.tokens)
    prompt = conversation.append(odd, [{"role": "user", "content": "sure?"}])
    assert prompt[start : start + len(odd)] == odd
    assert conversation.messages[-2] == {"role": "assistant", "content": "Hello"}
    assert prompt != reference(tokenizer, conversation.messages, None)


def test_closing_and_stop_tokens() -> None:
    chatml = ChatRenderer(smollm2_tokenizer())
    assert chatml.closing_text == "<|im_end|>\n"
    assert chatml.stop_tokens == chatml.encode("<|im_end|>")
    llama = ChatRenderer(llama3_tokenizer())
    assert llama.closing_text == "<|eot_id|>"
    assert llama.stop_tokens == llama.encode("<|eot_id|>")
    stop = chatml.stop_tokens
    assert chatml.closing_overlap([5, 6, *stop]) == 1
    assert chatml.closing_overlap([5, 6]) == 0
    assert chatml.is_finished([5, *stop]) and not chatml.is_finished([5, 6])
    assert chatml.completion_text(chatml.encode("hi") + stop) == "hi"


def test_continuation_renders_only_the_new_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    renderer = ChatRenderer(smollm2_tokenizer())
    conversation = Conversation.start(renderer, OPENING)
    rendered: list[int] = []
    original = renderer.render_text

    def counting(messages: Any, tools: Any = None, *, generation_prompt: bool) -> str:
        rendered.append(len(messages))
        return original(messages, tools, generation_prompt=generation_prompt)

    monkeypatch.setattr(renderer, "render_text", counting)
    for turn in range(30):
        completion = renderer.encode(f"step {turn}") + renderer.stop_tokens
        conversation.append(completion, [{"role": "user", "content": f"next {turn}"}])
    assert len(conversation.messages) == len(OPENING) + 60
    assert max(rendered) == len(OPENING) + 2  # opening + last assistant + one new message


def test_template_that_strips_reasoning_is_refused() -> None:
    with pytest.raises(HistoryRewriteError, match="rewrites earlier turns"):
        ChatRenderer(with_template(STRIPS_REASONING))


def test_history_rewrite_mid_episode_raises() -> None:
    renderer = ChatRenderer(with_template(REWRITES_BEFORE_TOOL))
    conversation = Conversation.start(renderer, OPENING)
    fine = renderer.encode("plain") + renderer.stop_tokens
    conversation.append(fine, [{"role": "tool", "content": "1"}])
    noted = renderer.encode("NOTE: call") + renderer.stop_tokens
    with pytest.raises(HistoryRewriteError, match="renders the last assistant turn differently"):
        conversation.append(noted, [{"role": "tool", "content": "2"}])


def test_template_errors_are_clear() -> None:
    tokenizer = smollm2_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(TemplateError, match="no chat_template"):
        ChatRenderer(tokenizer)
    renderer = ChatRenderer(smollm2_tokenizer())
    with pytest.raises(ValueError, match="at least one new message"):
        renderer.continuation(OPENING, renderer.stop_tokens, [])


def test_fork_is_independent() -> None:
    renderer = ChatRenderer(smollm2_tokenizer())
    root = Conversation.start(renderer, OPENING)
    a, b = root.fork(), root.fork()
    a.append(renderer.encode("a") + renderer.stop_tokens, [{"role": "user", "content": "x"}])
    assert b.tokens == root.tokens and len(a.tokens) > len(b.tokens)


def test_continued_prompts_follow_each_chat_by_its_content() -> None:
    """Interleaved chats, two of them identical, each continue from their own sampled tokens;
    a transcript never answered here (a resumed or windowed one) is rendered whole."""
    renderer = ChatRenderer(smollm2_tokenizer())
    prompts = ContinuedPrompts(renderer)
    # Two tokenizations of one text, as two samplers could produce for identical chats.
    odd = renderer.encode("Hel") + renderer.encode("lo") + renderer.stop_tokens
    plain = renderer.encode("Hello") + renderer.stop_tokens
    chats = {}
    for name, completion in (("a", odd), ("b", plain), ("c", plain)):
        opening = OPENING if name != "c" else [OPENING[0], {"role": "user", "content": "Hi"}]
        conversation = prompts.conversation(opening, TOOLS)
        assert conversation.tokens == reference(renderer.tokenizer, opening, TOOLS)
        chats[name] = (list(conversation.tokens), completion, opening)
        prompts.answered(conversation, completion)
    continued = {}
    for name in ("c", "b", "a"):  # any order: the content finds the chat
        prompt, _, opening = chats[name]
        chat = [*opening, {"role": "assistant", "content": "Hello"}, *OBSERVATIONS[0]]
        continued[name] = prompts.conversation(chat, TOOLS).tokens
    prompt, completion, _ = chats["c"]
    assert continued["c"][: len(prompt) + len(completion)] == prompt + completion
    # "a" and "b" are the same chat: each continuation took one of the two samples.
    sent = {tuple(chats[n][0] + chats[n][1]) for n in "ab"}
    assert {tuple(continued[n][: len(s)]) for n in "ab" for s in sent if
            tuple(continued[n][: len(s)]) in sent} == sent
    unknown = [*OPENING, {"role": "assistant", "content": "Bye"}, *OBSERVATIONS[1]]
    assert prompts.conversation(unknown, TOOLS).tokens == reference(
        renderer.tokenizer, unknown, TOOLS
    )
