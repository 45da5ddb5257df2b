"""What the OpenEnv packages in ``deploy/openenv/`` run: the server of ``agent-gym serve``
for one env the way a container serves it, on every interface at port 8000 with every route
but ``/health`` behind the bearer token in ``AGENT_GYM_TOKEN`` (off loopback the server
refuses to start without one). Each package's ``server/app.py`` names its env and calls
these; they start the server through ``launch``, as the command does, not through the
command line, which sits above this floor."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from agent_gym.cli.parsing import OneLineParser

if TYPE_CHECKING:
    from fastapi import FastAPI

TOKEN_ENV = "AGENT_GYM_TOKEN"
PORT = 8000


def serve_arguments(env_id: str, extra: Sequence[str] = ()) -> list[str]:
    """The server settings (``launch.add_arguments``) that serve ``env_id`` in a container;
    ``extra`` adds options (``--env-arg max_turns=5``, ``--critic-token-env VAR``, ...)."""
    return [env_id, "--host", "0.0.0.0", "--port", str(PORT), "--token-env", TOKEN_ENV, *extra]


def serve_main(env_id: str, extra: Sequence[str] = ()) -> int:
    """Serve ``env_id`` as a container does, until stopped; a setting the server refuses is
    one line on stderr and exit status 2, as from ``agent-gym serve``."""
    from agent_gym.serve.launch import LaunchError, add_arguments, run_server

    parser = OneLineParser(prog="server.app", description=f"Serve {env_id} as its container does.")
    add_arguments(parser)
    try:
        run_server(parser.parse_args(serve_arguments(env_id, extra)))
    except LaunchError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    return 0


def asgi_app(env_id: str) -> FastAPI:
    """The server's ASGI app for runtimes that import one (``openenv.yaml``'s ``app``),
    with the same token rule: such a runtime chooses where it listens."""
    from agent_gym.serve.app import create_app
    from agent_gym.serve.sessions import ServerConfig

    token = os.environ.get(TOKEN_ENV)
    if not token:
        raise RuntimeError(f"{TOKEN_ENV} is not set: the server needs a bearer token")
    return create_app(ServerConfig(env_id, token=token))


def package_server(env_id: str) -> tuple[Callable[[], None], Callable[[str], Any]]:
    """What a package's ``server/app.py`` is made of for ``env_id``: a function that serves
    until stopped (the command line adds ``agent-gym serve`` options such as
    ``--env-arg ...``) and a module ``__getattr__`` that builds ``app`` when first asked for,
    since building it needs the token."""

    def main() -> None:
        sys.exit(serve_main(env_id, sys.argv[1:]))

    @functools.cache
    def app() -> FastAPI:  # one app, one session pool, however often it is asked for
        return asgi_app(env_id)

    def module_attribute(name: str) -> Any:
        if name == "app":
            return app()
        raise AttributeError(name)

    return main, module_attribute
