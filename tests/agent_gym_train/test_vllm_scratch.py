"""``Scratch``, the temporary folder of a server an eval starts: gone after the run, even a
killed one. Apart from ``test_vllm.py`` because it needs no vLLM venv."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from agent_gym_train.backends.vllm import Scratch, sweep_dead_scratch

HOLDER = """
import sys, time
from pathlib import Path
from agent_gym_train.backends.vllm import Scratch
print(Scratch.make(Path(sys.argv[1])).path, flush=True)
time.sleep(600)
"""


def _holder(root: Path) -> tuple[subprocess.Popen[str], Path]:
    """A process that made a scratch folder in ``root`` and holds it."""
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(root)],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    return process, Path(process.stdout.readline().strip())


def test_a_killed_runs_folder_goes_with_the_next_one_and_a_live_runs_stays(
    tmp_path: Path,
) -> None:
    holder, held = _holder(tmp_path)
    try:
        (held / "model.safetensors").write_bytes(b"weights")
        mine = Scratch.make(tmp_path)
        assert held.is_dir(), "a live run's folder was removed"
        holder.kill()  # SIGKILL: no cleanup of its own runs
        holder.wait(timeout=30)
        assert held.is_dir()
        again = Scratch.make(tmp_path)
        assert not held.exists()
        assert sorted(tmp_path.iterdir()) == sorted([mine.path, again.path])
    finally:
        holder.kill()
        holder.wait(timeout=30)
    mine.remove()
    again.remove()
    assert list(tmp_path.iterdir()) == []


def test_remove_is_once_and_a_folder_without_a_lock_is_left_alone(tmp_path: Path) -> None:
    being_made = tmp_path / f"{Scratch.PREFIX}new"
    being_made.mkdir()
    unrelated = tmp_path / "agent-gym-sandbox-1"
    unrelated.mkdir()
    scratch = Scratch.make(tmp_path)
    scratch.remove()
    scratch.remove()  # its lock's descriptor is not closed twice (it may be another file's)
    assert not scratch.path.exists()
    assert sweep_dead_scratch(tmp_path) == []
    assert sorted(tmp_path.iterdir()) == [unrelated, being_made]
