"""docs/extending.md, followed as written: its env code is saved as a module, checked with
Gymnasium's checker, and its commands run -- with ``--import`` and, packaged, through the
``agent_gym.envs`` entry-point group."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.helpers.serve_process import running_server

ROOT = Path(__file__).resolve().parents[1]
GUIDE = (ROOT / "docs" / "extending.md").read_text(encoding="utf-8")
ENV_ID = "letter_count/LetterCount-v0"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", GUIDE, flags=re.DOTALL)


@pytest.fixture
def module_dir(tmp_path: Path) -> Path:
    """The guide's env saved as ``letter_count.py``, as it tells the reader to."""
    (tmp_path / "letter_count.py").write_text(_blocks("python")[0], encoding="utf-8")
    return tmp_path


def _environ(*paths: Path) -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (ROOT, *paths))),
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def _as_installed(bin_dir: Path) -> dict[str, str]:
    """An environment without PYTHONPATH whose ``agent-gym`` is a console script as pip
    writes it (its own directory first on ``sys.path``, never the working directory), of
    this checkout: a user's module is found only the way the command itself finds it."""
    bin_dir.mkdir()
    script = bin_dir / "agent-gym"
    script.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(1, {str(ROOT)!r})\n"
                      "from agent_gym.cli.main import main\nsys.exit(main())\n")
    script.chmod(0o755)
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    path = os.pathsep.join((str(bin_dir), str(Path(sys.executable).parent), environ["PATH"]))
    return {**environ, "PATH": path}


def _run(command: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(shlex.split(command), cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_guides_commands_run_as_written_from_the_modules_folder(
        module_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    env = _as_installed(tmp_path_factory.mktemp("installed") / "bin")
    commands = [line for line in _blocks("bash")[0].replace("\\\n", "").splitlines() if line]
    commands += re.findall(r"`(agent-gym eval letter_count:[^`]+)`", GUIDE)  # Gymnasium's form
    served = [c for c in commands if " serve " in f" {c} "]
    assert len(served) == 1
    for command in commands:
        if command in served:
            continue
        done = _run(command, module_dir, env)
        assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
        if command.startswith("agent-gym replay"):
            assert json.loads(done.stdout)["turn"] == 2  # the oracle's call and its answer
    summary = json.loads((module_dir / "runs" / "lc" / "summary.json").read_text())
    assert summary["episodes"] >= 4 and summary["success_rate"] == 1.0
    # `serve` as the guide writes it, with a free port: a client plays an episode.
    words = shlex.split(served[0])
    # (the helper starts it with `python -m` from elsewhere, so it is told the module's folder)
    with running_server(words[2], *words[3:],
                        env={"PYTHONPATH": os.pathsep.join((str(ROOT), str(module_dir)))}) as url:
        assert httpx.post(f"{url}/reset", json={}, timeout=30).status_code == 200


def test_a_packaged_env_registers_through_the_entry_point_group(module_dir: Path,
                                                                tmp_path: Path) -> None:
    """A real installed distribution's metadata (a dist-info beside the module), read by
    importlib.metadata as pip would leave it: no --import needed anywhere."""
    (entry,) = re.findall(r'\[project\.entry-points\."agent_gym\.envs"\]\n(.+)\n', GUIDE)
    dist = module_dir / "letter_count-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: letter-count\nVersion: 0.1\n")
    entry = entry.replace('"', "")  # TOML's quotes; entry_points.txt has none
    (dist / "entry_points.txt").write_text(f"[agent_gym.envs]\n{entry}\n")
    env = _environ(module_dir)
    listed = _run("agent-gym envs", module_dir, env)
    assert ENV_ID in listed.stdout.split()
    done = _run(f"agent-gym eval {ENV_ID} --policy oracle --episodes 2 --quiet --out run",
                module_dir, env)
    assert done.returncode == 0, done.stderr
    replayed = _run("agent-gym replay run/episodes.jsonl --episode 1", module_dir, env)
    assert replayed.returncode == 0, replayed.stderr
    script = ("import json, agent_gym\n"
              "state = json.loads(open('run/episodes.jsonl').readline())['final_state']\n"
              "env, _, info = agent_gym.make_from_state(json.dumps(state))\n"
              "print(info['turn'])\n")
    assert _run(f"{sys.executable} -c {shlex.quote(script)}", module_dir, env).stdout == "2\n"


def test_a_module_that_cannot_be_imported_is_one_line(tmp_path: Path) -> None:
    done = _run("agent-gym eval x/Y-v0 --import no_such_module --out run", tmp_path,
                _environ())
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "agent-gym eval: error: --import no_such_module: ModuleNotFoundError: No module named "
        "'no_such_module'"
    ]
