"""TRL's own GRPOTrainer trains on agent_gym envs through the adapter (CPU, offline), with the
embedded SmolLM2 model and its tool-capable chat template; episodes are scored as eval scores
them."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from typing import Any

import gymnasium
import pytest

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from transformers.utils import get_json_schema  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.chat_template_utils import (  # noqa: E402
    is_chat_template_prefix_preserving,
    parse_response,
    supports_tool_calling,
)

from agent_gym.actions.tools import ToolSpec, format_tool_call, parse_tool_call  # noqa: E402
from agent_gym.adapters.trl import trl_dataset, trl_environment, trl_reward  # noqa: E402
from agent_gym.env.state import EnvState  # noqa: E402
from agent_gym.eval.policies import PolicyInput, Reply  # noqa: E402
from agent_gym.eval.run import play_episode  # noqa: E402
from agent_gym.render import ChatRenderer  # noqa: E402
from agent_gym_train.backends.models import load_model, load_tokenizer, smollm2_tokenizer_dir  # noqa: E402

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

SEARCH = {"max_turns": 4, "invalid_penalty": 0.5}
GSM8K = {"max_turns": 1, "reward_incorrect": -0.25}


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tokenizer_for(spec: str) -> Any:
    tokenizer = load_tokenizer(spec)
    tokenizer.padding_side = "left"
    return tokenizer


def grpo(spec: str, env_cls: type, dataset: Any, tmp_path: Any, *, steps: int,
         completion_tokens: int, reward: Any = None) -> GRPOTrainer:
    """TRL's GRPOTrainer as a user builds it, trained for ``steps`` steps."""
    tokenizer = tokenizer_for(spec)
    config = GRPOConfig(
        output_dir=str(tmp_path / "grpo"), use_cpu=True, max_steps=steps,
        per_device_train_batch_size=2, num_generations=2,
        max_completion_length=completion_tokens, logging_steps=1, report_to="none",
        save_strategy="no", learning_rate=1e-5, max_tool_calling_iterations=2,
        dataloader_num_workers=0, seed=0,
    )
    trainer = GRPOTrainer(model=load_model(spec, tokenizer),
                          reward_funcs=reward or trl_reward(tokenizer), args=config,
                          train_dataset=dataset, processing_class=tokenizer,
                          environment_factory=env_cls)
    trainer.train()
    return trainer


# ------------------------------------------------------------------ the embedded model's template
def test_the_embedded_model_renders_tools_and_calls_as_the_envs_parse_them() -> None:
    tokenizer = load_tokenizer("smollm2")
    # TRL's own checks, which refused SmolLM2's GGUF template.
    assert supports_tool_calling(tokenizer) and is_chat_template_prefix_preserving(tokenizer)
    search = ToolSpec("search", "Search.", {"type": "object", "required": ["query"],
                                            "properties": {"query": {"type": "string"}}})
    call = {"type": "function", "function": {"name": "search",
                                             "arguments": {"query": "Caldmoor ü"}}}
    chat = [{"role": "user", "content": "When?"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
            {"role": "tool", "name": "search", "content": "Doc 1: ..."}]
    text = tokenizer.apply_chat_template(chat, tools=[search.openai_schema()], tokenize=False,
                                         add_generation_prompt=True)
    # The model is shown the tool, and a structured call renders as the very text the env
    # parses: what format_tool_call writes for a scripted reply.
    assert json.dumps(search.openai_schema()) in text
    rendered = format_tool_call("search", {"query": "Caldmoor ü"})
    assert f"<|im_start|>assistant\nLet me look.\n{rendered}<|im_end|>\n" in text
    assert parse_tool_call(f"Let me look.\n{rendered}", [search]).arguments == \
        {"query": "Caldmoor ü"}
    assert text.endswith("<|im_start|>tool\nDoc 1: ...<|im_end|>\n<|im_start|>assistant\n")
    # TRL parses a sampled call back with the template's response_template.
    prompt = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    reply = tokenizer.encode(rendered + "<|im_end|>", add_special_tokens=False)
    assert parse_response(tokenizer, reply, prefix=prompt)["tool_calls"] == [call]
    # Without tools it renders as SmolLM2's own template; prompts still grow by extension.
    original = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "A"},
             {"role": "tool", "content": "T"}]
    for messages in (plain, [{"role": "system", "content": "S"}, *plain]):
        assert tokenizer.apply_chat_template(messages, tokenize=False) == \
            original.apply_chat_template(messages, tokenize=False)
    tail = ChatRenderer(tokenizer).continuation(chat[:1], reply, chat[2:],
                                                [search.openai_schema()])
    assert tokenizer.decode(tail) == "\n<|im_start|>tool\nDoc 1: ...<|im_end|>\n<|im_start|>assistant\n"


