"""What every trainer's run shares, as plain functions and small dataclasses.

A trainer (``trainers.grpo``, ``trainers.tempo``) declares its ``Args`` on ``RunArgs``,
parses them with ``parse_args``, opens a ``Run`` with ``open_run`` and then writes its own
``for step in run.progress():`` loop, calling back here only for the parts that are the
same in every algorithm: the seeds, the tasks of a step, the update, and ``finish`` (the
durable metrics line, then the checkpoint). There are no hooks or callbacks: each trainer
still reads top to bottom.

Files of a run (``--out``): ``metrics.jsonl`` (one line per step, fsynced before the
checkpoint that counts the step as done), ``checkpoint.json`` (the latest checkpoint's
backend path, its step, the arguments and, for TEMPO, its store file), written atomically
last, so a run killed at any point resumes (``--resume``) from a whole checkpoint and
redoes at most the steps after it, with the metrics lines of those steps dropped.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
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

from agent_gym.core import describe_env
from agent_gym.render import ChatRenderer
from trainers.backends import BACKENDS, make_service
from trainers.episode import active_tokens

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from trainers.store import StateStore

LOSSES = ("importance_sampling", "ppo")
CHECKPOINT_FILE = "checkpoint.json"
METRICS_FILE = "metrics.jsonl"

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


class TrainingClient(Protocol):
    """What a run needs from a training client (pytrio's or the local one)."""

    def get_tokenizer(self) -> PreTrainedTokenizerBase: ...

    def forward_backward(
        self, data: list[Datum], loss_fn: str, loss_fn_config: dict[str, object] | None = None
    ) -> APIFuture[ForwardBackwardOutput]: ...

    def optim_step(self, adam_params: AdamParams) -> APIFuture[OptimStepResponse]: ...

    def save_state(
        self, name: str, ttl_seconds: int | None = None, overwrite: bool = False
    ) -> APIFuture[SaveWeightsResponse]: ...

    def save_weights_and_get_sampling_client(self) -> Sampler: ...


class ServiceClient(Protocol):
    """What a run needs from a service client (``pytrio.ServiceClient`` or the local one)."""

    def create_lora_training_client(
        self, base_model: str, rank: int = 32, seed: int | None = None
    ) -> TrainingClient: ...

    def create_training_client_from_state_with_optimizer(self, path: str) -> TrainingClient: ...


@runtime_checkable
class FullFineTuning(Protocol):
    """A service that also trains every weight (the local backend; pytrio trains LoRA only)."""

    def create_full_training_client(
        self, base_model: str, seed: int | None = None
    ) -> TrainingClient: ...


# --------------------------------------------------------------------- seeds
def derive_seed(*parts: object) -> int:
    """The one seed derivation: a 31-bit seed from (run seed, step, purpose, index, ...).

    Seeds depend on what they are for, never on scheduling order, so a resumed run draws
    what an uninterrupted one would and a deterministic backend reproduces every sample.
    """
    key = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=4).digest()
    return int.from_bytes(key, "little") & 0x7FFFFFFF


# --------------------------------------------------------------------- envs
def env_factory(env_id: str, env_kwargs: Mapping[str, Any], ray: str | None) -> EnvFactory:
    """Envs in this process, or each in a Ray actor (``ray``: ``"local"`` or an address).

    With Ray the env work (engines, sandboxes) spreads over the cluster while sampling
    stays asynchronous in this process.
    """
    if ray is None:
        return functools.partial(gymnasium.make, env_id, **env_kwargs)
    from agent_gym.distributed import remote_env_factory

    return remote_env_factory(env_id, dict(env_kwargs), ray)


