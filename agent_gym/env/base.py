"""The one base class every agent_gym environment stands on.

``TextEnv`` owns what must behave identically across environments, so envs cannot drift
apart on it: choosing a task, counting turns (no ``TimeLimit`` wrapper, which would miscount
after a restore), the shared rules of ``step`` (invalid penalty, truncation, sanitised and
capped observations), the action history with a digest of every observation, and restores
that replay it -- or jump over the prefixes ``agent_gym.env.prefixes`` knows -- checking
every observation. Backends outside the process are called through ``_outside``, which
records a transient failure in the state, so a restore sees what the episode saw.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar, NamedTuple, TypeVar, cast

import gymnasium
import numpy as np

from agent_gym import untrusted
from agent_gym.actions.tools import sanitize_tool_output
from agent_gym.env.prefixes import PrefixIndex, _StoreDisagrees
from agent_gym.env.spaces import UnicodeText
from agent_gym.env.state import (
    MAX_FAULT_CHARS,
    EnvState,
    StateError,
    StateMismatchError,
    _json_kwargs,
    _require_finite,
    decode_rng,
    digest,
    encode_rng,
    split_reset_options,
)
from agent_gym.env.types import BackendFailure, Opening, ResetInfo, StepInfo, Task, Transition
from agent_gym.hoststore import HostStore

MAX_OBSERVATION_CHARS = 1_000_000
MAX_ACTION_CHARS = 1_000_000
DEFAULT_MAX_OBS_CHARS = 16_000  # for envs without a max_obs_chars setting of their own
# The settings that score an episode: make_from_state's info reports those a state chose.
REWARD_SETTINGS = ("reward_correct", "reward_incorrect", "invalid_penalty")
T = TypeVar("T")


class TextEnv(gymnasium.Env[str, str]):
    """A text environment for LLM agents with replayable, verifiable save/restore.

    Subclasses set ``env_id``, pass their tasks to ``__init__`` and implement ``_start`` and
    ``_step`` (their docstrings say what each must do). A subclass's constructor arguments
    are recorded (``__init_subclass__``) so a state can rebuild the env elsewhere: JSON values.

    Fast restore (``agent_gym.env.prefixes``): an engine that snapshots cheaply implements
    ``_snapshot`` and ``_restore_snapshot`` (at most ``snapshot_cache_size`` kept); one that
    can also redo its moves (``_move``, ``_redo``, ``_fingerprint``) and opts in with
    ``use_prefix_store`` restores in a fresh process from the host's record.

    ``host_settings`` names the arguments that decide what the host does, not what the
    episode is (isolation, limits, endpoints, host paths, time budgets). States travel
    between machines, so they never choose them: ``agent_gym.make_from_state`` takes them
    from its caller, and a restore does not compare them.
    """

    env_id: ClassVar[str] = ""
    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi"], "render_fps": 1}
    host_settings: ClassVar[frozenset[str]] = frozenset()
    snapshot_cache_size: int = 1024  # snapshots kept per env instance

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Record each env's constructor arguments, so no env can forget one in its states:
        a forgotten one would rebuild a differently configured env on restore, which the
        observation check may not catch (a changed reward, say). The outermost constructor's
        are kept; ``render_mode`` is left out: it does not change what the env does."""
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
        self, tasks: Sequence[Task], *, max_turns: int, invalid_penalty: float = 0.0,
        max_action_chars: int = MAX_ACTION_CHARS, max_obs_chars: int = DEFAULT_MAX_OBS_CHARS,
        render_mode: str | None = None,
    ) -> None:
        if not tasks:
            raise ValueError(f"{type(self).__name__} was given no tasks")
        _require_finite(type(self).__name__, self.__dict__.get("_env_kwargs", {}))
        if isinstance(max_turns, bool) or not isinstance(max_turns, int | np.integer) \
                or max_turns < 1:
            raise ValueError(f"max_turns must be a whole number of at least 1, got {max_turns!r}")
        if not 100 <= max_obs_chars <= MAX_OBSERVATION_CHARS:
            raise ValueError(f"max_obs_chars must be between 100 and {MAX_OBSERVATION_CHARS}, "
                             f"got {max_obs_chars}")
        if render_mode not in (None, "ansi"):
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.tasks = list(tasks)
        self._task_index = {task.task_id: i for i, task in enumerate(self.tasks)}
        if len(self._task_index) != len(self.tasks):
            raise ValueError("task ids must be unique")
        self.max_turns = int(max_turns)
        self.invalid_penalty = untrusted.finite(invalid_penalty, "invalid_penalty")
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
        self.prefixes = PrefixIndex()  # the prefixes played; see use_prefix_store

    # ----------------------------------------------------------------- subclass hooks
    def _start(self, task: Task) -> Opening:
        """Set the engine up for ``task`` and return how the episode opens (every subclass).

        Called by every reset and restore, the last episode's bookkeeping cleared. The
        ``Opening``: the first observation, the actor's chat (``messages``) and ``tools``,
        what only a critic may see (``privileged``), reset info keys of the env's own. It
        may depend only on the task, the constructor's arguments and ``np_random`` (restored
        as it was after the task was drawn): a restore checks the first observation."""
        raise NotImplementedError

    def _step(self, action: str) -> Transition:
        """Apply one reply (text within ``max_action_chars``) and return what it did (every
        subclass).

        The ``Transition``: the observation, the reward before the base's rules,
        ``terminated`` when the task is over (answered, won), ``invalid`` for a reply that
        could not be acted on (the base subtracts ``invalid_penalty``), the answer's chat
        ``role``, step info keys of the env's own. Turns, truncation and the observation's
        cleaning are the base's. It must be deterministic given the task, the actions so far
        and ``np_random``: a restore replays it, checking every observation. A reply it
        cannot parse is an invalid transition, not an exception; a backend outside the
        process goes through ``_outside``, whose ``BackendFailure`` becomes an observation."""
        raise NotImplementedError

    def _close(self) -> None:
        """Release engines, sandboxes or connections; called by ``close``."""

    def _out_of_turns(self, last: Transition) -> Transition:
        """The last allowed turn did not end the episode (truncated; terminated if single-turn):
        return ``last`` as it should count (``dataclasses.replace`` it), by default as is."""
        return last

    def _snapshot(self) -> object | None:
        """The engine's whole state now, as an object ``_restore_snapshot`` can jump back
        to, or None (the default) when the env cannot snapshot and restores by replay.
        Called after every step, so it must be cheap; it must capture everything ``_step``
        depends on, and the object must not change afterwards."""
        return None

    def _restore_snapshot(self, snapshot: object) -> bool:
        """Put the engine where ``_snapshot`` returned ``snapshot``, right after ``_start`` of
        the same task; False when it no longer can (another game loaded since): the base
        replays instead."""
        return False

    def _fingerprint(self, task: Task) -> str | None:
        """A digest of what this task's episodes are played on beyond its id (its data), so a
        host store never mixes tasks that share an id; called right after ``_start``. None
        (the default) keeps this env's prefixes out of the store."""
        return None

    def _move(self) -> Any:
        """What the last ``_step`` did to the engine, as a JSON value ``_redo`` can redo in any
        instance of this env on this host, or None (no record of this prefix is then kept).
        Called after every step: keep it cheap."""
        return None

    def _redo(self, moves: Sequence[Any]) -> bool:
        """Put the engine where ``moves`` (``_move``'s values, in step order) lead from the
        task's start; called right after ``_start``. Return False when that cannot be
        done, with the engine back at the start, and the base replays instead."""
        return False

    def use_prefix_store(self, store: HostStore | None) -> None:
        """Opt in to restores in a fresh process (an env with ``_fingerprint``, ``_move``,
        ``_redo``): record the prefixes played from the next episode on in ``store`` (the
        host's processes share it: ``host_store``) and restore from it; None opts out."""
        self.prefixes.use_store(store)

    def _outside(self, call: Callable[[], T],
                 transient: type[Exception] | tuple[type[Exception], ...]) -> T:
        """Call a backend outside the episode (a search, a sandbox run) from ``_step``, at most
        once a step: returns what ``call`` returns. A ``transient`` error is recorded for the
        step (and saved in the state) and raised as ``BackendFailure``, which the env turns
        into an observation; a restore raises the recorded failure at the same step without
        calling, so it sees what the episode saw even if the backend has recovered since."""
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
    def task(self) -> Task:
        if self._task is None:
            raise RuntimeError("call reset() before using the environment")
        return self._task

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[str, ResetInfo]:
        """Start an episode, or restore a saved one mid-way.

        Args:
            seed: seeds ``np_random``, which draws the task when ``options`` names none (None
                keeps the generator, as in Gymnasium).
            options: ``task_id`` or ``index`` picks the task; ``state`` alone (an
                ``EnvState``, its JSON or its dict) replays that episode's actions on a
                fresh start, checking every observation, with the state's seed.

        Returns:
            ``(observation, info)``: the first observation (after a restore, the last one)
            and ``ResetInfo``: ``task_id``, ``messages``, ``tools``, ``privileged`` (never for
            the actor), ``turn``, the env's keys; a restore adds the last step's info and
            ``history``, ``restored_depth``, ``step_rewards``, ``episode_end``, ``snapshot_*``.

        Raises:
            KeyError, IndexError, ValueError: an unknown task id, an index out of range, an
                unknown option or one beside ``state``.
            StateError: a state this env cannot restore (another env or settings, a task it
                lacks); ``StateMismatchError`` when a replayed observation differs.
            RuntimeError: the env is closed.
        """
        self._require_open()
        state, options = split_reset_options(options)
        if state is not None:
            return self._restore(state)
        super().reset(seed=seed)
        self._seed = seed
        task = self._choose_task(options)
        self._rng = encode_rng(self.np_random)  # after the draw that chose the task
        self._recorded = {}
        opening = self._begin(task)
        return opening.observation, self._opening_info(opening)

    def step(self, action: str) -> tuple[str, float, bool, bool, StepInfo]:
        """Play one reply of the assistant.

        Args:
            action: the reply's text (bytes are read as UTF-8); one over ``max_action_chars``
                is an invalid step, never shown to ``_step``.

        Returns:
            ``(observation, reward, terminated, truncated, info)``: the env's answer, cleared
            of chat-template tokens, cut to ``max_obs_chars``; ``_step``'s reward less
            ``invalid_penalty`` if invalid; ``terminated`` when the task ended (or a one-turn
            task had its turn); ``truncated`` when a longer episode used ``max_turns``;
            ``StepInfo``: ``message`` (role and observation), ``invalid``, ``turn``,
            ``no_answer`` (an ``OutcomeEnv`` out of turns) and the env's keys.

        Raises:
            RuntimeError: before ``reset``, after the episode ended, or once closed.
            TypeError: an action that is not text.
        """
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
            result = Transition(f"Error: the action is {len(action)} characters long; the limit "
                                f"is {self.max_action_chars}.", invalid=True)
        else:
            result = self._step(action)
        outcome = self._advance(action, result)
        self._remember()
        return outcome

    def _advance(self, action: str, result: Transition) -> tuple[str, float, bool, bool, StepInfo]:
        """Record one action and what it did, applying the rules every env shares; the
        bookkeeping half of ``step``, also run on the transitions a snapshot restore reuses.
        ``result`` is kept as it is for restores, so what is handed out is built from it
        (the info deep-copied): a caller that edits its info cannot change a later restore."""
        self._path.append(result)
        out_of_turns = not result.terminated and self.turn + 1 >= self.max_turns
        if out_of_turns:
            result = self._out_of_turns(result)
        # A single-turn task's one reply is its natural end (terminated); only a multi-turn
        # budget running out is a cut (truncated), after which the episode still has a value.
        truncated = out_of_turns and self.max_turns > 1
        terminated = result.terminated or (out_of_turns and not truncated)
        # Refusals quote the model, tool output is anything: neither may carry a turn boundary
        # into the chat or outgrow the budget (max_obs_chars <= the space's limit).
        observation = sanitize_tool_output(result.observation, self.max_obs_chars)
        reward = float(result.reward) - (self.invalid_penalty if result.invalid else 0.0)
        self._actions.append(action)
        self.prefixes.advance(action, self._faults.get(self.turn))
        self._digests.append(digest(observation))
        self._transcript.append(observation)
        self._done = terminated or truncated
        info = cast(StepInfo, {**copy.deepcopy(result.info),
                               "message": {"role": result.role, "content": observation},
                               "invalid": result.invalid, "turn": self.turn})
        return observation, reward, terminated, truncated, info

    def _remember(self) -> None:
        """Keep the engine's snapshot after this prefix, if any, and the step's record."""
        self.prefixes.record(self._path[-1], self._move)
        snapshot = self._snapshot()
        if snapshot is None or self.snapshot_cache_size < 1:
            return
        self.prefixes.remember(snapshot, self._path, self.snapshot_cache_size)

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
        return EnvState(env_id=self.env_id, env_kwargs=kwargs, task_id=task.task_id,
                        seed=self._seed, actions=tuple(self._actions),
                        digests=tuple(self._digests), faults=tuple(sorted(self._faults.items())),
                        rng=self._rng)

    def state_mismatch(self, state: EnvState) -> str | None:
        """Why this env cannot restore ``state`` (another env, other episode settings, more
        actions than its turns, a task it lacks), or None; before any work that grows with
        the state's length."""
        if state.env_id != self.env_id:
            return f"state belongs to {state.env_id!r}, this env is {self.env_id!r}"
        saved, own = self.episode_settings(state.env_kwargs), self.settings
        if saved != own:
            return (f"state was saved from {self.env_id} with the settings {saved}, this one "
                    f"has {own}; use agent_gym.make_from_state(state)")
        if state.depth > self.max_turns:
            return (f"the state has {state.depth} actions; an episode of this {self.env_id} "
                    f"takes at most max_turns={self.max_turns}")
        if state.task_id not in self._task_index:
            return f"task {state.task_id!r} of the saved state is not in this env's data"
        return None

    def _restore(self, state: EnvState | str | Mapping[str, Any]) -> tuple[str, ResetInfo]:
        state = EnvState.of(state)
        mismatch = self.state_mismatch(state)
        if mismatch is not None:
            raise StateError(mismatch)
        super().reset(seed=state.seed)
        if state.rng is not None:  # as the original was after its reset; seed stays the same
            self._np_random = decode_rng(state.rng)
        self._seed = state.seed
        self._rng = state.rng or encode_rng(self.np_random)
        self._recorded = dict(state.faults)
        try:
            try:
                return self._replay(state, use_store=True)
            except _StoreDisagrees:  # real replay decides whether the record or state is wrong
                self._recorded = dict(state.faults)
                return self._replay(state, use_store=False)
        except BaseException:
            self._task = None  # a half-replayed episode must not be stepped on: reset first
            raise

    def _replay(self, state: EnvState, use_store: bool) -> tuple[str, ResetInfo]:
        opening = self._begin(self.tasks[self._task_index[state.task_id]])
        self._check(0, state.digests[0], opening.observation)
        # Jump over the longest prefix of the state's actions known to ``prefixes``; the
        # skipped steps' transitions reproduce the failures recorded among them.
        ahead, source, faults = self.prefixes.jump(state, self._restore_snapshot, self._redo,
                                                   use_store)
        for step, message in faults:
            self._faults[step] = message
            del self._recorded[step]
        try:
            return self._replay_steps(state, opening, ahead, source)
        except StateMismatchError as err:
            if source == "store" and err.step <= len(ahead):
                raise _StoreDisagrees from err
            raise

    def _replay_steps(self, state: EnvState, opening: Opening, ahead: tuple[Transition, ...],
                      source: str | None) -> tuple[str, ResetInfo]:
        observation = opening.observation
        info: StepInfo = {}
        history: list[dict[str, Any]] = []
        rewards: list[float] = []
        terminated = truncated = False
        for step_index, action in enumerate(state.actions, start=1):
            if self._done:
                raise StateMismatchError(step_index, state.digests[step_index],
                                         "(episode already over)",
                                         f"the replayed episode ended before step {step_index}")
            outcome = (self._advance(action, ahead[step_index - 1])
                       if step_index <= len(ahead) else self.step(action))
            observation, reward, terminated, truncated, info = outcome
            rewards.append(reward)
            if step_index in self._recorded:
                raise StateError(f"the state records a backend failure at step {step_index}, but "
                                 "replaying that step called no backend")
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
        restored["episode_end"] = "terminated" if terminated else "truncated" if truncated else None
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
            raise ValueError(f"unknown reset options {sorted(unknown)}; use task_id, index "
                             "or state")
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

    @property
    def settings(self) -> dict[str, Any]:
        """This env's episode settings: what a saved state must match to restore here."""
        return self.episode_settings(_json_kwargs(self.env_id, self._env_kwargs))

    def task_position(self, task_id: str) -> int | None:
        """The index of the task ``task_id`` in this env's data, or None if it lacks it."""
        return self._task_index.get(task_id)

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
        keeps_snapshots = (self.snapshot_cache_size > 0
                           and type(self)._snapshot is not TextEnv._snapshot)
        self.prefixes.begin(task.task_id, lambda: self._prefix_root(task), keeps_snapshots)
        self._digests = [digest(opening.observation)]
        self._transcript = [opening.observation]
        return opening

    def _prefix_root(self, task: Task) -> list[Any] | None:
        """What names the task's start in the host store, or None when no record is kept."""
        fingerprint = self._fingerprint(task)
        if fingerprint is None:
            return None
        return [self.env_id, self.settings, task.task_id, fingerprint]

    def _opening_info(self, opening: Opening) -> ResetInfo:
        return cast(ResetInfo, {**opening.info, "task_id": self.task.task_id,
                                "messages": opening.messages, "tools": opening.tools,
                                "privileged": opening.privileged, "turn": self.turn})