def test_trl_reward_refuses_a_template_whose_turns_cannot_be_told_apart() -> None:
    tokenizer = load_tokenizer("smollm2")
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ValueError, match="generation prompt does not extend the chat"):
        trl_reward(tokenizer)


# ------------------------------------------------------------------ scoring as eval scores
class Scripted:
    """An eval policy that plays given replies, each finished or cut by the token budget."""

    name = "scripted"

    def __init__(self, replies: list[tuple[str, bool]]) -> None:
        self.replies = list(replies)

    async def act(self, observation: PolicyInput) -> Reply:
        text, cut = self.replies.pop(0)
        return Reply(text, cut=cut)


def eval_reward(env_id: str, kwargs: dict, replies: list[tuple[str, bool]]) -> float:
    env = gymnasium.make(env_id, **kwargs)
    try:
        record = asyncio.run(play_episode(env, Scripted(replies), 0, 0, 0))
    finally:
        env.close()
    return record["reward"]


def completion_ids(tokenizer: Any, turns: list[str], results: list[list[str]],
                   cut: bool = False) -> list[int]:
    """A completion as TRL assembles it: each turn's tokens and end token, then the tool
    results as the template renders them, up to the next generation prompt."""
    ids: list[int] = []
    for k, turn in enumerate(turns):
        ids += tokenizer.encode(turn, add_special_tokens=False)
        if k == len(turns) - 1:
            return ids if cut else [*ids, tokenizer.eos_token_id]
        chat = [{"role": "user", "content": "?"}, {"role": "assistant", "content": turn}]
        before = tokenizer.apply_chat_template(chat, tokenize=False)
        after = tokenizer.apply_chat_template(
            [*chat, *({"role": "tool", "content": result} for result in results[k])],
            tokenize=False, add_generation_prompt=True)
        closed = before.rindex(tokenizer.eos_token) + len(tokenizer.eos_token)
        ids += [tokenizer.eos_token_id, *tokenizer.encode(after[closed:],
                                                          add_special_tokens=False)]
    return ids


def scored(env_id: str, kwargs: dict, turns: list[str], cut: bool = False) -> float:
    """The adapter's reward for a completion of ``turns`` on the env's first task, after the
    tool calls TRL's parser finds in them ran through the env's methods (what the model
    was shown)."""
    tokenizer = load_tokenizer("smollm2")
    prefix = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    probe = gymnasium.make(env_id, **kwargs)
    task_id = probe.unwrapped.tasks[0].task_id
    probe.close()
    env = trl_environment(env_id, **kwargs)()
    env.reset(**trl_dataset(env_id, task_ids=[task_id], **kwargs)[0])
    results = []
    for turn in turns[:-1]:
        reply = tokenizer.encode(turn + "<|im_end|>", add_special_tokens=False)
        calls = parse_response(tokenizer, reply, prefix=prefix)["tool_calls"]
        results.append([getattr(env, c["function"]["name"])(**c["function"]["arguments"])
                        for c in calls])
    ids = completion_ids(tokenizer, turns, results, cut)
    try:
        return trl_reward(tokenizer)(completion_ids=[ids], environments=[env])[0]
    finally:
        env._close()