class EnvPool:
    """Environments kept open across rollout groups and steps; call it as the ``make_env``
    factory of ``trainers.rollout``.

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
@dataclass
class RunArgs:
    """The arguments every trainer takes; a trainer's ``Args`` adds its own after them
    (and may change a default by declaring the field again)."""

    env_id: str = "agent_gym/GSM8K-v0"
    env_kwargs: dict[str, Any] = field(default_factory=dict)  # JSON on the command line
    backend: str = "local"  # local | pytrio
    model: str = "smollm2"  # local: smollm2 | tiny | a HF directory; pytrio: a model id
    lora_rank: int = 32  # 0 = full fine-tuning (local backend only)
    api_key: str | None = None  # pytrio only
    ray: str | None = None  # "local" or a cluster address: step envs in Ray actors
    # -- the local backend's device and thread options go here (they come with its rewrite)
    batch_size: int = 8  # groups per step
    learning_rate: float = 4e-5
    grad_clip_norm: float = 1.0
    loss: str = "importance_sampling"  # importance_sampling | ppo
    ppo_clip: float = 0.2
    max_turns: int | None = None  # replies per episode; default: the env's own budget
    max_tokens: int = 512  # per reply
    max_trajectory_tokens: int = 4096
    temperature: float = 1.0
    concurrency: int = 8  # groups rolled out at once
    seed: int = 0
    save_every: int = 5
    out: str = "runs/run"
    resume: bool = False
    progress: bool = True

    # Arguments a resumed run must share with the run it continues.
    RESUME_SAME: ClassVar[tuple[str, ...]] = ("env_id", "model", "lora_rank", "backend")

    def problems(self) -> list[str]:
        """What is wrong with these arguments (empty: nothing); trainers extend the list."""
        checks = [
            (self.backend not in BACKENDS, f"--backend must be one of {BACKENDS}"),
            (self.loss not in LOSSES, f"--loss must be one of {LOSSES}"),
            (self.backend == "pytrio" and self.lora_rank < 1,
             "pytrio trains LoRA adapters only: --lora-rank must be positive"),
            (self.temperature != 1.0,
             "--temperature must be 1: the learner and compute_logprobs score the untempered "
             "policy, so importance ratios to tempered sampling logprobs would be biased"),
            (min(self.batch_size, self.concurrency, self.max_tokens, self.save_every) < 1,
             "--batch-size, --concurrency, --max-tokens and --save-every must be positive"),
            (self.max_turns is not None and self.max_turns < 1, "--max-turns must be positive"),
        ]
        return [message for failed, message in checks if failed]


A = TypeVar("A", bound=RunArgs)


def options_parser(
    args_type: type[RunArgs], prog: str, description: str
) -> argparse.ArgumentParser:
    """``--field-name`` for every field: booleans as ``--x/--no-x``, ``env_kwargs`` as JSON,
    numbers typed by their annotation (``int | None`` defaults to None), the rest strings."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    for spec in dataclasses.fields(args_type):
        flag = "--" + spec.name.replace("_", "-")
        default: object = spec.default if spec.default is not dataclasses.MISSING else {}
        kind = str(spec.type).removesuffix(" | None")
        if kind == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif spec.name == "env_kwargs":
            parser.add_argument(flag, type=json.loads, default=default, help="JSON object")
        else:
            parser.add_argument(flag, type={"int": int, "float": float}.get(kind, str),
                                default=default)
    return parser


def parse_args(args_type: type[A], argv: Sequence[str] | None, prog: str, description: str) -> A:
    """A trainer's arguments from the command line; exits with usage on the first problem."""
    parser = options_parser(args_type, prog, description)
    args = args_type(**vars(parser.parse_args(argv)))
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
    """A fresh training client, or (``--resume`` and a checkpoint exists) the one the last
    checkpoint saved, with its optimizer, and that checkpoint."""
    if args.resume and checkpoint.is_file():
        saved = Checkpoint.read(checkpoint)
        for key in args.RESUME_SAME:
            if saved.args[key] != getattr(args, key):
                raise ValueError(
                    f"--resume: the run in {checkpoint.parent} used {key}={saved.args[key]!r}"
                )
        return service.create_training_client_from_state_with_optimizer(saved.path), saved
    if args.lora_rank > 0:
        return service.create_lora_training_client(
            args.model, rank=args.lora_rank, seed=args.seed
        ), None
    if not isinstance(service, FullFineTuning):
        raise ValueError(f"the {args.backend} backend trains LoRA adapters only")
    return service.create_full_training_client(args.model, seed=args.seed), None


