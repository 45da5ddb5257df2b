"""Rollouts that run ahead of the learner, by at most ``max_staleness`` weight versions.

A synchronous trainer alternates: the sampler waits while the learner updates, the learner
waits while the sampler rolls out, and on a machine where each would have a core of its
own one of them idles for most of a step. ``RolloutPipeline`` lets the rollouts of later
steps run, in a worker thread, while the learner trains the current one:

* the weights have a **version**, the number of updates applied (the first step when the
  run opens: a continued run's first sampler is its checkpoint's weights);
* the rollouts of step ``t`` are sampled on version ``max(0, t - max_staleness)``, so the
  data an update trains on is at most ``max_staleness`` versions behind the weights it
  updates, and the worker never runs further ahead than that; a continued run loads those
  older weights from the checkpoints that hold them (``Checkpoint.earlier``), so it samples
  what a run never stopped would have, and the run's journal (``agent_gym_train.run.journal``)
  continues the rollouts that were in flight;
* after each update the trainer calls ``publish``, which takes a sampler on the new weights
  (on the learner's thread: the weights are not changing then) when a later step needs it.

``max_staleness=0`` is the synchronous loop itself, with no thread: ``take(step)`` takes a
sampler on the current weights and rolls out, exactly as the trainers did before the
pipeline existed. What the data sampled on older weights costs the objective, and how the
loss bounds it, is in ``agent_gym_train.run.losses`` (``Objective.max_weight``).

On the local backend the learner and the sampler then run at once in one process: each is
given half of the run's torch threads (at least one), since both call torch's one
process-wide pool. Torch releases the GIL inside its operators, so the two threads overlap
except for their Python between operators. On the PyTRIO backend the worker's rollouts are
calls to the service, and overlap with the learner's calls the same way.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from agent_gym_train.backends.runtime import apply_threads
from agent_gym_train.run.args import option
from agent_gym_train.run.clients import Sampler, VersionedSampler
from agent_gym_train.run.losses import Objective

T = TypeVar("T")
SWITCH_INTERVAL_S = 0.0005  # how soon a thread computing in Python hands the GIL over


def max_staleness_option() -> int:
    """``--max-staleness``, for the ``Args`` of a trainer whose loop takes a pipeline."""
    return option(0, "sample the next steps' rollouts while the learner trains, on weights at "
                     "most N updates old (0: wait for each update, the synchronous loop)")


MAX_IMPORTANCE_WEIGHT = 2.0  # the default bound of ``Objective.truncated``


def max_importance_weight_option() -> float:
    """``--max-importance-weight``: the bound of ``Objective.truncated``."""
    return option(MAX_IMPORTANCE_WEIGHT,
                  "with --max-staleness, --sampler-precision bfloat16 or --sampler vllm: the "
                  "largest importance weight of a token under --loss importance_sampling "
                  "(truncated importance sampling)")


def off_policy_objective(objective: Objective, sampler: str, sampler_precision: str,
                         max_staleness: int, max_importance_weight: float) -> Objective:
    """``objective``, truncated (``Objective.truncated``) when the samples come from other
    weights than the learner's: older ones (``max_staleness``), a bfloat16 copy
    (``--sampler-precision``) or an engine (``--sampler vllm``: its own precision and
    kernels), whose logprobs differ from the learner's by the rounding."""
    exact = max_staleness == 0 and sampler == "local" and sampler_precision == "float32"
    return objective if exact else objective.truncated(max_importance_weight)


def staleness_problems(max_staleness: int, max_importance_weight: float) -> list[str]:
    """What is wrong with those two options (empty: nothing)."""
    return [*(["--max-staleness must not be negative"] if max_staleness < 0 else []),
            *(["--max-importance-weight must be at least 1"]
              if not 1 <= max_importance_weight < float("inf") else [])]


@dataclass(frozen=True)
class Weights:
    """Where a pipeline takes its samplers (``Run.weights`` gives a run's)."""

    current: Callable[[], Sampler]  # a sampler on the learner's weights as they are now
    saved: Callable[[str | None], Sampler]  # one on a checkpoint's (None: the base model's)
    checkpoints: Mapping[int, str]  # saved weight versions, by the step they complete
    initial: str | None  # version 0: ``--init-from``'s checkpoint, or None (the base model)
    threads: int | None  # the service's torch threads, shared with the learner (local backend)


@dataclass(frozen=True)
class Sampled(Generic[T]):
    """One step's rollouts: what ``collect`` returned, and on which weights."""

    step: int
    version: int  # updates applied to the weights that sampled it
    batch: T
    time_sampler: float  # taking the sampler (copying the weights)
    time_rollout: float  # collect's own time


