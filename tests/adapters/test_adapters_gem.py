"""GEM's own wrappers on ``agent_gym.adapters.gem``: what reaches a policy holds no
privileged info; a critic reads it from the env."""

from __future__ import annotations

import gymnasium
import pytest

pytest.importorskip("gem.core")

from gem.wrappers.episode_tracking_wrapper import EpisodeTrackingWrapper

from agent_gym.adapters.gem import GemEnv


def test_gem_infos_hold_no_privileged_info_and_the_critic_reads_it_from_the_env() -> None:
    local = gymnasium.make("agent_gym/Search-v0", max_turns=4)
    _, expected = local.reset(options={"index": 2})
    local.close()
    oracle = expected["privileged"]["oracle_actions"]

    env = EpisodeTrackingWrapper(GemEnv("agent_gym/Search-v0", {"index": 2}, max_turns=4))
    observation, info = env.reset(0)
    assert "privileged" not in info and info["task_id"] == expected["task_id"]
    assert not [a for a in oracle if a in observation or a in str(info)]
    assert env.unwrapped.privileged == expected["privileged"]
    _, _, _, _, step_info = env.step(oracle[0])
    assert "privileged" not in step_info
    # A copy at this point (GEM's spawn, a restore) knows its episode's too, and tells no one.
    twin = env.unwrapped.spawn(same_state=True)
    assert twin.privileged == expected["privileged"]
    for action in oracle[1:]:
        *_, twin_info = twin.step(action)
        assert "privileged" not in twin_info
    assert twin_info["em"]  # the oracle's answer, exactly right
    for copy in (env, twin):
        copy.close()
