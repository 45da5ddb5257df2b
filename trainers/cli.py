"""``agent-gym train ...``: the trainers' subcommands.

The trainer modules import torch and transformers, so the subcommands hand their arguments
over unparsed and import the trainer only when it runs; ``agent-gym train grpo --help``
prints the trainer's own help.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``train grpo``, ``train tempo``, ``train sft``, ``train opd`` and ``train plot`` to
    the ``agent-gym`` command line."""
    train = subparsers.add_parser("train", help="train a policy on an agent_gym environment")
    trainers = train.add_subparsers(dest="trainer", required=True)
    # No option prefix this parser knows: every argument, --help included, is passed on.
    grpo = trainers.add_parser(
        "grpo", help="GRPO (see `agent-gym train grpo --help`)", add_help=False,
        prefix_chars="\0",
    )
    grpo.add_argument("argv", nargs="*")
    grpo.set_defaults(run=_run_grpo)
    tempo = trainers.add_parser(
        "tempo", help="TEMPO (see `agent-gym train tempo --help`)", add_help=False,
        prefix_chars="\0",
    )
    tempo.add_argument("argv", nargs="*")
    tempo.set_defaults(run=_run_tempo)
    sft = trainers.add_parser(
        "sft", help="SFT on demonstrations (see `agent-gym train sft --help`)", add_help=False,
        prefix_chars="\0",
    )
    sft.add_argument("argv", nargs="*")
    sft.set_defaults(run=_run_sft)
    opd = trainers.add_parser(
        "opd", help="on-policy distillation (see `agent-gym train opd --help`)",
        add_help=False, prefix_chars="\0",
    )
    opd.add_argument("argv", nargs="*")
    opd.set_defaults(run=_run_opd)
    plot = trainers.add_parser(
        "plot", help="plot a training run's metrics to RUN_DIR/metrics.png", add_help=False,
        prefix_chars="\0",
    )
    plot.add_argument("argv", nargs="*")
    plot.set_defaults(run=_run_plot)


def _run_grpo(args: argparse.Namespace) -> int:
    from trainers.grpo import main

    return _reporting(args, "grpo", main)


def _run_tempo(args: argparse.Namespace) -> int:
    from trainers.tempo import main

    return _reporting(args, "tempo", main)


def _run_sft(args: argparse.Namespace) -> int:
    from trainers.sft import main

    return _reporting(args, "sft", main)


def _run_opd(args: argparse.Namespace) -> int:
    from trainers.opd import main

    return _reporting(args, "opd", main)


def _run_plot(args: argparse.Namespace) -> int:
    from trainers.plot import main

    return main(args.argv)


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
