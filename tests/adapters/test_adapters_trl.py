"""TRL's own GRPOTrainer trains on agent_gym envs through the adapter (tiny model, CPU, offline)."""

from __future__ import annotations

import os
from typing import Any

import pytest

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")

from transformers.utils import get_json_schema  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.chat_template_utils import add_response_schema, parse_response, qwen3_chat_template  # noqa: E402

from agent_gym.adapters.trl import env_reward, trl_dataset, trl_environment  # noqa: E402
from agent_gym.env.state import EnvState  # noqa: E402
from agent_gym_train.models import load_tokenizer, tiny_model  # noqa: E402

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def tool_tokenizer() -> Any:
    """The tiny model's SmolLM2 tokenizer with the Qwen3 chat template TRL ships: TRL needs a
    tool-calling template it recognises, and SmolLM2's ChatML tokens are the same."""
    tokenizer = load_tokenizer("tiny")
    tokenizer.chat_template = qwen3_chat_template
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def grpo(env_cls: type, dataset: Any, tmp_path: Any, steps: int = 2) -> GRPOTrainer:
    tokenizer = tool_tokenizer()
    config = GRPOConfig(
        output_dir=str(tmp_path / "grpo"), use_cpu=True, max_steps=steps,
        per_device_train_batch_size=2, num_generations=2, max_completion_length=12,
        logging_steps=1, report_to="none", save_strategy="no", learning_rate=1e-3,
        max_tool_calling_iterations=2, dataloader_num_workers=0, seed=0,
    )
    trainer = GRPOTrainer(model=tiny_model(tokenizer), reward_funcs=env_reward, args=config,
                          train_dataset=dataset, processing_class=tokenizer,
                          environment_factory=env_cls)
    trainer.train()
    return trainer


def test_grpo_trainer_gets_the_env_reward(tmp_path: Any) -> None:
    # A tiny random model never writes \boxed{}: every reply is scored reward_incorrect, so
    # the logged reward proves it came from the env.
    kwargs = {"max_turns": 1, "reward_incorrect": -0.25}
    env_cls = trl_environment("agent_gym/GSM8K-v0", **kwargs)
    dataset = trl_dataset("agent_gym/GSM8K-v0", task_ids=["agsm-001", "agsm-002"], **kwargs)
    trainer = grpo(env_cls, dataset, tmp_path)
    logged = [row for row in trainer.state.log_history if "rewards/env_reward/mean" in row]
    assert len(logged) == 2
    assert all(row["rewards/env_reward/mean"] == pytest.approx(-0.25) for row in logged)
    assert trainer.state.global_step == 2


def test_search_tools_are_typed_methods_trl_can_call(tmp_path: Any) -> None:
    env_cls = trl_environment("agent_gym/Search-v0", max_turns=4)
    public = [name for name in dir(env_cls) if not name.startswith("_")
              and callable(getattr(env_cls, name))]
    assert sorted(public) == ["reset", "search"]  # one method per env tool, no generic step
    schema = get_json_schema(env_cls.search)["function"]
    assert schema["name"] == "search"
    assert schema["parameters"]["properties"]["query"]["type"] == "string"
    assert schema["parameters"]["required"] == ["query"]

    # TRL's own parser turns the model's tokens into the call it makes on the env.
    tokenizer = add_response_schema(tool_tokenizer())
    env = env_cls()
    env.reset(task_id="q000")
    row = trl_dataset("agent_gym/Search-v0", task_ids=["q000"], max_turns=4)[0]
    prompt = tokenizer.apply_chat_template(row["prompt"], tools=[env.search], tokenize=False,
                                           add_generation_prompt=True)
    reply = ('<tool_call>\n{"name": "search", "arguments": {"query": "Caldmoor founded"}}\n'
             "</tool_call><|im_end|>")
    parsed = parse_response(tokenizer, tokenizer.encode(reply, add_special_tokens=False),
                            prefix=tokenizer.encode(prompt, add_special_tokens=False),
                            tools=[env.search])
    call = parsed["tool_calls"][0]["function"]
    assert call == {"name": "search", "arguments": {"query": "Caldmoor founded"}}
    observation = getattr(env, call["name"])(**call["arguments"])
    assert "Doc 1" in observation

    # A GRPO step on the tool env: the prompt carries the tool schema, rewards come back.
    dataset = trl_dataset("agent_gym/Search-v0", task_ids=["q000"], max_turns=4)
    trainer = grpo(env_cls, dataset, tmp_path, steps=1)
    assert any("rewards/env_reward/mean" in row for row in trainer.state.log_history)


def test_state_rows_restore_the_same_point_for_every_group_member() -> None:
    env_cls = trl_environment("agent_gym/Search-v0", max_turns=4)
    first = env_cls()
    first.reset(task_id="q000")
    first.search(query="Caldmoor")
    state = first._env.unwrapped.save_state()
    dataset = trl_dataset("agent_gym/Search-v0", states=[state], max_turns=4)
    row = dataset[0]
    assert EnvState.from_json(row["state"]) == state
    assert [m["role"] for m in row["prompt"]][-2:] == ["assistant", "tool"]
    members = [env_cls() for _ in range(2)]
    for member in members:
        member.reset(**row)
        assert member._env.unwrapped.save_state() == state
    assert [m._finish("Answer: 970") for m in members] == [1.0, 1.0]


@pytest.mark.parametrize("env_id, kwargs", [
    ("agent_gym/GSM8K-v0", {"max_turns": 1}),
    ("agent_gym/CodeInterpreter-v0", {"max_turns": 4}),
    ("agent_gym/Search-v0", {"max_turns": 5}),
    ("agent_gym/ALFWorld-v0", {"max_turns": 12}),
])
def test_the_oracle_wins_through_the_adapter_methods(env_id: str, kwargs: dict) -> None:
    """Each oracle tool call, parsed as TRL would hand it over, runs through the named
    method; the final reply goes through env_reward; the env's win reaches the reward."""
    import gymnasium

    from agent_gym.actions.tools import parse_tool_call

    env_cls = trl_environment(env_id, **kwargs)
    probe = gymnasium.make(env_id, **kwargs)
    first_task = probe.unwrapped.tasks[0].task_id
    probe.close()
    row = trl_dataset(env_id, task_ids=[first_task], **kwargs)[0]
    env = env_cls()
    env.reset(**row)
    oracle = env._last_info["privileged"]["oracle_actions"]
    specs = [schema["function"] for schema in env._last_info["tools"]]
    final = None
    for action in oracle:
        call = parse_tool_call(action, _specs(specs)) if specs else None
        if call is None:
            final = action
            break
        getattr(env, call.name)(**call.arguments)
    completion = [{"role": "assistant", "content": final}] if final is not None else \
        [{"role": "tool", "content": "..."}]
    assert env_reward([completion], [env]) == [pytest.approx(1.0)]
    assert env._done
    env._close()


def _specs(functions: list[dict]) -> list:
    from agent_gym.actions.tools import ToolSpec

    return [ToolSpec(f["name"], f["description"], f["parameters"]) for f in functions]