def test_calls_trl_would_run_score_as_the_envs_strict_parser_judges_them() -> None:
    call = format_tool_call("search", {"query": "History of Caldmoor"})
    trailing, twice = f"{call}\nThat should do.", f"{call}\n{call}"
    tokenizer = load_tokenizer("smollm2")
    prefix = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    for turn in (trailing, twice):  # TRL's parser finds calls in both...
        parsed = parse_response(tokenizer, tokenizer.encode(turn + "<|im_end|>",
                                                            add_special_tokens=False),
                                prefix=prefix)
        assert parsed["tool_calls"]
        # ...the env refuses both (an invalid step, -0.5), as eval shows, and the answer
        # that follows still wins (+1).
        turns = [turn, "<answer>970</answer>"]
        expected = eval_reward("agent_gym/Search-v0", SEARCH, [(t, False) for t in turns])
        assert expected == pytest.approx(0.5)
        assert scored("agent_gym/Search-v0", SEARCH, turns) == pytest.approx(expected)
    turns = [call, "<answer>970</answer>"]  # a call both parsers accept
    assert scored("agent_gym/Search-v0", SEARCH, turns) == pytest.approx(1.0)


@pytest.mark.parametrize("env_id, kwargs, turns", [
    ("agent_gym/GSM8K-v0", GSM8K, ["The answer is \\boxed{31}."]),
    ("agent_gym/Search-v0", SEARCH,
     [format_tool_call("search", {"query": "History of Caldmoor"}), "<answer>970</answer>"]),
])
def test_a_reply_cut_at_the_length_limit_is_not_scored(env_id: str, kwargs: dict,
                                                       turns: list[str]) -> None:
    # The right answer, cut before its end token: eval never shows it to the env, so the
    # episode keeps what it had (0.0); finished, the same reply wins.
    plays = [(turn, False) for turn in turns[:-1]]
    assert eval_reward(env_id, kwargs, [*plays, (turns[-1], True)]) == 0.0
    assert scored(env_id, kwargs, turns, cut=True) == 0.0
    assert eval_reward(env_id, kwargs, [*plays, (turns[-1], False)]) == 1.0
    assert scored(env_id, kwargs, turns) == 1.0


def test_nothing_privileged_reaches_the_policy() -> None:
    kwargs = {"max_turns": 5}
    env = gymnasium.make("agent_gym/Search-v0", **kwargs)
    _, info = env.reset(options={"task_id": "q000"})
    env.close()
    secrets = [json.dumps(v)[1:-1] for v in (info["privileged"]["gold_passage_ids"][0],
                                             info["privileged"]["oracle_actions"][-1])]
    row = trl_dataset("agent_gym/Search-v0", task_ids=["q000"], **kwargs)[0]
    assert set(row) == {"prompt", "task_id", "state"} and row["prompt"] == info["messages"]
    adapter = trl_environment("agent_gym/Search-v0", **kwargs)()
    shown = [row, adapter.reset(**row), adapter.search(query="History of Caldmoor")]
    for text in map(json.dumps, shown):
        assert "privileged" not in text and not any(secret in text for secret in secrets)
    # Nor does the adapter keep it where a policy-side hook could read it.
    assert "privileged" not in repr(vars(adapter))
    adapter._close()


# ------------------------------------------------------------------ TRL's own trainer
def test_grpo_trainer_trains_the_embedded_model_on_gsm8k(tmp_path: Any) -> None:
    """TRL's GRPOTrainer starts with the embedded model (its GGUF template made TRL refuse),
    and each completion's reward is the env's for the reply it finished, 0.0 for a cut one."""
    tokenizer = load_tokenizer("smollm2")
    seen: list[tuple[list[int], str, float]] = []
    scorer = trl_reward(tokenizer)

    def env_reward(completion_ids: list[list[int]], task_id: list[str],
                   **kwargs: Any) -> list[float]:
        rewards = scorer(completion_ids=completion_ids, **kwargs)
        seen.extend(zip(completion_ids, task_id, rewards, strict=True))
        return rewards

    env_cls = trl_environment("agent_gym/GSM8K-v0", **GSM8K)
    dataset = trl_dataset("agent_gym/GSM8K-v0", task_ids=["agsm-001", "agsm-002"], **GSM8K)
    trainer = grpo("smollm2", env_cls, dataset, tmp_path, steps=1, completion_tokens=24,
                   reward=env_reward)
    assert trainer.state.global_step == 1 and len(seen) == 2
    env = gymnasium.make("agent_gym/GSM8K-v0", **GSM8K)
    try:
        for ids, task_id, reward in seen:
            if ids[-1] != tokenizer.eos_token_id:  # cut at max_completion_length
                assert reward == 0.0
                continue
            env.reset(options={"task_id": task_id})
            _, expected, *_ = env.step(tokenizer.decode(ids[:-1]))
            assert reward == expected
    finally:
        env.close()
    logged = [row["rewards/env_reward/mean"] for row in trainer.state.log_history
              if "rewards/env_reward/mean" in row]
    assert logged == pytest.approx([sum(r for *_, r in seen) / 2])


