"""The run module every trainer shares: arguments and their checks, opening a run (turn
budget, resume, metrics trimmed), the env pool, the update, metrics lines, checkpoints and
seeds."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import gymnasium
import pytest

from agent_gym.seeding import derive_seed
from agent_gym_train.backends.local import LocalServiceClient
from agent_gym_train.cli import _reporting
from agent_gym_train.run.args import RunArgs, parse_args
from agent_gym_train.run.envpool import EnvPool
from agent_gym_train.run.files import (
    CHECKPOINT_FILE,
    METRICS_FILE,
    Checkpoint,
    RunConfigError,
    keep_metrics_before,
    read_metrics,
)
from agent_gym_train.run.journal import JOURNAL_FILE
from agent_gym_train.run.run import open_run
from agent_gym_train.run.store import StateStore
from tests.agent_gym_train.test_store import resume_point
from tests.helpers import grpo_toy


@dataclass
class ToyArgs(RunArgs):
    env_id: str = grpo_toy.ENV_ID
    lora_rank: int = 0
    out: str = "runs/toy"
    steps: int = 3
    ratio: float = 0.5
    flag: bool = False

    def problems(self) -> list[str]:
        return [*super().problems(), *(["--ratio must be below 1"] if self.ratio >= 1 else [])]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return grpo_toy.save_tiny_model(tmp_path_factory.mktemp("toy-model"))


def toy(model: str, out: Path, **overrides: object) -> ToyArgs:
    return ToyArgs(model=model, out=str(out), progress=False, **overrides)  # type: ignore[arg-type]


def test_options_come_from_the_fields_of_the_trainers_args() -> None:
    args = parse_args(ToyArgs, ["--max-turns", "3", "--ratio", "0.25", "--flag", "--ray",
                                "local", "--env-kwargs", '{"max_turns": 4}'], "toy", "")
    assert (args.max_turns, args.ratio, args.flag, args.ray, args.env_kwargs) == (
        3, 0.25, True, "local", {"max_turns": 4})
    defaults = parse_args(ToyArgs, [], "toy", "")
    assert defaults == ToyArgs() and defaults.max_turns is None and defaults.env_id == grpo_toy.ENV_ID
    for bad in (["--ratio", "2"], ["--max-turns", "0"], ["--loss", "dpo"], ["--save-every", "0"],
                ["--backend", "pytrio", "--lora-rank", "0"], ["--temperature", "0.5"],
                ["--sampler", "vllm", "--vllm-weights", "adapter", "--lora-rank", "0"],
                ["--vllm-url", "http://127.0.0.1:1"]):
        with pytest.raises(SystemExit):
            parse_args(ToyArgs, bad, "toy", "")


def test_seeds_depend_only_on_what_they_are_for() -> None:
    assert derive_seed(0, 3, "group", 1) == derive_seed(0, 3, "group", 1)
    seeds = {derive_seed(s, step, p, i) for s in (0, 1) for step in (0, 1)
             for p in ("group", "td") for i in range(4)}
    assert len(seeds) == 32 and all(0 <= s < 2**31 for s in seeds)


def test_the_pool_builds_an_env_per_concurrent_borrower_and_closes_them_all() -> None:
    closed: list[gymnasium.Env] = []

    class Counted(grpo_toy.SayDigitEnv):
        def close(self) -> None:
            closed.append(self)

    pool = EnvPool(Counted)
    first, second = pool(), pool()
    first.close()
    third = pool()  # the idle env is handed out again
    assert pool.built == 2 and third.unwrapped is first.unwrapped and not closed
    second.close()
    third.close()
    pool.close()
    assert len(closed) == 2


def test_a_run_plays_the_envs_turn_budget_unless_told_otherwise(model: str, tmp_path: Path) -> None:
    with open_run(toy(model, tmp_path / "a"), 3) as run:
        assert run.max_turns == 2 and run.num_tasks == len(grpo_toy.DIGITS)
        assert run.start == 0 and run.resumed is None
    with open_run(toy(model, tmp_path / "b", env_kwargs={"max_turns": 5}), 3) as run:
        assert run.max_turns == 5
    with open_run(toy(model, tmp_path / "c", max_turns=1), 3) as run:
        assert run.max_turns == 1
        tasks = run.tasks(run.rng(0), 6)
        assert tasks == run.tasks(run.rng(0), 6) and {t["index"] for t in tasks} == set(range(4))
        assert len({t["index"] for t in run.tasks(run.rng(1), 3)}) == 3  # distinct when possible


def test_finish_writes_the_line_then_the_checkpoint_and_resume_trims(
    model: str, tmp_path: Path
) -> None:
    args = toy(model, tmp_path, save_every=2)
    with open_run(args, 3) as run:
        assert run.update([]) == {"datums": 0, "trained_tokens": 0, "loss": None,
                                  "loss_sum": None, "grad_norm": None}
        store = StateStore(10, 10)
        for step in run.progress():
            store.add([resume_point(step)])
            run.finish(step, {"step": step, "value": step / 2}, store)
            saved = Checkpoint.read(tmp_path / CHECKPOINT_FILE) if step else None
            if step == 1:  # save_every=2: the second step is checkpointed
                assert saved is not None and saved.step == 2 and saved.store == "store-000002.json"
    assert Checkpoint.read(tmp_path / CHECKPOINT_FILE).step == 3  # and the last one
    assert sorted(p.name for p in tmp_path.glob("store-*.json")) == ["store-000003.json"]
    assert [row["step"] for row in read_metrics(tmp_path / METRICS_FILE)] == [0, 1, 2]

    # a kill after a line but before its checkpoint: the resumed run redoes that step
    checkpoint = json.loads((tmp_path / CHECKPOINT_FILE).read_text())
    (tmp_path / CHECKPOINT_FILE).write_text(json.dumps(checkpoint | {"step": 2}))
    with open_run(toy(model, tmp_path), 3) as run:
        assert run.start == 2 and run.resumed is not None and run.resumed.store is not None
        assert [row["step"] for row in read_metrics(tmp_path / METRICS_FILE)] == [0, 1]
    with pytest.raises(ValueError, match="holds a run with model"):
        open_run(toy("tiny", tmp_path), 3)


def test_a_cpu_budget_ends_the_run_at_the_step_that_spends_it_and_checkpoints_it(
    model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each step burns 0.1 CPU seconds; a budget of 0.25 s is spent by the third step, which
    is checkpointed although ``save_every`` would skip it, and a continued run counts the
    steps before it."""
    def burn(seconds: float = 0.1) -> None:
        start = time.process_time()
        while time.process_time() - start < seconds:
            pass

    args = toy(model, tmp_path, save_every=10, cpu_budget=0.25)
    with open_run(args, 10) as run:
        ran = []
        for step in run.progress():
            burn()
            run.finish(step, {"step": step})
            ran.append(step)
    assert ran == [0, 1, 2] and run.cpu_spent >= 0.25
    assert Checkpoint.read(tmp_path / CHECKPOINT_FILE).step == 3
    assert "--cpu-budget 0.25 s spent" in capsys.readouterr().err
    with open_run(toy(model, tmp_path, save_every=10, cpu_budget=0.25), 10) as run:
        assert run.cpu_spent == pytest.approx(
            sum(row["cpu_step"] for row in read_metrics(tmp_path / METRICS_FILE)))
        assert list(run.progress()) == []  # spent already: nothing more runs
    with open_run(toy(model, tmp_path, save_every=10, cpu_budget=0.45), 10) as run:
        for step in run.progress():
            burn()
            run.finish(step, {"step": step})
    assert 4 <= Checkpoint.read(tmp_path / CHECKPOINT_FILE).step <= 5
    assert ToyArgs(cpu_budget=0.0).problems() == ["--cpu-budget must be a positive number of "
                                                  "seconds"]


