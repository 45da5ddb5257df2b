"""Files of a training run that must survive a kill: atomic writes, metric trimming, and
the training client a checkpoint names."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def keep_metrics_before(path: Path, step: int) -> None:
    """Drop metric lines a killed run wrote after its last checkpoint."""
    if not path.is_file():
        return
    kept = [
        line for line in path.read_text(encoding="utf-8").splitlines()
        if line.strip() and json.loads(line)["step"] < step
    ]
    write_text(path, "".join(line + "\n" for line in kept))


def write_json(path: Path, value: Any) -> None:
    write_text(path, json.dumps(value, indent=1))


def write_text(path: Path, text: str) -> None:
    staging = path.with_name(path.name + ".tmp")
    staging.write_text(text, encoding="utf-8")
    os.replace(staging, path)  # atomic: a kill never leaves half a file


def append_metrics(path: Path, row: dict[str, Any]) -> None:
    """One line per step, on disk before the checkpoint that counts the step as done: a run
    killed between the two redoes the step instead of losing its line."""
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(row) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def open_training_client(
    service: Any, args: Any, checkpoint: Path, same: tuple[str, ...]
) -> tuple[Any, dict[str, Any] | None]:
    """A fresh training client, or (``args.resume`` and a checkpoint exists) the one the
    last checkpoint saved, with its optimizer; also returns that checkpoint's record.

    ``same`` names the arguments a resumed run must share with the run it continues.
    """
    if args.resume and checkpoint.is_file():
        saved = json.loads(checkpoint.read_text(encoding="utf-8"))
        for key in same:
            if saved["args"][key] != getattr(args, key):
                raise ValueError(
                    f"--resume: the run in {checkpoint.parent} used {key}={saved['args'][key]!r}"
                )
        return service.create_training_client_from_state_with_optimizer(saved["path"]), saved
    if args.lora_rank == 0:
        return service.create_full_training_client(args.model, seed=args.seed), None
    return service.create_lora_training_client(
        args.model, rank=args.lora_rank, seed=args.seed
    ), None
