"""Reading what came from outside the process: JSON of bounded depth, finite numbers.

Saved states, run directories and requests are written by someone else -- another version,
a crashed run, a hostile client. Python's JSON parser recurses, so a document nested a few
thousand levels deep raises ``RecursionError`` (or exhausts the stack of whatever walks it
next), and it accepts ``NaN`` and ``Infinity``, which then poison every sum and comparison
downstream. Every reader of untrusted JSON goes through ``loads`` here, so both are refused
in one place, in time linear in the text, with an error a caller can turn into one line.
"""

from __future__ import annotations

import json
import math
import numbers
from typing import Any

MAX_JSON_DEPTH = 64  # far deeper than anything agent_gym writes (states, episodes: <= 8)


class UntrustedJSONError(ValueError):
    """A document from outside is not JSON this code accepts: malformed, nested too deep,
    or holding a non-finite number."""


def _refuse_constant(name: str) -> float:
    raise UntrustedJSONError(f"holds the non-finite number {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses as infinity
        raise UntrustedJSONError(f"holds the number {text[:40]}, too large to be finite")
    return value


def loads(text: str | bytes, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` for untrusted text: ``UntrustedJSONError`` (a ``ValueError``) when it is
    not JSON, is nested deeper than ``max_depth`` arrays and objects, or holds NaN/Infinity."""
    try:
        if isinstance(text, bytes):  # UTF-8 only: json.loads would guess UTF-16 or -32 too
            text = text.decode("utf-8")
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise UntrustedJSONError(f"is nested deeper than {max_depth} levels") from None
    except UnicodeDecodeError as err:
        raise UntrustedJSONError(f"is not UTF-8: {err.reason} at byte {err.start}") from None
    except json.JSONDecodeError as err:
        raise UntrustedJSONError(f"is not valid JSON: {err}") from None
    except UntrustedJSONError:
        raise
    except ValueError as err:  # an integer of more digits than int() converts (4,300)
        raise UntrustedJSONError(f"holds a number this reader refuses: {err}") from None
    check_depth(value, max_depth)
    return value


def check_depth(value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Refuse a parsed JSON value nested deeper than ``max_depth``; iterative, so a value
    deep enough to break a recursive walker is refused rather than walked."""
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            raise UntrustedJSONError(f"is nested deeper than {max_depth} levels")
        pending.extend((child, depth + 1) for child in children)


def finite(value: Any, name: str) -> float:
    """``value`` as a finite float, or ``ValueError`` naming ``name``: a setting or a recorded
    figure that is NaN or infinite would never end an episode or would poison a mean."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return number
