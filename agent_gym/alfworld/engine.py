"""One ALFWorld game running on textworld's PDDL backend, with in-process snapshots.

ALFWorld's games are PDDL problems played by textworld's ``PddlEnv``: fast-downward's
library (``libdownward``) holds the planning state and textworld keeps a Python table of
the true facts, from which the grammar writes every observation. Neither can be pickled
(ctypes), but libdownward registers every state it reaches and can jump back to any of
them by id. A ``Snapshot`` is that id plus the textworld game state (its fact list,
applicable actions and their operator table); restoring one costs a few milliseconds,
where reloading a game and replaying its actions costs seconds. Snapshots stay valid while
the same game stays loaded in the same ``Engine`` (``generation`` tells).

Where a load's time goes (largest kitchen, 2 loaded cores): textworld translates the PDDL
with fast-downward's translator four times (twice in ``load``, twice again in ``reset``,
~250 ms each), parses the grammar with tatsu (~90 ms) and writes the admissible commands
(~150 ms, as every step does). An engine here translates a game once per host: the
translator's output (SAS text) is kept by content digest in this process and in the
host store (``agent_gym.hoststore``), the parsed grammar per process, and the start's
frame (intro and admissible commands) likewise; everything else is rebuilt from those in
milliseconds. What a step costs is textworld writing the text (feedback and every
admissible command, ~100 ms); moving the planner's state costs well under a millisecond.
So ``redo`` moves an engine through the operators other steps applied (by name: ids may
differ between translations) without writing any text, and the textworld view of the
reached state -- its applicable actions and their commands -- is built only when a step
needs it (and then checked against the frame it was given: a frame the engine does not
reproduce is an error, never silently kept).

textworld's grammar parser and fast-downward's translator keep module-level state, so two
engines used from two threads corrupt each other; every engine call holds one process-wide
lock (the work is pure Python under the GIL, so nothing is lost). Processes are
independent: each engine runs on its own copy of libdownward. Copies are never unloaded
(``dlclose`` of one crashes the process later, at exit or at the next load): a closed
engine frees its planning task and leaves the copy for the next engine.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import sys
import threading
import zlib
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from agent_gym import untrusted
from agent_gym.extras import install_hint

try:
    import fast_downward
    import textworld
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
    from fast_downward.translate import pddl as fd_pddl
    from textworld.core import GameState
    from textworld.envs.pddl import PddlEnv
    from textworld.envs.pddl import logic as pddl_logic
    from textworld.logic import Proposition, Type, Variable
except ModuleNotFoundError as err:  # the engine is an optional extra
    raise ModuleNotFoundError(
        f"ALFWorld-v0 runs on ALFWorld's engine, and {err.name!r} is not installed: "
        + install_hint("alfworld"),
        name=err.name,
    ) from err

from agent_gym.hoststore import HostStore, code_fingerprint, deflate, host_store, inflate

_LOCK = threading.RLock()
_SPARE_LIBRARIES: list[Any] = []  # libdownward copies of closed engines, ready for reuse
_KEPT_GAMES = 32  # parsed grammars and translations kept per process


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


@dataclass
class _View:
    """textworld's view of one reached state (its game state: applicable actions and
    their commands; the operator table they index), built when a step first needs it and
    then shared by every snapshot of that state."""

    game_state: Any = None
    operators: Mapping[int, Any] | None = None


@dataclass(frozen=True)
class Snapshot:
    """A reached game state; only ``Engine.restore`` of the same engine and generation
    can use it."""

    generation: int
    state_id: int
    facts: tuple[Any, ...]
    frame: Frame
    moves: int
    view: _View = field(compare=False)


@dataclass(frozen=True)
class _Translation:
    """What fast-downward's translator made of a game: its parsed task and SAS texts."""

    task: Any
    sas: str
    sas_replan: str


_LOGICS: OrderedDict[str, Any] = OrderedDict()  # grammar digest -> textworld GameLogic
_TRANSLATIONS: OrderedDict[str, _Translation] = OrderedDict()  # game digest -> translation