class OutcomeEnv(TextEnv):
    """A TextEnv whose episodes end right or wrong: an answer graded, a game won.

    The two outcome rewards are arguments of every such env (1/0 and +1/-1 schemes are a
    matter of configuration), and an episode whose turns run out before an outcome scores
    ``reward_incorrect`` on its last step, marked ``info["no_answer"]``: stalling is never
    worth more than a wrong answer.
    """

    def __init__(
        self, tasks: Sequence[Task], *, max_turns: int, reward_correct: float = 1.0,
        reward_incorrect: float = 0.0, invalid_penalty: float = 0.0,
        max_action_chars: int = MAX_ACTION_CHARS, max_obs_chars: int = DEFAULT_MAX_OBS_CHARS,
        render_mode: str | None = None,
    ) -> None:
        super().__init__(tasks, max_turns=max_turns, invalid_penalty=invalid_penalty,
                         max_action_chars=max_action_chars, max_obs_chars=max_obs_chars,
                         render_mode=render_mode)
        self.reward_correct = untrusted.finite(reward_correct, "reward_correct")
        self.reward_incorrect = untrusted.finite(reward_incorrect, "reward_incorrect")

    def _outcome(self, correct: bool) -> float:
        return self.reward_correct if correct else self.reward_incorrect

    def _out_of_turns(self, last: Transition) -> Transition:
        return replace(
            last, reward=last.reward + self.reward_incorrect, info={**last.info, "no_answer": True}
        )


class EnvPart(NamedTuple):
    """A run of consecutive task indices and the weight a sampler gives it as a whole."""

    num_tasks: int
    weight: float


class EnvShape(NamedTuple):
    """How big an agent_gym env is: its number of tasks, the turns an episode may take, and
    its parts (a mixture's members in task order; one part for any other env)."""

    num_tasks: int
    max_turns: int
    parts: tuple[EnvPart, ...]


def describe_env(env_id: str, env_kwargs: Mapping[str, Any]) -> EnvShape:
    """The ``EnvShape`` of an agent_gym env (a ``TextEnv`` here, a mixture of them, or a
    remote one that reports tasks and turns), read from an instance."""
    env = gymnasium.make(env_id, **env_kwargs)
    try:
        num_tasks = getattr(env.unwrapped, "num_tasks", None)
        max_turns = getattr(env.unwrapped, "max_turns", None)
        if not (isinstance(num_tasks, int) and isinstance(max_turns, int)):
            raise ValueError(f"{env_id} is not an agent_gym env: it reports no tasks and turns")
        parts = getattr(env.unwrapped, "parts", None) or (EnvPart(num_tasks, 1.0),)
        return EnvShape(num_tasks, max_turns, tuple(parts))
    finally:
        env.close()