def test_a_lora_only_service_refuses_full_fine_tuning(model: str, tmp_path: Path) -> None:
    class LoraOnly:
        def __init__(self) -> None:
            self.local = LocalServiceClient()
            self.ranks: list[int] = []

        def create_lora_training_client(self, base_model: str, rank: int = 32,
                                        seed: int | None = None) -> object:
            self.ranks.append(rank)
            return self.local.create_lora_training_client(base_model, rank=rank, seed=seed)

        def create_training_client_from_state_with_optimizer(self, path: str) -> object:
            return self.local.create_training_client_from_state_with_optimizer(path)

    service = LoraOnly()
    with pytest.raises(ValueError, match="LoRA adapters only"):
        open_run(toy(model, tmp_path), 1, service)  # type: ignore[arg-type]
    with open_run(toy(model, tmp_path, lora_rank=4), 1, service):  # type: ignore[arg-type]
        assert service.ranks == [4]


def test_every_option_has_help_with_its_default_and_the_real_command_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from agent_gym_train import grpo, opd, sft, tempo

    for module, name in ((grpo, "grpo"), (tempo, "tempo"), (sft, "sft"), (opd, "opd")):
        with pytest.raises(SystemExit):
            module.parse_args(["--help"])
        text = capsys.readouterr().out
        assert text.startswith(f"usage: agent-gym train {name}")
        options = [line.split()[0] for line in text.splitlines()
                   if line.startswith("  --") and line.split()[0] != "--help"]
        assert len(options) > 20
        flat = " ".join(text.split())
        for spec in dataclasses.fields(module.Args):
            flag = "--" + spec.name.replace("_", "-")
            assert flag in flat and spec.metadata.get("help"), flag
        assert f"(default: {module.Args.loss})" in flat and "{local,pytrio}" in flat


