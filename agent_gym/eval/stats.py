"""The statistics of a run's figures: Wilson and bootstrap intervals, pass@k, percentiles."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np

BOOTSTRAP_SAMPLES = 2000
BOOTSTRAP_SEED = 0


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval: honest at 0%, 100% and small n, unlike the normal one."""
    if trials == 0:
        return 0.0, 1.0
    return _wilson(successes / trials, trials, z)


def _wilson(p: float, trials: int, z: float = 1.96) -> tuple[float, float]:
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (
        1 + z * z / trials
    )
    return max(0.0, centre - half), min(1.0, centre + half)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of a task with ``c`` successes in ``n`` samples (Chen et al. 2021):
    ``1 - C(n-c, k) / C(n, k)``, the chance that k of the n samples drawn without
    replacement include a success.

    Computed as ``1 - prod_{i=n-c+1..n} (1 - k/i)``: c factors in [0, 1), no binomial
    that overflows a float and no difference of two huge numbers.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def bootstrap_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (one value per task),
    seeded so a summary is reproducible."""
    if not values:
        return 0.0, 1.0
    data = np.asarray(values, dtype=float)
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    means = data[rng.integers(0, len(data), (BOOTSTRAP_SAMPLES, len(data)))].mean(axis=1)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)


def rate_interval(values: Sequence[float]) -> tuple[float, float]:
    """95% interval of the mean of per-task rates in [0, 1] (success, pass@k): a percentile
    bootstrap over tasks, widened to at least Wilson's interval for one draw per task.

    The bootstrap alone collapses to a point when every task scored alike: 0 successes in
    72 episodes of 18 tasks would read [0, 0]. Counting each task once (its rollouts may be
    as good as copies of each other) gives the honest floor, here [0, 0.18].
    """
    if not values:
        return 0.0, 1.0
    low, high = bootstrap_interval(values)
    floor_low, floor_high = _wilson(statistics.fmean(values), len(values))
    return min(low, floor_low), max(high, floor_high)


def percentile(values: Sequence[float], q: float) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
