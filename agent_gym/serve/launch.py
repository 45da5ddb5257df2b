"""Starting a server from its command-line settings: what ``agent-gym serve`` and a
container's entry (``container.py``) both run, so the two read tokens and refuse settings
alike. The command line sits above this floor; it adds these options to its ``serve``
command and turns ``LaunchError`` into its one-line error.
"""

from __future__ import annotations

import argparse
import os

from agent_gym.cli.parsing import add_env_arg
from agent_gym.serve.app import ExposureError, serve
from agent_gym.serve.sessions import (
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_SESSIONS,
    ServerConfig,
)


class LaunchError(Exception):
    """A setting the server will not start with; whoever started it gets this one line."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's settings, as ``agent-gym serve`` and a container's entry take them."""
    parser.add_argument("env_id", help="e.g. agent_gym/GSM8K-v0")
    add_env_arg(parser, "env constructor argument (JSON value)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    parser.add_argument("--max-sessions", type=int, default=DEFAULT_MAX_SESSIONS,
                        help="sessions held at once; more are refused (CAPACITY_REACHED)")
    parser.add_argument("--idle-timeout", type=float, default=DEFAULT_IDLE_TIMEOUT_S,
                        metavar="SECONDS", help="close sessions idle this long (0: never)")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help="largest HTTP body or WebSocket frame accepted")
    parser.add_argument("--token-env", metavar="VAR",
                        help="require 'Authorization: Bearer <$VAR>' on every request "
                        "but /health (needed for a --host other than loopback)")
    parser.add_argument("--critic-token-env", metavar="VAR",
                        help="serve the episode's privileged info (answers, oracle actions) "
                        "to requests carrying critic_token=$VAR; without it no one gets it, "
                        "and observations never carry it")
    parser.add_argument("--allow-unauthenticated", action="store_true",
                        help="listen on a non-loopback --host with no token: anyone who "
                        "reaches it can run episodes")
    parser.add_argument("--verbose", action="store_true",
                        help="log a line per request and per WebSocket session")


def run_server(args: argparse.Namespace) -> None:
    """Serve until stopped with the settings ``add_arguments`` parsed.

    Raises ``LaunchError`` for what the one who started it can fix: a token variable that
    is unset, a limit out of range, a non-loopback host without a token."""
    token, critic_token = (_token_from(flag, variable) for flag, variable in (
        ("--token-env", args.token_env), ("--critic-token-env", args.critic_token_env)))
    try:
        config = ServerConfig(
            args.env_id, dict(args.env_arg), max_sessions=args.max_sessions,
            idle_timeout_s=args.idle_timeout or None, max_request_bytes=args.max_request_bytes,
            token=token, critic_token=critic_token,
        )
    except ValueError as err:  # a limit out of range, the critic's token the policy's
        raise LaunchError(str(err)) from err
    try:
        serve(config, host=args.host, port=args.port, verbose=args.verbose,
              allow_unauthenticated=args.allow_unauthenticated)
    except ExposureError as err:
        raise LaunchError(str(err)) from err


def _token_from(flag: str, variable: str | None) -> str | None:
    """The token in environment variable ``variable`` (tokens never go on a command line,
    where other users' ``ps`` shows them)."""
    if variable is None:
        return None
    token = os.environ.get(variable)
    if not token:
        raise LaunchError(f"{flag} {variable} is not set")
    return token
