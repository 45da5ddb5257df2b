"""The prefixes an env has played, behind its fast restores: ``PrefixIndex``.

In this instance: an env whose engine can snapshot itself cheaply implements ``_snapshot``
and ``_restore_snapshot``. The index then keeps, per task and action prefix the instance has
played, the engine snapshot and the transitions on the way (least recently used first out,
at most ``TextEnv.snapshot_cache_size``). A prefix is named by a digest chained over the task
and each action with its fault (``chain_key``), so naming every prefix of a state, and
finding the deepest one held, takes time linear in the state's length; the transitions are
shared with the episode that played them rather than copied per prefix. A restore jumps to
the deepest cached prefix of the state's actions and replays only the rest; the cached
transitions go through the same bookkeeping and digest check as replayed ones, so a state
whose observations differ still fails at the step that differs. The restore's info says how
many steps were skipped (``snapshot_depth``) out of ``restored_depth``.

In a fresh instance or process: an env that can also describe what each step did to its
engine in a form any instance can redo (``_move``, JSON), redo such moves from a task's
start (``_redo``) and name the content of its tasks (``_fingerprint``) opts in with
``TextEnv.use_prefix_store(store)``, a ``HostStore``. The store then records, for every
prefix it plays, keyed by a digest chained over the env, its episode settings, the task's
content, this code (``code_fingerprint``) and each action with its fault (``chain_key``),
the transition ``_step`` returned and the move. A restore redoes the moves of the longest
recorded prefix of the state's actions (milliseconds, no text is generated) and takes those
steps' transitions from the record, again through the same bookkeeping and digest check:
the state only selects records, which the host alone writes from what it computed, so it
can never make the env believe an observation it did not produce. Should a record ever
disagree with a state's digest the restore is done again by real replay, which decides: a
tampered state still fails at the step that differs, and a stale record is overwritten.
``info["snapshot_source"]`` says where the skipped steps came from ("instance", "store" or
None).
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from agent_gym.env.state import EnvState
from agent_gym.env.types import Transition
from agent_gym.hoststore import HostStore, code_fingerprint, deflate, inflate


class PrefixKey(NamedTuple):
    """A prefix this instance holds a snapshot of: its task, its number of actions, and the
    digest chained over the task and those actions with their faults."""

    task_id: str
    depth: int
    chain: str


@dataclass(frozen=True)
class _Prefix:
    """A point this env reached: its engine snapshot there and the transitions on the way
    from the task's start, as ``_step`` returned them (the base's rules are applied again
    when they are replayed, so they are applied exactly once). ``path`` is the episode's own
    list, which only ever grows: its first ``depth`` entries are this prefix's, so keeping a
    prefix costs nothing per step."""

    snapshot: object
    path: list[Transition]
    depth: int


class _StoreDisagrees(Exception):
    """A transition from the host store did not match the state being restored."""


def chain_key(previous: str, action: str, fault: str | None) -> str:
    """The key of a prefix one action longer than the one keyed ``previous``."""
    link = json.dumps([previous, action, fault], ensure_ascii=False)
    return hashlib.sha256(link.encode("utf-8", "surrogatepass")).hexdigest()


def _task_key(task_id: str) -> str:
    """The chain's start for a task's snapshots (``chain_key`` extends it)."""
    return hashlib.sha256(json.dumps(["agent_gym task", task_id]).encode("utf-8",
                                     "surrogatepass")).hexdigest()


def _chain(start: str, state: EnvState) -> list[str]:
    """``start`` followed by the key of each prefix of the state's actions, in one pass."""
    faults = dict(state.faults)
    keys = [start]
    for step, action in enumerate(state.actions, start=1):
        keys.append(chain_key(keys[-1], action, faults.get(step)))
    return keys


