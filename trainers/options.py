"""Command-line options from a trainer's ``Args`` dataclass: one flag per field."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any


def options_parser(args_type: type, prog: str, description: str) -> argparse.ArgumentParser:
    """``--field-name`` for every field: booleans as ``--x/--no-x``, ``env_kwargs`` as JSON,
    numbers typed by their annotation, everything else a string."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    for spec in dataclasses.fields(args_type):
        flag = "--" + spec.name.replace("_", "-")
        default: Any = spec.default if spec.default is not dataclasses.MISSING else {}
        if spec.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif spec.name == "env_kwargs":
            parser.add_argument(flag, type=json.loads, default=default, help="JSON object")
        else:
            kind = {"int": int, "float": float}.get(str(spec.type), str)
            parser.add_argument(flag, type=kind, default=default)
    return parser
