"""The sampler policies eval benchmarks (trainers.policies): context limits and seeds."""

import asyncio
import json
from pathlib import Path

from agent_gym.eval import EvalConfig, evaluate
from agent_gym.policies import make_policy

GSM8K = "agent_gym/GSM8K-v0"


def test_a_prompt_past_the_models_context_ends_the_episode(tmp_path: Path) -> None:
    policy = make_policy("local:tiny", max_tokens=8)
    assert policy.context_length == policy.client.context_length  # the model's positions
    config = EvalConfig(GSM8K, "local:tiny", episodes=1, max_tokens=8)
    asyncio.run(evaluate(config, policy, tmp_path / "fits", progress=False))
    first = json.loads((tmp_path / "fits" / "episodes.jsonl").read_text().splitlines()[0])
    # A context one token longer than the opening prompt leaves room for one token: the
    # reply is cut. One token shorter: the episode ends context_length, scored, no error.
    policy.context_length = first["prompt_tokens"] + 1
    summary = asyncio.run(evaluate(config, policy, tmp_path / "cut", progress=False))
    assert summary.end_reasons == {"max_tokens": 1} and summary.mean_tokens == 1
    assert summary.finish_reasons == {"length": 1}
    policy.context_length = first["prompt_tokens"]
    summary = asyncio.run(evaluate(config, policy, tmp_path / "over", progress=False))
    assert summary.errors == 0 and summary.end_reasons == {"context_length": 1}
    record = json.loads((tmp_path / "over" / "episodes.jsonl").read_text().splitlines()[0])
    assert record["turns"] == 0 and record["reward"] == 0.0
    assert "context is" in record["context_error"]