def test_a_bare_ray_means_a_local_ray_as_in_eval() -> None:
    assert parse_args(ToyArgs, ["--ray"], "toy", "").ray == "local"
    assert parse_args(ToyArgs, ["--ray", "auto"], "toy", "").ray == "auto"


def test_rerunning_into_the_same_out_continues_with_every_saved_argument(
    model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bare form `agent-gym train grpo --out RUN` continues a run made with other
    settings; explicit changes are reported; changing what the run is, is refused."""
    from agent_gym_train import grpo

    out = str(tmp_path / "run")
    first = ["--env-id", grpo_toy.ENV_ID, "--model", model, "--lora-rank", "0", "--steps", "2",
             "--batch-size", "2", "--group-size", "2", "--max-tokens", "4",
             "--max-trajectory-tokens", "64", "--no-progress", "--out", out]
    grpo.train(grpo.parse_args(first))
    capsys.readouterr()
    resumed = grpo.parse_args(["--out", out, "--steps", "3"])
    assert (resumed.model, resumed.batch_size, resumed.group_size, resumed.steps) == (
        model, 2, 2, 3)
    assert capsys.readouterr().err.strip() == f"resuming {out} at step 2 (changed: steps 2 -> 3)"
    assert [row["step"] for row in grpo.train(resumed)] == [2]
    assert "resuming" in capsys.readouterr().err
    with pytest.raises(RunConfigError, match="holds a run with model="):
        grpo.parse_args(["--out", out, "--model", "tiny"])


def test_steps_that_train_nothing_are_shown_and_explained(
    model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from agent_gym_train.run.run import IDLE_WARNING, final_line

    row = {"datums": 0, "cut_rate": 0.83, "reward_std": 0.0, "reward_mean": 0.0}
    with open_run(toy(model, tmp_path, save_every=100, max_tokens=512), 5) as run:
        for step in run.progress():
            run.finish(step, {"step": step, **row})
    err = capsys.readouterr().err
    assert err.count("trained nothing") == 1  # once per streak, after IDLE_WARNING steps
    assert f"{IDLE_WARNING} steps in a row trained nothing" in err
    assert "83% of replies were cut at --max-tokens 512" in err
    assert "every episode earned the same reward" in err
    line = json.loads(final_line([{"step": 4, **row}], tmp_path))
    assert line["steps_that_trained_nothing"] == 1 and "warning" in line


def test_defaults_follow_the_device_and_gpu_scale_settings_on_a_cpu_are_warned(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from agent_gym_train import grpo
    from agent_gym_train.run.run import device_defaults

    on_cpu = device_defaults(grpo.Args(device="cpu"))
    assert (on_cpu.batch_size, on_cpu.group_size, on_cpu.max_tokens) == (2, 4, 256)
    assert capsys.readouterr().err == ""  # the CPU defaults need no warning
    remote = device_defaults(grpo.Args(backend="pytrio"))
    assert (remote.batch_size, remote.group_size, remote.max_tokens) == (8, 8, 512)
    asked = device_defaults(grpo.Args(device="cpu", batch_size=8, group_size=8, max_tokens=512,
                                      threads=1))
    assert (asked.batch_size, asked.group_size, asked.max_tokens) == (8, 8, 512)
    warning = capsys.readouterr().err
    assert "GPU-scale" in warning and "min" in warning and "--batch-size 2" in warning


def test_a_run_can_start_from_another_runs_weights_with_a_fresh_optimizer(
    model: str, tmp_path: Path
) -> None:
    import torch

    with open_run(toy(model, tmp_path / "first"), 1) as first:
        for parameter in first.training.model.parameters():  # weights no fresh run has
            parameter.data.add_(0.5)
        first.finish(0, {"step": 0})
        trained = [p.detach().clone() for p in first.training.model.parameters()]
    for spec in (tmp_path / "first", tmp_path / "first" / CHECKPOINT_FILE,
                 Path(Checkpoint.read(tmp_path / "first" / CHECKPOINT_FILE).path)):
        with open_run(toy(model, tmp_path / "second", init_from=str(spec)), 1) as second:
            assert second.resumed is None and second.start == 0
            assert all(torch.equal(a, b) for a, b in zip(
                trained, second.training.model.parameters(), strict=True))
            assert second.training._optimizer is None  # built fresh on the first step
    with pytest.raises(RunConfigError, match=r"--init-from .*incompatible: lora_rank"):
        open_run(toy(model, tmp_path / "third", lora_rank=4,
                     init_from=str(tmp_path / "first")), 1)
    with pytest.raises(RunConfigError, match=r"--init-from .*not a local checkpoint"):
        open_run(toy(model, tmp_path / "fourth", init_from=str(tmp_path)), 1)


def test_a_preset_fills_only_the_options_the_command_line_leaves_out() -> None:
    from agent_gym_train import grpo, opd, sft, tempo
    from agent_gym_train.run.args import with_preset

    for module in (sft, grpo, opd, tempo):
        fields = {spec.name for spec in dataclasses.fields(module.Args)}
        assert set(module.Args.PRESETS["cpu-demo"]) <= fields, module.__name__
        preset = module.parse_args(["--preset", "cpu-demo"])
        assert all(getattr(preset, k) == v for k, v in module.Args.PRESETS["cpu-demo"].items())
        assert preset.preset == "cpu-demo"
    demo = grpo.parse_args(["--preset", "cpu-demo", "--group-size", "8", "--max-tokens", "64"])
    assert (demo.batch_size, demo.group_size, demo.max_tokens) == (2, 8, 64)
    assert grpo.parse_args([]).group_size is None  # no preset: the device defaults later
    assert with_preset(grpo.Args, "cpu-demo", group_size=8, max_tokens=64) == demo
    with pytest.raises(SystemExit):
        grpo.parse_args(["--preset", "gpu-huge"])
    with pytest.raises(RunConfigError, match="unknown preset"):
        with_preset(sft.Args, "gpu-huge")


@pytest.mark.parametrize("trainer", ["grpo", "opd"])
def test_a_preset_is_known_when_the_trainer_runs_as_a_module(trainer: str) -> None:
    """``python -m agent_gym_train.grpo --preset cpu-demo``: there the ``Args`` class lives
    in ``__main__``, and its presets must still be found (the error is the next option's)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", f"agent_gym_train.{trainer}", "--preset", "cpu-demo",
         "--max-staleness", "-1"], capture_output=True, text=True, cwd=root, timeout=120)
    assert done.returncode == 2
    assert "--max-staleness must not be negative" in done.stderr
    assert "--preset" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_a_supervised_batch_adds_its_gradient_to_the_same_update(
    model: str, tmp_path: Path
) -> None:
    """``update(datums, supervised)``: one optimizer step on the sum of the objective's
    gradient and the cross-entropy batch's (each its own batch's mean), so the gradient of
    both together is the sum of each alone."""
    import torch

    from agent_gym_train.run.episode import Span, TokenSequence, build_datum, cross_entropy_datum

    policy = build_datum(TokenSequence((3, 4, 5, 6), (Span(2, (-1.0, -1.2)),)), 0.7)
    label = cross_entropy_datum(TokenSequence((3, 4, 7, 8, 9), (Span(3, (-0.5, -0.5)),)), 0.5)

    def gradients(datums: list, supervised: list) -> tuple[list[torch.Tensor], dict]:
        with open_run(toy(model, tmp_path / f"run-{len(datums)}-{len(supervised)}"), 1) as run:
            run.adam = run.adam.model_copy(update={"learning_rate": 0.0})  # keep the weights
            row = run.update(datums, supervised)
            # optim_step clears the gradients: recompute them on the unchanged weights
            if datums:
                run.objective.forward_backward(run.training, datums).result()
            if supervised:
                run.training.forward_backward(supervised, "cross_entropy").result()
            return [p.grad.clone() for p in run.training.model.parameters()
                    if p.grad is not None], row

    both, row = gradients([policy], [label])
    # the weight scales the term: pytrio divides by the trained targets, not by the weights
    doubled = cross_entropy_datum(TokenSequence((3, 4, 7, 8, 9), (Span(3, (-0.5, -0.5)),)), 1.0)
    for half, full in zip(gradients([], [label])[0], gradients([], [doubled])[0], strict=True):
        torch.testing.assert_close(2 * half, full)
    alone_policy, _ = gradients([policy], [])
    alone_label, label_row = gradients([], [label])
    assert row["supervised_datums"] == 1 and row["supervised_tokens"] == 2
    assert row["supervised_loss"] == pytest.approx(label_row["supervised_loss"])
    assert label_row["datums"] == 0 and label_row["grad_norm"] > 0
    for total, a, b in zip(both, alone_policy, alone_label, strict=True):
        torch.testing.assert_close(total, a + b)


