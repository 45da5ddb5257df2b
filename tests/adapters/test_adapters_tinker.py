"""tinker-cookbook's own rollout code on the adapter's EnvGroupBuilder, sampled by the local
backend through a TokenCompleter (the completer lives here: agent_gym never imports agent_gym_train)."""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Sequence
from typing import Any

import pytest

pytest.importorskip("tinker_cookbook")

import tinker
from pytrio import ModelInput, SamplingParams
from tinker_cookbook.completers import StopCondition, TokenCompleter, TokensWithLogprobs
from tinker_cookbook.rl.rollouts import do_group_rollout
from tinker_cookbook.rl.types import TrajectoryGroup

from agent_gym.adapters.tinker import (
    AgentGymEnvGroupBuilder,
    AgentGymRLDataset,
    reply_text,
)
from agent_gym_train.backends.local import LocalServiceClient
from agent_gym_train.backends.models import smollm2_tokenizer_dir


class LocalTokenCompleter(TokenCompleter):
    """The cookbook's TokenCompleter over the local backend's sampler (the tiny model)."""

    def __init__(self, max_tokens: int = 12) -> None:
        self.sampler = LocalServiceClient().create_sampling_client(base_model="tiny")
        self.max_tokens = max_tokens

    async def __call__(self, model_input: tinker.ModelInput, stop: StopCondition, *,
                       max_tokens: int | None = None) -> TokensWithLogprobs:
        params = SamplingParams(max_tokens=min(max_tokens or self.max_tokens, self.max_tokens),
                                stop=list(stop), temperature=1.0)
        response = await self.sampler.sample_async(
            ModelInput.from_ints(model_input.to_ints()), num_samples=1, sampling_params=params
        )
        sequence = response.sequences[0]
        return TokensWithLogprobs(tokens=list(sequence.tokens),
                                  maybe_logprobs=list(sequence.logprobs),
                                  stop_reason=sequence.stop_reason)


@pytest.fixture(scope="module")
def policy() -> LocalTokenCompleter:
    return LocalTokenCompleter()


def builder(**overrides: Any) -> AgentGymEnvGroupBuilder:
    settings: dict[str, Any] = {
        "env_id": "agent_gym/GSM8K-v0", "env_kwargs": {"max_turns": 1, "reward_incorrect": -0.5},
        "group_size": 3, "renderer_name": "role_colon", "tokenizer": str(smollm2_tokenizer_dir()),
        "task_id": "agsm-001",
    }
    settings.update(overrides)
    return AgentGymEnvGroupBuilder(**settings)


def test_cookbook_group_rollout_yields_trajectories_and_env_rewards(policy: Any) -> None:
    group_builder = pickle.loads(pickle.dumps(builder()))  # builders travel to workers
    group: TrajectoryGroup = asyncio.run(do_group_rollout(group_builder, policy))
    assert len(group.trajectories_G) == 3
    for trajectory in group.trajectories_G:
        assert len(trajectory.transitions) == 1
        transition = trajectory.transitions[0]
        assert transition.ac.tokens and len(transition.ac.logprobs) == len(transition.ac.tokens)
        assert transition.ob.length > 0
        assert transition.episode_done
        # The tiny model's reply is cut at max_tokens (the cookbook's own MAX_TOKENS stop,
        # with its overflow reward) or, when it stops, scored by the env (no \boxed{}).
        if trajectory.stop_reason == "max_tokens":
            assert transition.reward == pytest.approx(-0.1)
        else:
            assert trajectory.stop_reason == "completed"
            assert transition.reward == pytest.approx(-0.5)
    assert group.get_total_rewards() == [t.transitions[0].reward for t in group.trajectories_G]
    assert all(m["turns"] == 1.0 for m in group.metrics_G)


def test_a_right_answer_is_rewarded_by_the_env_through_the_cookbook_env() -> None:
    """The cookbook's renderer parses a reply ending in its stop sequence; the env scores it."""
    group_builder = builder(group_size=1)
    (env,) = asyncio.run(group_builder.make_envs())
    message_env = group_builder._message_envs[0]

    async def answer() -> Any:
        _, stop = await env.initial_observation()
        reference = message_env.env.unwrapped.task.payload["reference"]
        reply = f"So the answer is \\boxed{{{reference}}}.{stop[0]}"
        tokens = env.renderer.tokenizer.encode(reply, add_special_tokens=False)
        return await env.step(tokens, extra={"stop_reason": "stop"})

    result = asyncio.run(answer())
    assert result.episode_done and result.reward == 1.0
    assert result.metrics["stop/completed"] == 1.0
    assert message_env.messages[-1]["role"] == "user"
    assert message_env.messages[-1]["content"].startswith("Final answer: ")
    asyncio.run(group_builder.cleanup())
    assert group_builder._message_envs == []


