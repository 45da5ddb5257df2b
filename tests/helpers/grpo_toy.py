"""A tiny learnable world for trainer tests: a character tokenizer, a tiny model, a toy env.

The task: the user shows a digit, the assistant must say it. A reply containing the digit
earns 1 and ends the episode; otherwise the user says "no" and the assistant tries again
(two turns at most). With a dozen characters in the vocabulary a random tiny model succeeds
now and then, which gives GRPO a signal to learn from in a few CPU seconds.

Importing this module registers ``agent_gym_tests/SayDigit-v0``; a subprocess can reach it
with the env id ``tests.helpers.grpo_toy:agent_gym_tests/SayDigit-v0``.
"""

from __future__ import annotations

from pathlib import Path

import gymnasium
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from agent_gym.env.base import Opening, Task, TextEnv, Transition
from agent_gym_train.backends.models import tiny_model

ENV_ID = "agent_gym_tests/SayDigit-v0"
DIGITS = "3579"
CHARS = "0123456789no \n"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def word_level_tokenizer(words: list[str], split: str) -> PreTrainedTokenizerFast:
    """A ChatML tokenizer whose vocabulary is exactly the special tokens plus ``words``."""
    vocab = {token: i for i, token in enumerate([*SPECIALS, *words])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(split), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<|endoftext|>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.chat_template = CHATML
    return tokenizer


def char_tokenizer() -> PreTrainedTokenizerFast:
    return word_level_tokenizer(CHARS, ".")


def save_tiny_model(folder: Path, seed: int = 0) -> str:
    """A tiny random model with the character tokenizer, as a local HF directory."""
    tokenizer = char_tokenizer()
    tiny_model(tokenizer, seed=seed, hidden=32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


class SayDigitEnv(TextEnv):
    env_id = ENV_ID

    def __init__(self, max_turns: int = 2, render_mode: str | None = None) -> None:
        tasks = [Task(f"digit-{d}", {"digit": d}) for d in DIGITS]
        super().__init__(tasks, max_turns=max_turns, render_mode=render_mode)

    def _start(self, task: Task) -> Opening:
        digit = task.payload["digit"]
        return Opening(digit, [{"role": "user", "content": digit}])

    def _step(self, action: str) -> Transition:
        if self.task.payload["digit"] in action:
            return Transition("", 1.0, terminated=True, role="user")
        return Transition("no", 0.0, role="user")


if ENV_ID not in gymnasium.registry:
    gymnasium.register(ENV_ID, entry_point=SayDigitEnv)
