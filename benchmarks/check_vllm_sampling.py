"""Does the vLLM engine sample what the local sampler samples, from the same weights?

    python benchmarks/check_vllm_sampling.py [--work runs/check-vllm-sampling]
        [--checkpoint RUN ...] [--questions 32] [--episodes-per-question 8]

A run's logprob gap shows that each token the engine sampled has the learner's logprob; it
cannot show a change of distribution that keeps those logprobs (a cut tail, draws shared
between the branches of a group, a request option the server overrides). This plays the
same Search-v0 ``world-large`` train questions at temperature 1, each several times, with
``agent-gym eval --policy vllm:smollm2@RUN`` and ``--policy local:smollm2@RUN`` (float32,
the learner's own weights) for each checkpoint, and sets side by side what GRPO's groups
are made of: success (paired by episode), episodes of more than two replies (on these
questions, searching a second entity: the behaviour GRPO has to find), distinct episodes
per question (a group's diversity) and questions whose episodes all succeed or all fail
(groups GRPO learns nothing from). Defaults: the SFT checkpoint of
``bench_search_rl.py`` and its local seed-2 GRPO run, which searches twice most of the time.
Reruns resume each eval where it stopped.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness import RESULTS, Result, paired  # noqa: E402

from agent_gym.cli.main import main as agent_gym  # noqa: E402
from agent_gym.eval.runs import read_run  # noqa: E402
from agent_gym_train.demo import ENV_ID, MAX_TOKENS, MAX_TURNS  # noqa: E402

SAMPLERS = ("vllm", "local")
FIRST_QUESTION = 200  # past the 200 the SFT demonstrations came from


def play(spec: str, out: Path, questions: int, episodes: int) -> None:
    code = agent_gym([
        "eval", ENV_ID, "--policy", spec, "--env-arg", "dataset=world-large", "--split",
        "train", "--env-arg", f"max_turns={MAX_TURNS}", "--seed", str(FIRST_QUESTION),
        "--episodes", str(questions), "--rollouts-per-task", str(episodes),
        "--temperature", "1", "--max-tokens", str(MAX_TOKENS), "--concurrency", "32",
        "--quiet", "--out", str(out)])
    if code:
        raise SystemExit(f"agent-gym eval --policy {spec} failed (exit {code})")


def shape(out: Path) -> dict[str, Any]:
    """What a group of episodes on one question is made of, over every question."""
    episodes = list(read_run(out).episodes.values())
    by_question: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for episode in episodes:
        by_question[episode["task_id"]].append(episode)
    groups = by_question.values()
    return {
        "episodes": len(episodes), "questions": len(by_question),
        "success_rate": round(sum(e["success"] for e in episodes) / len(episodes), 3),
        "mean_turns": round(sum(e["turns"] for e in episodes) / len(episodes), 3),
        "longer_than_two_replies": sum(e["turns"] > 2 for e in episodes),
        "distinct_episodes_per_question": round(sum(
            len({tuple(e["final_state"]["actions"]) for e in group}) for group in groups)
            / len(by_question), 2),
        "degenerate_questions": sum(len({e["success"] for e in group}) == 1
                                    for group in groups),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="runs/check-vllm-sampling",
                        help="where the evals go (recorded as $WORK)")
    parser.add_argument("--checkpoint", nargs="+", default=[
        "runs/bench-search-rl/sft", "runs/bench-search-rl/grpo-local-seed2"],
        help="training runs (their latest checkpoint) or checkpoint paths")
    parser.add_argument("--questions", type=int, default=32)
    parser.add_argument("--episodes-per-question", type=int, default=8)
    parser.add_argument("--out", default=str(RESULTS / "vllm_sampling.json"))
    args = parser.parse_args()
    work = Path(args.work).resolve()
    record = Result(placeholders={str(work): "$WORK"})
    record.figures = {"env_id": ENV_ID, "split": "train", "first_question": FIRST_QUESTION,
                      "temperature": 1.0, "max_tokens": MAX_TOKENS, "max_turns": MAX_TURNS,
                      "local_precision": "float32", "checkpoints": {}}
    for checkpoint in args.checkpoint:
        runs = {sampler: work / f"{Path(checkpoint).name}-{sampler}" for sampler in SAMPLERS}
        for sampler, out in runs.items():
            play(f"{sampler}:smollm2@{checkpoint}", out, args.questions,
                 args.episodes_per_question)
        record.figures["checkpoints"][checkpoint] = {
            **{sampler: shape(out) for sampler, out in runs.items()},
            "vllm_minus_local_success": paired(runs["local"], runs["vllm"])}
        record.write(args.out)
    print(record.figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