def test_a_checkpoint_record_of_garbage_is_one_line_and_moved_aside(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``checkpoint.json`` of ``{garbage`` ended every resume in a traceback."""
    (tmp_path / CHECKPOINT_FILE).write_text("{garbage")
    argv = ["--out", str(tmp_path), "--model", "tiny"]
    command = argparse.Namespace(argv=argv, debug=False)
    assert _reporting(command, "grpo", lambda a: parse_args(ToyArgs, a, "toy", "t") and 0) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "is not a readable checkpoint record" in lines[0], lines
    assert "moved to checkpoint.json.damaged" in lines[0]
    assert (tmp_path / "checkpoint.json.damaged").read_text() == "{garbage"
    assert parse_args(ToyArgs, argv, "toy", "t").out == str(tmp_path)  # the next run starts
    # a record of the right JSON but the wrong shape is refused the same way
    (tmp_path / CHECKPOINT_FILE).write_text('{"step": -1, "path": "x", "args": {}}')
    with pytest.raises(RunConfigError, match=r"checkpoint\.json\.damaged-2"):
        Checkpoint.read(tmp_path / CHECKPOINT_FILE)


def test_a_cut_last_metrics_line_is_dropped_and_a_bad_one_moved_aside(tmp_path: Path) -> None:
    """A kill cuts at most the last line, of a step no checkpoint counts: dropped. Any other
    line that does not read is one line, with the file set aside, never a traceback."""
    path = tmp_path / METRICS_FILE
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "lo')
    assert keep_metrics_before(path, 2) == [{"step": 0}, {"step": 1}]
    assert path.read_text() == '{"step": 0}\n{"step": 1}\n'
    path.write_text('{"step": 0}\n{garbage\n{"step": 1}\n')
    with pytest.raises(RunConfigError, match=r"line 2 .* moved to metrics\.jsonl\.damaged"):
        keep_metrics_before(path, 2)
    assert not path.exists() and (tmp_path / "metrics.jsonl.damaged").is_file()


def test_a_journal_that_is_not_a_database_stops_the_run_before_a_model_loads(
    tmp_path: Path
) -> None:
    (tmp_path / JOURNAL_FILE).write_bytes(b"\x07" * 8192)
    with pytest.raises(RunConfigError, match="is not a readable journal"):
        open_run(toy("no-such-model", tmp_path), 1)
    assert (tmp_path / "rollouts.sqlite.damaged").is_file()
