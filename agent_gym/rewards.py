"""Reward functions shared by the envs: math answers and QA answers.

math-verify guards its sympy work with ``signal.alarm``, which only works on the main
thread; off it, parsing either raises or runs unbounded (pathological inputs were measured
at 12 s to over 27 s). Rollouts call rewards from threads and from vector-env workers, so
here every verification runs in a long-lived helper *process* that the caller can abandon
and kill when the deadline passes. The helper is a plain subprocess, not
``multiprocessing``: Gymnasium's async vector workers are daemonic and may not fork
multiprocessing children.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import string
import subprocess
import sys
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import IO

DEFAULT_MATH_TIMEOUT = 5.0
_STARTUP_TIMEOUT = 60.0
_BOX = "\\boxed"
_BRACE_RE = re.compile(r"[{}]")


# ---------------------------------------------------------------------- answer extraction
def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text``, nested braces included.

    "Last" is the closed box that opens latest; an unclosed one is skipped, so an earlier
    complete box can still be the answer. One pass matches every brace with a stack:
    rescanning the tail from each ``\\boxed{`` was quadratic (a policy stuck repeating an
    unclosed ``\\boxed{`` made one 98 KB step take 76 s).
    """
    open_braces: list[int] = []  # positions of the "{" still open
    best: tuple[int, int] | None = None  # where the answer's "{" and "}" are
    for brace in _BRACE_RE.finditer(text):
        at = brace.start()
        if brace.group() == "{":
            open_braces.append(at)
        elif open_braces:
            opened = open_braces.pop()
            if text.endswith(_BOX, 0, opened) and (best is None or opened > best[0]):
                best = (opened, at)
    return None if best is None else text[best[0] + 1 : best[1]].strip()


def extract_gsm8k_answer(solution: str) -> str:
    """The final number of a GSM8K reference solution (after ``####``), commas removed."""
    if "####" not in solution:
        raise ValueError("a GSM8K solution ends with '#### <answer>'; none found")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


# ---------------------------------------------------------------------- math equivalence
DEFAULT_HELPER_IDLE_S = 30.0
DEFAULT_HELPER_WAIT_S = 60.0


