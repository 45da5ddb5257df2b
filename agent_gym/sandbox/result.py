"""What a call produced, and how it is read back from the capped output files."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from agent_gym.sandbox.config import Limits
from agent_gym.sandbox.process import read_tail

Status = Literal["ok", "error", "timeout", "crashed"]
STATE_LOST = (
    "The interpreter was restarted: all variables, functions and imports from earlier "
    "cells are lost."
)


@dataclass(frozen=True)
class ExecResult:
    """What one call produced.

    ``status``: ``ok``; ``error`` (the cell raised; the interpreter lives on); ``timeout``
    (stopped at the wall-time limit); ``crashed`` (the interpreter died: CPU limit, a
    signal, ``os._exit``). ``error`` names the exception or the cause of death. Output is
    the tail of each stream; ``*_omitted`` counts the bytes dropped before it.
    ``observation()`` is deterministic (no timings), so replays compare equal.
    """

    status: Status
    stdout: str = ""
    stderr: str = ""
    error: str | None = None
    stdout_omitted: int = 0
    stderr_omitted: int = 0
    output_capped: bool = False
    timeout: float = 0.0
    duration: float = 0.0
    state_lost: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def observation(self) -> str:
        """The text a model sees: stdout, then stderr, then what went wrong."""
        parts: list[str] = []
        for text, omitted in (
            (self.stdout, self.stdout_omitted),
            (self.stderr, self.stderr_omitted),
        ):
            if omitted:
                parts.append(f"[... {omitted} earlier bytes of output omitted ...]\n")
            if text:
                parts.append(text if text.endswith("\n") else text + "\n")
        notes: list[str] = []
        if self.output_capped:
            notes.append("[output stopped: the output size limit was reached]")
        if self.status == "timeout":
            notes.append(
                f"TimeoutError: the code ran longer than {self.timeout:g} s and was stopped."
            )
        elif self.status == "crashed":
            notes.append(f"The Python interpreter died: {self.error}.")
        if self.state_lost:
            notes.append(STATE_LOST)
        text = "".join(parts) + "\n".join(notes)
        return text.rstrip("\n") if text.strip() else "(no output)"


def collect(
    status: Status,
    error: str | None,
    files: tuple[int, int],
    limits: Limits,
    timeout: float,
    duration: float,
) -> ExecResult:
    """The result of a call whose stdout and stderr went to ``files``."""
    stdout, stdout_omitted = read_tail(files[0], limits)
    stderr, stderr_omitted = read_tail(files[1], limits)
    capped = (
        max(stdout_omitted + len(stdout.encode()), stderr_omitted + len(stderr.encode()))
        >= limits.file_bytes
    )
    return ExecResult(
        status=status,
        stdout=stdout,
        stderr=stderr,
        error=error,
        stdout_omitted=stdout_omitted,
        stderr_omitted=stderr_omitted,
        output_capped=capped,
        timeout=timeout,
        duration=duration,
    )