def _stored_json(entry: bytes | None) -> Any:
    """A host-store entry inflated (bounded) and parsed, or None when it is missing or does
    not read: the caller then computes it again, as for a new game."""
    if entry is None:
        return None
    try:
        return untrusted.loads(inflate(entry))
    except (zlib.error, ValueError):
        return None


def game_key(game: Mapping[str, Any]) -> str:
    """The digest of a game's content (domain, problem, grammar) and of the code that
    plays it: what the caches of translations and start frames are keyed by."""
    text = json.dumps([code_fingerprint(), game.get("pddl_domain"), game.get("pddl_problem"),
                       game.get("grammar")])
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _kept(cache: OrderedDict[str, Any], key: str, value: Any) -> Any:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > _KEPT_GAMES:
        cache.popitem(last=False)
    return value


class _PddlEnv(PddlEnv):
    """textworld's ``PddlEnv`` on a given libdownward copy instead of a fresh one, loading
    games from the caches (see the module docstring) instead of translating each time."""

    def __init__(self, infos: textworld.EnvInfos, library: Any, store: HostStore) -> None:
        textworld.Environment.__init__(self, infos)
        self.downward_lib = library
        self._store = store
        self.key = ""

    def load(self, data: Mapping[str, Any]) -> None:
        """``PddlEnv.load`` with the grammar parsed and the game translated at most once
        per process (the translation once per host, with a store file)."""
        self._game_file = None
        self._game_data = data
        self.walkthrough = data.get("walkthrough", None)
        self.key = game_key(data)
        self._logic = self._grammar(data["pddl_domain"], data["grammar"])
        self._translation = self._translate(data)
        self._pddl_state = self._start_state()
        self._entity_infos = self._get_entity_infos()

    @staticmethod
    def _grammar(domain: str, grammar: str) -> Any:
        key = hashlib.sha256(json.dumps([domain, grammar]).encode("utf-8", "surrogatepass"))
        digest = key.hexdigest()
        if digest in _LOGICS:
            _LOGICS.move_to_end(digest)
            return _LOGICS[digest]
        return _kept(_LOGICS, digest, pddl_logic.GameLogic(domain=domain, grammar=grammar))

    def _translate(self, data: Mapping[str, Any]) -> _Translation:
        stored = self._store.get("sas:" + self.key)
        if self.key in _TRANSLATIONS:
            _TRANSLATIONS.move_to_end(self.key)
            translation = _TRANSLATIONS[self.key]
        else:
            domain, problem = data["pddl_domain"], data["pddl_problem"]
            texts = _stored_json(stored)
            if isinstance(texts, dict) and isinstance(texts.get("sas"), str) \
                    and isinstance(texts.get("sas_replan"), str):
                translation = _Translation(_parse(domain, problem), texts["sas"],
                                           texts["sas_replan"])
            else:
                stored = None  # missing or unreadable: translated again, and stored anew
                task, sas = fast_downward.pddl2sas(domain, problem)
                _, sas_replan = fast_downward.pddl2sas(domain, problem, optimize=True)
                translation = _Translation(task, sas, sas_replan)
            _kept(_TRANSLATIONS, self.key, translation)
        if stored is None:  # this store (its file) may be new to a game the process knows
            texts = {"sas": translation.sas, "sas_replan": translation.sas_replan}
            self._store.put("sas:" + self.key, deflate(json.dumps(texts).encode()))
        return translation

    def _start_state(self) -> Any:
        """textworld's ``PddlState`` at the game's start, as ``PddlState.__init__`` builds
        it, from the kept translation instead of two new ones."""
        translation, lib, logic = self._translation, self.downward_lib, self._logic
        state = pddl_logic.PddlState.__new__(pddl_logic.PddlState)
        state._facts = defaultdict(set)
        state._vars_by_name = {}
        state._vars_by_type = defaultdict(set)
        state._var_counts = Counter()
        state._logic = logic
        state.downward_lib = lib
        state.pddl_problem = self._game_data["pddl_problem"]
        state.task, state.sas, state.sas_replan = (translation.task, translation.sas,
                                                   translation.sas_replan)
        state._actions = {action.name: action for action in translation.task.actions}
        for kind in translation.task.types:
            with contextlib.suppress(ValueError):  # known already: grammars are shared
                logic.types.add(Type(kind.name, kind.supertype_names))
        lib.load_sas(translation.sas.encode("utf-8"))
        lib.load_sas_replan(translation.sas_replan.encode("utf-8"))
        state.name2type = {o.name: o.type_name for o in translation.task.objects}
        state.add_facts([fact for fact in map(state_fact(state.name2type), translation.task.init)
                         if fact is not None])
        atoms = (pddl_logic.Atom * lib.get_state_size())()
        lib.get_state(atoms)
        facts = [atom.get_fact(state.name2type) for atom in atoms]
        state.add_facts([fact for fact in facts if not fact.is_negation])
        return state

    def begin(self) -> None:
        """The bookkeeping of ``PddlEnv.reset`` for the state ``load`` just built."""
        self.prev_state = None
        self.state = GameState()
        self._last_action = None
        self._moves = 0

    def describe(self, feedback: str | None) -> Any:
        """Write textworld's view of the current state (``feedback`` given, or the intro)."""
        self.state = GameState()
        if feedback is None:
            context = {"state": self._pddl_state, "facts": list(self._pddl_state.facts),
                       "variables": {}, "mapping": {}, "entity_infos": self._entity_infos}
            feedback = self._logic.grammar.derive("#intro#", context)
        self.state.feedback = feedback
        self.state.raw = feedback
        self._last_action = None
        self._gather_infos()
        return self.state


