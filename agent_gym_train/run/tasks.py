"""Which tasks a GRPO step rolls out: uniformly, or preferring the tasks that teach.

A group whose rewards are all equal (every branch solved the task, or none did) has no
advantage to learn from: its rollout time is spent for nothing. Which tasks give mixed
outcomes changes as the policy learns: at first the easy ones, later the hard ones. So
``--task-sampler mixed`` keeps, per task, whether its last ``WINDOW`` groups had mixed
outcomes, and draws tasks with probability proportional to the posterior mean of that,
never below ``FLOOR`` (a task that has been all-or-nothing is still revisited, as the
policy moves). The prior of a task is its part's odds (below; they start even): a task
never drawn takes them, and each group it plays moves it from there, ``(mixed + 2 p) /
(groups + 2)``. So a task drawn once and found all-or-nothing always ranks below one not
drawn yet, however rarely its part teaches. ``uniform`` (the default) draws
as every run did before.

An env made of parts (``agent_gym/Mixture-v0``: several envs, each with a weight) is drawn
part by part: ``uniform`` gives part k the share weight k / sum of weights, spread evenly
over its tasks. ``mixed`` multiplies that share by each task's chance of a mixed group; a
task not drawn yet takes its part's chance instead (the posterior mean over the part's last
``PART_WINDOW`` groups). On a set of a thousand tasks a run draws most tasks once at most,
so a task's own window rarely speaks: what the sampler learns in that case is which parts
teach (an env the policy always fails, or always solves, loses its share to one that has
mixed outcomes).

The sampler's memory is a function of the groups the run rolled out; each metrics line
records its step's (``task_outcomes``: task index -> 1 if the group was mixed), so a
continued run rebuilds it from the lines before its checkpoint (``from_metrics``) and draws
what an uninterrupted run would have.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from agent_gym.env import EnvPart
from agent_gym_train.run.files import Metrics, RunConfigError

SAMPLERS = ("uniform", "mixed")
WINDOW = 4  # groups of a task remembered
PART_WINDOW = 32  # groups of a part remembered (its untried tasks' chance)
FLOOR = 0.05  # the least weight of a task, relative to even odds' 0.5


@dataclass
class TaskSampler:
    """Draws the tasks of a step (``draw``) and learns from their groups (``observe``)."""

    num_tasks: int
    kind: str = "uniform"
    parts: tuple[EnvPart, ...] = ()  # () is one part of every task
    outcomes: dict[int, deque[bool]] = field(default_factory=dict)
    part_outcomes: dict[int, deque[bool]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in SAMPLERS:
            raise ValueError(f"task sampler {self.kind!r} is not one of {SAMPLERS}")
        self.parts = self.parts or (EnvPart(self.num_tasks, 1.0),)
        for part in self.parts:
            if part.num_tasks < 1 or not math.isfinite(part.weight) or part.weight <= 0:
                raise ValueError(f"an env part needs tasks and a positive weight, got {part}")
        if sum(part.num_tasks for part in self.parts) != self.num_tasks:
            raise ValueError(f"the parts hold {sum(p.num_tasks for p in self.parts)} tasks, "
                             f"not {self.num_tasks}")
        self._ends = np.cumsum([part.num_tasks for part in self.parts])

    def draw(self, rng: np.random.Generator, count: int) -> list[dict[str, int]]:
        """Reset options of ``count`` tasks, distinct while there are enough."""
        replace = count > self.num_tasks
        if self.kind == "uniform" and len(self.parts) == 1:
            chosen = rng.choice(self.num_tasks, size=count, replace=replace)
        else:
            weights = self.weights()
            chosen = rng.choice(self.num_tasks, size=count, replace=replace,
                                p=weights / weights.sum())
        return [{"index": int(i)} for i in chosen]

    def weights(self) -> np.ndarray:
        """Each task's weight: its part's share over the part's tasks, times (``mixed``)
        the chance its next group is mixed, as its window (or its part's) says."""
        total = sum(part.weight for part in self.parts)
        share = np.concatenate([np.full(part.num_tasks, part.weight / total / part.num_tasks)
                                for part in self.parts])
        if self.kind == "uniform":
            return share
        part_chance = [_posterior(self.part_outcomes.get(k), 0.5)
                       for k in range(len(self.parts))]
        chance = np.concatenate([np.full(part.num_tasks, part_chance[k])
                                 for k, part in enumerate(self.parts)])
        for index, seen in self.outcomes.items():
            chance[index] = _posterior(seen, part_chance[self._part_of(index)])
        return share * np.maximum(FLOOR, chance)

    def _part_of(self, index: int) -> int:
        return int(np.searchsorted(self._ends, index, side="right"))

    def observe(self, index: int, mixed: bool) -> None:
        if isinstance(index, bool) or not 0 <= index < self.num_tasks:
            raise ValueError(f"task index {index!r} is not in [0, {self.num_tasks})")
        mixed = _outcome(mixed)
        self.outcomes.setdefault(index, deque(maxlen=WINDOW)).append(mixed)
        self.part_outcomes.setdefault(self._part_of(index), deque(maxlen=PART_WINDOW)
                                      ).append(mixed)

    def record(self, tasks: Sequence[Mapping[str, int]], mixed: Sequence[bool]) -> dict[str, int]:
        """Observe a step's groups as its metrics line keeps them (a task drawn twice in
        one step counts its last group), and return that record."""
        kept = {str(task["index"]): int(_outcome(outcome))
                for task, outcome in zip(tasks, mixed, strict=True)}
        for index, outcome in kept.items():
            self.observe(int(index), outcome)
        return kept

    @classmethod
    def from_metrics(cls, num_tasks: int, kind: str, rows: Iterable[Metrics],
                     parts: tuple[EnvPart, ...] = ()) -> TaskSampler:
        """The sampler as it was after the steps of ``rows`` (a continued run's lines); a
        line naming a task the env does not have is a one-line error, not a guess."""
        sampler = cls(num_tasks, kind, parts)
        for row in rows:
            outcomes = row.get("task_outcomes")
            if not isinstance(outcomes, dict):
                continue
            for index, mixed in outcomes.items():
                try:
                    if not (isinstance(index, str) and index.isascii() and index.isdigit()):
                        raise ValueError(f"task index {index!r} is not a number")
                    sampler.observe(int(index), mixed)
                except ValueError as err:
                    raise RunConfigError(f"metrics line of step {row.get('step')}: {err}"
                                         ) from err
        return sampler


def _outcome(mixed: object) -> bool:
    """A group's outcome as a bool, from a bool or the 0 / 1 its metrics line stores.

    Anything else is refused rather than read by its truth: a hand-edited or foreign line
    holding ``"0"``, ``"no"`` or ``5`` would otherwise count as a mixed group and steer
    every later draw."""
    if isinstance(mixed, (bool, np.bool_)) or (isinstance(mixed, (int, np.integer))
                                                and mixed in (0, 1)):
        return bool(mixed)
    raise ValueError(f"a group's outcome is true / false or 1 / 0, not {mixed!r}")


def _posterior(seen: Iterable[bool] | None, prior: float) -> float:
    """The posterior mean chance of a mixed group, from a prior mean ``prior`` worth two
    groups: (mixed + 2 prior) / (n + 2)."""
    seen = list(seen or ())
    return (sum(seen) + 2 * prior) / (len(seen) + 2)
