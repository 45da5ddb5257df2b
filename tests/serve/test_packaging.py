"""The OpenEnv packages in deploy/openenv/ (openenv.yaml, pyproject.toml, server/app.py,
server/Dockerfile per env), checked with the installed openenv CLI's own validation, and
`openenv validate --url` (the CLI itself) against a running server of each env. There is no
Docker engine here, so each recipe is parsed: the files it copies exist, the extras and
pinned packages it installs are the project's, and the command it runs is agent-gym's."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

pytest.importorskip("openenv")
pytest.importorskip("fastapi")

from openenv.cli._validation import validate_multi_mode_deployment
from starlette.testclient import TestClient

from agent_gym.cli.parsing import OneLineParser
from agent_gym.serve.container import PORT, TOKEN_ENV, serve_arguments, serve_main
from agent_gym.serve.launch import add_arguments
from tests.helpers.serve_process import ROOT, running_server

PACKAGES = sorted(path.parent for path in (ROOT / "deploy" / "openenv").glob("*/openenv.yaml"))
# The one check of OpenEnv's layout validator the packages do not meet, on purpose: they
# install from the project's requirements.lock with pip, so a uv.lock would be a second lock.
NO_UV_LOCK = "Missing uv.lock - run 'uv lock' to generate it"


def server_module(package: Path) -> Any:
    spec = importlib.util.spec_from_file_location(f"pkg_{package.name}",
                                                  package / "server" / "app.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def normalized(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def test_there_is_a_package_per_env() -> None:
    env_ids = sorted(server_module(package).ENV_ID for package in PACKAGES)
    assert env_ids == ["agent_gym/ALFWorld-v0", "agent_gym/CodeInterpreter-v0",
                       "agent_gym/GSM8K-v0", "agent_gym/Search-v0"]


@pytest.mark.parametrize("package", PACKAGES, ids=lambda path: path.name)
def test_package_layout_passes_openenvs_checks(package: Path) -> None:
    _, issues = validate_multi_mode_deployment(package)
    assert issues == [NO_UV_LOCK], issues
    manifest = yaml.safe_load((package / "openenv.yaml").read_text())
    assert manifest["spec_version"] == 1 and manifest["port"] == PORT
    assert manifest["name"] == f"agent_gym_{package.name}"
    assert manifest["app"] == "server.app:app"
    assert manifest["validation"]["capabilities"]["task_api"] is True
    script = tomllib.loads((package / "pyproject.toml").read_text())["project"]["scripts"]
    assert script == {"server": "server.app:main"}


@pytest.mark.parametrize("package", PACKAGES, ids=lambda path: path.name)
def test_container_recipe_copies_what_exists_and_runs_agent_gym_serve(package: Path) -> None:
    text = (package / "server" / "Dockerfile").read_text()
    lines = re.sub(r"\\\n", " ", text).splitlines()
    instructions = [line.split(None, 1) for line in lines if line and not line.startswith("#")]
    assert instructions[0] == ["FROM", "python:3.11-slim"]
    relative = package.relative_to(ROOT)
    assert f"docker build -f {relative}/server/Dockerfile" in text  # built from the root
    for keyword, rest in instructions:
        if keyword == "COPY":
            *sources, _ = rest.split()
            for source in sources:
                assert (ROOT / source).exists(), source
    copies = [rest for keyword, rest in instructions if keyword == "COPY"]
    assert f"{relative} /app/env" in copies
    assert ["WORKDIR", "/app/env"] in instructions
    assert instructions[-1] == ["CMD", '["python", "-m", "server.app"]']
    # What it installs: the project's extras, and only packages its lock pins.
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    locked = {normalized(line.split("==")[0]) for line in
              (ROOT / "requirements.lock").read_text().splitlines() if "==" in line}
    for keyword, rest in instructions:
        for install in re.findall(r"pip install ([^&]*)", rest) if keyword == "RUN" else ():
            words = shlex.split(install)
            assert "-c" in words and words[words.index("-c") + 1] == "requirements.lock"
            for word in words:
                if word.startswith(".["):
                    assert set(word[2:-1].split(",")) <= set(extras), word
                elif not word.startswith("-") and word != "requirements.lock":
                    assert normalized(word) in locked, word
    # What server/app.py runs is agent-gym serve's own server, with the container's token.
    module = server_module(package)
    parser = OneLineParser()
    add_arguments(parser)
    args = parser.parse_args(serve_arguments(module.ENV_ID))
    assert (args.env_id, args.host, args.port, args.token_env) == (
        module.ENV_ID, "0.0.0.0", PORT, TOKEN_ENV)


def test_the_container_entry_refuses_in_one_line_without_its_token(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert serve_main("agent_gym/GSM8K-v0") == 2
    assert capsys.readouterr().err == f"server.app: error: --token-env {TOKEN_ENV} is not set\n"


def test_the_packaged_asgi_app_needs_its_token(monkeypatch: pytest.MonkeyPatch) -> None:
    module = server_module(ROOT / "deploy" / "openenv" / "gsm8k")
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(RuntimeError, match=f"{TOKEN_ENV} is not set"):
        module.app  # noqa: B018  (the attribute builds the app)
    monkeypatch.setenv(TOKEN_ENV, "t0ken")
    with TestClient(module.app) as client:
        assert client.get("/health").status_code == 200
        assert client.get("/metadata").status_code == 401
        meta = client.get("/metadata", headers={"authorization": "Bearer t0ken"}).json()
        assert meta["name"] == "agent_gym/GSM8K-v0"


def test_openenv_validate_passes_on_each_envs_server_as_packaged() -> None:
    """`openenv validate --url` (the installed CLI) on a server of each env, all four up at
    once, each with its package's default settings; the package's declared tools and task
    count are what that server serves."""
    openenv_cli = Path(sys.executable).with_name("openenv")
    with contextlib.ExitStack() as stack:
        urls = {package: stack.enter_context(running_server(server_module(package).ENV_ID))
                for package in PACKAGES}
        runs = {package: subprocess.Popen([str(openenv_cli), "validate", "--url", url],
                                          text=True, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE)
                for package, url in urls.items()}
        for package, url in urls.items():
            output, errors = runs[package].communicate(timeout=120)
            assert runs[package].returncode == 0, output + errors
            report = json.loads(output)
            assert report["passed"] and report["mode"] == "simulation"
            assert report["summary"]["passed_count"] == report["summary"]["total_count"] == 6
            declared = yaml.safe_load((package / "openenv.yaml").read_text())[
                "validation"]["capabilities"]
            with httpx.Client(base_url=url, timeout=120) as http:
                tools = http.post("/mcp", json={"jsonrpc": "2.0", "id": 1,
                                                "method": "tools/list"}).json()
                assert [t["name"] for t in tools["result"]["tools"]] == declared[
                    "declared_tools"]
                name = http.get("/list_environments").json()[0]
                (split, count), = declared["declared_task_count"].items()
                assert http.get(f"/{name}/splits").json()[0]["name"] == split
                assert http.post(f"/{name}/num_tasks", json={"split": split}).json() == {
                    "num_tasks": count}
