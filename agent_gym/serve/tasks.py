"""OpenEnv's task API on ``agent-gym serve``: which tasks the server serves, never what
they hold (a task's payload holds its answer).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request

from agent_gym.serve.replies import JSONText, error_reply, parsed, read_body
from agent_gym.serve.sessions import SessionPool, TaskList
from agent_gym.serve.wire import VALIDATION_ERROR, ProtocolError


def add_task_routes(app: FastAPI, pool: SessionPool) -> None:
    """OpenEnv's task API (``HTTPEnvServer``'s routes for an env with ``list_splits`` and
    friends): the server's one split, its tasks as ``{"id", "index"}`` (never a task's
    payload, which holds its answer), and ``reset`` by ``split`` and ``index``. The env is
    named by its id's last part (``Search-v0``), as a URL path segment cannot hold '/'."""
    name = task_env_name(pool.config.env_id)

    async def task_request(env_name: str, request: Request | None
                           ) -> tuple[TaskList, dict[str, Any]]:
        """The served tasks (``TaskList`` checks the split and bounds a request names) and
        the request's body, after checking the env's name and that the body is an object."""
        if env_name.lower() != name.lower():
            raise ProtocolError(VALIDATION_ERROR, f"unknown environment {env_name!r}; this "
                                f"server serves {name!r}", status=404)
        tasks = (await pool.catalogue()).tasks
        if request is None:
            return tasks, {}
        body = await parsed(pool, await read_body(request, pool.config.max_request_bytes)
                            or b"{}")
        if not isinstance(body, dict):
            raise ProtocolError(VALIDATION_ERROR, "the request body must be a JSON object")
        return tasks, body

    async def answered(handler: Callable[[], Awaitable[Any]]) -> JSONText:
        try:
            return JSONText(await handler())
        except ProtocolError as exc:
            return error_reply(exc)

    @app.get("/list_environments", tags=["Task API"])
    async def list_environments() -> JSONText:
        return JSONText([name])

    @app.get("/{env_name}/splits", tags=["Task API"])
    async def list_splits(env_name: str) -> JSONText:
        async def handle() -> Any:
            tasks, _ = await task_request(env_name, None)
            kind = tasks.split if tasks.split in ("train", "validation", "test") else \
                "validation"
            return [{"name": tasks.split, "type": kind}]
        return await answered(handle)

    @app.post("/{env_name}/tasks", tags=["Task API"])
    async def list_tasks(env_name: str, request: Request) -> JSONText:
        async def handle() -> Any:
            tasks, body = await task_request(env_name, request)
            return {"tasks": tasks.tasks(body.get("split")), "env_name": name}
        return await answered(handle)

    @app.post("/{env_name}/num_tasks", tags=["Task API"])
    async def num_tasks(env_name: str, request: Request) -> JSONText:
        async def handle() -> Any:
            tasks, body = await task_request(env_name, request)
            return {"num_tasks": len(tasks.ids(body.get("split")))}
        return await answered(handle)

    @app.post("/{env_name}/task", tags=["Task API"])
    async def get_task(env_name: str, request: Request) -> JSONText:
        async def handle() -> Any:
            tasks, body = await task_request(env_name, request)
            return {"task": tasks.task(body.get("split"), body.get("index"))}
        return await answered(handle)

    @app.post("/{env_name}/task_range", tags=["Task API"])
    async def get_task_range(env_name: str, request: Request) -> JSONText:
        async def handle() -> Any:
            tasks, body = await task_request(env_name, request)
            return {"tasks": tasks.tasks(body.get("split"), body.get("start"),
                                         body.get("stop"))}
        return await answered(handle)


def task_env_name(env_id: str) -> str:
    """The name the task API knows an env by: its id without the namespace."""
    return env_id.rsplit("/", 1)[-1]
