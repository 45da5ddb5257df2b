"""The arguments every trainer shares: ``RunArgs`` and its checks, a dataclass of options
as a command line (``option`` declares a field with its ``--help`` line,
``options_parser`` gives every field its ``--field-name``), and a trainer's ``Args`` from
the command line (a continued run's from its checkpoint) or from a preset."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from agent_gym import untrusted
from agent_gym.cli.parsing import OneLineParser
from agent_gym_train.backends import BACKENDS, SAMPLER_PRECISIONS, SAMPLERS, VLLM_WEIGHTS
from agent_gym_train.run.files import CHECKPOINT_FILE, Checkpoint, RunConfigError
from agent_gym_train.run.losses import AGGREGATIONS, POLICY_LOSSES, TOKEN_MEAN
from agent_gym_train.run.losses import problems as loss_problems

T = TypeVar("T")
LOSSES = POLICY_LOSSES
OUT_HELP = "run directory; rerunning the command into it continues the run"


def option(default: T, help: str, choices: Sequence[str] = ()) -> T:
    """A field of a trainer's ``Args``: its default and the ``--help`` line it gets
    (the parser adds the default; ``choices`` are checked and listed)."""
    return field(default=default, metadata={"help": help, "choices": tuple(choices)})


def options_parser(
    args_type: type[RunArgs], prog: str, description: str, *, explicit_only: bool = False
) -> argparse.ArgumentParser:
    """``--field-name`` for every field: booleans as ``--x/--no-x``, dicts as JSON objects,
    numbers typed by their annotation (``int | None`` defaults to None), the rest strings.

    With ``explicit_only`` every default is left out of the namespace, so parsing tells
    which options the user gave (a continued run keeps the others from its checkpoint).
    """
    parser = OneLineParser(
        prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    for spec in dataclasses.fields(args_type):
        flag = "--" + spec.name.replace("_", "-")
        default: object = spec.default if spec.default is not dataclasses.MISSING else {}
        if explicit_only:
            default = argparse.SUPPRESS
        kind = str(spec.type).removesuffix(" | None")
        help_text = spec.metadata.get("help", "")
        choices = spec.metadata.get("choices") or None
        if kind == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=help_text)
        elif kind.startswith("dict"):
            parser.add_argument(flag, type=_json_object, default=default, metavar="JSON",
                                help=help_text)
        elif spec.name == "ray":
            parser.add_argument(flag, nargs="?", const="local", default=default,
                                metavar="ADDRESS", help=help_text)
        else:
            parser.add_argument(flag, type={"int": int, "float": float}.get(kind, str),
                                default=default, choices=choices, help=help_text)
    return parser


def _json_object(text: str) -> dict[str, object]:
    try:
        value = untrusted.loads(text)
    except untrusted.UntrustedJSONError as err:  # argparse would say only "invalid _json_object"
        raise argparse.ArgumentTypeError(f"{text[:80]!r} {err}") from err
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


@dataclass
class RunArgs:
    """The arguments every trainer takes; a trainer's ``Args`` adds its own after them
    (and may change a default by declaring the field again)."""

    env_id: str = option("agent_gym/GSM8K-v0", "the env to train on (see `agent-gym envs`)")
    env_kwargs: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "the env's constructor arguments as a JSON object, e.g. '{\"max_turns\": 3}'"})
    backend: str = option("local", "where the model trains", BACKENDS)
    model: str = option(
        "smollm2", "local: smollm2 (the embedded SmolLM2-135M-Instruct), tiny (a random "
        "two-layer model for smoke runs) or a Hugging Face directory; pytrio: a model id")
    lora_rank: int = option(32, "LoRA rank; 0 trains every weight (local backend only)")
    init_from: str | None = option(
        None, "start from the weights of another run's checkpoint (its run directory, its "
        "checkpoint.json or a backend checkpoint path) with a fresh optimizer; --model and "
        "--lora-rank must be that run's (default: the base model)")
    api_key: str | None = option(None, "PyTRIO API key (default: $PYTRIO_API_KEY)")
    ray: str | None = option(
        None, "step the envs in Ray actors: a bare --ray starts a local Ray, ADDRESS joins a "
        "cluster (e.g. auto)")
    device: str = option(
        "auto", "local backend: auto (CUDA when available, then MPS, else CPU), cpu, "
        "cuda[:N] or mps")
    threads: int | None = option(
        None, "local backend: torch threads (default: the free cores, or $AGENT_GYM_THREADS)")
    activation_checkpointing: bool = option(
        False, "local backend: recompute each layer's activations in the backward pass (the "
        "same gradient, about a third of the learner's peak memory and 1.4x its time)")
    sampler_precision: str = option(
        "float32", "local backend: the samplers' copy of the weights; bfloat16 decodes faster "
        "where the hardware has bf16 units, and the loss's importance ratio corrects the "
        "rounding as it corrects staleness", SAMPLER_PRECISIONS)
    sampler: str = option(
        "local", "where rollouts are sampled: the backend's own sampler, or vllm (a vLLM "
        "server the run starts from make setup's .venv-vllm, or --vllm-url); the learner "
        "stays on the local backend", SAMPLERS)
    vllm_url: str | None = option(
        None, "with --sampler vllm: a vLLM server already running, serving --model under "
        "its name (with --vllm-weights merged, started with VLLM_SERVER_DEV_MODE=1 from a "
        "model with an untied head; with adapter, with --enable-lora) (default: the run "
        "starts and stops its own)")
    vllm_weights: str = option(
        "merged", "with --sampler vllm: how each update reaches the engine: merged (the whole "
        "model, adapter folded in, reloaded in place; the fast path on CPU, and full "
        "fine-tuning's) or adapter (the LoRA adapter, loaded under a versioned name; vLLM's "
        "fast path on GPU)", VLLM_WEIGHTS)
    batch_size: int | None = option(
        None, "groups (tasks) per step (default: 2 when the local backend runs on CPU, else 8)")
    learning_rate: float = option(4e-5, "Adam learning rate")
    grad_clip_norm: float = option(1.0, "gradient norm clip")
    loss: str = option(
        "importance_sampling", "policy-gradient loss: importance_sampling, ppo and cispo are "
        "pytrio's own; gspo (sequence-level ratio) runs through forward_backward_custom",
        LOSSES)
    loss_aggregation: str = option(
        TOKEN_MEAN, "token-mean (pytrio's built-in: every trained token of the batch weighs "
        "the same) or sequence-mean (every episode weighs the same; via "
        "forward_backward_custom)", AGGREGATIONS)
    clip_low: float | None = option(
        None, "ppo/cispo/gspo: clip ratios below 1 - this (default: ppo 0.2, cispo 1.0 = no "
        "lower clip, gspo 3e-4)")
    clip_high: float | None = option(
        None, "ppo/cispo/gspo: clip ratios above 1 + this (default: ppo 0.2, cispo 3.0, "
        "gspo 4e-4; DAPO's clip-higher raises ppo's to 0.28)")
    max_turns: int | None = option(None, "replies per episode (default: the env's own budget)")
    max_tokens: int | None = option(
        None, "tokens per reply; a reply cut there ends its episode (default: 256 when the "
        "local backend runs on CPU, else 512)")
    max_trajectory_tokens: int = option(4096, "tokens per episode, prompt included")
    temperature: float = option(1.0, "sampling temperature (must be 1: see the docs)")
    concurrency: int = option(8, "groups rolled out at once")
    seed: int = option(0, "seed of tasks and sampling: the same seed replays the same run")
    save_every: int = option(5, "checkpoint every N steps (and at the end)")
    cpu_budget: float | None = option(
        None, "stop after the step that brings the run's CPU seconds to this many, and "
        "checkpoint it: this process's (every thread) plus, with --sampler vllm, the engine "
        "the run started, summed over every step (a continued run's earlier ones too); for "
        "comparing methods at equal compute (default: the run's steps decide)")
    out: str = option("runs/run", OUT_HELP)
    progress: bool = option(True, "show a progress bar")
    preset: str | None = option(
        None, "a named set of option values (the trainer's Args.PRESETS; cpu-demo: steps "
        "sized for a 2-core CPU); options you give override it")

    # Defaults that depend on where the model runs: (on a CPU, elsewhere). On a CPU a step of
    # the GPU-scale settings takes most of an hour (agent_gym_train.backends.runtime.step_cost).
    DEVICE_DEFAULTS: ClassVar[dict[str, tuple[int, int]]] = {
        "batch_size": (2, 8), "max_tokens": (256, 512),
    }
    # The losses ``--loss`` may name: a trainer with another objective (SFT's cross_entropy)
    # declares its own, and ``Run.update`` sends whichever ``--loss`` says.
    LOSSES: ClassVar[tuple[str, ...]] = LOSSES
    # ``--preset NAME``: option values applied before the ones given on the command line
    # (which win). Each trainer declares its own on its ``Args``; cpu-demo sizes a step for
    # SmolLM2-135M on 2 shared cores and one torch thread.
    PRESETS: ClassVar[dict[str, dict[str, object]]] = {}
    # What a run is: a continued run may change anything else (it is reported), not these.
    IDENTITY: ClassVar[tuple[str, ...]] = ("env_id", "env_kwargs", "model", "lora_rank",
                                            "backend", "init_from")

    def problems(self) -> list[str]:
        """What is wrong with these arguments (empty: nothing); trainers extend the list."""
        checks = [
            (self.backend not in BACKENDS, f"--backend must be one of {BACKENDS}"),
            (self.loss not in self.LOSSES, f"--loss must be one of {self.LOSSES}"),
            (self.backend == "pytrio" and self.lora_rank < 1,
             "pytrio trains LoRA adapters only: --lora-rank must be positive"),
            (self.temperature != 1.0,
             "--temperature must be 1: the learner and compute_logprobs score the untempered "
             "policy, so importance ratios to tempered sampling logprobs would be biased"),
            (min(_given(self.batch_size), self.concurrency, _given(self.max_tokens),
                 self.save_every, _given(self.threads)) < 1,
             "--batch-size, --concurrency, --max-tokens, --save-every and --threads must be "
             "positive"),
            (self.max_turns is not None and self.max_turns < 1, "--max-turns must be positive"),
            (self.cpu_budget is not None and not (math.isfinite(self.cpu_budget)
                                                   and self.cpu_budget > 0),
             "--cpu-budget must be a positive number of seconds"),
            (self.sampler == "vllm" and self.backend != "local",
             "--sampler vllm samples for the local learner: PyTRIO samples on its own service"),
            (self.sampler == "vllm" and self.vllm_weights == "adapter" and self.lora_rank < 1,
             "--vllm-weights adapter loads each update's LoRA adapter and full fine-tuning "
             "(--lora-rank 0) has none: use --vllm-weights merged"),
            (self.vllm_url is not None and self.sampler != "vllm",
             "--vllm-url goes with --sampler vllm"),
        ]
        return [*(message for failed, message in checks if failed),
                *loss_problems(self.loss, self.loss_aggregation, self.clip_low, self.clip_high)]

    def branches_per_task(self) -> int:
        """Episodes rolled out per task in a step (a trainer with groups says how many)."""
        return 1

    def env_settings(self) -> list[tuple[str, dict[str, Any]]]:
        """Each set of constructor arguments the run builds ``env_id`` with, and the option
        it came from: ``open_run`` builds each once before anything else (``check_env``).
        A trainer that builds the env otherwise too (SFT's held-out tasks) adds its own."""
        return [("--env-kwargs", self.env_kwargs)]


A = TypeVar("A", bound=RunArgs)


def _given(value: int | None) -> int:
    """A count to check, or 1 (passes) when it is left to its device default."""
    return 1 if value is None else value


def with_preset(args_type: type[A], preset: str, **given: Any) -> A:
    """A trainer's arguments from a preset and the values ``given`` over it (what
    ``--preset NAME --option value`` parses to), for callers that build ``Args`` in code."""
    presets = args_type.PRESETS
    if preset not in presets:
        raise RunConfigError(f"unknown preset {preset!r} for {args_type.__module__}; known: "
                             f"{', '.join(presets) or 'none'}")
    return args_type(**{**presets[preset], **given, "preset": preset})


def parse_args(args_type: type[A], argv: Sequence[str] | None, prog: str, description: str) -> A:
    """A trainer's arguments from the command line; exits with usage on the first problem.

    When ``--out`` already holds a checkpoint, the run continues: every option the user did
    not give comes from the checkpoint, the ones given and changed are reported, and a
    change of what the run is (``IDENTITY``) is refused.
    """
    parser = options_parser(args_type, prog, description)
    values = vars(parser.parse_args(argv))
    given = vars(options_parser(args_type, prog, description, explicit_only=True)
                 .parse_args(argv))
    if values["preset"] is not None:
        presets = args_type.PRESETS
        if values["preset"] not in presets:
            parser.error(f"--preset must be one of {sorted(presets)}")
        values |= {k: v for k, v in presets[values["preset"]].items() if k not in given}
    args = args_type(**values)
    checkpoint = Path(args.out) / CHECKPOINT_FILE
    if checkpoint.is_file():
        saved = Checkpoint.read(checkpoint)
        names = {spec.name for spec in dataclasses.fields(args_type)}
        kept = {k: v for k, v in saved.args.items() if k in names and k not in given}
        args = dataclasses.replace(args, **kept)
        clashes = [k for k in args.IDENTITY if k in given and given[k] != saved.args.get(k)]
        if clashes:
            raise RunConfigError(
                f"{args.out} holds a run with "
                + ", ".join(f"{k}={saved.args.get(k)!r}" for k in clashes)
                + "; continue it with the same values or give another --out"
            )
        changed = [f"{k} {saved.args[k]!r} -> {given[k]!r}" for k in sorted(given)
                   if k in saved.args and saved.args[k] != given[k]]
        print(f"resuming {args.out} at step {saved.step}"
              + (f" (changed: {', '.join(changed)})" if changed else ""), file=sys.stderr)
    for problem in args.problems():
        parser.error(problem)
    return args
