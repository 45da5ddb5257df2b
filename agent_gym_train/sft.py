"""Supervised fine-tuning on demonstrations played through an agent_gym env, in one file.

    python -m agent_gym_train.sft --env-id agent_gym/Search-v0 --epochs 2
    agent-gym train sft --env-id agent_gym/ALFWorld-v0 --demos runs/eval-oracle

A demonstration is a list of actions for one task: the env's scripted solution
(``info["privileged"]["oracle_actions"]``, ``--demos oracle``) or the actions of the
successful episodes of an ``agent-gym eval`` run directory (``--demos RUN_DIR``: rejection
sampling fine-tuning). Either way the actions are *played through the env*, so every
observation the model is trained after is the one the env really returns, and a
demonstration that does not earn a reward on replay is dropped (and counted): the data
can never teach something the env does not pay for.

Each played demonstration becomes one token-continuous datum, exactly as a sampled episode
would (``agent_gym_train.run.episode.cross_entropy_datum``): the action's tokens plus the turn's
stop token are the "sampled" spans, every prompt and observation position is masked. The
loss is pytrio's ``cross_entropy`` with weight 1 on each demonstrated token, so ``loss`` is
the mean negative log-likelihood per demonstrated token.

Each step takes ``batch_size`` demonstrations of a per-epoch shuffle, one
``forward_backward`` and one ``optim_step``. With ``--heldout-env-kwargs`` (the same env on
held-out tasks, e.g. another ``data_path``) the oracle demonstrations of those tasks are
scored (``forward``, no update) before the first step (``heldout_nll_before``, in the first
metrics line), every ``--heldout-every`` steps and after the last (``heldout_nll``): the
number a learning run must lower. Everything that is not SFT (arguments every trainer
takes, the training client, the env pool, the update, metrics lines, checkpoints and
continuing a stopped run) is in ``agent_gym_train.run.run``; ``agent-gym eval --policy
local:MODEL@PATH`` plays a checkpoint.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import gymnasium
import numpy as np
from pytrio import Datum

from agent_gym.env.state import EnvState, StateError
from agent_gym.eval.runfiles import FINAL_STATE_SCHEMA, read_log
from agent_gym.render import ChatRenderer, Conversation
from agent_gym_train.run.args import OUT_HELP, RunArgs, option
from agent_gym_train.run.args import parse_args as parse_run_args
from agent_gym_train.run.clients import ServiceClient, TrainingClient
from agent_gym_train.run.envpool import EnvFactory, env_factory
from agent_gym_train.run.episode import DatumError, TokenSequence, cross_entropy_datum
from agent_gym_train.run.files import Metrics, RunConfigError
from agent_gym_train.run.losses import TOKEN_MEAN
from agent_gym_train.run.run import final_line, open_run

# --help's description: the docstring's first paragraph, kept here (python -OO drops docstrings)
DESCRIPTION = (
    'Supervised fine-tuning on demonstrations played through an agent_gym env, in one file.'
)

ORACLE = "oracle"
CROSS_ENTROPY = "cross_entropy"
UNUSED = "not used by SFT: demonstrations are played, never sampled"


@dataclass
class Args(RunArgs):
    env_id: str = option("agent_gym/Search-v0", "the env whose tasks are demonstrated")
    out: str = option("runs/sft", OUT_HELP)
    demos: str = option(
        ORACLE, "oracle (the env's scripted solutions) or an `agent-gym eval` run directory "
        "(its successful episodes)")
    heldout_env_kwargs: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "the same env on held-out tasks, as a JSON object of constructor arguments: "
        "their oracle demonstrations are scored, never trained on ({}: none)"})
    heldout_every: int = option(0, "steps between held-out scorings (0: before and after only)")
    epochs: int = option(2, "passes over the demonstrations")
    batch_size: int | None = option(4, "demonstrations per step")
    learning_rate: float = option(2e-4, "Adam learning rate")
    loss: str = option(CROSS_ENTROPY, "pytrio's cross_entropy on the demonstrated tokens",
                       (CROSS_ENTROPY,))
    max_trajectory_tokens: int = option(
        4096, "tokens per demonstration, prompt included; longer ones are dropped (counted)")
    save_every: int = option(10, "checkpoint every N steps (and at the end)")
    loss_aggregation: str = option(
        TOKEN_MEAN, "not used by SFT: cross_entropy is pytrio's mean over the batch's "
        "demonstrated tokens")
    clip_low: float | None = option(None, "not used by SFT: cross_entropy has no ratio to clip")
    clip_high: float | None = option(None, "not used by SFT: cross_entropy has no ratio to clip")
    max_turns: int | None = option(None, "not used by SFT: a demonstration plays to its end")
    max_tokens: int | None = option(None, UNUSED)
    concurrency: int = option(8, UNUSED)
    temperature: float = option(1.0, UNUSED)
    seed: int = option(0, "seed of the per-epoch shuffles: the same seed replays the same run")

    LOSSES: ClassVar[tuple[str, ...]] = (CROSS_ENTROPY,)
    PRESETS: ClassVar[dict[str, dict[str, object]]] = {"cpu-demo": {
        "batch_size": 4, "epochs": 1, "learning_rate": 1e-3, "max_trajectory_tokens": 1024}}
    DEVICE_DEFAULTS: ClassVar[dict[str, tuple[int, int]]] = {}
    IDENTITY: ClassVar[tuple[str, ...]] = (*RunArgs.IDENTITY, "demos")

    def problems(self) -> list[str]:
        return [*super().problems(),
                *(["--epochs must be positive"] if self.epochs < 1 else []),
                *(["--heldout-every must be >= 0"] if self.heldout_every < 0 else [])]

    def env_settings(self) -> list[tuple[str, dict[str, Any]]]:
        held_out = [("--heldout-env-kwargs", self.heldout_env_kwargs)]
        return [*super().env_settings(), *(held_out if self.heldout_env_kwargs else [])]


def parse_args(argv: Sequence[str] | None = None) -> Args:
    return parse_run_args(Args, argv, "agent-gym train sft", DESCRIPTION)


# --------------------------------------------------------------------- demonstrations
@dataclass(frozen=True)
class Demonstration:
    """Actions to play on one task, and where they came from."""

    reset_options: Mapping[str, Any]
    actions: Sequence[str]
    source: str


def oracle_demonstrations(make_env: EnvFactory) -> list[Demonstration]:
    """The env's scripted solution of every task, in task order."""
    env = make_env()
    try:
        demos = []
        for index in range(env.unwrapped.num_tasks):
            _, info = env.reset(options={"index": index})
            actions = list(info["privileged"].get("oracle_actions") or ())
            if not actions:
                raise RunConfigError(f"task {info['task_id']} has no oracle_actions to demonstrate")
            demos.append(Demonstration({"task_id": info["task_id"]}, actions, ORACLE))
        return demos
    finally:
        env.close()


