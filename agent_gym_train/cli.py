"""``agent-gym train ...``: the trainers' subcommands.

The trainer modules import torch and transformers, so the subcommands hand their arguments
over unparsed and import the trainer only when it runs; ``agent-gym train grpo --help``
prints the trainer's own help. Without the ``train`` extra every subcommand, ``--help``
included, says in one line what to install.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from collections.abc import Callable

from agent_gym.cli.parsing import missing_extra

# Each subcommand: its help line and the module whose ``main(argv)`` runs it. The modules
# import torch, so they are imported only when their command runs.
COMMANDS = {
    "grpo": ("GRPO", "agent_gym_train.grpo"),
    "tempo": ("TEMPO", "agent_gym_train.tempo"),
    "sft": ("SFT on demonstrations", "agent_gym_train.sft"),
    "opd": ("on-policy distillation", "agent_gym_train.opd"),
    "demo": ("evaluate, fine-tune and re-evaluate the embedded model on held-out tasks "
             "(what `make run` does)", "agent_gym_train.demo"),
    "plot": ("plot a training run's metrics to RUN_DIR/metrics.png", "agent_gym_train.plot"),
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
    return _reporting(args, name, lambda argv: importlib.import_module(module).main(argv))


def _reporting(args: argparse.Namespace, name: str, main: Callable[[list[str]], int]) -> int:
    """A trainer's run (its import included), its user errors (a run directory of another
    run, a model that is not there, a PyTRIO session without credentials, a module of an
    extra that is not installed) printed as one line with exit status 2 unless
    ``agent-gym --debug``."""
    if getattr(args, "debug", False):  # every error as raised, with its traceback
        return main(args.argv)
    try:
        return _user_errors(main, args.argv)
    except _UserError as err:
        print(f"agent-gym train {name}: error: {err}", file=sys.stderr)
        return 2


class _UserError(Exception):
    """A trainer's user error, as the one line ``_reporting`` prints (``__cause__``: the
    error itself)."""


def _user_errors(main: Callable[[list[str]], int], argv: list[str]) -> int:
    """``main(argv)``, with a user error raised as ``_UserError``. A module that is missing
    is one only when an extra installs it; it is caught outermost because the trainers'
    own errors cannot even be imported without the train extra (they import torch)."""
    try:
        from agent_gym_train.backends.models import ModelSpecError
        from agent_gym_train.backends.pytrio import BackendError
        from agent_gym_train.backends.vllm import EngineError
        from agent_gym_train.run.files import RunConfigError
        from agent_gym_train.run.store import StoreError

        try:
            return main(argv)
        except (RunConfigError, ModelSpecError, StoreError, BackendError, EngineError) as err:
            raise _UserError(" ".join(str(err).split())) from err
    except ImportError as err:  # a module missing, or (--ray) a module's own hint about it
        line = missing_extra(err)
        if line is None:
            raise
        raise _UserError(line) from err