def _parse(domain: str, problem: str) -> Any:
    """The task as the translator reads it before translating (parsed and normalised:
    milliseconds), which is what textworld reads of it (actions, types, objects, init).
    Call under ``_exclusive``: the translator's options module parses ``sys.argv`` when
    first imported, so it is given what ``fast_downward.pddl2sas`` gives it."""
    sys.argv = ["translate.py", "domain", "task"]
    from fast_downward.translate import normalize
    from fast_downward.translate.pddl_parser import lisp_parser, parsing_functions

    task = parsing_functions.parse_task(lisp_parser.parse_nested_list(domain.split("\n")),
                                        lisp_parser.parse_nested_list(problem.split("\n")))
    normalize.normalize(task)
    return task


def state_fact(name2type: Mapping[str, str]) -> Any:
    """How ``PddlState.__init__`` reads a fact of the problem's init: an atom, or an
    assignment naming a relation; equality, costs and distances are left out."""

    def convert(atom: Any) -> Proposition | None:
        if isinstance(atom, fd_pddl.Atom):
            if atom.predicate == "=":
                return None
            return Proposition(atom.predicate, [Variable(a, name2type[a]) for a in atom.args])
        if isinstance(atom, fd_pddl.Assign):
            name = f"{atom.expression.value}"
            if atom.fluent.symbol == "total-cost" or name.isdigit():
                return None
            return Proposition(name, [Variable(a, name2type[a]) for a in atom.fluent.args])
        return None

    return convert