def run_demonstrations(run_dir: Path, env_id: str) -> list[Demonstration]:
    """The successful episodes of an ``agent-gym eval`` run on ``env_id``: each episode's
    final saved state holds the exact actions that earned its reward. The log is read as
    eval's readers read it (``agent_gym.eval.runlog``): a line it cannot take is named and
    skipped, never trained on."""
    path = run_dir / "episodes.jsonl"
    if not path.is_file():
        raise RunConfigError(f"{run_dir} is not an agent-gym eval run (no episodes.jsonl)")
    log = read_log(path, FINAL_STATE_SCHEMA)
    for note in log.notes():
        print(f"note: {run_dir}: {note}", file=sys.stderr)
    demos = []
    for _, record in log.records:
        try:
            state = EnvState.from_dict(record["final_state"])
        except StateError as err:
            raise RunConfigError(f"{path}: episode {record['episode']}: {err}") from err
        if state.env_id != env_id:
            raise RunConfigError(f"{path} holds {state.env_id} episodes, not {env_id}")
        if record["success"]:
            demos.append(Demonstration({"task_id": state.task_id}, list(state.actions),
                                       f"{run_dir.name}#{record['episode']}"))
    return demos


def play_demonstration(
    env: gymnasium.Env, renderer: ChatRenderer, demo: Demonstration
) -> tuple[TokenSequence, float]:
    """Play a demonstration's actions; returns its token sequence (each action, with the
    template's stop token so the model learns to end its turn, as the span a sampler
    would have recorded, logprob 0) and the reward the env paid."""
    _, info = env.reset(options=dict(demo.reset_options))
    conversation = Conversation.start(renderer, info["messages"], info.get("tools"))
    sequence = TokenSequence(tuple(conversation.tokens))
    reward = 0.0
    for action in demo.actions:
        completion = [*renderer.encode(action), *renderer.stop_tokens]
        sequence = sequence.extend(conversation.tokens, completion, [0.0] * len(completion))
        _, step_reward, terminated, truncated, info = env.step(action)
        reward += float(step_reward)
        if terminated or truncated:
            break
        conversation.append(completion, [info["message"]])
    return sequence, reward


