"""``agent-gym train ...``: the trainers' subcommands.

The trainer modules import torch and transformers, so the subcommands hand their arguments
over unparsed and import the trainer only when it runs; ``agent-gym train grpo --help``
prints the trainer's own help.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from collections.abc import Callable

# Each subcommand: its help line and the module whose ``main(argv)`` runs it. The modules
# import torch, so they are imported only when their command runs.
COMMANDS = {
    "grpo": ("GRPO", "trainers.grpo"),
    "tempo": ("TEMPO", "trainers.tempo"),
    "sft": ("SFT on demonstrations", "trainers.sft"),
    "opd": ("on-policy distillation", "trainers.opd"),
    "demo": ("evaluate, fine-tune and re-evaluate the embedded model on held-out tasks "
             "(what `make run` does)", "trainers.demo"),
    "plot": ("plot a training run's metrics to RUN_DIR/metrics.png", "trainers.plot"),
}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``train grpo|tempo|sft|opd|plot`` to the ``agent-gym`` command line."""
    train = subparsers.add_parser("train", help="train a policy on an agent_gym environment")
    trainers = train.add_subparsers(dest="trainer", required=True)
    for name, (summary, module) in COMMANDS.items():
        # No option prefix this parser knows: every argument, --help included, is passed on.
        command = trainers.add_parser(
            name, help=f"{summary} (see `agent-gym train {name} --help`)", add_help=False,
            prefix_chars="\0",
        )
        command.add_argument("argv", nargs="*")
        command.set_defaults(run=functools.partial(_run, name, module))


def _run(name: str, module: str, args: argparse.Namespace) -> int:
    return _reporting(args, name, importlib.import_module(module).main)


def _reporting(args: argparse.Namespace, name: str, main: Callable[[list[str]], int]) -> int:
    """A trainer's run, its user errors (a run directory of another run, a model that is
    not there, a PyTRIO session without credentials) printed as one line with exit status 2
    unless ``agent-gym --debug``."""
    from trainers.backends.pytrio import BackendError
    from trainers.models import ModelSpecError
    from trainers.run import RunConfigError
    from trainers.store import StoreError

    try:
        return main(args.argv)
    except (RunConfigError, ModelSpecError, StoreError, BackendError) as err:
        if getattr(args, "debug", False):
            raise
        print(f"agent-gym train {name}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