class Engine:
    """A textworld ``PddlEnv`` wrapped as ALFWorld wraps it (``AlfredDemangler`` names the
    objects "apple 1", ``AlfredInfos``), loaded with one game at a time."""

    def __init__(self, store: HostStore | None = None) -> None:
        infos = textworld.EnvInfos(admissible_commands=True, won=True)
        self._store = store if store is not None else host_store("alfworld_games")
        with _exclusive():
            library = _SPARE_LIBRARIES.pop() if _SPARE_LIBRARIES else fast_downward.load_lib()
            self._env = AlfredInfos(AlfredDemangler(_PddlEnv(infos, library, self._store)))
        self._core: _PddlEnv = self._env.unwrapped
        self.generation = 0
        self._closed = False
        self._frame: Frame | None = None
        self._view = _View()
        self.last_move: str | None = None  # the operator the last step applied

    @property
    def key(self) -> str:
        """``game_key`` of the loaded game."""
        return self._core.key

    def load(self, game: Mapping[str, Any]) -> Frame:
        """Load a game (a ``game.tw-pddl`` mapping with domain and grammar) and reset it."""
        self._require_open()
        with _exclusive():
            self._env.load(dict(game))  # through the wrappers: they name the objects
            self._core.begin()
            start = _stored_json(self._store.get("start:" + self._core.key))
            if not (isinstance(start, list) and len(start) == 3 and isinstance(start[0], str)
                    and isinstance(start[1], list) and all(isinstance(c, str) for c in start[1])
                    and isinstance(start[2], bool)):
                state = self._core.describe(None)
                self._frame = self._read(state)
                self._view = _View(state, self._core._pddl_state._operators)
                start = [self._frame.feedback, list(self._frame.admissible), self._frame.won]
                self._store.put("start:" + self._core.key,
                                deflate(json.dumps(start).encode("utf-8")))
            else:
                feedback, admissible, won = start
                self._frame = Frame(feedback, tuple(admissible), won)
                self._view = _View()
        self.generation += 1
        self.last_move = None
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
            self._describe()
            operators = self._core._pddl_state._operators
            state, _, _ = self._env.step(command)
            action = self._core._last_action
            self.last_move = None if action is None else operators[action.id].name
            self._view = _View(state, self._core._pddl_state._operators)
        self._frame = self._read(state)
        return self._frame

    def redo(self, operators: Sequence[str | None], frame: Frame) -> bool:
        """Apply these operators (by name; None: a step that changed nothing) from the
        current state without writing any text, and take ``frame`` as what the game
        shows there; the next step checks it. False when one is not applicable, with the
        engine left between states: restore a snapshot then."""
        self._require_open()
        with _exclusive():
            core = self._core
            facts = core._pddl_state
            lib = core.downward_lib
            for name in operators:
                if name is None:
                    continue
                applicable = (fast_downward.Operator * lib.get_applicable_operators_count())()
                lib.get_applicable_operators(applicable)
                operator = next((op for op in applicable if op.name == name), None)
                if operator is None:
                    return False
                # As PddlState.apply does: the planner moves, and textworld's facts follow.
                effects = (pddl_logic.Atom * operator.nb_effect_atoms)()
                lib.apply_operator(operator.id, effects)
                for effect in effects:
                    fact = effect.get_fact(facts.name2type)
                    facts.remove_fact(fact.negate())
                    facts.add_fact(fact)
                core._moves += 1
            core._last_action = None
        self._frame = frame
        self._view = _View()
        self.last_move = None
        return True

    def _describe(self) -> None:
        """Build textworld's view of the current state if nothing has yet (after a load
        from the caches or a ``redo``), and check it shows the frame the engine was given."""
        if self._view.game_state is not None:
            return
        state = self._core.describe(self.frame.feedback)
        if self._read(state) != self.frame:
            raise RuntimeError(
                "the ALFWorld engine does not reproduce the frame it was restored to (a "
                "damaged host store?); delete the store file and restore again"
            )
        self._view.game_state = state
        self._view.operators = self._core._pddl_state._operators

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
        view = self._view
        facts = view.game_state["_facts"] if view.game_state is not None else None
        return Snapshot(
            generation=self.generation,
            state_id=int(core.downward_lib.get_state_id()),
            facts=tuple(facts if facts is not None else core._pddl_state.facts),
            frame=self.frame,
            moves=core._moves,
            view=view,
        )

    def restore(self, snapshot: Snapshot) -> Frame:
        """Jump back to a snapshot taken since the current game was loaded."""
        self._require_open()
        if snapshot.generation != self.generation:
            raise ValueError("the snapshot belongs to a game this engine no longer holds")
        with _exclusive():
            self._jump(snapshot)
        self._frame = snapshot.frame
        self._view = snapshot.view
        self.last_move = None
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
        facts.add_facts(snapshot.facts)
        if snapshot.view.game_state is not None:
            facts._operators = snapshot.view.operators
            core.state = snapshot.view.game_state
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