class PrefixIndex:
    """The prefixes one env instance knows: its snapshots, and the host store if any."""

    def __init__(self, store: HostStore | None = None) -> None:
        self._snapshots: OrderedDict[PrefixKey, _Prefix] = OrderedDict()
        self._store = store
        self._chain: list[str] = []  # the store keys of this episode's prefixes
        self._task_id = ""
        self._local = ""  # the snapshot key of this episode's prefix (its chain digest)

    # ----------------------------------------------------------------- public
    @property
    def store(self) -> HostStore | None:
        """The host store the prefixes are recorded in, or None."""
        return self._store

    def use_store(self, store: HostStore | None) -> None:
        """Record the prefixes played from the next episode on in ``store`` (a ``HostStore``
        shared by the host's processes), and restore from its records; None stops both.
        Only an env that implements ``_fingerprint``, ``_move`` and ``_redo`` gains."""
        self._store = store

    def clear(self) -> None:
        """Forget this instance's snapshots (the host store keeps its records)."""
        self._snapshots.clear()

    def snapshots(self) -> list[PrefixKey]:
        """The prefixes this instance holds snapshots of, least recently used first."""
        return list(self._snapshots)

    def forget(self, key: PrefixKey) -> None:
        """Drop the snapshot of one prefix, if held."""
        self._snapshots.pop(key, None)

    @property
    def head(self) -> str | None:
        """The host-store key of the current episode's prefix, None when none is kept."""
        return self._chain[-1] if self._chain else None

    # ----------------------------------------------------------------- for TextEnv
    def begin(self, task_id: str, root: Callable[[], Sequence[Any] | None],
              snapshots: bool) -> None:
        """Start an episode's chains; ``root`` names its start in the store (None: keep no
        record) and is only asked when there is a store. ``snapshots``: whether this env
        keeps snapshots at all; an env that does not pays nothing per step for naming them."""
        self._task_id = task_id
        self._local = _task_key(task_id) if snapshots else ""
        self._chain = []
        parts = root() if self._store is not None else None
        if parts is None:
            return
        start = json.dumps(["agent_gym prefix", code_fingerprint(), *parts], sort_keys=True,
                           ensure_ascii=False)
        self._chain = [hashlib.sha256(start.encode("utf-8", "surrogatepass")).hexdigest()]

    def advance(self, action: str, fault: str | None) -> None:
        if self._local:
            self._local = chain_key(self._local, action, fault)
        if self._chain:
            self._chain.append(chain_key(self._chain[-1], action, fault))

    def record(self, transition: Transition, move: Callable[[], Any]) -> None:
        """Record the step that led to the current prefix in the host store, if any, with
        ``move()`` (None or a value that is not JSON: the step is not kept)."""
        if self._store is None or not self._chain:
            return
        done = move()
        if done is None:
            return
        try:
            text = json.dumps({"transition": _transition_json(transition), "move": done},
                              ensure_ascii=False)
        except (TypeError, ValueError):  # an info that is not JSON: this step is not kept
            return
        self._store.put(self._chain[-1], deflate(text.encode("utf-8", "surrogatepass")))

    def remember(self, snapshot: object, path: list[Transition], size: int) -> None:
        """Keep the engine's snapshot after the current prefix, whose transitions are
        ``path`` (the episode's list, appended to and never changed), at most ``size``."""
        if not self._local:  # the episode began without snapshots: its prefixes are unnamed
            return
        key = PrefixKey(self._task_id, len(path), self._local)
        self._snapshots[key] = _Prefix(snapshot, path, len(path))
        self._snapshots.move_to_end(key)
        while len(self._snapshots) > size:
            self._snapshots.popitem(last=False)

    def jump(
        self, state: EnvState, restore: Callable[[object], bool],
        redo: Callable[[list[Any]], bool], use_store: bool,
    ) -> tuple[tuple[Transition, ...], str | None, tuple[tuple[int, str], ...]]:
        """Put the engine after the longest known prefix of the state's actions -- a
        snapshot of this instance (``restore``), or the moves the host store recorded
        (``redo``) when it knows a deeper one -- and return the transitions on the way
        there, where they came from and the faults among them; ((), None, ()) when
        neither knows any."""
        recorded = self._recorded(state) if use_store else []
        held = _chain(_task_key(state.task_id), state) if self._snapshots else []
        for depth in range(len(state.actions), 0, -1):
            # At equal depth a snapshot of this instance wins: it restores everything the
            # engine had built there, where redone moves leave it to be built again.
            key = PrefixKey(state.task_id, depth, held[depth]) if held else None
            prefix = self._snapshots.get(key) if key else None
            if key is not None and prefix is not None:
                if restore(prefix.snapshot):
                    self._snapshots.move_to_end(key)
                    return tuple(prefix.path[:depth]), "instance", _faults_to(state, depth)
                del self._snapshots[key]  # stale: a shallower one may still be good
            if depth <= len(recorded):
                if redo([move for _, move in recorded[:depth]]):
                    return (tuple(transition for transition, _ in recorded[:depth]), "store",
                            _faults_to(state, depth))
                recorded = []  # the engine cannot redo them: only snapshots are left
        return (), None, ()

    def _recorded(self, state: EnvState) -> list[tuple[Transition, Any]]:
        """The transitions and moves the host store holds for the state's first steps,
        as far as it holds every one of them."""
        if self._store is None or not self._chain or not state.actions:
            return []
        keys = _chain(self._chain[0], state)
        found = self._store.get_many(keys[1:])
        recorded = []
        for key in keys[1:]:
            if key not in found:
                break
            try:
                entry = json.loads(inflate(found[key]).decode("utf-8", "surrogatepass"))
                recorded.append((_transition_from_json(entry["transition"]), entry["move"]))
            except (ValueError, KeyError, TypeError, zlib.error):  # damaged: stop there
                break
        return recorded


def _faults_to(state: EnvState, depth: int) -> tuple[tuple[int, str], ...]:
    return tuple(fault for fault in state.faults if fault[0] <= depth)


def _transition_json(transition: Transition) -> dict[str, Any]:
    return {"observation": transition.observation, "reward": float(transition.reward),
            "terminated": transition.terminated, "invalid": transition.invalid,
            "role": transition.role, "info": transition.info}


def _transition_from_json(data: Mapping[str, Any]) -> Transition:
    return Transition(str(data["observation"]), float(data["reward"]),
                      bool(data["terminated"]), bool(data["invalid"]), str(data["role"]),
                      dict(data["info"]))
