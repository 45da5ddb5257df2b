"""The one base class every agent_gym environment stands on.

``TextEnv`` owns everything that must behave identically across environments: choosing a
task from a seed or from options, counting turns (so no ``TimeLimit`` wrapper is needed,
which would miscount after a restore), recording the action history with a digest of every
observation, and restoring a saved state by replaying that history on a fresh task while
checking each observation. It also owns the rules every env shares, so envs cannot drift
apart on them: an invalid step earns ``-invalid_penalty``; running out of turns truncates a
multi-turn episode (a single-turn task, ``max_turns=1``, terminates with its one reply), and
an env with right/wrong outcomes (``OutcomeEnv``) scores that as ``reward_incorrect``; an
env whose engine can snapshot itself cheaply restores from a bounded cache of snapshots
instead of replaying, still checking every observation, and an env that can also redo its
engine's moves elsewhere restores in a fresh instance or process from the host's record of
the prefixes it played (``_move``/``_redo``, see ``TextEnv``). Every observation a step
returns -- tool output, answers, refusals -- is sanitised of chat-template control tokens
and capped at ``max_obs_chars`` here, so no env can forget to.

Backends outside the process (a search service, the code sandbox) can fail for reasons that
have nothing to do with the episode. An env makes such calls through ``_outside``: a
transient failure is recorded with the episode and saved in its state, and a restore
reproduces it at the same step instead of calling the backend, which may have recovered by
then. What the episode saw is what the restore sees.

States are data that travel between processes and machines, so they never decide what the
host does: the settings an env lists in ``host_settings`` (sandbox isolation and limits,
network endpoints, host paths, time budgets) are the caller's alone.
``agent_gym.make_from_state`` takes them from its caller, never from the state, and a
restore does not compare them.

Subclasses only describe their task: how an episode opens (``_start``), what one action
does (``_step``) and, optionally, how to snapshot (``_snapshot``, ``_restore_snapshot``).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import inspect
import json
import multiprocessing
import os
import string
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, TypeVar

import gymnasium
import numpy as np
from gymnasium import spaces
from gymnasium.vector.utils import shared_memory

from agent_gym.actions.tools import sanitize_tool_output
from agent_gym.env.hoststore import HostStore, code_fingerprint
from agent_gym.env.state import (
    MAX_FAULT_CHARS,
    EnvState,
    StateError,
    StateMismatchError,
    decode_rng,
    digest,
    encode_rng,
)

MAX_OBSERVATION_CHARS = 1_000_000
MAX_ACTION_CHARS = 1_000_000
DEFAULT_MAX_OBS_CHARS = 16_000  # for envs without a max_obs_chars setting of their own
# The settings that say how an episode is scored: make_from_state reports them in its info
# when a state chose them.
REWARD_SETTINGS = ("reward_correct", "reward_incorrect", "invalid_penalty")
T = TypeVar("T")


class BackendFailure(Exception):
    """A backend outside the episode failed transiently (``TextEnv._outside``); ``message``
    says how, exactly as the episode saw it, whether it happened now or was recorded."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class UnicodeText(spaces.Text):
    """A text space that accepts any unicode string up to ``max_length`` characters.

    Gymnasium's ``Text`` rejects every character outside its charset, but model output and
    tool output are arbitrary unicode. ``sample()`` still yields short printable strings so
    random-action smoke tests (``check_env``) stay cheap.
    """

    def __init__(self, max_length: int, sample_max_length: int = 64, seed: int | None = None):
        super().__init__(max_length=max_length, min_length=0, charset=string.printable, seed=seed)
        self.sample_max_length = min(sample_max_length, max_length)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        length = int(self.np_random.integers(0, self.sample_max_length + 1))
        return super().sample(mask=(length, None)) if length else ""

    def __repr__(self) -> str:
        return f"UnicodeText({self.max_length})"


# Gymnasium stores Text observations in shared memory as charset indices, which cannot hold
# arbitrary unicode, and reads them back as a copy that async vector envs never refresh.
# UnicodeText stores a length and the code points, and reads back a live view.
class SharedTexts(Sequence[str]):
    """The strings in an async vector env's shared observation buffer, decoded on access."""

    def __init__(self, rows: np.ndarray) -> None:
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        row = self._rows[index]
        return row[1 : 1 + row[0]].astype("<u4").tobytes().decode("utf-32-le", "surrogatepass")

    def __deepcopy__(self, memo: dict[int, Any]) -> tuple[str, ...]:
        return tuple(self)

    def __repr__(self) -> str:
        return f"SharedTexts({tuple(self)!r})"


