"""Checkpoints of the local backend: plain directories holding the trained weights (the
LoRA adapters, or every weight), the optimizer state when saved for resuming, and
``meta.json``, the ``TrainingSetup`` that another run must share to load them."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import safetensors.torch
import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict

META_FILE = "meta.json"
WEIGHTS_FILE = "weights.safetensors"
OPTIMIZER_FILE = "optimizer.pt"


@dataclass(frozen=True)
class TrainingSetup:
    """What a training run is: two runs can share a checkpoint only if these agree."""

    base_model: str
    lora_rank: int  # 0 = full fine-tuning
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True

    def mismatches(self, other: TrainingSetup) -> list[str]:
        mine, theirs = asdict(self), asdict(other)
        return [
            f"{k} (this run {mine[k]!r}, checkpoint {theirs[k]!r})"
            for k in mine
            if k != "seed" and mine[k] != theirs[k]
        ]


def save_checkpoint(
    directory: Path, name: str, model: torch.nn.Module, setup: TrainingSetup, *,
    overwrite: bool, optimizer: Callable[[], torch.optim.Optimizer] | None = None,
) -> tuple[str, int]:
    """Save ``model``'s trained weights (and ``optimizer()``'s state, when given) as the
    checkpoint ``directory/name``, atomically; returns its path and size in bytes."""
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"checkpoint name {name!r} must be a plain, non-hidden file name")
    target = directory / name
    if target.exists() and not overwrite:
        raise FileExistsError(f"checkpoint {target} exists; pass overwrite=True to replace it")
    directory.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=directory))
    if setup.lora_rank:
        weights = {k: v.contiguous() for k, v in get_peft_model_state_dict(
            model, save_embedding_layers=False
        ).items()}
        safetensors.torch.save_file(weights, staging / WEIGHTS_FILE)
    else:
        safetensors.torch.save_model(model, str(staging / WEIGHTS_FILE))
    if optimizer is not None:  # one that has not stepped yet saves its empty state
        torch.save(optimizer().state_dict(), staging / OPTIMIZER_FILE)
    (staging / META_FILE).write_text(json.dumps(asdict(setup)), encoding="utf-8")
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)
    size = sum(f.stat().st_size for f in target.iterdir())
    return str(target.resolve()), size


def load_checkpoint(
    path: str, model: torch.nn.Module, setup: TrainingSetup,
    optimizer: Callable[[], torch.optim.Optimizer] | None = None,
) -> None:
    """Load the checkpoint at ``path`` into ``model`` (and ``optimizer()``, when given);
    refused when it was saved by a run of another ``setup``."""
    saved = read_setup(path)
    problems = setup.mismatches(saved)
    if problems:
        raise ValueError(f"checkpoint {path} is incompatible: {', '.join(problems)}")
    weights = Path(path) / WEIGHTS_FILE
    if setup.lora_rank:
        result = set_peft_model_state_dict(model, safetensors.torch.load_file(weights))
        if result.unexpected_keys:
            unknown = result.unexpected_keys[:3]
            raise ValueError(f"checkpoint {path} has unknown tensors {unknown}")
    else:
        safetensors.torch.load_model(model, str(weights))
    if optimizer is not None:
        state_file = Path(path) / OPTIMIZER_FILE
        if not state_file.is_file():
            raise FileNotFoundError(f"checkpoint {path} has no optimizer state")
        optimizer().load_state_dict(torch.load(state_file, weights_only=True))


def read_setup(path: str) -> TrainingSetup:
    """The ``TrainingSetup`` a checkpoint was saved by."""
    meta = Path(path) / META_FILE
    if not meta.is_file():
        raise FileNotFoundError(f"{path} is not a local checkpoint (no {META_FILE})")
    return TrainingSetup(**json.loads(meta.read_text(encoding="utf-8")))
