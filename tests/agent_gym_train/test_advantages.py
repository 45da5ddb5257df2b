from __future__ import annotations

import numpy as np
import pytest

from agent_gym_train.advantages import STD_EPSILON, group_advantages


def test_each_branch_is_judged_against_its_siblings() -> None:
    got = group_advantages([1.0, 0.0, 0.0, 1.0])
    assert got is not None
    np.testing.assert_allclose(got, [0.5, -0.5, -0.5, 0.5])
    assert got.sum() == pytest.approx(0.0, abs=1e-12)  # the baseline takes the mean out


def test_normalising_by_the_std_gives_unit_spread() -> None:
    got = group_advantages([2.0, 0.0, 1.0, 1.0], normalize_std=True)
    assert got is not None
    want = np.array([1.0, -1.0, 0.0, 0.0]) / (np.std([2.0, 0.0, 1.0, 1.0]) + STD_EPSILON)
    np.testing.assert_allclose(got, want)
    assert got.std() == pytest.approx(1.0, rel=1e-5)


@pytest.mark.parametrize("returns", [[0.0, 0.0, 0.0], [1.0, 1.0], [0.3]])
def test_a_group_of_equal_returns_has_nothing_to_teach(returns: list[float]) -> None:
    assert group_advantages(returns) is None
    assert group_advantages(returns, normalize_std=True) is None


def test_the_input_is_left_alone() -> None:
    returns = np.array([1.0, 0.0])
    group_advantages(returns, normalize_std=True)
    assert returns.tolist() == [1.0, 0.0]
