"""The OpenEnv server of agent_gym/GSM8K-v0.

``main`` runs ``agent-gym serve`` on port 8000 of every interface (the container's command;
the bearer token in AGENT_GYM_TOKEN); ``app`` is the same server for runtimes that import an
ASGI app (openenv.yaml's ``app``). See ``agent_gym.serve.container``.
"""

from agent_gym.serve.container import package_server

ENV_ID = "agent_gym/GSM8K-v0"
serve, __getattr__ = package_server(ENV_ID)


def main() -> None:  # defined here, where OpenEnv's layout check looks for it
    serve()


if __name__ == "__main__":
    main()
