"""CodeInterpreter-v0 played from a real install: a cell finds nothing of the project.

A wheel or a container install puts the package, every bundled problem with its answer,
into the interpreter's site-packages, which the sandbox binds so that cells can import
what is installed. Each test installs this checkout into a fresh venv (offline, from a
wheel, and as the deploy image does, ``pip install .``), plays both modes of the env in
that venv, and has a cell search ``sys.path`` and the whole file system.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Walks sys.path and / (the pseudo file systems aside) for any file of the project (its
# directories stay, empty, as the mount points that hide them), tries the installed
# package's own paths, which the host passes in, and imports the generator.
PROBE = r"""
import json, os, sys
hits = []
def note(path):
    parts = path.split(os.sep)
    if (any(p in ("agent_gym", "agent_gym_train") or p.startswith("agent_gym-") for p in parts)
            or "agent_gym_0" in parts[-1] or parts[-1] == "math_large.py"
            or (parts[-2:-1] == ["datasets"] and parts[-1].endswith(".jsonl"))):
        hits.append(path)
for top in [*sys.path, "/"]:
    for root, dirs, files in os.walk(top or "."):
        if root == "/":
            dirs[:] = [d for d in dirs if d not in ("proc", "sys", "dev")]
        for name in files:
            note(os.path.join(root, name))
for path in KNOWN:
    try:
        with open(path, "rb") as handle:
            hits.append(f"{path} ({len(handle.read())} bytes)")
    except OSError:
        pass
try:
    import agent_gym.envs.math_large
    hits.append(f"imported {agent_gym.envs.math_large.__file__}")
except ImportError:
    pass
print("HITS", json.dumps(sorted(set(hits))))
"""

# Plays one episode in each mode with the probe as its only cell; prints what it found.
PLAY = r"""
import json, sys
import gymnasium as gym
import agent_gym
from pathlib import Path
package = Path(agent_gym.__file__).parent
known = [str(package / "envs" / "math_large.py"), *map(str, package.glob("datasets/*.jsonl"))]
assert len(known) > 2, known
cell = "KNOWN = " + repr(known) + "\n" + sys.argv[1]
for mode in ("stateful", "stateless"):
    env = gym.make("agent_gym/CodeInterpreter-v0", protocol="fenced", mode=mode, timeout=60)
    env.reset(seed=0)
    observation = env.step("```python\n" + cell + "\n```")[0]
    env.close()
    print(mode, json.dumps(observation))
"""


def _venv(where: Path) -> Path:
    """A bare venv of this interpreter whose site-packages reach this one's dependencies
    (a path line after its own, so the venv's install is the agent_gym it imports)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def _pip(python: Path, *args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", "--no-build-isolation", "--quiet", *args],
        check=True, env=_clean_env(),
    )


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of what the package is built from (a build writes into its source tree)."""
    where = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, where / name)
    for name in ("agent_gym", "agent_gym_train"):
        shutil.copytree(REPO / name, where / name, ignore=shutil.ignore_patterns("__pycache__"))
    return where


def _play(python: Path) -> None:
    done = subprocess.run(
        [str(python), "-c", PLAY, PROBE], capture_output=True, text=True, env=_clean_env(),
        timeout=240, cwd="/",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["stateful", "stateless"], done.stdout
    for line in lines:
        observation = json.loads(line.split(" ", 1)[1])
        assert "HITS []" in observation, line


def test_a_cell_finds_nothing_of_a_wheel_install(source: Path, tmp_path: Path) -> None:
    wheels = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-index", "--no-build-isolation",
         "--quiet", "-w", str(wheels), str(source)],
        check=True, env=_clean_env(),
    )
    python = _venv(tmp_path / "venv")
    _pip(python, str(next(wheels.glob("agent_gym-*.whl"))))
    _play(python)


def test_a_cell_finds_nothing_of_the_deploy_image_install(source: Path, tmp_path: Path) -> None:
    """The image's ``pip install '.[serve,code]'``: the package into site-packages."""
    python = _venv(tmp_path / "venv")
    _pip(python, str(source))
    _play(python)
