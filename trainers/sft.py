"""Supervised fine-tuning on demonstrations played through an agent_gym env, in one file.

    python -m trainers.sft --env-id agent_gym/Search-v0 --epochs 2
    agent-gym train sft --env-id agent_gym/ALFWorld-v0 --demos runs/eval-oracle

A demonstration is a list of actions for one task: the env's scripted solution
(``info["privileged"]["oracle_actions"]``, ``--demos oracle``) or the actions of the
successful episodes of an ``agent-gym eval`` run directory (``--demos RUN_DIR``: rejection
sampling fine-tuning). Either way the actions are *played through the env*, so every
observation the model is trained after is the one the env really returns, and a
demonstration that does not earn a reward on replay is dropped (and counted): the data
can never teach something the env does not pay for.

Each played demonstration becomes one token-continuous datum, exactly as a sampled episode
would (``trainers.episode.build_datum``): the action's tokens plus the turn's stop token are
the "sampled" positions, every prompt and observation position is masked. The loss is
pytrio's ``cross_entropy`` with weight 1 on each demonstrated token, so ``loss_mean`` is the
mean negative log-likelihood per demonstrated token.

Each step takes ``batch_size`` demonstrations of a per-epoch shuffle, one
``forward_backward`` and one ``optim_step``. With ``--heldout-env-kwargs`` (a JSON object
for the same env, e.g. a held-out ``data_path`` or ``split``) the oracle demonstrations of
those tasks are scored (``forward``, no update) before the first step
(``heldout_nll_before``, in the first metrics line), every ``--heldout-every`` steps and
after the last (``heldout_nll``): their mean NLL per token, the number a learning run must
lower. Metrics go to ``<out>/metrics.jsonl``; ``<out>/checkpoint.json``
names the latest checkpoint (``--resume`` continues from it; ``agent-gym eval --policy
local:MODEL@PATH`` plays it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
from pytrio import AdamParams, Datum
from tqdm import tqdm

from agent_gym.render import ChatRenderer, Conversation
from trainers.backends import BACKENDS, make_service
from trainers.episode import DatumError, Turn, active_tokens, build_datum
from trainers.options import options_parser
from trainers.runfiles import append_metrics, keep_metrics_before, open_training_client, write_json

CHECKPOINT_FILE = "checkpoint.json"
METRICS_FILE = "metrics.jsonl"
ORACLE = "oracle"
DEMO_STOP = "stop"  # a demonstrated reply ends with the template's stop token, as a sampled one


@dataclass
class Args:
    env_id: str = "agent_gym/Search-v0"
    env_kwargs: dict[str, Any] = field(default_factory=dict)  # JSON on the command line
    demos: str = ORACLE  # "oracle" | an `agent-gym eval` run directory
    heldout_env_kwargs: str = ""  # JSON: the same env on held-out tasks, scored, never trained
    heldout_every: int = 0  # steps between held-out scorings (0: only before and after)
    backend: str = "local"  # local | pytrio
    model: str = "smollm2"  # local: smollm2 | tiny | a HF directory; pytrio: a model id
    lora_rank: int = 32  # 0 = full fine-tuning (local backend only)
    api_key: str | None = None  # pytrio only
    epochs: int = 2
    batch_size: int = 4  # demonstrations per step
    learning_rate: float = 2e-4
    grad_clip_norm: float = 1.0
    max_trajectory_tokens: int = 4096  # longer demonstrations are dropped (and counted)
    seed: int = 0
    save_every: int = 10
    out: str = "runs/sft"
    resume: bool = False
    progress: bool = True


def parse_args(argv: list[str] | None = None) -> Args:
    parser = options_parser(Args, "sft", __doc__.split("\n\n")[0])
    args = Args(**vars(parser.parse_args(argv)))
    if args.backend not in BACKENDS:
        parser.error(f"--backend must be one of {BACKENDS}")
    if args.backend == "pytrio" and args.lora_rank < 1:
        parser.error("pytrio trains LoRA adapters only: --lora-rank must be positive")
    if min(args.epochs, args.batch_size, args.save_every) < 1:
        parser.error("--epochs, --batch-size and --save-every must be positive")
    if args.heldout_env_kwargs:
        try:
            heldout = json.loads(args.heldout_env_kwargs)
        except json.JSONDecodeError as err:
            parser.error(f"--heldout-env-kwargs is not JSON: {err}")
        if not isinstance(heldout, dict):
            parser.error("--heldout-env-kwargs must be a JSON object")
    return args


# ---------------------------------------------------------------------------- demonstrations
@dataclass(frozen=True)
class Demonstration:
    """Actions to play on one task, and where they came from."""

    reset_options: Mapping[str, Any]
    actions: Sequence[str]
    source: str


def oracle_demonstrations(env_id: str, env_kwargs: Mapping[str, Any]) -> list[Demonstration]:
    """The env's scripted solution of every task, in task order."""
    env = gymnasium.make(env_id, **env_kwargs)
    try:
        demos = []
        for index in range(len(env.unwrapped.tasks)):
            _, info = env.reset(options={"index": index})
            actions = list(info["privileged"].get("oracle_actions") or ())
            if not actions:
                raise ValueError(f"{env_id} task {info['task_id']} has no oracle_actions")
            demos.append(Demonstration({"task_id": info["task_id"]}, actions, ORACLE))
        return demos
    finally:
        env.close()


