"""The OpenEnv server of agent_gym/Search-v0.

The container runs ``main`` (``agent-gym serve`` on port 8000 of every interface, the bearer
token in AGENT_GYM_TOKEN); ``app`` is the same server for runtimes that import an ASGI app
(openenv.yaml's ``app``).
"""

import sys
from typing import Any

from agent_gym.serve.container import asgi_app, serve_main

ENV_ID = "agent_gym/Search-v0"


def __getattr__(name: str) -> Any:
    if name == "app":  # built when asked for: it needs the token
        return asgi_app(ENV_ID)
    raise AttributeError(name)


def main() -> None:
    """Serve the env; arguments are more ``agent-gym serve`` options (``--env-arg ...``)."""
    sys.exit(serve_main(ENV_ID, sys.argv[1:]))


if __name__ == "__main__":
    main()
