"""OpenEnv's task API on `agent-gym serve`: the env's split, its tasks and a reset by split
and index, with OpenEnv's own request models (in process, through the ASGI app)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("openenv")
pytest.importorskip("fastapi")

from openenv.core.env_server.types import (
    GetTaskRangeRequest,
    GetTaskRequest,
    ListTasksRequest,
    NumTasksRequest,
)
from starlette.testclient import TestClient

from agent_gym.serve.app import create_app
from agent_gym.serve.sessions import ServerConfig


@pytest.fixture(scope="module")
def client() -> Any:
    with TestClient(create_app(ServerConfig("agent_gym/GSM8K-v0"))) as test_client:
        yield test_client


def test_splits_tasks_and_ranges(client: TestClient) -> None:
    assert client.get("/list_environments").json() == ["GSM8K-v0"]
    assert client.get("/gsm8k-v0/splits").json() == [{"name": "all", "type": "validation"}]
    body = ListTasksRequest(split="all").model_dump()
    tasks = client.post("/GSM8K-v0/tasks", json=body).json()
    assert tasks["env_name"] == "GSM8K-v0" and len(tasks["tasks"]) == 54
    assert tasks["tasks"][2] == {"id": "agsm-002", "index": 2}  # ids only: never the answer
    count = client.post("/GSM8K-v0/num_tasks", json=NumTasksRequest(split="all").model_dump())
    assert count.json() == {"num_tasks": 54}
    one = client.post("/GSM8K-v0/task", json=GetTaskRequest(split="all", index=53).model_dump())
    assert one.json() == {"task": {"id": tasks["tasks"][53]["id"], "index": 53}}
    window = client.post("/GSM8K-v0/task_range",
                         json=GetTaskRangeRequest(split="all", start=50).model_dump()).json()
    assert [task["index"] for task in window["tasks"]] == [50, 51, 52, 53]


@pytest.mark.parametrize(("path", "body", "status", "message"), [
    ("/Search-v0/num_tasks", {"split": "all"}, 404, "unknown environment 'Search-v0'"),
    ("/GSM8K-v0/num_tasks", {"split": "train"}, 400, "split 'train' is not served here"),
    ("/GSM8K-v0/task", {"split": "all", "index": 54}, 400, "index must be a whole number in "
     "[0, 54), got 54"),
    ("/GSM8K-v0/task", {"split": "all", "index": True}, 400, "got True"),
    ("/GSM8K-v0/task_range", {"split": "all", "start": "1"}, 400, "start and stop must be"),
    ("/GSM8K-v0/tasks", [1], 400, "must be a JSON object"),
])
def test_task_api_refusals(client: TestClient, path: str, body: Any, status: int,
                           message: str) -> None:
    reply = client.post(path, json=body)
    assert reply.status_code == status
    assert message in reply.json()["detail"]["message"]


def test_reset_by_split_and_index_on_each_transport(client: TestClient) -> None:
    target = client.post("/GSM8K-v0/task", json={"split": "all", "index": 7}).json()["task"]
    http = client.post("/reset", json={"split": "all", "index": 7}).json()
    assert http["observation"]["info"]["task_id"] == target["id"]
    with client.websocket_connect("/ws") as ws:
        ws.send_json({"type": "reset", "data": {"split": "all", "index": 7}})
        assert ws.receive_json()["data"]["observation"]["info"]["task_id"] == target["id"]
        ws.send_json({"type": "reset", "data": {"split": "test", "index": 7}})
        refused = ws.receive_json()["data"]
        assert refused["code"] == "VALIDATION_ERROR"
        assert "split 'test' is not served here: this env's tasks are split 'all'" in \
            refused["message"]
        ws.send_json({"type": "reset", "data": {"split": "all", "state": {}}})
        assert "'state' cannot be combined" in ws.receive_json()["data"]["message"]
