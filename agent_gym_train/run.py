"""What every trainer's run shares, as plain functions and small dataclasses.

A trainer (``agent_gym_train.grpo``, ``agent_gym_train.tempo``) declares its ``Args`` on
``RunArgs``, parses them with ``parse_args``, opens a ``Run`` with ``open_run`` and then
writes its own ``for step in run.progress():`` loop, calling back here only for the parts
that are the same in every algorithm: the seeds, the tasks of a step, the update, and
``finish`` (the durable metrics line, then the checkpoint). There are no hooks or callbacks:
each trainer still reads top to bottom.

Files of a run (``--out``): ``metrics.jsonl`` (one line per step, fsynced before the
checkpoint that counts the step as done), ``checkpoint.json`` (the latest checkpoint's
backend path, its step, the arguments and, for TEMPO, its store file), written atomically
last, so a run killed at any point continues, when its command runs again into the same
``--out``, from a whole checkpoint and redoes at most the steps after it, with the metrics
lines of those steps dropped.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar, runtime_checkable

import gymnasium
import numpy as np
from pytrio import AdamParams, Datum, ModelInput, SamplingParams
from pytrio.types import (
    APIFuture,
    ForwardBackwardOutput,
    OptimStepResponse,
    SampleResponse,
    SaveWeightsResponse,
)
from tqdm import tqdm

from agent_gym.cli.main import OneLineParser
from agent_gym.env.base import describe_env
from agent_gym.eval.policies import derive_seed
from agent_gym.render import ChatRenderer
from agent_gym_train.backends import BACKENDS, make_service
from agent_gym_train.episode import active_tokens
from agent_gym_train.losses import AGGREGATIONS, POLICY_LOSSES, TOKEN_MEAN, Objective
from agent_gym_train.losses import problems as loss_problems

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from agent_gym_train.store import StateStore

LOSSES = POLICY_LOSSES
CHECKPOINT_FILE = "checkpoint.json"
METRICS_FILE = "metrics.jsonl"
IDLE_WARNING = 3  # steps in a row that trained nothing before the run warns

EnvFactory = Callable[[], gymnasium.Env]
# One metrics line: numbers, None (not measured this step), the phase, counts by end reason.
Metrics = dict[str, float | int | str | dict[str, int] | None]


# --------------------------------------------------------------------- the client surface
class Sampler(Protocol):
    """What rollouts and the critic need from a sampling client (pytrio's or the local one)."""

    async def sample_async(
        self,
        prompt: ModelInput,
        num_samples: int = 1,
        sampling_params: SamplingParams = ...,
    ) -> SampleResponse: ...

    async def compute_logprobs_async(self, prompt: ModelInput) -> list[float | None]: ...

    def get_tokenizer(self) -> PreTrainedTokenizerBase: ...


class TrainingClient(Protocol):
    """What a run needs from a training client (pytrio's or the local one)."""

    def get_tokenizer(self) -> PreTrainedTokenizerBase: ...

    def forward(
        self, data: list[Datum], loss_fn: str, loss_fn_config: dict[str, object] | None = None
    ) -> APIFuture[ForwardBackwardOutput]: ...

    def forward_backward(
        self, data: list[Datum], loss_fn: str, loss_fn_config: dict[str, object] | None = None
    ) -> APIFuture[ForwardBackwardOutput]: ...

    def forward_backward_custom(
        self, data: list[Datum], loss_fn: Callable[..., Any],
        loss_fn_config: dict[str, object] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]: ...

    def optim_step(self, adam_params: AdamParams) -> APIFuture[OptimStepResponse]: ...

    def save_state(
        self, name: str, ttl_seconds: int | None = None, overwrite: bool = False
    ) -> APIFuture[SaveWeightsResponse]: ...

    def load_state(self, path: str) -> APIFuture[Any]: ...

    def save_weights_and_get_sampling_client(self) -> Sampler: ...


class ServiceClient(Protocol):
    """What a run needs from a service client (``pytrio.ServiceClient`` or the local one)."""

    def create_lora_training_client(
        self, base_model: str, rank: int = 32, seed: int | None = None
    ) -> TrainingClient: ...

    def create_training_client_from_state_with_optimizer(self, path: str) -> TrainingClient: ...

    def create_sampling_client(self, base_model: str, model_path: str | None = None) -> Sampler: ...


@runtime_checkable
class FullFineTuning(Protocol):
    """A service that also trains every weight (the local backend; pytrio trains LoRA only)."""

    def create_full_training_client(
        self, base_model: str, seed: int | None = None
    ) -> TrainingClient: ...


# --------------------------------------------------------------------- envs
def env_factory(env_id: str, env_kwargs: Mapping[str, Any], ray: str | None) -> EnvFactory:
    """Envs in this process, or each in a Ray actor (``ray``: ``"local"`` or an address).

    With Ray the env work (engines, sandboxes) spreads over the cluster while sampling
    stays asynchronous in this process.
    """
    if ray is None:
        return functools.partial(gymnasium.make, env_id, **env_kwargs)
    from agent_gym.serve.distributed import remote_env_factory

    return remote_env_factory(env_id, dict(env_kwargs), ray)


def check_env(
    env_id: str, env_kwargs: Mapping[str, Any], option: str | None = "--env-kwargs"
) -> tuple[int, int]:
    """``(number of tasks, max turns)`` of the env, built once here and closed.

    A run calls this before it creates its directory or loads a model, so an unknown env id
    or constructor arguments the env refuses (an unknown name, a wrong type, a missing
    extra) are a one-line ``RunConfigError`` at once, not a traceback a model load later.
    ``option`` names the command-line option the arguments came from (None: none did).
    """
    try:
        return describe_env(env_id, env_kwargs)
    except gymnasium.error.Error as err:  # an unknown id: keeps Gymnasium's "did you mean"
        raise RunConfigError(f"--env-id {env_id}: {err} (see `agent-gym envs`)") from err
    except (TypeError, ValueError, ImportError, OSError) as err:
        given = f"{option} " if option else ""
        # Gymnasium appends the id and arguments to a constructor's error: said once here.
        why = str(err).split(" was raised from the environment creator for ")[0]
        raise RunConfigError(
            f"cannot build {env_id} with {given}{json.dumps(dict(env_kwargs), default=str)}: "
            f"{why}"
        ) from err


class EnvPool:
    """Environments kept open across rollout groups and steps; call it as the ``make_env``
    factory of ``agent_gym_train.rollout``.

    A rollout group makes its branches' envs and closes them when it ends. Through a pool,
    "make" hands out an idle env (building one only when none is idle) and "close" gives it
    back, so an env is built once per concurrent branch per run, not once per branch per
    step: an ALFWorld engine loads its game and a private fast-downward, and under Ray an
    env is a whole actor process. Call ``close()`` on the pool when done.
    """

    def __init__(self, make_env: EnvFactory) -> None:
        self._make = make_env
        self._idle: list[gymnasium.Env] = []
        self._built: list[gymnasium.Env] = []
        self._lock = threading.Lock()

    def __call__(self) -> gymnasium.Env:
        with self._lock:
            env = self._idle.pop() if self._idle else None
        if env is None:
            env = self._make()
            with self._lock:
                self._built.append(env)
        return _Borrowed(env, self._give_back)

    @property
    def built(self) -> int:
        """Envs this pool has built so far."""
        return len(self._built)

    def _give_back(self, env: gymnasium.Env) -> None:
        with self._lock:
            self._idle.append(env)

    def close(self) -> None:
        with self._lock:
            built, self._built, self._idle = self._built, [], []
        for env in built:
            env.close()


class _Borrowed(gymnasium.Wrapper):
    """A pooled env whose ``close`` returns it to the pool instead of closing it."""

    def __init__(self, env: gymnasium.Env, give_back: Callable[[gymnasium.Env], None]) -> None:
        super().__init__(env)
        self._give_back = give_back

    def close(self) -> None:
        self._give_back(self.env)


# --------------------------------------------------------------------- arguments
T = TypeVar("T")
OUT_HELP = "run directory; rerunning the command into it continues the run"


def option(default: T, help: str, choices: Sequence[str] = ()) -> T:
    """A field of a trainer's ``Args``: its default and the ``--help`` line it gets
    (the parser adds the default; ``choices`` are checked and listed)."""
    return field(default=default, metadata={"help": help, "choices": tuple(choices)})


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
    out: str = option("runs/run", OUT_HELP)
    progress: bool = option(True, "show a progress bar")
    preset: str | None = option(
        None, "a named set of option values (see agent_gym_train.run.PRESETS; cpu-demo: steps "
        "sized for a 2-core CPU); options you give override it")

    # Defaults that depend on where the model runs: (on a CPU, elsewhere). On a CPU a step of
    # the GPU-scale settings takes most of an hour (agent_gym_train.backends.runtime.step_cost).
    DEVICE_DEFAULTS: ClassVar[dict[str, tuple[int, int]]] = {
        "batch_size": (2, 8), "max_tokens": (256, 512),
    }
    # The losses ``--loss`` may name: a trainer with another objective (SFT's cross_entropy)
    # declares its own, and ``Run.update`` sends whichever ``--loss`` says.
    LOSSES: ClassVar[tuple[str, ...]] = LOSSES
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


def device_defaults(args: A) -> A:
    """``args`` with the device-dependent defaults filled in (``DEVICE_DEFAULTS``), and a
    warning naming the expected step cost when settings meant for a GPU meet a CPU."""
    on_cpu = False
    if args.backend == "local":
        from agent_gym_train.backends import runtime

        device = runtime.resolve_device(args.device)
        on_cpu = device.type == "cpu"
    filled = {name: pair[0] if on_cpu else pair[1] for name, pair in args.DEVICE_DEFAULTS.items()
              if getattr(args, name) is None}
    args = dataclasses.replace(args, **filled)
    if on_cpu:
        shape = runtime.StepShape(args.batch_size or 1, args.branches_per_task(),
                                  args.max_tokens or 1, args.max_turns or 1)
        threads = args.threads or runtime.default_threads()
        warning = runtime.cpu_step_warning(device, shape, threads=threads)
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
    return args


# --------------------------------------------------------------------- presets
# ``--preset NAME`` of each trainer: option values applied before the ones given on the
# command line (which win). One table per trainer, all here, so they can be compared.
# cpu-demo: a step well under a minute on 2 shared cores with SmolLM2-135M and one torch
# thread (measured per trainer in the README), against the GPU-scale defaults (GRPO: 8 tasks
# x 8 branches x 512 tokens; TEMPO: H=10, N=4, K=4, 512-token critic replies).
PRESETS: dict[str, dict[str, dict[str, object]]] = {
    "sft": {"cpu-demo": {"batch_size": 4, "epochs": 1, "learning_rate": 1e-3,
                         "max_trajectory_tokens": 1024}},
    "grpo": {"cpu-demo": {"batch_size": 2, "group_size": 4, "max_tokens": 48,
                          "max_turns": 4}},
    "opd": {"cpu-demo": {"batch_size": 2, "group_size": 2, "max_tokens": 48,
                         "max_turns": 4}},
    "tempo": {"cpu-demo": {"batch_size": 2, "horizon": 2, "branches": 2, "critic_samples": 2,
                           "endpoint_samples": 1, "max_tokens": 32, "critic_max_tokens": 8,
                           "max_turns": 6}},
}


def trainer_presets(args_type: type[RunArgs]) -> dict[str, dict[str, object]]:
    """The presets of the trainer whose ``Args`` this is (``trainers.NAME``: ``PRESETS[NAME]``)."""
    return PRESETS.get(args_type.__module__.rpartition(".")[2], {})


def with_preset(args_type: type[A], preset: str, **given: Any) -> A:
    """A trainer's arguments from a preset and the values ``given`` over it (what
    ``--preset NAME --option value`` parses to), for callers that build ``Args`` in code."""
    presets = trainer_presets(args_type)
    if preset not in presets:
        raise RunConfigError(f"unknown preset {preset!r} for {args_type.__module__}; known: "
                             f"{', '.join(presets) or 'none'}")
    return args_type(**{**presets[preset], **given, "preset": preset})


class RunConfigError(ValueError):
    """The arguments cannot run: a user error, reported in one line by ``agent-gym train``."""


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
        value = json.loads(text)
    except json.JSONDecodeError as err:  # argparse would say only "invalid _json_object"
        raise argparse.ArgumentTypeError(f"not valid JSON ({err}): {text!r}") from err
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


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
        presets = trainer_presets(args_type)
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


# --------------------------------------------------------------------- run files
@dataclass(frozen=True)
class Checkpoint:
    """``checkpoint.json``: the step it completes, the backend's checkpoint path, the run's
    arguments and (TEMPO) the store file saved with it."""

    step: int
    path: str
    args: dict[str, object]
    store: str | None = None

    def to_dict(self) -> dict[str, object]:
        record: dict[str, object] = {"step": self.step, "path": self.path, "args": self.args}
        return record | ({"store": self.store} if self.store is not None else {})

    @classmethod
    def read(cls, path: Path) -> Checkpoint:
        saved = json.loads(path.read_text(encoding="utf-8"))
        return cls(saved["step"], saved["path"], saved["args"], saved.get("store"))


def _write_text(path: Path, text: str) -> None:
    staging = path.with_name(path.name + ".tmp")
    staging.write_text(text, encoding="utf-8")
    os.replace(staging, path)  # atomic: a kill never leaves half a file


def _append_metrics(path: Path, row: Metrics) -> None:
    """One line per step, on disk before the checkpoint that counts the step as done: a run
    killed between the two redoes the step instead of losing its line."""
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(row) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def read_metrics(path: Path) -> list[Metrics]:
    """The metrics lines of a run, in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _keep_metrics_before(path: Path, step: int) -> None:
    """Drop metric lines a killed run wrote after its last checkpoint."""
    if path.is_file():
        kept = [row for row in read_metrics(path) if row["step"] < step]
        _write_text(path, "".join(json.dumps(row) + "\n" for row in kept))


def _training_client(
    service: ServiceClient, args: RunArgs, checkpoint: Path
) -> tuple[TrainingClient, Checkpoint | None]:
    """The training client the last checkpoint saved, with its optimizer, and that
    checkpoint, when there is one (a run continues where it stopped); else a fresh one."""
    if checkpoint.is_file():
        saved = Checkpoint.read(checkpoint)
        for key in args.IDENTITY:
            if saved.args.get(key) != getattr(args, key):
                raise RunConfigError(
                    f"{checkpoint.parent} holds a run with {key}={saved.args.get(key)!r}, not "
                    f"{getattr(args, key)!r}: continue it with the same {key} or give another "
                    "--out"
                )
        return service.create_training_client_from_state_with_optimizer(saved.path), saved
    if args.lora_rank > 0:
        training = service.create_lora_training_client(
            args.model, rank=args.lora_rank, seed=args.seed)
    elif isinstance(service, FullFineTuning):
        training = service.create_full_training_client(args.model, seed=args.seed)
    else:
        raise RunConfigError(f"the {args.backend} backend trains LoRA adapters only")
    if args.init_from is not None:
        try:  # weights only: the backend refuses a checkpoint of another model or rank
            training.load_state(checkpoint_path(args.init_from)).result()
        except RunConfigError as err:
            raise RunConfigError(f"--init-from {err}") from err
        except (ValueError, OSError) as err:
            raise RunConfigError(f"--init-from {args.init_from}: {err}") from err
    return training, None


def checkpoint_path(spec: str) -> str:
    """The backend path a checkpoint spec names, wherever one is taken (``--init-from``, a
    ``local:MODEL@CHECKPOINT`` policy or teacher): a run directory or its
    ``checkpoint.json`` stands for the run's latest checkpoint; anything else is a backend
    path already. A ``RunConfigError`` starts with ``spec``, for the caller to prefix."""
    local = Path(spec)
    record = local / CHECKPOINT_FILE if local.is_dir() else local
    if record.name == CHECKPOINT_FILE and record.is_file():
        try:
            return Checkpoint.read(record).path
        except (ValueError, KeyError, OSError) as err:
            raise RunConfigError(f"{spec}: {record} is not a readable checkpoint record "
                                 f"({type(err).__name__}: {err})") from err
    if local.is_dir() and not any(local.iterdir()):
        raise RunConfigError(f"{spec}: an empty directory, not a run or checkpoint")
    return spec


# --------------------------------------------------------------------- a run
@dataclass
class Run:
    """An open run: what every step of a trainer uses. Open it with ``open_run``; use it as
    a context manager, so its envs close when the loop ends or fails."""

    args: RunArgs
    out: Path
    # Total steps of the run, resumed or not. A trainer that knows them only once the run is
    # open (SFT: from the demonstrations it played) sets them before ``progress()``.
    steps: int
    service: ServiceClient  # more clients of the same service (e.g. a teacher's sampler)
    training: TrainingClient
    resumed: Checkpoint | None  # the checkpoint this invocation continues
    renderer: ChatRenderer
    envs: EnvPool
    num_tasks: int
    max_turns: int  # replies per episode: --max-turns, or the env's own budget
    adam: AdamParams
    objective: Objective
    idle_steps: int = 0  # steps in a row that trained nothing
    bar: tqdm | None = field(default=None, repr=False)

    @property
    def start(self) -> int:
        """The first step this invocation runs."""
        return self.resumed.step if self.resumed else 0

    def progress(self) -> tqdm:
        """The steps still to run, as a progress bar (``--no-progress`` hides it)."""
        if self.resumed is not None:
            print(f"resuming {self.out} at step {self.start}", file=sys.stderr)
        self.bar = tqdm(range(self.start, self.steps), initial=self.start, total=self.steps,
                        disable=not self.args.progress)
        return self.bar

    def rng(self, step: int) -> np.random.Generator:
        """The step's generator (task choice, state draws): a function of (seed, step)."""
        return np.random.default_rng([self.args.seed, step])

    def seed(self, step: int, purpose: str, index: int) -> int:
        """A sampling seed for item ``index`` of ``purpose`` in ``step`` (``derive_seed``)."""
        return derive_seed(self.args.seed, step, purpose, index)

    def tasks(self, rng: np.random.Generator, count: int) -> list[dict[str, int]]:
        """Reset options of ``count`` tasks drawn uniformly (distinct while there are enough)."""
        chosen = rng.choice(self.num_tasks, size=count, replace=count > self.num_tasks)
        return [{"index": int(i)} for i in chosen]

    def update(self, datums: list[Datum], supervised: Sequence[Datum] = ()) -> Metrics:
        """One forward-backward of the run's objective on the step's whole logical batch
        (pytrio normalises by whole-batch totals) and one ``optim_step``; nothing when there
        are neither datums nor supervised ones. Returns the update's part of the metrics line.

        ``supervised``: ``cross_entropy`` datums trained in the same step, as a second pass
        whose gradients add to the first's (each pass is its own batch's mean, so the two
        terms keep their weights however many tokens each has). OPD's teacher labels.
        """
        metrics: dict[str, float] = {}
        extra: Metrics = {}
        if datums:
            metrics = dict(self.objective.forward_backward(self.training, datums).result().metrics)
        if supervised:
            ce = self.training.forward_backward(list(supervised), "cross_entropy").result()
            extra = {"supervised_datums": len(supervised),
                     "supervised_tokens": active_tokens(supervised),
                     "supervised_loss": ce.metrics.get("loss_mean")}
        if datums or supervised:
            metrics |= self.training.optim_step(self.adam).result().metrics
        return {
            "datums": len(datums), "trained_tokens": active_tokens(datums),
            "loss": metrics.get("loss_mean"), "loss_sum": metrics.get("loss_sum"),
            "grad_norm": metrics.get("grad_norm"),
            **({"clip_fraction": metrics["clip_fraction"]} if "clip_fraction" in metrics else {}),
            **extra,
        }

    def finish(
        self, step: int, row: Metrics, store: StateStore | None = None,
        shown: Mapping[str, object] | None = None,
    ) -> None:
        """The step's metrics line, then, every ``save_every`` steps and at the end, a
        checkpoint: weights, optimizer, ``store`` if given, and ``checkpoint.json`` last,
        so a kill at any point leaves the previous checkpoint whole. ``shown`` goes on the
        progress bar, with what the step trained; steps in a row that trained nothing get
        a warning that names the likely cause."""
        _append_metrics(self.out / METRICS_FILE, row)
        self.idle_steps = 0 if trained_datums(row) else self.idle_steps + 1
        if self.bar is not None:
            self.bar.set_postfix({**(shown or {}), "trained": trained_datums(row) or "nothing"})
        if self.idle_steps == IDLE_WARNING:
            tqdm.write(idle_advice(self.idle_steps, row, self.args), file=sys.stderr)
        done = step + 1
        if done % self.args.save_every and done != self.steps:
            return
        path = self.training.save_state(f"step-{done:06d}", overwrite=True).result().path
        store_file = None
        if store is not None:
            store_file = f"store-{done:06d}.json"
            _write_text(self.out / store_file, store.to_json())
        record = Checkpoint(done, path, dataclasses.asdict(self.args), store_file)
        _write_text(self.out / CHECKPOINT_FILE, json.dumps(record.to_dict(), indent=1))
        if store_file is not None:  # the previous checkpoint's store is named no more
            for old in self.out.glob("store-*.json"):
                if old.name != store_file:
                    old.unlink()

    def close(self) -> None:
        self.envs.close()

    def __enter__(self) -> Run:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()


def idle_advice(steps: int, row: Metrics, args: RunArgs) -> str:
    """Why the last ``steps`` steps trained nothing, read off the last one, and what to try."""
    causes = []
    cut = row.get("cut_rate")
    if isinstance(cut, float) and cut >= 0.5:
        causes.append(f"{cut:.0%} of replies were cut at --max-tokens {args.max_tokens} and "
                      "scored nothing: raise --max-tokens")
    if row.get("reward_std") == 0:
        causes.append(f"every episode earned the same reward ({row.get('reward_mean')}): no "
                      "group had a signal; try an easier env or split, more branches per "
                      "group, or supervised fine-tuning first")
    return (f"warning: {steps} steps in a row trained nothing (every group degenerate, 0 "
            "datums)" + (": " + "; ".join(causes) if causes else "") + ".")


def trained_datums(row: Metrics) -> int:
    """Datums a step trained, by its objective and by cross-entropy together."""
    return int(row.get("datums") or 0) + int(row.get("supervised_datums") or 0)


def final_line(history: Sequence[Metrics], out: Path, **extra: object) -> str:
    """The one JSON line a trainer prints at the end: where the run is and how much of this
    invocation trained (a run of steps that trained nothing says so).

    ``step`` counts the run's steps done, from 1, as the progress bar and
    ``checkpoint.json`` do (a metrics row's ``step`` is the 0-based index its readers
    expect). The warning points up only when ``Run.finish`` printed one: a streak of
    ``IDLE_WARNING`` steps, which a run whose every step was idle has iff it ran that many."""
    idle = sum(not trained_datums(row) for row in history)
    line: dict[str, object] = {"step": history[-1]["step"] + 1 if history else None,
                               "out": str(out), "steps": len(history),
                               "steps_that_trained_nothing": idle, **extra}
    if history and idle == len(history):
        line["warning"] = ("no step trained anything (every group degenerate, 0 datums)"
                           + (": see the warning above" if idle >= IDLE_WARNING else ""))
    return json.dumps(line)


def open_run(args: RunArgs, steps: int, service: ServiceClient | None = None) -> Run:
    """Open (or, when ``args.out`` holds a checkpoint, continue) a run of ``steps`` steps: the
    service (``args.backend`` unless given), the training client, the metrics trimmed to
    the checkpoint, the renderer, a pool of envs (local or Ray actors) reused by every step,
    and the episode's turn budget."""
    # The envs first: a typo in --env-id or --env-kwargs is a one-line error before a model
    # loads, and --out is created only once the run can start.
    described = [check_env(args.env_id, kwargs, option) for option, kwargs in args.env_settings()]
    num_tasks, env_turns = described[0]
    out = Path(args.out)
    service = service or make_service(
        args.backend, checkpoint_dir=out / "checkpoints", api_key=args.api_key,
        device=args.device, threads=args.threads,
        activation_checkpointing=args.activation_checkpointing,
    )
    training, resumed = _training_client(service, args, out / CHECKPOINT_FILE)
    out.mkdir(parents=True, exist_ok=True)
    _keep_metrics_before(out / METRICS_FILE, resumed.step if resumed else 0)
    return Run(
        args=args, out=out, steps=steps, service=service, training=training, resumed=resumed,
        renderer=ChatRenderer(training.get_tokenizer()),
        envs=EnvPool(env_factory(args.env_id, args.env_kwargs, args.ray)),
        num_tasks=num_tasks,
        max_turns=args.max_turns if args.max_turns is not None else env_turns,
        adam=AdamParams(learning_rate=args.learning_rate, grad_clip_norm=args.grad_clip_norm),
        objective=Objective(args.loss, args.loss_aggregation, args.clip_low, args.clip_high),
    )