def run_demonstrations(run_dir: Path, env_id: str) -> list[Demonstration]:
    """The successful episodes of an ``agent-gym eval`` run on ``env_id``: each episode's
    final saved state holds the exact actions that earned its reward."""
    path = run_dir / "episodes.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not an agent-gym eval run (no episodes.jsonl)")
    demos = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        state = record["final_state"]
        if state["env_id"] != env_id:
            raise ValueError(f"{path} holds {state['env_id']} episodes, not {env_id}")
        if record["success"]:
            demos.append(Demonstration({"task_id": state["task_id"]}, state["actions"],
                                       f"{run_dir.name}#{record['episode']}"))
    return demos


def play_demonstration(
    env: gymnasium.Env, renderer: ChatRenderer, demo: Demonstration
) -> tuple[list[Turn], float]:
    """Play a demonstration's actions; returns its turns (as a sampler would have recorded
    them, the action tokens standing for sampled ones) and the reward the env paid."""
    _, info = env.reset(options=dict(demo.reset_options))
    conversation = Conversation.start(renderer, info["messages"], info.get("tools"))
    turns: list[Turn] = []
    reward = 0.0
    for action in demo.actions:
        completion = [*renderer.encode(action), *renderer.stop_tokens]
        turns.append(Turn(list(conversation.tokens), completion, [0.0] * len(completion),
                          DEMO_STOP))
        _, step_reward, terminated, truncated, info = env.step(action)
        reward += float(step_reward)
        if terminated or truncated:
            break
        conversation.append(completion, [info["message"]])
    return turns, reward


def sft_datum(turns: Sequence[Turn], max_length: int | None = None) -> Datum:
    """A ``cross_entropy`` datum: weight 1 on every demonstrated token, masked elsewhere.

    Built through ``build_datum`` with advantage 1, whose advantages are then exactly the
    weights (1 at demonstrated positions, 0 at masked ones), so SFT and RL datums share one
    alignment and one masking rule.
    """
    datum = build_datum(turns, 1.0, max_length=max_length)
    inputs = datum.loss_fn_inputs
    return Datum(model_input=datum.model_input,
                 loss_fn_inputs={"target_tokens": inputs["target_tokens"],
                                 "weights": inputs["advantages"]})


def demonstration_datums(
    env_id: str, env_kwargs: Mapping[str, Any], renderer: ChatRenderer,
    demos: Sequence[Demonstration], max_length: int,
) -> tuple[list[Datum], dict[str, int]]:
    """Datums of the demonstrations the env rewards and that fit; counts of the others."""
    env = gymnasium.make(env_id, **env_kwargs)
    datums: list[Datum] = []
    dropped = {"unrewarded": 0, "too_long": 0}
    try:
        for demo in demos:
            turns, reward = play_demonstration(env, renderer, demo)
            if reward <= 0:
                dropped["unrewarded"] += 1
                continue
            try:
                datums.append(sft_datum(turns, max_length))
            except DatumError:
                dropped["too_long"] += 1
    finally:
        env.close()
    return datums, dropped