def test_every_group_member_restores_the_same_saved_state(policy: Any) -> None:
    import gymnasium

    env = gymnasium.make("agent_gym/Search-v0", max_turns=4)
    _, info = env.reset(options={"task_id": "q000"})
    env.step(info["privileged"]["oracle_actions"][0])
    state = env.unwrapped.save_state()
    env.close()
    group_builder = builder(env_id="agent_gym/Search-v0", env_kwargs={"max_turns": 4},
                            renderer_name="qwen3", task_id=None, state=state.to_json(),
                            group_size=2)
    group = asyncio.run(do_group_rollout(group_builder, policy))
    assert len(group.trajectories_G) == 2
    first_prompts = [t.transitions[0].ob.to_ints() for t in group.trajectories_G]
    assert first_prompts[0] == first_prompts[1]  # identical restored starting point
    assert all(t.transitions[-1].episode_done for t in group.trajectories_G)


def test_reply_text_writes_tool_calls_for_the_env() -> None:
    from tinker_cookbook.renderers import ToolCall

    call = ToolCall(function=ToolCall.FunctionBody(name="search", arguments='{"query": "x"}'))
    text = reply_text({"role": "assistant", "content": "Let me look.", "tool_calls": [call]})
    assert text == ('Let me look.\n<tool_call>\n{"name": "search", "arguments": {"query": "x"}}'
                    "\n</tool_call>")
    dataset = AgentGymRLDataset("agent_gym/GSM8K-v0", {"max_turns": 1}, batch_size=4,
                                group_size=2, renderer_name="role_colon", tokenizer="unused")
    assert len(dataset) == 54 // 4 and len(dataset.get_batch(0)) == 4


END_OF_TURN = 2  # SmolLM2's <|im_end|>


def test_a_groups_envs_render_the_same_prompt_while_the_cookbook_renders_them_at_once() -> None:
    """The cookbook renders every env's first prompt in a thread of its own, on one shared
    tokenizer; without turn-taking, 18 of 30 groups of 8 had a member whose prompt differed
    (special tokens encoded as text)."""
    import gymnasium

    env = gymnasium.make("agent_gym/Search-v0", max_turns=4)
    _, info = env.reset(options={"task_id": "q000"})
    env.step(info["privileged"]["oracle_actions"][0])
    state = env.unwrapped.save_state().to_json()
    env.close()

    async def first_prompts(envs: Sequence[Any]) -> list[list[int]]:
        observations = await asyncio.gather(*(e.initial_observation() for e in envs))
        return [ob.to_ints() for ob, _ in observations]

    for _ in range(5):
        group_builder = builder(env_id="agent_gym/Search-v0", env_kwargs={"max_turns": 4},
                                renderer_name="qwen3", task_id=None, state=state, group_size=8)
        prompts = asyncio.run(first_prompts(asyncio.run(group_builder.make_envs())))
        asyncio.run(group_builder.cleanup())
        assert all(p == prompts[0] for p in prompts)
        assert END_OF_TURN in prompts[0]  # one token, not its spelling


def test_what_the_cookbook_renders_holds_no_privileged_info_and_a_critic_reads_it() -> None:
    """The policy sees only what the renderer encodes (the messages) and the step results;
    the episode's privileged info stays on the message env, for a critic."""
    import gymnasium

    local = gymnasium.make("agent_gym/Search-v0", max_turns=4)
    _, expected = local.reset(options={"task_id": "q001"})
    local.close()
    oracle = expected["privileged"]["oracle_actions"]
    group_builder = builder(env_id="agent_gym/Search-v0", env_kwargs={"max_turns": 4},
                            renderer_name="qwen3", task_id="q001", group_size=1)
    (env,) = asyncio.run(group_builder.make_envs())
    message_env = group_builder._message_envs[0]

    async def play() -> tuple[str, Any]:
        prompt, stop = await env.initial_observation()
        reply = f"{oracle[0]}{stop[0]}"
        tokens = env.renderer.tokenizer.encode(reply, add_special_tokens=False)
        return env.renderer.tokenizer.decode(prompt.to_ints()), await env.step(
            tokens, extra={"stop_reason": "stop"})

    shown, result = asyncio.run(play())
    assert message_env.privileged == expected["privileged"]
    assert not [action for action in oracle if action in shown]
    assert "privileged" not in str(result.logs) + str(result.metrics)
    env_side = str([m["content"] for m in message_env.messages if m["role"] != "assistant"])
    assert not [action for action in oracle[1:] if action in env_side]
    asyncio.run(group_builder.cleanup())


def test_a_renderer_without_tool_calling_names_the_text_protocol_that_works(
    policy: Any,
) -> None:
    """role_colon declares no tools: on a tool-protocol env it is one clear error naming
    the workaround, and with the env's text protocol the group rolls out."""
    tools = builder(env_id="agent_gym/Search-v0", env_kwargs={"max_turns": 2}, task_id="q001",
                    group_size=1)
    (env,) = asyncio.run(tools.make_envs())
    with pytest.raises(ValueError, match="protocol='tag'"):
        asyncio.run(env.initial_observation())
    asyncio.run(tools.cleanup())
    tags = builder(env_id="agent_gym/Search-v0", env_kwargs={"max_turns": 2, "protocol": "tag"},
                   task_id="q001", group_size=2)
    group: TrajectoryGroup = asyncio.run(do_group_rollout(tags, policy))
    assert len(group.trajectories_G) == 2
    assert all(trajectory.transitions for trajectory in group.trajectories_G)
