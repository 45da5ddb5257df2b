"""How a group's returns become each branch's training signal.

A group is several branches from one start (a task, or a saved state), so the start's
difficulty is the same for all of them: the group's mean is the baseline, and a branch's
advantage is how much better than its siblings it did (GRPO; tinker-cookbook's
``compute_grpo_advantages`` is the same rule). GRPO, OPD's reward term, TEMPO's actor
(on macro-step returns) and its critic (on the critic's own rewards) all centre this way.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

STD_EPSILON = 1e-6  # keeps a near-constant group's normalised advantages finite


def group_advantages(
    returns: Sequence[float] | np.ndarray, *, normalize_std: bool = False
) -> np.ndarray | None:
    """Each return minus the group's mean (divided by the group's std plus ``STD_EPSILON``
    with ``normalize_std``, Dr. GRPO's caution aside), or None for a degenerate group: when
    every return is equal every advantage is 0, and a trainer skips and counts the group
    rather than send datums that teach nothing."""
    array = np.asarray(returns, dtype=np.float64)
    if np.ptp(array) == 0:
        return None
    advantages = array - array.mean()
    if normalize_std:
        advantages /= array.std() + STD_EPSILON
    return advantages
