"""The ``agent-gym`` command line: each area registers its own subcommands.

Commands from other installed packages (the bundled ``agent_gym_train`` adds ``agent-gym train``)
come in through the ``agent_gym.commands`` entry-point group: each entry is named after its
command and is a ``register(subparsers)`` function. It is imported only when its command
runs (or for the overview), so the env commands never import another package.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import re
import signal
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from importlib.metadata import EntryPoint, PackageNotFoundError, entry_points, version
from pathlib import Path
from types import FrameType
from typing import Any

import gymnasium

import agent_gym
from agent_gym.alfworld import cli as alfworld_cli
from agent_gym.alfworld.games import GameError
from agent_gym.cli import runs as runs_cli
from agent_gym.cli.parsing import (
    DefaultsHelpFormatter,
    OneLineParser,
    add_env_arg,
    missing_extra,
)
from agent_gym.data import DataError
from agent_gym.env.state import EnvState, StateError
from agent_gym.eval.compare import CompareError
from agent_gym.eval.config import EvalConfig
from agent_gym.eval.policies import PolicyError, PolicyInput, make_policy, phrase_action
from agent_gym.eval.run import action_protocol, evaluate
from agent_gym.eval.runfiles import (
    ERRORS_FILE,
    FINAL_STATE_SCHEMA,
    MAX_LINE_BYTES,
    read_json_file,
    read_log,
)
from agent_gym.eval.runlog import RunMismatchError
from agent_gym.eval.runs import CONFIG_FILE, RunDirError, read_run
from agent_gym.eval.summary import Summary, format_table, overall_summary
from agent_gym.render import TemplateError
from agent_gym.search import cli as search_cli


@dataclass(frozen=True)
class SuiteEntry:
    """One env of a suite: scripted baselines are cheap and get more episodes than models
    (0 skips the env for model policies)."""

    env_id: str
    env_kwargs: dict[str, Any]
    episodes: int
    model_episodes: int

    def episodes_for(self, policy_spec: str) -> int:
        return self.episodes if policy_spec in SCRIPTED_POLICIES else self.model_episodes


COMMAND_ENTRY_POINTS = "agent_gym.commands"
BUILTIN_COMMANDS = frozenset({"envs", "replay", "eval", "view", "compare", "rescore", "search",
                              "alfworld", "serve"})
SCRIPTED_POLICIES = ("oracle", "random")
# Suites run on bundled data only, so they work offline.
SUITES: dict[str, list[SuiteEntry]] = {
    "default": [
        SuiteEntry("agent_gym/GSM8K-v0", {}, episodes=20, model_episodes=2),
        SuiteEntry("agent_gym/CodeInterpreter-v0", {"max_turns": 3}, episodes=20, model_episodes=1),
        SuiteEntry("agent_gym/Search-v0", {"max_turns": 5}, episodes=20, model_episodes=1),
        # Bundled synthetic games; the longest walkthrough is 11 commands. No model episodes:
        # twelve long-prompt turns of a CPU model take minutes and a 135M model scores 0.
        SuiteEntry("agent_gym/ALFWorld-v0", {"max_turns": 12}, episodes=12, model_episodes=0),
    ],
}
SUITE_POLICIES = ["oracle", "local"]


class UserError(Exception):
    """A mistake in what the user asked for: printed as one line, exit status 2."""


# What a user's typo or setting can raise; anything else is an internal error whose
# traceback is worth seeing. ``--debug`` shows tracebacks for these too.
USER_ERRORS = (UserError, StateError, RunMismatchError, DataError, GameError, TemplateError,
               RunDirError, CompareError, agent_gym.PluginError)
# The commands that build envs: each takes --import, for envs of other packages.
ENV_COMMANDS = ("envs", "replay", "eval", "serve", "view", "rescore")


def _add_import_option(parser: argparse.ArgumentParser) -> None:
    if "-" not in parser.prefix_chars:  # a stand-in that takes every argument as it comes
        return
    parser.add_argument(
        "--import", dest="imports", action="append", default=[], metavar="MODULE",
        help="import MODULE first, so the envs it registers with Gymnasium can be used "
        "(repeatable); installed packages can register through the agent_gym.envs "
        "entry-point group instead",
    )


def _list_envs(args: argparse.Namespace) -> int:
    bundled = (k for k in gymnasium.registry if k.startswith("agent_gym/"))
    for env_id in sorted({*bundled, *args.plugin_envs}):
        print(env_id)
    return 0


def _replay(args: argparse.Namespace) -> int:
    """Restore a state; host settings (sandbox, network, paths) come from --env-arg only."""
    state = _read_state(Path(args.state), args.episode, args.rollout)
    try:
        env, observation, info = agent_gym.make_from_state(state, **dict(args.env_arg))
    except StateError as err:  # one line, with make_from_state's note on host settings
        raise UserError(" ".join([str(err), *getattr(err, "__notes__", ())])) from err
    print(json.dumps({"turn": info["turn"], "observation": observation,
                      "reward_settings": info["reward_settings"],
                      "host_settings_not_taken": info["host_settings_not_taken"]},
                     ensure_ascii=False))
    env.close()
    return 0


def _read_state(path: Path, episode: int | None, rollout: int = 0) -> EnvState:
    """A state file, or (``--episode N [--rollout R]``) the final state of episode N's
    rollout R of an eval log, read as untrusted input (``agent_gym.eval.runlog``)."""
    if not path.is_file():
        raise UserError(f"{path} does not exist (or is not a file)")
    log = read_log(path, FINAL_STATE_SCHEMA)
    if not log.records:  # not an eval log: a state, on one line or pretty-printed
        if episode is not None:
            raise UserError(f"--episode reads an eval log (episodes.jsonl); {path} is not one")
        return EnvState.from_dict(read_json_file(path, MAX_LINE_BYTES))
    for note in log.notes():
        print(f"agent-gym replay: note: {note}", file=sys.stderr)
    records = log.by_episode()[0]
    if episode is None:
        numbers = sorted({number for number, _ in records})
        raise UserError(f"{path} is an eval log with {len(records)} episodes; pick one with "
                        f"--episode N (N from {numbers[0]} to {numbers[-1]})")
    if (episode, rollout) not in records:
        raise UserError(f"{path} holds no finished episode {episode} rollout {rollout}")
    return EnvState.from_dict(records[episode, rollout]["final_state"])


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def _env_factory(config: EvalConfig, ray_address: str | None, plugins: Sequence[str] = ()
                 ) -> Any:
    """Envs in this process, or (``--ray``) each in a Ray actor on the cluster, which
    imports ``plugins`` (``--import``) before it makes its env."""
    if ray_address is None:
        return None
    from agent_gym.serve.distributed import ensure_ray, remote_env_factory

    try:
        ensure_ray(None if ray_address == "local" else ray_address)
    except ConnectionError as err:
        raise UserError(
            f"no Ray cluster at {ray_address!r} ({err}); start one with `ray start --head`, "
            "or pass a bare --ray for a Ray inside this process"
        ) from err
    return remote_env_factory(config.env_id, config.env_kwargs, ray_address, plugins)


def _probe_env(env_id: str, env_kwargs: dict[str, Any], policy_spec: str) -> None:
    """Build the env once (and reset it) before anything is written to the run directory,
    so a typo fails here, cleanly, instead of leaving a run of something that cannot run."""
    try:
        env = gymnasium.make(env_id, **env_kwargs)
    except gymnasium.error.Error as err:  # an unknown id: keeps Gymnasium's "did you mean"
        raise UserError(str(err)) from err
    except ImportError as err:  # the env's optional stack: name the extra when one has it
        raise UserError(missing_extra(err) or f"cannot build {env_id} with {env_kwargs}: {err}"
                        ) from err
    except (TypeError, ValueError, OSError) as err:
        raise UserError(f"cannot build {env_id} with {env_kwargs}: {err}") from err
    try:
        _, info = env.reset(seed=0)
        protocol = action_protocol(env)
    finally:
        env.close()
    if policy_spec != "random":
        return
    admissible = info.get("admissible_actions")
    if not admissible:
        raise UserError(
            f"--policy random picks among admissible actions, and {env_id} lists none; "
            "use it with ALFWorld-v0"
        )
    try:  # the policy's own check, made before anything runs
        phrase_action(PolicyInput([], info["tools"], 0, protocol=protocol), admissible[0])
    except PolicyError as err:
        raise UserError(f"--policy random cannot play {env_id}: {err}") from err


def _interrupt(signum: int, frame: FrameType | None) -> None:
    """SIGTERM's handler during a run: what Ctrl-C would do. Where SIGINT is ignored (a run
    started with ``cmd &`` from a script, or under nohup), raising it does nothing, so the
    interruption is raised here instead; asyncio.run then cancels the run, which still
    writes its summary."""
    if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL):
        raise KeyboardInterrupt
    signal.raise_signal(signal.SIGINT)


def _eval(args: argparse.Namespace) -> int:
    if (args.env_id is None) == (args.suite is None):
        raise UserError("give either an ENV_ID or --suite NAME")
    if args.suite is not None:
        if args.suite not in SUITES:
            raise UserError(f"unknown suite {args.suite!r}; known: {', '.join(sorted(SUITES))}")
        if args.env_arg or args.split is not None:
            raise UserError(
                "--env-arg and --split do not apply to a suite (each of its envs has its own "
                "settings); evaluate one ENV_ID to change them"
            )
        plan = SUITES[args.suite]
        policies = args.policy or SUITE_POLICIES
    else:
        kwargs = dict(args.env_arg)
        if args.split is not None:
            kwargs["split"] = args.split
        plan = [SuiteEntry(args.env_id, kwargs, args.episodes or 10, args.episodes or 10)]
        policies = args.policy or ["oracle"]
    if len(set(policies)) != len(policies):
        raise UserError("a --policy is given twice")
    for entry in plan:
        for policy_spec in policies:
            if args.episodes or entry.episodes_for(policy_spec):
                _probe_env(entry.env_id, entry.env_kwargs, policy_spec)
    runs: list[tuple[EvalConfig, Summary, Path]] = []
    # SIGTERM stops a run as Ctrl-C does: asyncio.run turns SIGINT into a cancellation,
    # and evaluate writes the summary of the finished episodes on its way out.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for policy_spec in policies:
            try:
                policy = make_policy(
                    policy_spec, seed=args.seed, max_tokens=args.max_tokens,
                    temperature=args.temperature, timeout=args.timeout, device=args.device,
                    threads=args.threads, precision=args.sampler_precision,
                )
            except ValueError as err:
                raise UserError(str(err)) from err
            for entry in plan:
                episodes = args.episodes or entry.episodes_for(policy_spec)
                if episodes == 0:
                    continue
                try:
                    config = EvalConfig(
                        entry.env_id, policy_spec, episodes, args.seed, entry.env_kwargs,
                        rollouts_per_task=args.rollouts_per_task, max_tokens=args.max_tokens,
                        temperature=args.temperature, history_window=args.history_window,
                    )
                except ValueError as err:  # --episodes or --rollouts-per-task out of range
                    raise UserError(str(err)) from err
                out_dir = Path(args.out)
                if args.suite is not None:
                    out_dir = (out_dir / entry.env_id.removeprefix("agent_gym/")
                               / _run_name(policy_spec))
                elif len(policies) > 1:
                    out_dir = out_dir / _run_name(policy_spec)
                try:
                    summary = asyncio.run(evaluate(
                        config, policy, out_dir, concurrency=args.concurrency,
                        progress=not args.quiet,
                        make_env=_env_factory(config, args.ray, args.imports),
                        notify=_tell,
                    ))
                except KeyboardInterrupt:
                    if (out_dir / CONFIG_FILE).exists():  # its figures, from its episodes
                        summary = replace(read_run(out_dir).summary(), interrupted=True)
                        runs.append((config, summary, out_dir))
                    _report(runs, args)
                    print("agent-gym eval: interrupted; the finished episodes are kept and "
                          "summarised: rerun the same command to resume", file=sys.stderr)
                    return 130
                runs.append((config, summary, out_dir))
    finally:
        signal.signal(signal.SIGTERM, previous)
    _report(runs, args)
    failed = [(s, out) for _, s, out in runs if s.episodes == 0 and s.errors]
    for summary, out_dir in failed:
        print(f"agent-gym eval: every episode of {summary.env_id} / {summary.policy} failed; "
              f"the first: {summary.first_error} (all in {out_dir / ERRORS_FILE})",
              file=sys.stderr)
    return 1 if failed else 0


def _tell(note: str) -> None:
    """An eval's word on what it found in a run directory, shown even with --quiet."""
    print(f"agent-gym eval: {note}", file=sys.stderr)


