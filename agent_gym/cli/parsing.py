"""How every ``agent-gym`` command parses and fails, the trainers' included.

The one module of the CLI that ``agent_gym_train`` imports: a trainer's options look and
fail like eval's without importing the rest of the command line (and its env imports).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, requires
from typing import Any, NoReturn

from agent_gym import untrusted
from agent_gym.extras import install_hint


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (with where to read more), not the whole
    usage block: the line is what a user needs to fix the command."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each option's default to its help, unless the help already says it in its own
    words ("default: 10, or the suite's counts", which a bare "(default: None)" after it
    contradicted) or there is none worth saying (None, an empty list, an off switch)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (re.search(r"\bdefault:", text, re.IGNORECASE) or default is None
                or default is False or default == []):
            return text
        return super()._get_help_string(action)


def env_arg(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` of ``--env-arg``: VALUE as JSON, else the string itself."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, untrusted.loads(value)
    except untrusted.UntrustedJSONError:
        return key, value


class EnvKwargsJSON(argparse.Action):
    """``--env-kwargs JSON``, a whole object at once: read as one ``--env-arg`` per key, with a
    note that says so. Every command takes ``--env-arg KEY=VALUE``; this other form is
    accepted so a command copied from an older trainer still runs."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        try:
            kwargs = untrusted.loads(str(values))
        except untrusted.UntrustedJSONError as err:
            parser.error(f"{option_string}: {err}; prefer --env-arg KEY=VALUE")
        if not isinstance(kwargs, dict):
            parser.error(f"{option_string}: expected a JSON object, got {values!r}")
        print(f"{parser.prog}: note: {option_string} is read as one --env-arg KEY=VALUE per "
              "key, the form every command takes", file=sys.stderr)
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest) or []), *kwargs.items()])


HOST_SETTING_HELP = ("repeatable; a host setting (isolation, limits, url, paths) to build the "
                     "env with: a state never chooses these itself")


def add_env_arg(parser: argparse.ArgumentParser, help: str = HOST_SETTING_HELP) -> None:
    """The repeatable ``--env-arg KEY=VALUE`` option, and ``--env-kwargs JSON`` read into it."""
    parser.add_argument("--env-arg", type=env_arg, action="append", default=[],
                        metavar="KEY=VALUE", help=help)
    parser.add_argument("--env-kwargs", action=EnvKwargsJSON, dest="env_arg", metavar="JSON",
                        help="the same settings as one JSON object (each key an --env-arg)")


def extra_providing(module: str) -> str | None:
    """The extra of agent-gym (``train`` first) that installs the top-level package of
    ``module``, read off the installed package's metadata (pyproject's
    ``optional-dependencies``): one list, not a copy of it here. None: no extra does."""
    top = module.partition(".")[0].lower().replace("-", "_")
    try:
        requirements = requires("agent-gym") or []
    except PackageNotFoundError:
        return None
    extras: list[str] = []
    for requirement in requirements:
        distribution, _, marker = requirement.partition(";")
        named = re.match(r"[A-Za-z0-9._-]+", distribution.strip())
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", marker)
        if named and extra and named.group().lower().replace("-", "_") == top:
            extras.append(extra.group(1))
    return "train" if "train" in extras else next(iter(extras), None)


def missing_extra(err: ImportError) -> str | None:
    """The one line for an import that failed because an extra is not installed (the
    module that is missing, or the hint an ImportError raised in its place already gives),
    or None when no extra would help: a policy, env or command loads its optional stack
    only when used, so this can surface from any command, deep in a traceback."""
    missing = next((cause.name for cause in (err, err.__cause__)
                    if isinstance(cause, ImportError) and cause.name), None)
    extra = extra_providing(missing or "")
    if extra is None:
        return None
    hint = install_hint(extra)
    text = " ".join(str(err).split())
    return text if hint in text else f"this needs the {extra} extra ({text}): {hint}"
