"""A trained model's whole weights, as an inference engine loads a model: every LoRA
adapter folded into the weight it adapts, in the base model's own parameter names.

This is how weights reach a vLLM server that reloads them in place
(``vllm.MergedWeights``): vLLM's CPU build samples a base model about 8x faster than the same
model through a LoRA adapter (docs/experiments/vllm.md), and a reload is the only way full
fine-tuning reaches a running engine at all.

The output head is always written as a weight of its own, untied from the embedding. The
learner's LoRA adapts ``lm_head`` but not the embedding, so after one update the two
differ, and an engine that ties them would silently drop the head's update. The engine's
starting model is therefore written the same way (``save_engine_model``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import safetensors.torch
import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
HEAD = "lm_head.weight"
EMBEDDING = "model.embed_tokens.weight"
# What an engine reads beside the weights at start: the tokenizer and its chat template.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "generation_config.json")


@torch.no_grad()
def merged_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter of the base model under its own name, with the adapter's update added
    (computed beside the weight, which is left as it is: merging in place and back would
    round the learner's weights on every publish)."""
    inner = model.get_base_model() if isinstance(model, PeftModel) else model
    weights: dict[str, torch.Tensor] = {}
    for name, module in inner.named_modules():
        if isinstance(module, LoraLayer):
            base = module.get_base_layer().weight
            delta = sum((module.get_delta_weight(a) for a in module.active_adapters
                         if a in module.lora_A), torch.zeros_like(base))
            weights[f"{name}.weight"] = base + delta
    for name, tensor in inner.state_dict().items():
        if "lora_" not in name:
            weights.setdefault(name.replace(".base_layer.", "."), tensor)
    if HEAD not in weights and EMBEDDING in weights:
        weights[HEAD] = weights[EMBEDDING]
    return weights


def save_merged(model: torch.nn.Module, folder: Path, dtype: torch.dtype = torch.bfloat16
                ) -> None:
    """``folder``: the merged weights in ``dtype`` and the model's config with the head
    untied. bfloat16 by default: what vLLM serves a float32 checkpoint in on CPU, so the
    rounding is the one the engine would do, at half the bytes to write and read."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.detach().to("cpu", dtype, copy=True).contiguous()
               for name, tensor in merged_weights(model).items()}
    safetensors.torch.save_file(tensors, folder / WEIGHTS_FILE, metadata={"format": "pt"})
    inner = model.get_base_model() if isinstance(model, PeftModel) else model
    config = inner.config.to_dict()
    config["tie_word_embeddings"] = False
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2, default=str))


def save_engine_model(model: torch.nn.Module, source: Path, folder: Path) -> Path:
    """The model an engine starts from: ``model``'s weights as ``save_merged`` writes them,
    with the tokenizer files of ``source`` (the model's Hugging Face directory)."""
    save_merged(model, folder)
    for name in _TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, folder / name)
    return folder
