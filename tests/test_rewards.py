import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from agent_gym.rewards import (
    MathVerifier,
    exact_match,
    extract_boxed,
    extract_gsm8k_answer,
    f1_score,
    math_equal,
    normalize_answer,
    score_math,
)

# A power tower that sympy tries to evaluate for far longer than any deadline (a long
# number to the power of another no longer does: today's math-verify refuses it at once).
HANGS_MATH_VERIFY = "9^{9^{9^{9}}}"


def test_extract_boxed_takes_the_last_and_keeps_nested_braces() -> None:
    assert extract_boxed("first \\boxed{1}, then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert extract_boxed("\\boxed{x^{2} + {y}}") == "x^{2} + {y}"
    assert extract_boxed("\\boxed{3} then an unclosed \\boxed{4") == "3"
    assert extract_boxed("no box") is None
    assert extract_boxed("\\boxed{\\boxed{1}}") == "1"  # the last to open wins, as before
    assert extract_boxed("} \\boxed{a}} {\\boxed{b") == "a"  # stray braces change nothing


def test_extract_boxed_is_linear_in_unclosed_boxes() -> None:
    """Each unclosed ``\\boxed{`` used to rescan the rest of the text: 98 KB took 76 s."""
    action = "\\boxed{" * 5_000  # 35 KB: about 10 s when quadratic
    start = time.perf_counter()
    assert extract_boxed(action) is None
    assert extract_boxed("\\boxed{7}" + action) == "7"
    assert time.perf_counter() - start < 0.5


def test_extract_gsm8k_answer() -> None:
    assert extract_gsm8k_answer("3 + 4 = 7 apples.\n#### 1,007") == "1007"
    with pytest.raises(ValueError, match="####"):
        extract_gsm8k_answer("no marker")


@pytest.mark.parametrize(
    ("prediction", "reference", "equal"),
    [
        ("0.5", "\\frac{1}{2}", True),
        ("\\frac{3}{4}", "0.75", True),
        ("1,000", "1000", True),
        ("2\\sqrt{2}", "\\sqrt{8}", True),
        ("73", "72", False),
        ("x^{", "2", False),  # malformed LaTeX is simply not equal
        ("\\sqrt{", "2", False),
    ],
)
def test_math_equivalence(prediction: str, reference: str, equal: bool) -> None:
    assert math_equal(prediction, reference) is equal


INTEGER_PAIRS = [("42", "42"), ("042", "42"), ("-0", "0"), ("42", "43"), ("-5", "5"),
                 (" 18", "18"), ("123456789", "123456788"), ("10" * 20, "10" * 20)]


def test_integers_are_compared_without_the_helper_as_math_verify_compares_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    verifier = MathVerifier()
    try:
        expected = [verifier.equal(prediction, reference) for prediction, reference in INTEGER_PAIRS]
    finally:
        verifier.close()

    def no_helper(self: MathVerifier, prediction: str, reference: str) -> bool:
        raise AssertionError(f"{prediction!r} vs {reference!r} went to a helper process")

    monkeypatch.setattr(MathVerifier, "equal", no_helper)
    assert [math_equal(p, r) for p, r in INTEGER_PAIRS] == expected


def test_score_math_without_an_answer() -> None:
    assert score_math("I think it is 4", "4").correct is False
    assert score_math("so \\boxed{4}", "4").correct is True


def test_a_hanging_input_returns_within_the_timeout_from_a_worker_thread() -> None:
    verifier = MathVerifier(timeout=1.0)
    verifier.equal("1", "1")  # warm the helper so only the hard case is timed
    results: list[tuple[bool, float]] = []

    def grade() -> None:
        started = time.monotonic()
        results.append((verifier.equal(HANGS_MATH_VERIFY, "1"), time.monotonic() - started))

    worker = threading.Thread(target=grade)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive()
    equal, elapsed = results[0]
    assert equal is False and elapsed < 10
    assert verifier.equal("2", "2") is True  # the killed helper was replaced
    verifier.close()


def test_many_threads_share_the_verifier() -> None:
    outcomes: dict[int, bool] = {}

    def grade(n: int) -> None:
        outcomes[n] = math_equal(str(n), f"{n}.0")

    threads = [threading.Thread(target=grade, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcomes == {n: True for n in range(8)}


def test_qa_normalisation_exact_match_and_f1() -> None:
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert exact_match("the eiffel tower", ["Eiffel Tower", "tour eiffel"])
    assert not exact_match("eiffel", ["Eiffel Tower"])
    assert f1_score("eiffel", ["Eiffel Tower"]) == pytest.approx(2 / 3)
    assert f1_score("paris", ["Eiffel Tower"]) == 0.0
    assert f1_score("", [""]) == 1.0


def test_a_forked_child_uses_its_own_helpers_and_leaves_the_parents_alone() -> None:
    # Async vector workers are forked after the parent graded: Popen sees the inherited
    # helpers as not its children (ECHILD), so the child neither reuses nor kills them.
    verifier = MathVerifier(timeout=5.0)
    assert verifier.equal("1/2", "0.5")
    parent_helper = verifier._idle[0][0]
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the child closes (as its atexit would), grades and reports
        try:
            verifier.close()
            ok = verifier.equal("3", "3") and verifier._idle[0][0] is not parent_helper
            verifier.close()
            os.write(write_end, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    assert os.read(read_end, 1) == b"1"
    assert parent_helper.poll() is None  # the child did not kill the parent's helper
    assert verifier.equal("2", "2.0") and verifier._idle[0][0] is parent_helper
    verifier.close()


# ---------------------------------------------------------------------- the helper pool
needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")


def running(pid: int) -> tuple[str, int] | None:
    """A process's state letter and parent, None once it has exited (a zombie included:
    an orphan's is reaped only if this machine's init reaps)."""
    try:
        state, parent = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:2]
    except (OSError, ValueError):
        return None
    return None if state in "ZX" else (state, int(parent))


def helpers_of(pid: int) -> set[int]:
    """The math-verify helpers ``pid`` started that are running now, from /proc."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        process = running(int(entry.name))
        try:
            command = (entry / "cmdline").read_bytes()
        except OSError:  # gone meanwhile
            continue
        if process is not None and process[1] == pid and b"math_verify" in command:
            found.add(int(entry.name))
    return found


@needs_proc
def test_forty_concurrent_gradings_share_a_bounded_pool_and_idle_helpers_are_stopped() -> None:
    verifier = MathVerifier(timeout=5.0, max_helpers=3, idle_s=1.0)
    others = helpers_of(os.getpid())  # the shared verifier's, from other tests
    peak, grading = 0, threading.Event()
    grading.set()

    def watch() -> None:
        nonlocal peak
        while grading.is_set():
            peak = max(peak, len(helpers_of(os.getpid()) - others))
            time.sleep(0.01)

    outcomes: list[bool] = []
    threads = [threading.Thread(target=lambda: outcomes.append(verifier.equal("0.5", "1/2")))
               for _ in range(40)]
    watcher = threading.Thread(target=watch)
    watcher.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    grading.clear()
    watcher.join()
    assert outcomes == [True] * 40
    assert 1 <= peak <= 3
    deadline = time.monotonic() + 15
    while helpers_of(os.getpid()) - others and time.monotonic() < deadline:
        time.sleep(0.1)
    assert helpers_of(os.getpid()) - others == set(), "idle helpers outlived their idle timeout"
    assert verifier.equal("2", "2.0")  # a helper starts again when needed
    verifier.close()


def test_a_call_that_finds_every_helper_busy_past_its_wait_is_an_error_not_a_new_helper(
) -> None:
    verifier = MathVerifier(timeout=3.0, max_helpers=1, wait_s=0.5)
    verifier.equal("1", "1")
    hung = threading.Thread(target=verifier.equal, args=(HANGS_MATH_VERIFY, "1"))
    hung.start()
    time.sleep(0.2)
    with pytest.raises(RuntimeError, match=r"all 1 math-verify helpers stayed busy for 0\.5 s"):
        verifier.equal("2", "2")
    hung.join(timeout=30)  # its deadline ends the busy helper
    verifier.close()
    with pytest.raises(ValueError, match="at least one helper"):
        MathVerifier(max_helpers=0)


@needs_proc
def test_a_helper_stops_computing_soon_after_a_killed_parent_would_have_stopped_it() -> None:
    grader = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import threading, time
        from agent_gym.rewards import MathVerifier
        verifier = MathVerifier(timeout=2.0)
        verifier.equal("1", "1")
        threading.Thread(target=verifier.equal, args=({HANGS_MATH_VERIFY!r}, "1")).start()
        print("grading", flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert grader.stdout is not None and grader.stdout.readline() == "grading\n"
        time.sleep(0.5)
        helpers = helpers_of(grader.pid)
        assert len(helpers) == 1
    finally:
        os.kill(grader.pid, signal.SIGKILL)
        grader.wait()
    deadline = time.monotonic() + 15  # 2 s of CPU and a second more, on a busy machine
    while any(running(pid) for pid in helpers) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [pid for pid in helpers if running(pid)]
    for pid in alive:  # the old helper computed on for no one: end it here
        os.kill(pid, signal.SIGKILL)
    assert alive == [], "a helper went on computing after its parent was killed"
