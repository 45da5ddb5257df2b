"""Run GRPO many times, each run killed with SIGKILL at a chosen moment, without paying the
trainer's imports (seconds) on every start.

``ForkRunner`` starts ``python -m tests.helpers.fork_runner``, which imports the trainer
once and then, for each request on its stdin, forks a child that runs
``agent_gym_train.grpo.main(argv)``. A request may name a moment to die at: the child
sends itself SIGKILL at the ``call``-th call of one ``PHASES`` function, so the kill lands
inside a rollout, an update or a checkpoint write by construction, not by luck of timing.
The server answers one line per child: ``killed``, ``finished`` or ``failed``. Forking is
safe here because the server itself never runs torch (it only imports it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path
from types import TracebackType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# Where a run can die: a turn boundary being journaled (mid-rollout), a sampling call, an
# optimizer step (mid-update), and checkpoint.json about to be written (the weights are
# saved, the checkpoint does not name them yet).
PHASES = ("journal", "sample", "update", "checkpoint")


class ForkRunner:
    """The test side: ``run(argv, kill_at=(phase, call))`` -> how the child ended."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "AGENT_GYM_THREADS": "1",
               "OMP_NUM_THREADS": "1"}
        self.server = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.fork_runner"], cwd=ROOT, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, argv: list[str], kill_at: tuple[str, int] | None = None) -> str:
        assert self.server.stdin is not None and self.server.stdout is not None
        self.server.stdin.write(json.dumps({"argv": argv, "kill_at": kill_at}) + "\n")
        self.server.stdin.flush()
        return self.server.stdout.readline().strip()

    def __enter__(self) -> ForkRunner:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        assert self.server.stdin is not None
        self.server.stdin.close()
        try:
            self.server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait()


def _die_at(phase: str, call: int) -> None:
    """In the child: SIGKILL itself at the ``call``-th call of ``phase``."""
    from agent_gym_train.backends.local import LocalTrainingClient
    from agent_gym_train.backends.sampler import LocalSamplingClient
    from agent_gym_train.run import run
    from agent_gym_train.run.journal import Journal

    calls = 0

    def counting(real: Any, applies: Any = None) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            if applies is None or applies(*args, **kwargs):
                calls += 1
                if calls == call:
                    os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)
        return wrapper

    if phase == "journal":
        Journal.record = counting(Journal.record)  # type: ignore[method-assign]
    elif phase == "sample":
        LocalSamplingClient.sample_async = counting(  # type: ignore[method-assign]
            LocalSamplingClient.sample_async)
    elif phase == "update":
        LocalTrainingClient.optim_step = counting(  # type: ignore[method-assign]
            LocalTrainingClient.optim_step)
    elif phase == "checkpoint":
        run.write_text = counting(  # type: ignore[attr-defined]
            run.write_text, lambda path, text: Path(path).name == "checkpoint.json")
    else:
        raise ValueError(f"no phase {phase!r}")


def serve() -> None:
    from agent_gym_train import grpo  # the imports every child shares
    from tests.helpers import grpo_toy  # noqa: F401 (registers the toy env)

    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the child: run, and die where told
            code = 0
            quiet = os.open(os.devnull, os.O_WRONLY)
            os.dup2(quiet, 1)  # the server's stdout is the protocol: the child's is not
            try:
                if request["kill_at"]:
                    _die_at(*request["kill_at"])
                grpo.main(request["argv"])
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        ended = ("killed" if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
                 else "finished" if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
                 else "failed")
        print(ended, flush=True)


if __name__ == "__main__":
    serve()
