"""A tiny model that answers every chat with ``<value>0.d</value>``, for TEMPO's tests.

A randomly initialised model never writes a parsable value tag, so every critic sample
would fail and every group would be degenerate: an end-to-end test would run but train
nothing. This model is taught first (about a second of supervised training) to end any
chat, short or long, with a value tag holding a random digit. Its critic values then vary,
critic and actor groups carry signal, and every path of an update (parsed and failed
values, actor and critic datums in one batch) runs for real. As an actor it answers with
value tags too: ALFWorld reads them as invalid actions (enough to move through
macro-steps) and ``SayDigit`` pays when the tag holds the digit asked for.

The tokenizer is word level with a vocabulary of 23 entries: the chat template's
markers, the value tags, digits and the period; every other word is one unknown token. A
small vocabulary is what makes the training cheap.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerFast

from agent_gym.render import ChatRenderer
from agent_gym_train.backends.models import tiny_model
from tests.helpers.grpo_toy import word_level_tokenizer

WORDS = ["<value>", "</value>", *"0123456789", ".", " ", "\n", "system", "user", "assistant",
         "tool", "no"]
FILLER = ("go to desk 1", "apple", "open fridge 2", "value", "Task:", "turn 3", "the", "is",
          "Nothing happens.", "you see a", "reward", "agent", "critic", "no", "7")


def word_tokenizer() -> PreTrainedTokenizerFast:
    return word_level_tokenizer(WORDS, r"</?value>|[A-Za-z]+|\s|.")


def _chat(rng: random.Random) -> list[dict[str, str]]:
    def text(low: int, high: int) -> str:
        return " ".join(rng.choice(FILLER) for _ in range(rng.randint(low, high)))

    chat = [{"role": "system", "content": text(1, 15)}, {"role": "user", "content": text(1, 30)}]
    for _ in range(rng.randint(0, 2)):
        chat += [{"role": "assistant", "content": text(1, 4)},
                 {"role": "tool", "content": text(1, 8)}]
    return chat


def save_value_model(folder: Path, *, seed: int = 0, steps: int = 40) -> str:
    """Train the value-speaking tiny model; returns it as a local Hugging Face directory."""
    tokenizer = word_tokenizer()
    renderer = ChatRenderer(tokenizer)
    model = tiny_model(tokenizer, seed=seed, hidden=32)
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    # Matrices this small gain nothing from a second thread, and on a busy machine two
    # threads spin against each other: 1.4 s on one thread took 79 s on two here.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _fit(model, renderer, optimizer, rng, steps)
    finally:
        torch.set_num_threads(threads)
    model.eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _fit(
    model: torch.nn.Module, renderer: ChatRenderer, optimizer: torch.optim.Optimizer,
    rng: random.Random, steps: int,
) -> None:
    for _ in range(steps):
        rows, starts = [], []
        for _ in range(8):
            prompt = renderer.prompt(_chat(rng))
            reply = renderer.encode(f"<value>0.{rng.randint(0, 9)}</value>")
            rows.append(prompt + reply + renderer.stop_tokens)
            starts.append(len(prompt))
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, (row, start) in enumerate(zip(rows, starts, strict=True)):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
            labels[i, start - 1 : len(row) - 1] = torch.tensor(row[start:])
        logits = model(input_ids=ids, attention_mask=mask).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


_TRAINED: dict[int, str] = {}


def value_model(tmp_path_factory: Any, seed: int = 0) -> str:
    """The value-speaking model, trained once per test session (shared by test modules)."""
    if seed not in _TRAINED:
        _TRAINED[seed] = save_value_model(tmp_path_factory.mktemp("value-model"), seed=seed)
    return _TRAINED[seed]