def demonstration_datums(
    make_env: EnvFactory, renderer: ChatRenderer, demos: Sequence[Demonstration],
    max_length: int,
) -> tuple[list[Datum], dict[str, int]]:
    """Datums of the demonstrations the env rewards and that fit; counts of the others."""
    env = make_env()
    datums: list[Datum] = []
    dropped = {"unrewarded": 0, "too_long": 0}
    try:
        for demo in demos:
            sequence, reward = play_demonstration(env, renderer, demo)
            if reward <= 0:
                dropped["unrewarded"] += 1
                continue
            try:
                datums.append(cross_entropy_datum(sequence, max_length=max_length))
            except DatumError:
                dropped["too_long"] += 1
    finally:
        env.close()
    return datums, dropped


def mean_nll(training: TrainingClient, datums: Sequence[Datum]) -> float:
    """Mean negative log-likelihood per demonstrated token (a ``forward``, no update)."""
    return float(training.forward(list(datums), CROSS_ENTROPY).result().metrics["loss_mean"])


# --------------------------------------------------------------------- training
def train(args: Args, service: ServiceClient | None = None) -> list[Metrics]:
    """Run (or continue) SFT; returns this invocation's per-step metrics."""
    history: list[Metrics] = []
    # The run's length is known once the demonstrations are played: set below.
    with open_run(args, 0, service) as run:
        # ---- demonstrations, played through the env once
        demos = (oracle_demonstrations(run.envs) if args.demos == ORACLE
                 else run_demonstrations(Path(args.demos), args.env_id))
        datums, dropped = demonstration_datums(run.envs, run.renderer, demos,
                                               args.max_trajectory_tokens)
        if not datums:
            raise RunConfigError(
                f"no usable demonstrations ({len(demos)} found, dropped {dropped})")
        heldout: list[Datum] = []
        if args.heldout_env_kwargs:
            heldout_env = env_factory(args.env_id, args.heldout_env_kwargs, args.ray)
            heldout, _ = demonstration_datums(heldout_env, run.renderer,
                                              oracle_demonstrations(heldout_env),
                                              args.max_trajectory_tokens)
        steps_per_epoch = math.ceil(len(datums) / args.batch_size)
        run.steps = steps_per_epoch * args.epochs
        (run.out / "demonstrations.json").write_text(json.dumps(
            {"found": len(demos), "used": len(datums), "dropped": dropped,
             "heldout": len(heldout), "steps": run.steps}), encoding="utf-8")
        before = mean_nll(run.training, heldout) if heldout and run.resumed is None else None

        for step in run.progress():
            t0 = time.perf_counter()
            # ---- this step's demonstrations: a fresh shuffle every epoch
            epoch, offset = divmod(step, steps_per_epoch)
            order = np.random.default_rng(run.seed(epoch, "shuffle", 0)).permutation(len(datums))
            batch = [datums[i] for i in order[offset * args.batch_size:][: args.batch_size]]

            # ---- one update: mean NLL per demonstrated token (--loss cross_entropy)
            trained = run.update(batch)
            t1 = time.perf_counter()

            # ---- held-out likelihood, metrics, then checkpoint
            row: Metrics = {"step": step, "epoch": epoch, **trained}
            if before is not None:  # the held-out score of the weights this run started from
                row["heldout_nll_before"], before = before, None
            done = step + 1
            if heldout and (done == run.steps
                            or (args.heldout_every and done % args.heldout_every == 0)):
                row["heldout_nll"] = mean_nll(run.training, heldout)
            row |= {"time_train": t1 - t0, "time_step": time.perf_counter() - t0}
            run.finish(step, row, shown={"loss": round(float(row["loss"] or 0.0), 3)})
            history.append(row)
    return history


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    history = train(args)
    before = [row["heldout_nll_before"] for row in history if "heldout_nll_before" in row]
    after = [row["heldout_nll"] for row in history if "heldout_nll" in row]
    print(final_line(history, Path(args.out), loss=history[-1]["loss"] if history else None,
                     heldout_nll_before=before[0] if before else None,
                     heldout_nll=after[-1] if after else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