def default_max_helpers() -> int:
    """One helper per core this process may run on, at most eight: grading is CPU work, so
    more helpers than cores only queue inside the kernel, and each holds about 50 MB."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, 8))


class MathVerifier:
    """math-verify equivalence with a hard per-call deadline, safe from any thread.

    Keeps warm helper processes (importing sympy costs about a second), at most
    ``max_helpers`` of them: a call that finds them all busy waits up to ``wait_s`` for one
    instead of starting another, as it once did (40 concurrent gradings on a server left 40
    helpers and 2 GB behind). A helper idle for ``idle_s`` is stopped, so a server whose
    sessions ended returns to its idle memory. A helper that misses the deadline is killed
    and replaced, and the answer counts as not equal.
    """

    def __init__(self, timeout: float = DEFAULT_MATH_TIMEOUT, max_helpers: int | None = None,
                 idle_s: float = DEFAULT_HELPER_IDLE_S,
                 wait_s: float = DEFAULT_HELPER_WAIT_S) -> None:
        if max_helpers is not None and max_helpers < 1:
            raise ValueError(f"a math verifier needs at least one helper, not {max_helpers}")
        self.timeout = timeout
        self.max_helpers = max_helpers or default_max_helpers()
        self.idle_s = idle_s
        self.wait_s = wait_s
        self._start_afresh()
        _all_verifiers.add(self)

    def _start_afresh(self) -> None:
        """No helpers: at construction, and in a forked child, whose inherited helpers are
        its parent's to use and to stop."""
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._idle: list[tuple[subprocess.Popen[str], float]] = []  # (helper, idle since)
        self._helpers = 0  # running, idle or busy: what the bound counts
        self._reaper: threading.Thread | None = None

    def equal(self, prediction: str, reference: str) -> bool:
        worker = self._checkout()
        request = json.dumps({"prediction": prediction, "reference": reference,
                              "cpu_s": self.timeout})
        line = None
        try:
            assert worker.stdin is not None and worker.stdout is not None
            worker.stdin.write(request + "\n")
            worker.stdin.flush()
            line = _readline_before(worker.stdout, time.monotonic() + self.timeout)
        except (OSError, TimeoutError):
            return False
        finally:  # a helper that failed, or whose answer was not read, is not reused
            if line is None:
                self._retire([worker])
            else:
                self._checkin(worker)
        return bool(json.loads(line).get("equal", False))

    def close(self) -> None:
        """Stop the idle helpers now; a busy one is stopped once it has been idle ``idle_s``."""
        with self._lock:
            workers, self._idle = [worker for worker, _ in self._idle], []
        self._retire(workers)

    def _checkout(self) -> subprocess.Popen[str]:
        deadline = time.monotonic() + self.wait_s
        with self._lock:
            while True:
                while self._idle:
                    worker, _ = self._idle.pop()  # the latest idle: the oldest are reaped
                    if worker.poll() is None:
                        return worker
                    self._helpers -= 1
                if self._helpers < self.max_helpers:
                    self._helpers += 1
                    break
                if not self._freed.wait(deadline - time.monotonic()):
                    raise RuntimeError(f"all {self.max_helpers} math-verify helpers stayed "
                                       f"busy for {self.wait_s:g} s")
        try:
            return _start_helper()
        except BaseException:
            self._free(1)
            raise

    def _checkin(self, worker: subprocess.Popen[str]) -> None:
        with self._lock:
            self._idle.append((worker, time.monotonic()))
            self._freed.notify()
            if self._reaper is None:
                self._reaper = threading.Thread(target=self._reap, daemon=True,
                                                name="math-verify-reaper")
                self._reaper.start()

    def _retire(self, workers: list[subprocess.Popen[str]]) -> None:
        for worker in workers:
            _kill(worker)
        self._free(len(workers))

    def _free(self, places: int) -> None:
        """``places`` helpers fewer: waiting calls may start their own."""
        with self._lock:
            self._helpers -= places
            self._freed.notify(places)

    def _reap(self) -> None:
        """Stop helpers idle for ``idle_s``, until none is idle (a later check-in starts
        another reaper)."""
        while True:
            with self._lock:
                cutoff = time.monotonic() - self.idle_s
                expired = [worker for worker, since in self._idle if since <= cutoff]
                self._idle = [(worker, since) for worker, since in self._idle if since > cutoff]
                if not self._idle:
                    self._reaper = None
                wake = self._idle[0][1] + self.idle_s if self._idle else None
            if expired:
                self._retire(expired)
            if wake is None:
                return
            time.sleep(max(wake - time.monotonic(), 0.01))


_all_verifiers: weakref.WeakSet[MathVerifier] = weakref.WeakSet()


def _forget_inherited_helpers() -> None:
    for verifier in list(_all_verifiers):
        verifier._start_afresh()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_inherited_helpers)