@shared_memory.create_shared_memory.register(UnicodeText)
def _create_unicode_memory(space: UnicodeText, n: int = 1, ctx: Any = multiprocessing) -> Any:
    return ctx.Array("i", n * (space.max_length + 1))


@shared_memory.read_from_shared_memory.register(UnicodeText)
def _read_unicode_memory(space: UnicodeText, memory: Any, n: int = 1) -> SharedTexts:
    rows = np.frombuffer(memory.get_obj(), dtype=np.int32).reshape(n, space.max_length + 1)
    return SharedTexts(rows)


@shared_memory.write_to_shared_memory.register(UnicodeText)
def _write_unicode_memory(space: UnicodeText, index: int, value: str, memory: Any) -> None:
    codes = np.frombuffer(value.encode("utf-32-le", "surrogatepass"), dtype="<u4")
    start = index * (space.max_length + 1)
    destination = np.frombuffer(memory.get_obj(), dtype=np.int32)
    destination[start] = len(codes)
    destination[start + 1 : start + 1 + len(codes)] = codes


@dataclass(frozen=True)
class Task:
    """One problem an episode can be about; ``payload`` is whatever the env needs."""

    task_id: str
    payload: Mapping[str, Any]


@dataclass
class Opening:
    """How an episode begins: the first observation and the chat an actor is shown.

    ``privileged`` holds what a critic may see and the actor must not (reference answers,
    gold passages, walkthroughs); it never enters ``messages``. ``info`` adds env-specific
    keys to the reset info (such as the admissible actions a scripted policy picks from).
    """

    observation: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    privileged: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Transition:
    """What one action did, as the env's task logic sees it: ``reward`` before the base's
    rules (invalid penalty, running out of turns) are applied. ``role`` is the chat role of
    the message the env answers with. Frozen, because the base keeps transitions to hand
    them out again on a snapshot restore."""

    observation: str
    reward: float = 0.0
    terminated: bool = False
    invalid: bool = False
    role: str = "tool"
    info: dict[str, Any] = field(default_factory=dict)


# (task id, the actions so far, the backend failures among them)
_PrefixKey = tuple[str, tuple[str, ...], tuple[tuple[int, str], ...]]


@dataclass(frozen=True)
class _Prefix:
    """A point this env reached: its engine snapshot there and every transition on the way
    from the task's start, as ``_step`` returned them (the base's rules are applied again
    when they are replayed, so they are applied exactly once)."""

    snapshot: object
    transitions: tuple[Transition, ...]


def _chain(previous: str, action: str, fault: str | None) -> str:
    """The key of a prefix one action longer than the one keyed ``previous``."""
    link = json.dumps([previous, action, fault], ensure_ascii=False)
    return hashlib.sha256(link.encode("utf-8", "surrogatepass")).hexdigest()


