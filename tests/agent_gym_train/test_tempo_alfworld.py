"""TEMPO end to end on the bundled ALFWorld games: warm-up and TD updates on the local
backend, with stored states restored into fresh engines and checked against what the
saved episodes showed."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
from pathlib import Path

import gymnasium
import pytest

from agent_gym.render import ChatRenderer
from agent_gym_train.backends.local import LocalServiceClient
from agent_gym_train.run.envpool import EnvPool
from agent_gym_train.run.rollout import RolloutConfig, RolloutError, rollout_group
from agent_gym_train.run.store import StateStore
from agent_gym_train.tempo import Args, train
from tests.helpers import tempo_toy

pytest.importorskip("textworld")
ENV_ID = "agent_gym/ALFWorld-v0"
ENV_KWARGS = {"max_turns": 4, "task_types": ["look_at_obj_in_light"]}


def test_tempo_on_alfworld(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    model = tempo_toy.value_model(tmp_path_factory)
    args = Args(
        env_id=ENV_ID, env_kwargs=ENV_KWARGS, model=model, lora_rank=0, warmup_updates=2,
        td_updates=2, batch_size=2, horizon=2, branches=2, fresh_fraction=0.5, learning_rate=1e-3, max_tokens=16, critic_max_tokens=12,
        max_trajectory_tokens=4096, out=str(tmp_path), progress=False, save_every=2,
    )
    history = train(args)
    assert [row["phase"] for row in history] == ["warmup", "warmup", "td", "td"]
    warmup, td = history[:2], history[2:]
    assert all(row["warmup/boundary_states"] > 0 for row in warmup)
    assert sum(row["critic/datums"] for row in history) > 0
    for row in td:
        # a stored state was restored (replayed, digest-checked, chat compared) every update
        assert row["td/restored_states"] == 1 and row["td/fresh_states"] == 1
        assert row["is/weight_mean"] is not None
        assert row["critic/parse_failure_rate"] is not None
        # The toy wins no game, and after warm-up its critic says so: a group whose returns
        # are all equal is skipped, so no datum is trained on the critic's noise.
        assert (row["actor/datums"] == 0) == (row["actor/degenerate_group_rate"] == 1.0)

    # every stored state restores, in a fresh engine, to the observation it was saved with
    saved = json.loads((tmp_path / "checkpoint.json").read_text())
    store = StateStore.from_json((tmp_path / saved["store"]).read_text(), 100, 100)
    assert len(store) == history[-1]["td/store_size"] > 0
    pool = EnvPool(functools.partial(gymnasium.make, ENV_ID, **ENV_KWARGS))
    try:
        env = pool()
        for state in store:
            observation, info = env.reset(options={"state": state.state})
            assert observation == state.observation
            assert [*info["messages"], *info["history"]] == list(state.messages)
        env.close()

        # and a state whose saved observation differs from the game's is refused
        state = next(iter(store))
        tampered = dataclasses.replace(
            state, messages=(*state.messages[:-1], {**state.messages[-1], "content": "You win."})
        )
        sampler = LocalServiceClient().create_sampling_client(model)
        config = RolloutConfig(group_size=1, max_turns=1, max_tokens=4, keep_states=True)
        with pytest.raises(RolloutError, match=r"the saved state showed 'You win\.'"):
            asyncio.run(rollout_group(pool, tampered, sampler,
                                      ChatRenderer(sampler.get_tokenizer()), config))
    finally:
        pool.close()