def _start_helper() -> subprocess.Popen[str]:
    worker = subprocess.Popen(
        [sys.executable, "-c", _WORKER_SOURCE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    assert worker.stdout is not None
    try:  # the helper says "ready" once math-verify is imported
        _readline_before(worker.stdout, time.monotonic() + _STARTUP_TIMEOUT)
    except (OSError, TimeoutError) as err:
        _kill(worker)
        raise RuntimeError("the math-verify helper process failed to start") from err
    return worker


def _readline_before(stream: IO[str], deadline: float) -> str:
    ready, _, _ = select.select([stream.fileno()], [], [], max(deadline - time.monotonic(), 0.0))
    if not ready:
        raise TimeoutError
    line = stream.readline()
    if not line:
        raise OSError("math-verify helper exited")
    return line


def _kill(worker: subprocess.Popen[str]) -> None:
    worker.kill()
    worker.wait()
    for stream in (worker.stdin, worker.stdout):
        if stream is not None:
            stream.close()


# The helper runs math-verify on its own main thread with math-verify's alarms disabled:
# the parent enforces the deadline by killing the helper. Should the parent die first
# (SIGKILL), an idle helper reads the end of its input and exits; a busy one may be deep in
# one C call of sympy's (9^{9^{9^{9}}} holds the GIL for minutes), where no thread of its
# own runs, so each request also caps its CPU time (RLIMIT_CPU: the kernel ends it) at the
# deadline and a second more, and an orphan stops computing soon after it.
_WORKER_SOURCE = """
import json, math, resource, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
_, hard = resource.getrlimit(resource.RLIMIT_CPU)
def allow_cpu(seconds):
    used = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(used.ru_utime + used.ru_stime + seconds) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard < 0 else min(soft, hard), hard))
from math_verify import parse, verify
print("ready", flush=True)
for line in sys.stdin:
    request = json.loads(line)
    allow_cpu(request["cpu_s"])
    try:
        gold = parse("\\\\boxed{" + request["reference"] + "}", parsing_timeout=None)
        pred = parse("\\\\boxed{" + request["prediction"] + "}", parsing_timeout=None)
        equal = bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=None)
    except Exception:
        equal = False
    sys.stdout.write(json.dumps({"equal": bool(equal)}) + "\\n")
    sys.stdout.flush()
"""

_verifiers: dict[float, MathVerifier] = {}
_verifiers_lock = threading.Lock()
# Bounded: int() refuses strings of over 4300 digits, and no answer is that long.
_INTEGER_RE = re.compile(r"\s*-?\d{1,64}\s*")


def math_equal(prediction: str, reference: str, timeout: float = DEFAULT_MATH_TIMEOUT) -> bool:
    """Whether two math answers are equivalent (``1/2`` == ``0.5`` == ``\\frac{1}{2}``).

    Two integers (every GSM8K answer) are compared here, as math-verify compares them
    (``042`` == ``42``, ``-0`` == ``0``), without a round trip to a helper process: that
    was a sixth of eval's time per GSM8K episode. Anything else goes to one shared
    ``MathVerifier`` per timeout, so its helper processes stay warm.
    """
    if _INTEGER_RE.fullmatch(prediction) and _INTEGER_RE.fullmatch(reference):
        return int(prediction) == int(reference)
    with _verifiers_lock:
        verifier = _verifiers.get(timeout)
        if verifier is None:
            verifier = _verifiers[timeout] = MathVerifier(timeout)
            atexit.register(verifier.close)
    return verifier.equal(prediction, reference)


@dataclass(frozen=True)
class MathScore:
    """How a response's final answer compares with the reference."""

    answer: str | None  # the extracted \\boxed{} content; None when there is none
    correct: bool


def score_math(response: str, reference: str, timeout: float = DEFAULT_MATH_TIMEOUT) -> MathScore:
    """Grade the last ``\\boxed{}`` answer of ``response`` against ``reference``."""
    answer = extract_boxed(response)
    if not answer:
        return MathScore(answer, False)
    return MathScore(answer, math_equal(answer, reference, timeout))


# ---------------------------------------------------------------------- QA answers
_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD / Search-R1 normalisation: lower case, no punctuation, articles or extra spaces."""
    text = _ARTICLES_RE.sub(" ", text.lower().translate(_PUNCTUATION))
    return " ".join(text.split())


def exact_match(prediction: str, golds: list[str]) -> bool:
    normalized = normalize_answer(prediction)
    return any(normalized == normalize_answer(gold) for gold in golds)


def f1_score(prediction: str, golds: list[str]) -> float:
    """Best token-overlap F1 of ``prediction`` against any gold answer."""
    predicted = normalize_answer(prediction).split()
    best = 0.0
    for gold in golds:
        reference = normalize_answer(gold).split()
        overlap = sum((Counter(predicted) & Counter(reference)).values())
        if overlap:
            precision, recall = overlap / len(predicted), overlap / len(reference)
            best = max(best, 2 * precision * recall / (precision + recall))
        elif predicted == reference:
            best = max(best, 1.0)
    return best
