"""Which tasks a GRPO step rolls out: uniformly, or preferring the tasks that teach.

A group whose rewards are all equal (every branch solved the task, or none did) has no
advantage to learn from: its rollout time is spent for nothing. Which tasks give mixed
outcomes changes as the policy learns: at first the easy ones, later the hard ones. So
``--task-sampler mixed`` keeps, per task, whether its last ``WINDOW`` groups had mixed
outcomes, and draws tasks with probability proportional to the posterior mean of that
(``(mixed + 1) / (groups + 2)``: a task never drawn counts as even odds, so every task is
tried), never below ``FLOOR`` (a task that has been all-or-nothing is still revisited, as
the policy moves). ``uniform`` (the default) draws as every run did before.

The sampler's memory is a function of the groups the run rolled out; each metrics line
records its step's (``task_outcomes``: task index -> 1 if the group was mixed), so a
continued run rebuilds it from the lines before its checkpoint (``from_metrics``) and draws
what an uninterrupted run would have.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from agent_gym_train.runfiles import Metrics

SAMPLERS = ("uniform", "mixed")
WINDOW = 4  # groups of a task remembered
FLOOR = 0.05  # the least weight of a task, relative to even odds' 0.5


@dataclass
class TaskSampler:
    """Draws the tasks of a step (``draw``) and learns from their groups (``observe``)."""

    num_tasks: int
    kind: str = "uniform"
    outcomes: dict[int, deque[bool]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in SAMPLERS:
            raise ValueError(f"task sampler {self.kind!r} is not one of {SAMPLERS}")

    def draw(self, rng: np.random.Generator, count: int) -> list[dict[str, int]]:
        """Reset options of ``count`` tasks, distinct while there are enough."""
        replace = count > self.num_tasks
        if self.kind == "uniform":
            chosen = rng.choice(self.num_tasks, size=count, replace=replace)
        else:
            weights = self.weights()
            chosen = rng.choice(self.num_tasks, size=count, replace=replace,
                                p=weights / weights.sum())
        return [{"index": int(i)} for i in chosen]

    def weights(self) -> np.ndarray:
        """Each task's weight: the chance its next group is mixed, as the window says."""
        weights = np.full(self.num_tasks, 0.5)
        for index, seen in self.outcomes.items():
            weights[index] = max(FLOOR, (sum(seen) + 1) / (len(seen) + 2))
        return weights

    def observe(self, index: int, mixed: bool) -> None:
        self.outcomes.setdefault(index, deque(maxlen=WINDOW)).append(mixed)

    def record(self, tasks: Sequence[Mapping[str, int]], mixed: Sequence[bool]) -> dict[str, int]:
        """Observe a step's groups as its metrics line keeps them (a task drawn twice in
        one step counts its last group), and return that record."""
        kept = {str(task["index"]): int(outcome)
                for task, outcome in zip(tasks, mixed, strict=True)}
        for index, outcome in kept.items():
            self.observe(int(index), bool(outcome))
        return kept

    @classmethod
    def from_metrics(cls, num_tasks: int, kind: str, rows: Iterable[Metrics]) -> TaskSampler:
        """The sampler as it was after the steps of ``rows`` (a continued run's lines)."""
        sampler = cls(num_tasks, kind)
        for row in rows:
            outcomes = row.get("task_outcomes")
            if isinstance(outcomes, dict):
                for index, mixed in outcomes.items():
                    sampler.observe(int(index), bool(mixed))
        return sampler