def test_grpo_trainer_calls_the_env_tools(tmp_path: Any) -> None:
    env_cls = trl_environment("agent_gym/Search-v0", max_turns=4)
    public = [name for name in dir(env_cls) if not name.startswith("_")
              and callable(getattr(env_cls, name))]
    assert sorted(public) == ["reset", "search"]  # one method per env tool, no generic step
    schema = get_json_schema(env_cls.search)["function"]
    assert schema["name"] == "search"
    assert schema["parameters"]["properties"]["query"]["type"] == "string"
    assert schema["parameters"]["required"] == ["query"]
    # A GRPO step on the tool env: the prompt carries the tool schema, rewards come back.
    dataset = trl_dataset("agent_gym/Search-v0", task_ids=["q000"], max_turns=4)
    trainer = grpo("tiny", env_cls, dataset, tmp_path, steps=1, completion_tokens=12)
    assert any("rewards/env_reward/mean" in row for row in trainer.state.log_history)


def test_state_rows_restore_the_same_point_for_every_group_member() -> None:
    env_cls = trl_environment("agent_gym/Search-v0", max_turns=4)
    first = env_cls()
    first.reset(task_id="q000")
    first.search(query="Caldmoor")
    state = first._env.unwrapped.save_state()
    first._close()
    dataset = trl_dataset("agent_gym/Search-v0", states=[state], max_turns=4)
    row = dataset[0]
    assert EnvState.from_json(row["state"]) == state
    assert [m["role"] for m in row["prompt"]][-2:] == ["assistant", "tool"]
    members = [env_cls() for _ in range(2)]
    for member in members:
        member.reset(**row)
        assert member._env.unwrapped.save_state() == state
    assert [m._score(["<answer>970</answer>"]) for m in members] == [1.0, 1.0]
    for member in members:
        member._close()


@pytest.mark.parametrize("env_id, kwargs", [
    ("agent_gym/GSM8K-v0", {"max_turns": 1}),
    ("agent_gym/CodeInterpreter-v0", {"max_turns": 4}),
    ("agent_gym/Search-v0", {"max_turns": 5}),
    ("agent_gym/ALFWorld-v0", {"max_turns": 12}),
])
def test_the_oracle_wins_through_the_adapter_methods(env_id: str, kwargs: dict) -> None:
    """Each oracle tool call, parsed as TRL would hand it over, runs through the named
    method; the episode's replies, replayed through the env, win."""
    probe = gymnasium.make(env_id, **kwargs)
    _, info = probe.reset(options={"index": 0})
    probe.close()
    oracle, specs = info["privileged"]["oracle_actions"], [
        ToolSpec(s["function"]["name"], s["function"]["description"], s["function"]["parameters"])
        for s in info["tools"]]
    env = trl_environment(env_id, **kwargs)()
    env.reset(**trl_dataset(env_id, task_ids=[info["task_id"]], **kwargs)[0])
    for action in oracle:
        call = parse_tool_call(action, specs) if specs else None
        if call is not None:
            assert not getattr(env, call.name)(**call.arguments).startswith("Error")
    assert env._score(oracle) == pytest.approx(1.0)
    env._close()
