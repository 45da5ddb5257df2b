"""The newest OpenEnv against real `agent-gym serve` servers, from `.venv-openenv` (built by
`make setup` beside the main venv from requirements-openenv.lock: verifiers pins the main
venv's MCP to a version only openenv 0.4.1 accepts). One server per env, behind a bearer
token and a critic token: OpenEnv 0.10's `GenericEnvClient` and `MCPToolClient` each play
task 0 to reward 1.0 with the oracle's replies, which a critic reads through public calls
only (tests/serve/openenv_clients.py), and `openenv validate --url` passes on the tokened
server given the token in a netrc file, as a shipped container is validated."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.serve_process import ROOT, running_server
from tests.serve.episodes import SERVED, TOOLS

VENV = ROOT / ".venv-openenv" / "bin"
pytestmark = pytest.mark.skipif(
    not (VENV / "python").is_file(),
    reason=".venv-openenv is absent: `make setup` builds it (the newest OpenEnv's venv)")

TOKEN, CRITIC = "t0ken-for-the-policy", "critic-s3cret"
SECRETS = {"AGENT_GYM_TEST_TOKEN": TOKEN, "AGENT_GYM_TEST_CRITIC": CRITIC}


@pytest.fixture(scope="module", params=list(SERVED))
def server(request: pytest.FixtureRequest) -> Any:
    with running_server(request.param, *SERVED[request.param],
                        "--token-env", "AGENT_GYM_TEST_TOKEN",
                        "--critic-token-env", "AGENT_GYM_TEST_CRITIC", env=SECRETS) as url:
        yield request.param, url


def in_the_venv(*command: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(command, capture_output=True, text=True, env=environment,
                          timeout=240, cwd=ROOT)


def test_openenvs_newest_clients_play_each_env_with_a_public_critic(server: Any) -> None:
    env_id, url = server
    run = in_the_venv(str(VENV / "python"), "tests/serve/openenv_clients.py", url, **SECRETS)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout.splitlines()[-1])
    assert report["openenv"].startswith("0.10.")
    for client in ("generic", "mcp"):
        played = report[client]
        assert (played["reward"], played["done"], played["leaks"]) == (1.0, True, []), client
    assert report["mcp"]["tools"] == TOOLS[env_id]


@pytest.mark.parametrize("server", ["agent_gym/GSM8K-v0"], indirect=True)
def test_openenv_validate_reaches_a_tokened_server_through_netrc(
        server: Any, tmp_path: Path) -> None:
    """`openenv validate --url` sets no header; `requests`, which it sends with, adds
    HTTP Basic from the netrc file by itself, and the server takes the token as its
    password. Without the file every check but /health is refused."""
    _, url = server
    netrc = tmp_path / "netrc"
    netrc.write_text(f"machine 127.0.0.1\nlogin agent-gym\npassword {TOKEN}\n")
    netrc.chmod(0o600)
    validate = (str(VENV / "openenv"), "validate", "--url", url, "--json")
    passed = in_the_venv(*validate, NETRC=str(netrc))
    assert passed.returncode == 0, passed.stdout + passed.stderr
    report = json.loads(passed.stdout)
    assert report["summary"]["passed_count"] == report["summary"]["total_count"] == 6
    refused = in_the_venv(*validate, NETRC=str(tmp_path / "none"))
    assert refused.returncode != 0