class RolloutPipeline(Generic[T]):
    """The rollouts of ``steps`` (a continued run's start to its end), produced by
    ``collect(step, sampler)`` and handed to the learner in order by ``take``. ``close`` it
    (``with contextlib.closing(...)``): that stops the worker (a rollout in progress is
    abandoned)."""

    def __init__(
        self, collect: Callable[[int, VersionedSampler], T], steps: range, weights: Weights,
        max_staleness: int,
    ) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must not be negative, got {max_staleness}")
        self.collect = collect
        self.steps = steps
        self.weights = weights
        self.max_staleness = max_staleness
        self._ready: dict[int, Sampled[T]] = {}
        self._samplers: dict[int, tuple[Sampler, float]] = {}
        self._failure: BaseException | None = None
        self._stopping = False
        self._changed = threading.Condition()
        self._worker: threading.Thread | None = None
        self._restore: tuple[int, float] | None = None
        self._earlier: set[int] = set()  # versions before the first step, from checkpoints
        if max_staleness:
            self._share_cores()
            saved = weights.checkpoints
            for version in sorted({max(0, t - max_staleness) for t in steps}):
                if version >= steps.start:
                    break
                if version in saved or version == 0:
                    t0 = time.perf_counter()
                    sampler = weights.saved(saved.get(version) or weights.initial)
                    self._samplers[version] = (sampler, time.perf_counter() - t0)
                    self._earlier.add(version)
            self._publish_now(steps.start)
            self._worker = threading.Thread(target=self._produce, name="rollouts", daemon=True)
            self._worker.start()

    def version_for(self, step: int) -> int:
        """The weight version step ``step``'s rollouts are sampled on: ``max_staleness``
        updates old, as in a run never stopped, unless the run continues and those older
        weights are in no checkpoint; then the checkpoint's."""
        wanted = max(0, step - self.max_staleness)
        start = self.steps.start
        return wanted if wanted >= start or wanted in self._earlier else start

    def take(self, step: int) -> Sampled[T]:
        """Step ``step``'s rollouts; waits for the worker if they are not done yet."""
        if self._worker is None:  # synchronous: sample on the weights as they are now
            t0 = time.perf_counter()
            sampler = self.weights.current()
            t1 = time.perf_counter()
            batch = self.collect(step, VersionedSampler(sampler, step))
            return Sampled(step, step, batch, t1 - t0, time.perf_counter() - t1)
        with self._changed:
            while step not in self._ready and self._failure is None:
                self._changed.wait()
            if self._failure is not None:
                raise RuntimeError("the rollout worker failed") from self._failure
            return self._ready.pop(step)

    def publish(self, version: int) -> None:
        """The weights now hold ``version`` updates: take a sampler on them if a later step
        samples on this version. Call it right after the update, before anything else."""
        if self._worker is None:
            return
        if any(self.version_for(t) == version for t in range(version, self.steps.stop)):
            self._publish_now(version)

    def close(self) -> None:
        with self._changed:
            self._stopping = True
            self._samplers.clear()
            self._changed.notify_all()
        if self._restore is not None:
            threads, interval = self._restore
            apply_threads(threads)
            sys.setswitchinterval(interval)
            self._restore = None

    # ----------------------------------------------------------------- worker
    def _publish_now(self, version: int) -> None:
        t0 = time.perf_counter()
        sampler = self.weights.current()
        with self._changed:
            self._samplers[version] = (sampler, time.perf_counter() - t0)
            self._changed.notify_all()

    def _produce(self) -> None:
        try:
            for step in self.steps:
                version = self.version_for(step)
                with self._changed:
                    while version not in self._samplers and not self._stopping:
                        self._changed.wait()
                    if self._stopping:
                        return
                    sampler, copy_time = self._samplers[version]
                    for old in [v for v in self._samplers if v < version]:
                        del self._samplers[old]  # no later step samples on older weights
                t0 = time.perf_counter()
                batch = self.collect(step, VersionedSampler(sampler, version))
                done = Sampled(step, version, batch, copy_time, time.perf_counter() - t0)
                del sampler
                with self._changed:
                    self._ready[step] = done
                    self._changed.notify_all()
        except BaseException as error:  # handed to the learner by take()
            with self._changed:
                if not self._stopping:
                    self._failure = error
                self._changed.notify_all()

    def _share_cores(self) -> None:
        """Half the run's torch threads each for the learner and the sampler (local
        backend), and quick GIL hand-overs between them."""
        self._restore = (torch.get_num_threads(), sys.getswitchinterval())
        if self.weights.threads is not None:
            apply_threads(max(1, self.weights.threads // 2))
        sys.setswitchinterval(SWITCH_INTERVAL_S)