# --------------------------------------------------------------------- a run
@dataclass
class Run:
    """An open run: what every step of a trainer uses. Open it with ``open_run``; use it as
    a context manager, so its envs close when the loop ends or fails."""

    args: RunArgs
    out: Path
    steps: int  # total steps of the run, resumed or not
    training: TrainingClient
    resumed: Checkpoint | None  # the checkpoint this invocation continues
    renderer: ChatRenderer
    envs: EnvPool
    num_tasks: int
    max_turns: int  # replies per episode: --max-turns, or the env's own budget
    adam: AdamParams
    loss_config: dict[str, object] | None

    @property
    def start(self) -> int:
        """The first step this invocation runs."""
        return self.resumed.step if self.resumed else 0

    def progress(self) -> tqdm:
        """The steps still to run, as a progress bar (``--no-progress`` hides it)."""
        return tqdm(range(self.start, self.steps), initial=self.start, total=self.steps,
                    disable=not self.args.progress)

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

    def update(self, datums: list[Datum]) -> Metrics:
        """One ``forward_backward`` on the step's whole logical batch (pytrio normalises by
        whole-batch totals) and one ``optim_step``; nothing when there are no datums.
        Returns the update's part of the metrics line."""
        metrics: dict[str, float] = {}
        if datums:
            result = self.training.forward_backward(datums, self.args.loss, self.loss_config)
            metrics = dict(result.result().metrics)
            metrics |= self.training.optim_step(self.adam).result().metrics
        return {
            "datums": len(datums), "trained_tokens": active_tokens(datums),
            "loss": metrics.get("loss_mean"), "loss_sum": metrics.get("loss_sum"),
            "grad_norm": metrics.get("grad_norm"),
        }

    def finish(self, step: int, row: Metrics, store: StateStore | None = None) -> None:
        """The step's metrics line, then, every ``save_every`` steps and at the end, a
        checkpoint: weights, optimizer, ``store`` if given, and ``checkpoint.json`` last,
        so a kill at any point leaves the previous checkpoint whole."""
        _append_metrics(self.out / METRICS_FILE, row)
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


def open_run(args: RunArgs, steps: int, service: ServiceClient | None = None) -> Run:
    """Open (or, with ``--resume`` and a checkpoint, reopen) a run of ``steps`` steps: the
    service (``args.backend`` unless given), the training client, the metrics trimmed to
    the checkpoint, the renderer, a pool of envs (local or Ray actors) reused by every step,
    and the episode's turn budget."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    service = service or make_service(
        args.backend, checkpoint_dir=out / "checkpoints", api_key=args.api_key
    )
    training, resumed = _training_client(service, args, out / CHECKPOINT_FILE)
    _keep_metrics_before(out / METRICS_FILE, resumed.step if resumed else 0)
    num_tasks, env_turns = describe_env(args.env_id, args.env_kwargs)
    return Run(
        args=args, out=out, steps=steps, training=training, resumed=resumed,
        renderer=ChatRenderer(training.get_tokenizer()),
        envs=EnvPool(env_factory(args.env_id, args.env_kwargs, args.ray)),
        num_tasks=num_tasks,
        max_turns=args.max_turns if args.max_turns is not None else env_turns,
        adam=AdamParams(learning_rate=args.learning_rate, grad_clip_norm=args.grad_clip_norm),
        loss_config=(
            {"clip_low_threshold": 1 - args.ppo_clip, "clip_high_threshold": 1 + args.ppo_clip}
            if args.loss == "ppo" else None
        ),
    )