class TextEnv(gymnasium.Env[str, str]):
    """A text environment for LLM agents with replayable, verifiable save/restore.

    Subclasses set ``env_id``, pass their tasks to ``__init__`` and implement ``_start`` and
    ``_step``. ``_step`` must be deterministic given the task and the actions so far: that is
    what makes replay a faithful restore. Every argument a subclass's constructor receives is
    recorded (see ``__init_subclass__``) so a saved state can rebuild an identical env
    elsewhere; constructor arguments must therefore be JSON values.

    Fast restore: an env whose engine can snapshot itself cheaply implements ``_snapshot``
    and ``_restore_snapshot``. The base then keeps, per task and action prefix this instance
    has played, the engine snapshot and the transitions on the way (least recently used
    first out, at most ``snapshot_cache_size``). A restore jumps to the deepest cached
    prefix of the state's actions and replays only the rest; the cached transitions go
    through the same bookkeeping and digest check as replayed ones, so a state whose
    observations differ still fails at the step that differs. The restore's info says how
    many steps a snapshot skipped (``snapshot_depth``) out of ``restored_depth``.

    Restore in a fresh instance or process: an env that can also describe what each step
    did to its engine in a form any instance can redo (``_move``, JSON) and redo such moves
    from a task's start (``_redo``), and that names the content of its tasks
    (``_fingerprint``), gets a record in its host store (``self._store``, a
    ``HostStore``): for every prefix it plays, keyed by a digest chained over the env, its
    episode settings, the task's content, this code (``code_fingerprint``) and each action
    with its fault, the transition ``_step`` returned and the move. A restore redoes the
    moves of the longest recorded prefix of the state's actions (milliseconds, no text is
    generated) and takes those steps' transitions from the record, again through the same
    bookkeeping and digest check as replayed ones: the state only selects records, which
    the host alone writes from what it computed, so it can never make the env believe an
    observation it did not produce. Should a record ever disagree with a state's digest
    the restore is done again by real replay, which decides: a tampered state still fails
    at the step that differs, and a stale record is overwritten. ``info["snapshot_source"]``
    says where the skipped steps came from ("instance", "store" or None).

    ``host_settings`` names the constructor arguments that decide what the host does rather
    than what the episode is -- sandbox isolation and resource limits, network endpoints,
    paths on the host, time budgets: a state never chooses them (see the module docstring).
    """

    env_id: ClassVar[str] = ""
    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi"], "render_fps": 1}
    host_settings: ClassVar[frozenset[str]] = frozenset()
    snapshot_cache_size: int = 1024  # snapshots kept per env instance

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Record each env's constructor arguments, so no env can forget one in its states.

        A forgotten argument would rebuild a differently configured env on restore, which
        the observation check may not catch (a changed reward, say). The outermost
        constructor's arguments are kept; ``render_mode`` is left out because it does not
        change what the env does.
        """
        super().__init_subclass__(**kwargs)
        if "__init__" not in cls.__dict__:
            return
        init = cls.__dict__["__init__"]
        signature = inspect.signature(init)
        if any(p.kind is p.VAR_POSITIONAL for p in signature.parameters.values()):
            raise TypeError(f"{cls.__name__}.__init__ must not take *args: states record names")

        @functools.wraps(init)
        def recording_init(self: TextEnv, *args: Any, **kw: Any) -> None:
            if "_env_kwargs" not in self.__dict__:
                bound = signature.bind(self, *args, **kw)
                bound.apply_defaults()
                recorded: dict[str, Any] = {}
                for name, value in list(bound.arguments.items())[1:]:
                    if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                        recorded.update(value)
                    elif name != "render_mode":
                        recorded[name] = value
                self._env_kwargs = recorded
            init(self, *args, **kw)

        cls.__init__ = recording_init  # type: ignore[method-assign]

    def __init__(
        self,
        tasks: Sequence[Task],
        *,
        max_turns: int,
        invalid_penalty: float = 0.0,
        max_action_chars: int = MAX_ACTION_CHARS,
        max_obs_chars: int = DEFAULT_MAX_OBS_CHARS,
        render_mode: str | None = None,
    ) -> None:
        if not tasks:
            raise ValueError(f"{type(self).__name__} was given no tasks")
        if max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {max_turns}")
        if not 100 <= max_obs_chars <= MAX_OBSERVATION_CHARS:
            raise ValueError(
                f"max_obs_chars must be between 100 and {MAX_OBSERVATION_CHARS}, got "
                f"{max_obs_chars}"
            )
        if render_mode not in (None, "ansi"):
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.tasks = list(tasks)
        self._task_index = {task.task_id: i for i, task in enumerate(self.tasks)}
        if len(self._task_index) != len(self.tasks):
            raise ValueError("task ids must be unique")
        self.max_turns = max_turns
        self.invalid_penalty = invalid_penalty
        self.max_action_chars = max_action_chars
        self.max_obs_chars = max_obs_chars
        self.render_mode = render_mode
        self.__dict__.setdefault("_env_kwargs", {})
        self.observation_space = UnicodeText(MAX_OBSERVATION_CHARS)
        self.action_space = UnicodeText(max_action_chars)
        self._task: Task | None = None
        self._seed: int | None = None
        self._actions: list[str] = []
        self._digests: list[str] = []
        self._transcript: list[str] = []
        self._path: list[Transition] = []  # this episode's transitions as _step gave them
        self._done = False
        self._closed = False
        self._rng: str | None = None  # the generator right after this episode's reset
        self._faults: dict[int, str] = {}  # step -> the backend failure it saw
        self._recorded: dict[int, str] = {}  # failures a restore has yet to reproduce
        self._outside_step = 0  # the last step that called a backend
        self._prefix_cache: OrderedDict[_PrefixKey, _Prefix] = OrderedDict()
        self._store: HostStore | None = None  # set by envs that implement _move and _redo
        self._chain: list[str] = []  # the store keys of this episode's prefixes

    # ----------------------------------------------------------------- subclass hooks
    def _start(self, task: Task) -> Opening:
        raise NotImplementedError

    def _step(self, action: str) -> Transition:
        raise NotImplementedError

    def _close(self) -> None:
        """Release engines, sandboxes or connections; called by ``close``."""

    def _out_of_turns(self, last: Transition) -> Transition:
        """The last allowed turn ended without ending the episode (truncated, or terminated
        when the task is single-turn).

        Return ``last`` as it should count (``dataclasses.replace`` it); the default leaves
        it as it is.
        """
        return last

    def _snapshot(self) -> object | None:
        """The engine's whole state now, as an object ``_restore_snapshot`` can jump back
        to, or None (the default) when the env cannot snapshot and restores by replay.

        Called after every step, so it must be cheap; it must capture everything ``_step``
        depends on, and the object must not change afterwards.
        """
        return None

    def _restore_snapshot(self, snapshot: object) -> bool:
        """Put the engine where ``_snapshot`` returned ``snapshot``; called right after
        ``_start`` of the same task. Return False when the snapshot can no longer be used
        (say, the engine has loaded another game since), and the base replays instead."""
        return False

    def _fingerprint(self, task: Task) -> str | None:
        """A digest of what this task's episodes are played on beyond its id (its data), so
        records of one host store never mix tasks that share an id; called right after
        ``_start``. None (the default) keeps this env's prefixes out of the store."""
        return None

    def _move(self) -> Any:
        """What the last ``_step`` did to the engine, as a JSON value ``_redo`` can redo in
        any instance of this env on this host, or None when it cannot be redone (then no
        record of this prefix is kept). Called after every step: keep it cheap."""
        return None

    def _redo(self, moves: Sequence[Any]) -> bool:
        """Put the engine where ``moves`` (``_move``'s values, in step order) lead from the
        task's start; called right after ``_start``. Return False when that cannot be
        done, with the engine back at the start, and the base replays instead."""
        return False

    def _outside(
        self, call: Callable[[], T], transient: type[Exception] | tuple[type[Exception], ...]
    ) -> T:
        """Call a backend outside the episode (a search, a sandbox run) from ``_step``.

        Returns what ``call`` returns. When it raises one of the ``transient`` errors, the
        failure is recorded for this step (and saved in the state) and ``BackendFailure``
        carries its message; the env turns that into an observation. Restoring a state
        raises the recorded ``BackendFailure`` at the same step without calling at all, so
        the restore sees what the episode saw even if the backend has recovered since.
        A step calls at most one backend: the record is per step.
        """
        step = self.turn + 1
        if self._outside_step == step:
            raise RuntimeError(f"{type(self).__name__} called a backend twice in one step")
        self._outside_step = step
        if step in self._recorded:
            message = self._faults[step] = self._recorded.pop(step)
            raise BackendFailure(message)
        try:
            return call()
        except transient as err:
            message = self._faults[step] = str(err)[:MAX_FAULT_CHARS]
            raise BackendFailure(message) from err

    # ----------------------------------------------------------------- gymnasium API
    @property
    def turn(self) -> int:
        return len(self._actions)

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    @property
    def steps_in_process(self) -> bool:
        """True when no step ever waits on anything outside this process (a subprocess, the
        network, a file it writes): a step is computation, so a server may run a short one
        on its event loop rather than pay two thread hand-offs (``agent_gym.serve.app``).
        False unless an env knows better: a sandbox, a remote backend or a verifier helper
        process can make any step wait for seconds."""
        return False

    @property
    def task(self) -> Task:
        if self._task is None:
            raise RuntimeError("call reset() before using the environment")
        return self._task

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        self._require_open()
        options = dict(options or {})
        state = options.pop("state", None)
        if state is not None:
            if options:
                raise ValueError(f"options {sorted(options)} cannot be combined with 'state'")
            return self._restore(state)
        super().reset(seed=seed)
        self._seed = seed
        task = self._choose_task(options)
        self._rng = encode_rng(self.np_random)  # after the draw that chose the task
        self._recorded = {}
        opening = self._begin(task)
        return opening.observation, self._opening_info(opening)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self._require_open()
        if self._task is None:
            raise RuntimeError("call reset() before step()")
        if self._done:
            raise RuntimeError("the episode is over; call reset() to start a new one")
        if isinstance(action, bytes):
            action = action.decode("utf-8", errors="replace")
        elif not isinstance(action, str):
            raise TypeError(f"an action is the assistant's text (str), got {type(action).__name__}")
        if len(action) > self.max_action_chars:
            result = Transition(
                f"Error: the action is {len(action)} characters long; the limit is "
                f"{self.max_action_chars}.",
                invalid=True,
            )
        else:
            result = self._step(action)
        outcome = self._advance(action, result)
        self._remember()
        return outcome

    def _advance(
        self, action: str, result: Transition
    ) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Record one action and what it did, applying the rules every env shares; the
        bookkeeping half of ``step``, also run on the transitions a snapshot restore reuses.

        ``result`` is kept as it is for restores, so what is handed out is built from it
        (the info deep-copied): a caller that edits its info cannot change a later restore.
        """
        self._path.append(result)
        out_of_turns = not result.terminated and self.turn + 1 >= self.max_turns
        if out_of_turns:
            result = self._out_of_turns(result)
        # A single-turn task ends with its one reply: that is the task's natural end, so it
        # terminates; only a multi-turn budget running out is a cut (truncated), after which
        # a trainer may still value what the episode could have become.
        truncated = out_of_turns and self.max_turns > 1
        terminated = result.terminated or (out_of_turns and not truncated)
        # Refusals quote the model and tool output is anything: neither may carry a turn
        # boundary into the chat or outgrow the budget (max_obs_chars <= the space's limit).
        observation = sanitize_tool_output(result.observation, self.max_obs_chars)
        reward = float(result.reward) - (self.invalid_penalty if result.invalid else 0.0)
        self._actions.append(action)
        if self._chain:
            self._chain.append(_chain(self._chain[-1], action, self._faults.get(self.turn)))
        self._digests.append(digest(observation))
        self._transcript.append(observation)
        self._done = terminated or truncated
        info = {
            **copy.deepcopy(result.info),
            "message": {"role": result.role, "content": observation},
            "invalid": result.invalid,
            "turn": self.turn,
        }
        return observation, reward, terminated, truncated, info

    def _remember(self) -> None:
        """Cache the engine's snapshot after the current action prefix, if it takes any,
        and record the step in the host store, if the env has one."""
        if self._store is not None and self._chain:
            self._record(self._chain[-1], self._path[-1])
        snapshot = self._snapshot()
        if snapshot is None or self.snapshot_cache_size < 1:
            return
        key = (self.task.task_id, tuple(self._actions), tuple(sorted(self._faults.items())))
        self._prefix_cache[key] = _Prefix(snapshot, tuple(self._path))
        self._prefix_cache.move_to_end(key)
        while len(self._prefix_cache) > self.snapshot_cache_size:
            self._prefix_cache.popitem(last=False)

    def _record(self, key: str, transition: Transition) -> None:
        move = self._move()
        if move is None or self._store is None:
            return
        try:
            text = json.dumps({"transition": _transition_json(transition), "move": move},
                              ensure_ascii=False)
        except (TypeError, ValueError):  # an info that is not JSON: this step is not kept
            return
        self._store.put(key, zlib.compress(text.encode("utf-8", "surrogatepass"), 1))

    def _jump(self, state: EnvState, use_store: bool) -> tuple[tuple[Transition, ...], str | None]:
        """Put the engine after the longest known prefix of the state's actions -- a
        snapshot of this instance, or the moves the host store recorded when it knows a
        deeper one -- and return the transitions on the way there with where they came
        from; ((), None) when neither knows any."""
        recorded = self._recorded_prefix(state) if use_store else []
        for depth in range(len(state.actions), 0, -1):
            faults = tuple(fault for fault in state.faults if fault[0] <= depth)
            # At equal depth a snapshot of this instance wins: it restores everything the
            # engine had built there, where redone moves leave it to be built again.
            key = (state.task_id, state.actions[:depth], faults)
            prefix = self._prefix_cache.get(key)
            if prefix is not None:
                if self._restore_snapshot(prefix.snapshot):
                    self._prefix_cache.move_to_end(key)
                    self._reproduce(faults)
                    return prefix.transitions, "instance"
                del self._prefix_cache[key]  # stale: a shallower one may still be good
            if depth <= len(recorded):
                if self._redo([move for _, move in recorded[:depth]]):
                    self._reproduce(faults)
                    return tuple(transition for transition, _ in recorded[:depth]), "store"
                recorded = []  # the engine cannot redo them: only snapshots are left
        return (), None

    def _reproduce(self, faults: tuple[tuple[int, str], ...]) -> None:
        """The skipped steps' transitions reproduce these recorded failures."""
        for step, message in faults:
            self._faults[step] = message
            del self._recorded[step]

    def _recorded_prefix(self, state: EnvState) -> list[tuple[Transition, Any]]:
        """The transitions and moves the host store holds for the state's first steps,
        as far as it holds every one of them."""
        if self._store is None or not self._chain or not state.actions:
            return []
        faults = dict(state.faults)
        keys = [self._chain[0]]
        for step, action in enumerate(state.actions, start=1):
            keys.append(_chain(keys[-1], action, faults.get(step)))
        found = self._store.get_many(keys[1:])
        recorded = []
        for key in keys[1:]:
            if key not in found:
                break
            try:
                entry = json.loads(zlib.decompress(found[key]).decode("utf-8", "surrogatepass"))
                recorded.append((_transition_from_json(entry["transition"]), entry["move"]))
            except (ValueError, KeyError, TypeError, zlib.error):  # damaged: stop there
                break
        return recorded

    def render(self) -> str | None:
        if self.render_mode != "ansi":
            return None
        return "\n---\n".join(self._transcript)

    def close(self) -> None:
        """Release the env's backends; idempotent. A closed env refuses reset and step."""
        if self._closed:
            return
        self._closed = True
        self._close()
        super().close()

    def _require_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this {self.env_id or type(self).__name__} env is closed; make a "
                               "new one")

    # ----------------------------------------------------------------- save / restore
    def save_state(self) -> EnvState:
        """The recipe to rebuild this episode exactly, anywhere; see ``agent_gym.env.state``."""
        task = self.task
        kwargs = _json_kwargs(self.env_id, self._env_kwargs)
        return EnvState(
            env_id=self.env_id,
            env_kwargs=kwargs,
            task_id=task.task_id,
            seed=self._seed,
            actions=tuple(self._actions),
            digests=tuple(self._digests),
            faults=tuple(sorted(self._faults.items())),
            rng=self._rng,
        )

    def _restore(self, state: EnvState | str | Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        if isinstance(state, str | bytes):
            state = EnvState.from_json(state)
        elif isinstance(state, Mapping):
            state = EnvState.from_dict(dict(state))
        elif not isinstance(state, EnvState):
            raise StateError(f"cannot restore from a {type(state).__name__}; pass an EnvState")
        if state.env_id != self.env_id:
            raise StateError(f"state belongs to {state.env_id!r}, this env is {self.env_id!r}")
        saved = self.episode_settings(state.env_kwargs)
        own = self.episode_settings(_json_kwargs(self.env_id, self._env_kwargs))
        if saved != own:
            raise StateError(
                f"state was saved from {self.env_id} with the settings {saved}, this one has "
                f"{own}; use agent_gym.make_from_state(state)"
            )
        if state.task_id not in self._task_index:
            raise StateError(f"task {state.task_id!r} of the saved state is not in this env's data")
        super().reset(seed=state.seed)
        if state.rng is not None:  # as the original was after its reset; seed stays the same
            self._np_random = decode_rng(state.rng)
        self._seed = state.seed
        self._rng = state.rng or encode_rng(self.np_random)
        self._recorded = dict(state.faults)
        try:
            try:
                return self._replay(state, use_store=True)
            except _StoreDisagrees:
                # Real replay decides whether the record or the state is wrong.
                self._recorded = dict(state.faults)
                return self._replay(state, use_store=False)
        except BaseException:
            self._task = None  # a half-replayed episode must not be stepped on: reset first
            raise

    def _replay(self, state: EnvState, use_store: bool) -> tuple[str, dict[str, Any]]:
        opening = self._begin(self.tasks[self._task_index[state.task_id]])
        self._check(0, state.digests[0], opening.observation)
        ahead, source = self._jump(state, use_store)
        try:
            return self._replay_steps(state, opening, ahead, source)
        except StateMismatchError as err:
            if source == "store" and err.step <= len(ahead):
                raise _StoreDisagrees from err
            raise

    def _replay_steps(
        self, state: EnvState, opening: Opening, ahead: tuple[Transition, ...],
        source: str | None,
    ) -> tuple[str, dict[str, Any]]:
        observation = opening.observation
        info: dict[str, Any] = {}
        history: list[dict[str, Any]] = []
        rewards: list[float] = []
        terminated = truncated = False
        for step_index, action in enumerate(state.actions, start=1):
            if self._done:
                raise StateMismatchError(
                    step_index, state.digests[step_index], "(episode already over)",
                    f"the replayed episode ended before step {step_index}",
                )
            if step_index <= len(ahead):
                outcome = self._advance(action, ahead[step_index - 1])
            else:
                outcome = self.step(action)
            observation, reward, terminated, truncated, info = outcome
            rewards.append(reward)
            if step_index in self._recorded:
                raise StateError(
                    f"the state records a backend failure at step {step_index}, but replaying "
                    "that step called no backend"
                )
            self._check(step_index, state.digests[step_index], observation)
            history += [{"role": "assistant", "content": action}, info["message"]]
        restored = self._opening_info(opening)
        # After replay the info is the last step's (its message, validity, env keys).
        restored.update(info)
        # The chat after the opening messages, so a restored branch can rebuild its prompt.
        restored["history"] = history
        restored["restored_depth"] = state.depth
        restored["snapshot_depth"] = len(ahead)  # of those steps, how many a snapshot skipped
        # What this code scores the replayed steps (``agent-gym rescore`` reads them) and
        # whether the episode ended on the last one: a saved run's rewards are recomputed
        # from its states, the observations verified on the way.
        restored["step_rewards"] = rewards
        restored["episode_end"] = (
            "terminated" if terminated else "truncated" if truncated else None
        )
        restored["snapshot_source"] = source
        return observation, restored

    @staticmethod
    def _check(step_index: int, expected: str, observation: str) -> None:
        actual = digest(observation)
        if actual != expected:
            raise StateMismatchError(step_index, expected, actual, observation)

    # ----------------------------------------------------------------- internals
    def _choose_task(self, options: Mapping[str, Any]) -> Task:
        unknown = set(options) - {"task_id", "index"}
        if unknown:
            raise ValueError(
                f"unknown reset options {sorted(unknown)}; use task_id, index or state"
            )
        if "task_id" in options:
            task_id = options["task_id"]
            if task_id not in self._task_index:
                raise KeyError(f"no task with id {task_id!r} in {self.env_id}")
            return self.tasks[self._task_index[task_id]]
        if "index" in options:
            index = options["index"]
            if not isinstance(index, int | np.integer) or not 0 <= index < len(self.tasks):
                raise IndexError(f"task index must be in [0, {len(self.tasks)}), got {index!r}")
            return self.tasks[int(index)]
        return self.tasks[int(self.np_random.integers(len(self.tasks)))]

    def episode_settings(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The settings of ``kwargs`` that define an episode: all but ``host_settings``."""
        return {k: v for k, v in kwargs.items() if k not in self.host_settings}

    def _begin(self, task: Task) -> Opening:
        self._task = task
        self._actions = []
        self._path = []
        self._faults = {}
        self._outside_step = 0
        self._done = False
        opening = self._start(task)
        self._chain = self._chain_root(task)
        self._digests = [digest(opening.observation)]
        self._transcript = [opening.observation]
        return opening

    def _chain_root(self, task: Task) -> list[str]:
        """[the store key of the task's start], or [] when no record is kept."""
        if self._store is None:
            return []
        fingerprint = self._fingerprint(task)
        if fingerprint is None:
            return []
        settings = self.episode_settings(_json_kwargs(self.env_id, self._env_kwargs))
        root = json.dumps(["agent_gym prefix", code_fingerprint(), self.env_id, settings,
                           task.task_id, fingerprint], sort_keys=True, ensure_ascii=False)
        return [hashlib.sha256(root.encode("utf-8", "surrogatepass")).hexdigest()]

    def _opening_info(self, opening: Opening) -> dict[str, Any]:
        return {
            **opening.info,
            "task_id": self.task.task_id,
            "messages": opening.messages,
            "tools": opening.tools,
            "privileged": opening.privileged,
            "turn": self.turn,
        }


class OutcomeEnv(TextEnv):
    """A TextEnv whose episodes end right or wrong: an answer graded, a game won.

    The two outcome rewards are arguments of every such env (1/0 and +1/-1 schemes are a
    matter of configuration), and an episode whose turns run out before an outcome scores
    ``reward_incorrect`` on its last step, marked ``info["no_answer"]``: stalling is never
    worth more than a wrong answer.
    """

    def __init__(
        self,
        tasks: Sequence[Task],
        *,
        max_turns: int,
        reward_correct: float = 1.0,
        reward_incorrect: float = 0.0,
        invalid_penalty: float = 0.0,
        max_action_chars: int = MAX_ACTION_CHARS,
        max_obs_chars: int = DEFAULT_MAX_OBS_CHARS,
        render_mode: str | None = None,
    ) -> None:
        super().__init__(
            tasks,
            max_turns=max_turns,
            invalid_penalty=invalid_penalty,
            max_action_chars=max_action_chars,
            max_obs_chars=max_obs_chars,
            render_mode=render_mode,
        )
        self.reward_correct = reward_correct
        self.reward_incorrect = reward_incorrect

    def _outcome(self, correct: bool) -> float:
        return self.reward_correct if correct else self.reward_incorrect

    def _out_of_turns(self, last: Transition) -> Transition:
        return replace(
            last, reward=last.reward + self.reward_incorrect, info={**last.info, "no_answer": True}
        )


class _StoreDisagrees(Exception):
    """A transition from the host store did not match the state being restored."""


def _transition_json(transition: Transition) -> dict[str, Any]:
    return {"observation": transition.observation, "reward": float(transition.reward),
            "terminated": transition.terminated, "invalid": transition.invalid,
            "role": transition.role, "info": transition.info}


def _transition_from_json(data: Mapping[str, Any]) -> Transition:
    return Transition(str(data["observation"]), float(data["reward"]),
                      bool(data["terminated"]), bool(data["invalid"]), str(data["role"]),
                      dict(data["info"]))


def describe_env(env_id: str, env_kwargs: Mapping[str, Any]) -> tuple[int, int]:
    """``(number of tasks, max turns)`` of an agent_gym env (a ``TextEnv`` here, or a remote
    one that reports both), read from an instance."""
    env = gymnasium.make(env_id, **env_kwargs)
    try:
        num_tasks = getattr(env.unwrapped, "num_tasks", None)
        max_turns = getattr(env.unwrapped, "max_turns", None)
        if not (isinstance(num_tasks, int) and isinstance(max_turns, int)):
            raise ValueError(f"{env_id} is not an agent_gym env: it reports no tasks and turns")
        return num_tasks, max_turns
    finally:
        env.close()


def _json_kwargs(env_id: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Constructor arguments as they travel in a state: JSON values (paths as strings)."""

    def convert(value: Any) -> Any:
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        raise TypeError(f"{type(value).__name__} is not a JSON value")

    try:
        return json.loads(json.dumps(kwargs, default=convert))
    except TypeError as err:
        raise StateError(
            f"{env_id} was built with constructor arguments that are not JSON values, so "
            f"its state cannot be saved: {err}"
        ) from err