def _report(runs: Sequence[tuple[EvalConfig, Summary, Path]], args: argparse.Namespace) -> None:
    """Print the table of ``runs`` (with one overall row per policy of a suite, also
    written to OUT/overall.json) and each run's notes."""
    summaries = [summary for _, summary, _ in runs]
    if args.suite is not None:
        overall = []
        for policy_spec in dict.fromkeys(config.policy for config, _, _ in runs):
            mine = [run for run in runs if run[0].policy == policy_spec]
            if len(mine) > 1:
                overall.append(overall_summary(mine))
        if overall:
            Path(args.out, "overall.json").write_text(
                json.dumps([asdict(s) for s in overall], indent=2), encoding="utf-8")
        summaries += overall
    if summaries:
        print(format_table(summaries))
    for _, summary, _ in runs:  # the overall rows would repeat their envs' notes
        for note in summary.notes:
            print(f"agent-gym eval: {summary.env_id} / {summary.policy}: {note}",
                  file=sys.stderr)


def _run_name(policy_spec: str) -> str:
    """The directory of one policy's run: its spec in letters, digits, '.', '-' and '_'
    alone (an endpoint's ':', '/', '@' or '#' would make a path that breaks shells and the
    report's file URLs)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", policy_spec).strip(".") or "policy"


def _serve(args: argparse.Namespace) -> int:
    from agent_gym.serve.launch import LaunchError, run_server

    try:
        run_server(args)
    except LaunchError as err:
        raise UserError(str(err)) from err
    return 0


def _missing_serve(missing: str, _: argparse.Namespace) -> int:
    raise UserError(missing)


def _register_serve(commands: Any) -> None:
    try:
        from agent_gym.serve import launch  # it needs FastAPI, the serve extra
        from agent_gym.serve.wire import OPENENV_VERSION_MATCHED
    except ImportError as err:  # the server's stack is an optional extra
        # Every argument, --help included, is taken as it comes, so whatever the user typed
        # the answer is the one line that names the extra.
        stub = commands.add_parser("serve", help="serve an env over OpenEnv's protocol "
                                   "(needs the serve extra)", add_help=False, prefix_chars="\0")
        stub.add_argument("argv", nargs="*")
        stub.set_defaults(run=functools.partial(_missing_serve, str(err)))
        return

    server = commands.add_parser(
        "serve", help="serve an env over OpenEnv's protocol (WebSocket /ws and HTTP), with restore",
        description=f"Host ENV_ID for remote clients over OpenEnv's wire format (matched to "
        f"{OPENENV_VERSION_MATCHED}): one env per session, reset data may carry a saved "
        "'state' to restore mid-episode. Every env is built from the server's own --env-arg "
        "settings; a state saved with other settings is refused.",
    )
    launch.add_arguments(server)
    server.set_defaults(run=_serve)


def build_parser(plugins: Iterable[EntryPoint] = ()) -> argparse.ArgumentParser:
    """The whole command line, with the plugin commands in ``plugins`` registered."""
    parser = OneLineParser(
        prog="agent-gym",
        description="Text environments for LLM agents: list and replay them, benchmark policies on "
        "them, build their search indexes and games, and train on them.",
        epilog="`agent-gym COMMAND --help` explains a command. User errors print one line; "
        "--debug (before the command) shows the traceback instead.",
    )
    parser.add_argument("--version", action="version", version=f"agent-gym {_version()}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser("envs", help="list the registered environments").set_defaults(
        run=_list_envs
    )
    replay = commands.add_parser(
        "replay", help="restore a saved state and verify every observation",
        description="Rebuild the env a state was saved from, replay its actions and check each "
        "observation against the state's digests; print the restored turn and observation.",
    )
    replay.add_argument(
        "state", help="a state saved with EnvState.to_json(), or an eval run's episodes.jsonl "
        "(with --episode)",
    )
    replay.add_argument("--episode", type=int, default=None, metavar="N",
                        help="with an episodes.jsonl: replay the final state of episode N")
    replay.add_argument("--rollout", type=int, default=0, metavar="R",
                        help="with --episode: which of its rollouts (--rollouts-per-task)")
    add_env_arg(replay)
    replay.set_defaults(run=_replay)

    evaluation = commands.add_parser(
        "eval", help="benchmark a policy on an env (or a suite), resumable",
        formatter_class=DefaultsHelpFormatter,
        description="Run episodes concurrently, log each to OUT/episodes.jsonl (rerun the same "
        "command to resume; a run directory only grows), and print a summary table with 95% "
        "intervals and the shares of invalid actions and of cut replies.",
    )
    evaluation.add_argument("env_id", nargs="?", help="e.g. agent_gym/GSM8K-v0 (see `envs`)")
    evaluation.add_argument("--suite",
                            help=f"run a suite of envs instead; suites: {', '.join(SUITES)}")
    evaluation.add_argument(
        "--policy", action="append", metavar="SPEC",
        help="repeatable; oracle | random | openai:MODEL@BASE_URL[#text] | "
        "local[:MODEL][@CHECKPOINT] (MODEL: smollm2, tiny or a HF directory) | "
        "vllm[:MODEL][@CHECKPOINT] | pytrio:MODEL[@CHECKPOINT]; default: oracle (a suite: "
        "oracle and local)",
    )
    evaluation.add_argument("--episodes", type=int, default=None,
                            help="episodes per env (default: 10, or the suite's counts)")
    evaluation.add_argument("--concurrency", type=int, default=4, help="episodes at once")
    evaluation.add_argument(
        "--out", required=True,
        help="run directory: resumed or extended if it holds the same run; its summary covers "
        "every episode in it, even with fewer --episodes")
    evaluation.add_argument("--split", help="data split, passed to the env as split=")
    evaluation.add_argument("--seed", type=int, default=0, help="episode i plays seed+i")
    evaluation.add_argument("--max-tokens", type=int, default=256, help="per model reply")
    evaluation.add_argument(
        "--rollouts-per-task", type=_positive, default=1, metavar="K",
        help="play each task K times with distinct seeds; the summary adds pass@1..K "
        "(use --temperature > 0 with a model, or the rollouts repeat each other)")
    evaluation.add_argument("--temperature", type=float, default=0.0,
                            help="sampling temperature of a model policy")
    evaluation.add_argument(
        "--history-window", type=_positive, default=None, metavar="N",
        help="show the policy the task and only the last N turns (long-horizon envs such "
        "as ALFWorld outgrow small contexts); default: the whole chat")
    evaluation.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                            help="HTTP timeout of an openai: policy's requests")
    add_env_arg(evaluation, "env constructor argument, VALUE as JSON (else a string)")
    evaluation.add_argument(
        "--device", default="auto",
        help="where a local[...] policy runs: auto (CUDA when available, then MPS, else CPU), "
        "cpu, cuda[:N] or mps")
    evaluation.add_argument(
        "--threads", type=int, default=None,
        help="torch threads of a local[...] policy (default: the free cores, or "
        "$AGENT_GYM_THREADS)")
    evaluation.add_argument(
        "--sampler-precision", choices=("float32", "bfloat16"), default="float32",
        help="the dtype of a local[...] policy's weights: bfloat16 decodes faster where the "
        "hardware has bf16 units (and is refused where it does not)")
    evaluation.add_argument("--quiet", action="store_true", help="no progress bar")
    evaluation.add_argument(
        "--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
        help="step envs in Ray actors: a bare --ray starts a local Ray; ADDRESS joins a "
        "cluster (e.g. auto)",
    )
    evaluation.set_defaults(run=_eval)
    runs_cli.register(commands)
    search_cli.register(commands)
    alfworld_cli.register(commands)
    _register_serve(commands)
    for name in ENV_COMMANDS:
        _add_import_option(commands.choices[name])
    for point in plugins:
        point.load()(commands)
    return parser


def _version() -> str:
    try:
        return version("agent-gym")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _plugins_for(argv: Sequence[str]) -> list[EntryPoint]:
    """The plugin commands ``argv`` needs: the one it names, or all of them when it names no
    built-in command (the overview, or an unknown command whose error lists them all)."""
    plugins = list(entry_points(group=COMMAND_ENTRY_POINTS))
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    if command in BUILTIN_COMMANDS:
        return []
    named = [point for point in plugins if point.name == command]
    return named or plugins


def _importable_from_here() -> None:
    """Put the working directory first on ``sys.path``, as ``python -c`` and ``python -m``
    do, so ``--import m`` and the ``m:ENV_ID`` form find a module where ``python -c "import
    m"`` would: a console script's path starts at its own bin directory instead, and
    ``agent-gym eval ... --import letter_count`` beside ``letter_count.py`` failed."""
    here = os.getcwd()
    if here not in sys.path:
        sys.path.insert(0, here)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_plugins_for(argv))
    args = parser.parse_args(argv)
    if args.command is None:  # `agent-gym` alone: the overview
        parser.print_help()
        return 0
    _importable_from_here()
    try:
        args.plugin_envs = agent_gym.load_env_plugins(getattr(args, "imports", ()))
        return int(args.run(args))
    except USER_ERRORS as err:
        if args.debug:
            raise
        message = " ".join(str(err).split()) or type(err).__name__
    except ImportError as err:  # an optional stack, loaded only by what needs it
        message = missing_extra(err)
        if message is None or args.debug:
            raise
    print(f"agent-gym {args.command}: error: {message}", file=sys.stderr)
    return 2