def mean_nll(training: Any, datums: Sequence[Datum]) -> float:
    """Mean negative log-likelihood per demonstrated token (a ``forward``, no update)."""
    return float(training.forward(list(datums), "cross_entropy").result().metrics["loss_mean"])


# ---------------------------------------------------------------------------- training
def train(args: Args, service: Any | None = None) -> list[dict[str, Any]]:
    """Run (or resume) SFT; returns this invocation's per-step metrics."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    service = service or make_service(
        args.backend, checkpoint_dir=out / "checkpoints", api_key=args.api_key
    )
    checkpoint = out / CHECKPOINT_FILE
    training, saved = open_training_client(
        service, args, checkpoint, ("env_id", "model", "lora_rank", "backend", "demos")
    )
    start = saved["step"] if saved else 0
    metrics_path = out / METRICS_FILE
    keep_metrics_before(metrics_path, start)
    renderer = ChatRenderer(training.get_tokenizer())

    # ---- demonstrations, played through the env once
    demos = (oracle_demonstrations(args.env_id, args.env_kwargs) if args.demos == ORACLE
             else run_demonstrations(Path(args.demos), args.env_id))
    datums, dropped = demonstration_datums(args.env_id, args.env_kwargs, renderer, demos,
                                           args.max_trajectory_tokens)
    if not datums:
        raise ValueError(f"no usable demonstrations ({len(demos)} found, dropped {dropped})")
    heldout: list[Datum] = []
    if args.heldout_env_kwargs:
        heldout_kwargs = json.loads(args.heldout_env_kwargs)
        heldout, _ = demonstration_datums(
            args.env_id, heldout_kwargs, renderer,
            oracle_demonstrations(args.env_id, heldout_kwargs), args.max_trajectory_tokens,
        )
    steps_per_epoch = math.ceil(len(datums) / args.batch_size)
    total_steps = steps_per_epoch * args.epochs
    write_json(out / "demonstrations.json", {"found": len(demos), "used": len(datums),
                                             "dropped": dropped, "heldout": len(heldout),
                                             "steps": total_steps})
    adam = AdamParams(learning_rate=args.learning_rate, grad_clip_norm=args.grad_clip_norm)

    history: list[dict[str, Any]] = []
    before = mean_nll(training, heldout) if heldout and start == 0 else None
    bar = tqdm(range(start, total_steps), initial=start, total=total_steps,
               disable=not args.progress)
    for step in bar:
        t0 = time.perf_counter()
        # ---- this step's demonstrations: a fresh shuffle every epoch
        epoch, offset = divmod(step, steps_per_epoch)
        order = np.random.default_rng([args.seed, epoch]).permutation(len(datums))
        batch = [datums[i] for i in order[offset * args.batch_size:][: args.batch_size]]

        # ---- one update: mean NLL per demonstrated token
        metrics = training.forward_backward(batch, "cross_entropy").result().metrics
        metrics |= training.optim_step(adam).result().metrics
        t1 = time.perf_counter()

        # ---- held-out likelihood, metrics, then checkpoint
        last = step + 1 == total_steps
        row = {"step": step, "epoch": epoch, "datums": len(batch),
               "trained_tokens": active_tokens(batch), "loss": metrics["loss_mean"],
               "grad_norm": metrics.get("grad_norm")}
        if before is not None:  # the held-out score of the weights this run started from
            row["heldout_nll_before"], before = before, None
        if heldout and (last or (args.heldout_every and (step + 1) % args.heldout_every == 0)):
            row["heldout_nll"] = mean_nll(training, heldout)
        row |= {"time_train": t1 - t0, "time_step": time.perf_counter() - t0}
        append_metrics(metrics_path, row)
        if (step + 1) % args.save_every == 0 or last:
            path = training.save_state(f"step-{step + 1:06d}", overwrite=True).result().path
            write_json(checkpoint, {"step": step + 1, "path": path,
                                    "args": dataclasses.asdict(args)})
        history.append(row)
        bar.set_postfix(loss=round(row["loss"], 3))
    return history


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    history = train(args)
    if history:
        summary = {"step": history[-1]["step"], "loss": history[-1]["loss"], "out": args.out}
        for key in ("heldout_nll_before", "heldout_nll"):
            values = [row[key] for row in history if key in row]
            if values:
                summary[key] = values[0] if key.endswith("before") else values[-1]
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
