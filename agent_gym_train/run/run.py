"""What every trainer's run shares, as plain functions and small dataclasses.

A trainer (``agent_gym_train.grpo``, ``agent_gym_train.tempo``) declares its ``Args`` on
``RunArgs`` and parses them with ``parse_args`` (both ``agent_gym_train.run.args``), opens a
``Run`` with ``open_run`` and then writes its own ``for step in run.progress():`` loop,
calling the run only for the parts that are the same in every algorithm: the seeds, the
tasks and rollouts of a step, the update, and ``finish`` (the durable metrics line, then
the checkpoint). There are no hooks or callbacks: each trainer still reads top to bottom.

The run is where the pieces of this folder meet; none of them knows it (they take what
they need as arguments): ``clients`` (what a run needs of a backend's clients),
``envpool`` (the envs, built once and reused), ``rollout`` (groups of episodes),
``journal`` (in-flight episodes), ``pipeline`` (rollouts ahead of the learner), ``tasks``
(which tasks a step draws) and ``files`` (``metrics.jsonl``, ``checkpoint.json``, and how a
killed run continues from them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

import numpy as np
from pytrio import AdamParams, Datum
from tqdm import tqdm

from agent_gym.render import ChatRenderer
from agent_gym.seeding import derive_seed
from agent_gym_train.backends import make_service
from agent_gym_train.backends.vllm import (
    BASE_WEIGHTS,
    Engine,
    EngineConfig,
    EngineTraining,
    MergedWeights,
    VLLMWeights,
    keep_versions,
    served_model_name,
)
from agent_gym_train.run.args import RunArgs
from agent_gym_train.run.clients import (
    Sampler,
    ServiceClient,
    TrainingClient,
    VersionedSampler,
    training_client,
)
from agent_gym_train.run.envpool import EnvPool, check_env, env_factory
from agent_gym_train.run.episode import Episode, active_tokens
from agent_gym_train.run.files import (
    CHECKPOINT_FILE,
    METRICS_FILE,
    Checkpoint,
    Metrics,
    append_metrics,
    checkpoint_path,
    keep_metrics_before,
    write_text,
)
from agent_gym_train.run.journal import (
    JOURNAL_FILE,
    GroupJournal,
    Journal,
    check_journal,
    fingerprint,
)
from agent_gym_train.run.losses import Objective, sampler_mismatch
from agent_gym_train.run.pipeline import Weights
from agent_gym_train.run.rollout import RolloutConfig, Start, rollout_groups
from agent_gym_train.run.tasks import TaskSampler

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from agent_gym_train.run.store import StateStore

IDLE_WARNING = 3  # steps in a row that trained nothing before the run warns
A = TypeVar("A", bound=RunArgs)


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
    task_sampler: TaskSampler
    idle_steps: int = 0  # steps in a row that trained nothing
    engine: Engine | None = None  # the vLLM server rollouts sample from (--sampler vllm)
    bar: tqdm | None = field(default=None, repr=False)
    _journal: Journal | None = field(default=None, repr=False)
    _checkpoints: dict[int, str] | None = field(default=None, repr=False)
    # This process's CPU seconds (every thread's) when the last metrics line was written.
    _cpu_mark: float = field(default_factory=time.process_time, repr=False)
    # The engine's prefix-cache counters (tokens asked for, found) at the last metrics line.
    _cache_mark: tuple[float, float] = field(default=(0.0, 0.0), repr=False)
    _engine_cpu_mark: float = field(default=0.0, repr=False)  # the engine's, likewise
    # CPU seconds of every step so far, the checkpointed ones of earlier invocations too
    # (``cpu_step`` plus ``engine_cpu_step``): what ``--cpu-budget`` is spent against.
    cpu_spent: float = 0.0

    def __post_init__(self) -> None:
        if self.engine is not None:  # the engine's start-up is not the first step's
            self._engine_cpu_mark = self.engine.cpu_seconds() or 0.0

    def checkpoints(self) -> dict[int, str]:
        """Backend paths of this run's latest checkpoints, by the step they complete (the
        weights of that version): the last one, and those ``--max-staleness`` needs."""
        if self._checkpoints is None:
            self._checkpoints = ({**self.resumed.earlier, self.resumed.step: self.resumed.path}
                                 if self.resumed is not None else {})
        return self._checkpoints

    @property
    def journal(self) -> Journal:
        """The run's journal of in-flight episodes (``agent_gym_train.run.journal``), opened
        on first use: the trainers whose rollouts it keeps (``rollouts``) use it."""
        if self._journal is None:
            self._journal = Journal(self.out / JOURNAL_FILE,
                                    fingerprint(dataclasses.asdict(self.args)),
                                    getattr(self.args, "max_staleness", 0))
            if self._journal.discarded:
                print(f"{self.out / JOURNAL_FILE} held {self._journal.discarded} branches of a "
                      "run with other settings: discarded", file=sys.stderr)
        return self._journal

    @property
    def start(self) -> int:
        """The first step this invocation runs."""
        return self.resumed.step if self.resumed else 0

    def progress(self) -> Iterator[int]:
        """The steps still to run, on a progress bar (``--no-progress`` hides it); they end
        early once ``--cpu-budget`` is spent."""
        if self.resumed is not None:
            print(f"resuming {self.out} at step {self.start}", file=sys.stderr)
        self.bar = tqdm(range(self.start, self.steps), initial=self.start, total=self.steps,
                        disable=not self.args.progress)
        for step in self.bar:
            if self.budget_spent():
                tqdm.write(f"{self.out}: --cpu-budget {self.args.cpu_budget:g} s spent "
                           f"({self.cpu_spent:.0f} s) after {step} steps", file=sys.stderr)
                self.bar.close()
                return
            yield step

    def budget_spent(self) -> bool:
        budget = self.args.cpu_budget
        return budget is not None and self.cpu_spent >= budget

    def rng(self, step: int) -> np.random.Generator:
        """The step's generator (task choice, state draws): a function of (seed, step)."""
        return np.random.default_rng([self.args.seed, step])

    def seed(self, step: int, purpose: str, index: int) -> int:
        """A sampling seed for item ``index`` of ``purpose`` in ``step`` (``derive_seed``)."""
        return derive_seed(self.args.seed, step, purpose, index)

    def tasks(self, rng: np.random.Generator, count: int) -> list[dict[str, int]]:
        """Reset options of ``count`` tasks, drawn by the run's task sampler (uniformly
        unless ``--task-sampler`` says otherwise; distinct while there are enough)."""
        return self.task_sampler.draw(rng, count)

    # ---- rollouts on the run's envs, renderer and journal
    def rollout_config(self, group_size: int, history_window: int | None = None
                       ) -> RolloutConfig:
        """The budgets the run's arguments set for groups of ``group_size`` branches; the
        turn budget is the run's (``--max-turns``, else the env's own)."""
        args = self.args
        if args.max_tokens is None:
            raise ValueError("--max-tokens is left to its device default: fill it first "
                             "(device_defaults)")
        return RolloutConfig(
            group_size=group_size, max_turns=self.max_turns, max_tokens=args.max_tokens,
            max_trajectory_tokens=args.max_trajectory_tokens, temperature=args.temperature,
            history_window=history_window,
        )

    def rollouts(
        self, step: int, policy: VersionedSampler, starts: Sequence[Start],
        config: RolloutConfig, *, purpose: str = "group",
    ) -> list[list[Episode]]:
        """A step's groups, group ``g`` seeded by ``(step, purpose, g)`` so a continued run
        draws what an uninterrupted one would, and journaled turn by turn (``journal``) so
        a killed run continues them."""
        return asyncio.run(rollout_groups(
            self.envs, starts, policy.sampler, self.renderer, config,
            seeds=[self.seed(step, purpose, g) for g in range(len(starts))],
            concurrency=self.args.concurrency,
            journals=[GroupJournal(self.journal, step, purpose, g, policy.version)
                      for g in range(len(starts))],
        ))

    def sampled_versions(self, step: int, episodes: Sequence[Episode]) -> Metrics:
        """Which weights sampled a step's episodes (the oldest of them, and how many updates
        behind the step that trains them), and what they took from the run's journal."""
        oldest = min((e.version for e in episodes if e.version is not None), default=step)
        taken = self.journal.resumed(step)
        return {"sampler_version": oldest, "staleness": step - oldest,
                "journal_reused_episodes": taken.reused_episodes,
                "journal_resumed_branches": taken.resumed_branches,
                "journal_dropped_branches": taken.dropped_branches}

    def weights(self) -> Weights:
        """Where a ``RolloutPipeline`` takes its samplers: the learner's weights, or a
        version saved in one of the run's checkpoints."""
        init_from = self.args.init_from
        saved: Callable[[str | None], Sampler] = functools.partial(
            self.service.create_sampling_client, self.args.model)
        if isinstance(self.training, EngineTraining):  # older weights go to the engine too
            saved = self.training.sampler_on
        return Weights(
            current=self.training.save_weights_and_get_sampling_client,
            saved=saved,
            checkpoints=self.checkpoints(),
            initial=checkpoint_path(init_from) if init_from is not None else None,
            threads=getattr(self.service, "threads", None),
        )

    def update(
        self, datums: list[Datum], supervised: Sequence[Datum] = (),
        objective: Objective | None = None,
    ) -> Metrics:
        """One forward-backward of the run's objective on the step's whole logical batch
        (pytrio normalises by whole-batch totals) and one ``optim_step``; nothing when there
        are neither datums nor supervised ones. Returns the update's part of the metrics line.

        ``supervised``: ``cross_entropy`` datums trained in the same step, as a second pass
        whose gradients add to the first's (each pass is its own batch's mean, so the two
        terms keep their weights however many tokens each has). OPD's teacher labels.
        ``objective``: the loss of ``datums`` when not the run's (stale data's truncated one).
        """
        metrics: dict[str, float] = {}
        extra: Metrics = {}
        if datums:
            objective = objective or self.objective
            output = objective.forward_backward(self.training, datums).result()
            metrics = dict(output.metrics)
            extra |= sampler_mismatch(datums, output.loss_fn_outputs, objective.max_weight)
        if supervised:
            ce = self.training.forward_backward(list(supervised), "cross_entropy").result()
            extra |= {"supervised_datums": len(supervised),
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
        a warning that names the likely cause.

        Every line gets ``cpu_step``: the CPU seconds this process spent (all its threads)
        since the previous line, so runs that share a machine compare at equal CPU, not at
        equal wall-clock (a continued run's first line counts from its start). With
        ``--sampler vllm`` it also gets ``engine_prefix_hit_rate``: the share of the step's
        prompt tokens the engine's prefix cache already held, and ``engine_cpu_step``: the
        CPU seconds of the engine's processes, when the run started them."""
        now = time.process_time()
        row = {**row, "cpu_step": now - self._cpu_mark}
        self._cpu_mark = now
        self.cpu_spent += row["cpu_step"]
        if self.engine is not None:  # how much of the step's prompts the engine had cached
            asked, found = self.engine.prefix_cache()
            row["engine_prefix_hit_rate"] = ((found - self._cache_mark[1])
                                             / (asked - self._cache_mark[0])
                                             if asked > self._cache_mark[0] else None)
            self._cache_mark = (asked, found)
            spent = self.engine.cpu_seconds()
            if spent is not None:
                row["engine_cpu_step"] = spent - self._engine_cpu_mark
                self._engine_cpu_mark = spent
                self.cpu_spent += row["engine_cpu_step"]
        append_metrics(self.out / METRICS_FILE, row)
        self.idle_steps = 0 if trained_datums(row) else self.idle_steps + 1
        if self.bar is not None:
            self.bar.set_postfix({**(shown or {}), "trained": trained_datums(row) or "nothing"})
        if self.idle_steps == IDLE_WARNING:
            tqdm.write(idle_advice(self.idle_steps, row, self.args), file=sys.stderr)
        done = step + 1
        if done % self.args.save_every and done != self.steps and not self.budget_spent():
            return
        path = self.training.save_state(f"step-{done:06d}", overwrite=True).result().path
        store_file = None
        if store is not None:
            store_file = f"store-{done:06d}.json"
            write_text(self.out / store_file, store.to_json())
        keep = getattr(self.args, "max_staleness", 0)  # weights rollouts may still be sampled on
        earlier = {s: p for s, p in self.checkpoints().items() if done - keep <= s < done}
        record = Checkpoint(done, path, dataclasses.asdict(self.args), store_file, earlier)
        self._checkpoints = {**earlier, done: path}
        write_text(self.out / CHECKPOINT_FILE, json.dumps(record.to_dict(), indent=1))
        if self._journal is not None:  # the checkpoint holds these steps' updates now
            self._journal.forget_before(done)
        if store_file is not None:  # the previous checkpoint's store is named no more
            for old in self.out.glob("store-*.json"):
                if old.name != store_file:
                    old.unlink()

    def close(self) -> None:
        self.envs.close()
        if self.engine is not None:
            self.engine.close()
        if self._journal is not None:
            self._journal.close()

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
    num_tasks, env_turns, parts = described[0]
    out = Path(args.out)
    check_journal(out / JOURNAL_FILE)  # a damaged one is one line, before a model loads
    service = service or make_service(
        args.backend, checkpoint_dir=out / "checkpoints", api_key=args.api_key,
        device=args.device, threads=args.threads,
        activation_checkpointing=args.activation_checkpointing,
        sampler_precision=args.sampler_precision,
    )
    training, resumed = training_client(service, args, out / CHECKPOINT_FILE)
    out.mkdir(parents=True, exist_ok=True)
    earlier = keep_metrics_before(out / METRICS_FILE, resumed.step if resumed else 0)
    engine = None
    if args.sampler == "vllm":  # last: nothing after it can fail and leave it running
        engine, weights = open_engine(args, out, training.get_tokenizer())
        training = EngineTraining(training, service, weights)
    return Run(
        args=args, out=out, steps=steps, service=service, training=training, resumed=resumed,
        renderer=ChatRenderer(training.get_tokenizer()),
        envs=EnvPool(env_factory(args.env_id, args.env_kwargs, args.ray)),
        num_tasks=num_tasks,
        max_turns=args.max_turns if args.max_turns is not None else env_turns,
        adam=AdamParams(learning_rate=args.learning_rate, grad_clip_norm=args.grad_clip_norm),
        objective=Objective(args.loss, args.loss_aggregation, args.clip_low, args.clip_high),
        task_sampler=TaskSampler.from_metrics(
            num_tasks, getattr(args, "task_sampler", "uniform"), earlier, parts),
        engine=engine,
        cpu_spent=sum(row.get("cpu_step", 0.0) + (row.get("engine_cpu_step") or 0.0)
                      for row in earlier),
    )


def open_engine(args: RunArgs, out: Path, tokenizer: PreTrainedTokenizerBase
                ) -> tuple[Engine, VLLMWeights | MergedWeights]:
    """The vLLM server of ``--sampler vllm`` and how weights reach it: ``--vllm-url``'s, or
    one the run starts (its output in ``out/vllm.log``): from the base model as
    ``merged.save_engine_model`` writes it (``out/engine/base``) for merged weights, from
    ``--model``'s directory with LoRA at ``--lora-rank`` for adapters."""
    name = served_model_name(args.model)
    keep = keep_versions(getattr(args, "max_staleness", 0))
    if args.vllm_weights == "adapter":
        if args.vllm_url is not None:
            engine = Engine.connect(args.vllm_url, name)
        else:
            from agent_gym_train.backends.models import model_dir  # torch: a local engine

            engine = Engine.start(EngineConfig(
                model_dir=model_dir(args.model), served_name=name,
                max_lora_rank=args.lora_rank, max_loras=keep, log=out / "vllm.log",
                threads=args.threads))
        return engine, VLLMWeights(engine, tokenizer, out / "adapters", keep)
    from agent_gym_train.backends.merged import save_engine_model  # torch: the learner's side
    from agent_gym_train.backends.models import load_model, model_dir

    folder = out / "engine"
    base = save_engine_model(load_model(args.model), model_dir(args.model),
                             folder / BASE_WEIGHTS)
    if args.vllm_url is not None:
        engine = Engine.connect(args.vllm_url, name)
        loaded = None
    else:
        engine = Engine.start(EngineConfig(
            model_dir=base, served_name=name, max_lora_rank=0, max_loras=1,
            log=out / "vllm.log", threads=args.threads, reloads=True))
        loaded = BASE_WEIGHTS
    try:
        return engine, MergedWeights(engine, tokenizer, folder, keep, loaded)
    except BaseException:
        engine.close()
        raise
