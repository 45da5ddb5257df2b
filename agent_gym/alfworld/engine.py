"""One ALFWorld game running on textworld's PDDL backend, with in-process snapshots.

ALFWorld's games are PDDL problems played by textworld's ``PddlEnv``: fast-downward's
library (``libdownward``) holds the planning state and textworld keeps a Python table of
the true facts, from which the grammar writes every observation. Neither can be pickled
(ctypes), but libdownward registers every state it reaches and can jump back to any of
them by id. A ``Snapshot`` is that id plus the textworld game state (its fact list,
applicable actions and their operator table); restoring one costs a few milliseconds,
where reloading a game and replaying its actions costs seconds. Snapshots stay valid while
the same game stays loaded in the same ``Engine`` (``generation`` tells).

textworld's grammar parser and fast-downward's translator keep module-level state, so two
engines used from two threads corrupt each other; every engine call holds one process-wide
lock (the work is pure Python under the GIL, so nothing is lost). Processes are
independent: each engine runs on its own copy of libdownward. Copies are never unloaded
(``dlclose`` of one crashes the process later, at exit or at the next load): a closed
engine frees its planning task and leaves the copy for the next engine.
"""

from __future__ import annotations

import multiprocessing
import sys
import threading
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

try:
    import fast_downward
    import textworld
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
    from textworld.envs.pddl import PddlEnv
except ModuleNotFoundError as err:  # the engine is an optional extra
    raise ModuleNotFoundError(
        f"ALFWorld-v0 runs on ALFWorld's engine, and {err.name!r} is not installed: "
        "pip install 'agent-gym[alfworld]'",
        name=err.name,
    ) from err

_LOCK = threading.RLock()
_SPARE_LIBRARIES: list[Any] = []  # libdownward copies of closed engines, ready for reuse


@contextmanager
def _exclusive() -> Iterator[None]:
    """Hold the engines' lock and give back ``sys.argv``, which fast-downward's
    translator overwrites."""
    with _LOCK:
        argv = list(sys.argv)
        try:
            yield
        finally:
            sys.argv[:] = argv


@dataclass(frozen=True)
class Frame:
    """What the game says after a reset or an action."""

    feedback: str
    admissible: tuple[str, ...]
    won: bool


@dataclass(frozen=True)
class Snapshot:
    """A reached game state; only ``Engine.restore`` of the same engine and generation
    can use it."""

    generation: int
    state_id: int
    game_state: Any
    operators: Mapping[int, Any]
    moves: int


class _PddlEnv(PddlEnv):
    """textworld's ``PddlEnv`` on a given libdownward copy instead of a fresh one."""

    def __init__(self, infos: textworld.EnvInfos, library: Any) -> None:
        textworld.Environment.__init__(self, infos)
        self.downward_lib = library


class Engine:
    """A textworld ``PddlEnv`` wrapped as ALFWorld wraps it (``AlfredDemangler`` names the
    objects "apple 1", ``AlfredInfos``), loaded with one game at a time."""

    def __init__(self) -> None:
        infos = textworld.EnvInfos(admissible_commands=True, won=True)
        with _exclusive():
            library = _SPARE_LIBRARIES.pop() if _SPARE_LIBRARIES else fast_downward.load_lib()
            self._env = AlfredInfos(AlfredDemangler(_PddlEnv(infos, library)))
        self._core: PddlEnv = self._env.unwrapped
        self.generation = 0
        self._closed = False
        self._frame: Frame | None = None

    def load(self, game: Mapping[str, Any]) -> Frame:
        """Load a game (a ``game.tw-pddl`` mapping with domain and grammar) and reset it."""
        self._require_open()
        with _exclusive():
            self._env.load(dict(game))
            state = self._env.reset()
        self.generation += 1
        self._frame = self._read(state)
        return self._frame

    @property
    def frame(self) -> Frame:
        if self._frame is None:
            self._require_open()
            raise RuntimeError("no game is loaded")
        return self._frame

    def step(self, command: str) -> Frame:
        """Apply one admissible command; anything else is the caller's error."""
        if command not in self.frame.admissible:
            raise ValueError(f"{command!r} is not admissible in this state")
        with _exclusive():
            state, _, _ = self._env.step(command)
        self._frame = self._read(state)
        return self._frame

    def names(self) -> dict[str, str]:
        """PDDL object id (lower case, as fast-downward spells it) -> name shown to players."""
        return {key: info.name for key, info in self._core._entity_infos.items()}

    def plan(self) -> list[str]:
        """Commands that win from the current state, found by fast-downward's planner;
        empty when it finds none. Its blind search can run for many minutes on a large
        kitchen: see ``plan_walkthrough`` for a bounded call."""
        with _exclusive():
            return list(self._core._pddl_state.replan(self._core._entity_infos))

    def snapshot(self) -> Snapshot:
        self._require_open()
        core = self._core
        return Snapshot(
            generation=self.generation,
            state_id=int(core.downward_lib.get_state_id()),
            game_state=core.state,
            operators=core._pddl_state._operators,
            moves=core._moves,
        )

    def restore(self, snapshot: Snapshot) -> Frame:
        """Jump back to a snapshot taken since the current game was loaded."""
        self._require_open()
        if snapshot.generation != self.generation:
            raise ValueError("the snapshot belongs to a game this engine no longer holds")
        with _exclusive():
            self._jump(snapshot)
        self._frame = self._read(snapshot.game_state)
        return self._frame

    def _jump(self, snapshot: Snapshot) -> None:
        core = self._core
        core.downward_lib.set_state_id(snapshot.state_id)
        facts = core._pddl_state
        # Rebuild textworld's fact tables from the fact list the game state recorded; the
        # grammar sorts facts before listing them, so contents fix the text.
        facts._facts = defaultdict(set)
        facts._vars_by_name = {}
        facts._vars_by_type = defaultdict(set)
        facts._var_counts = Counter()
        facts.add_facts(snapshot.game_state["_facts"])
        facts._operators = snapshot.operators
        core.state = snapshot.game_state
        core._moves = snapshot.moves
        core._last_action = None

    def _require_open(self) -> None:
        if self._closed:  # its libdownward is unloaded: any call would crash the process
            raise RuntimeError("the engine is closed")

    def close(self) -> None:
        """Free the game and hand the libdownward copy to the next engine; the engine is
        dead afterwards."""
        if self._closed:
            return
        with _exclusive():
            self._env.close()
            self._core.downward_lib.cleanup()
            _SPARE_LIBRARIES.append(self._core.downward_lib)
        self._closed = True
        self._frame = None

    @staticmethod
    def _read(state: Any) -> Frame:
        return Frame(
            feedback=str(state["feedback"]),
            admissible=tuple(state["admissible_commands"]),
            won=bool(state["won"]),
        )


def plan_walkthrough(game: Mapping[str, Any], timeout: float) -> list[str] | None:
    """Winning commands from a game's start, planned in a child process that is killed
    after ``timeout`` seconds; None when no plan came in time.

    The child is spawned (a fork could inherit the engines' lock held by another thread),
    so a script that triggers this needs the usual ``if __name__ == "__main__"`` guard.
    """
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_plan_in_child, args=(dict(game), sender), daemon=True)
    child.start()
    sender.close()
    try:
        return (receiver.recv() or None) if receiver.poll(timeout) else None
    except EOFError:  # the child died
        return None
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        receiver.close()


def _plan_in_child(game: dict[str, Any], sender: Any) -> None:
    engine = Engine()
    engine.load(game)
    sender.send(engine.plan())
    sender.close()
