"""Every in-flight episode of a run, journaled at each turn boundary, so that a run killed
at any moment resumes its rollouts where they stood instead of sampling them again.

A run's ``rollouts.sqlite`` holds, for each branch of each group of each step not yet in
a checkpoint, its latest turn boundary: the env's saved state (``EnvState``), the exact
prompt tokens and chat, the token sequence with the sampler's logprobs, the rewards so
far, and the weight version that sampled it; or, once it ended, the finished episode.
SQLite in WAL mode: each record is one small transaction, and a kill (of the process; the
OS survives) loses at most the record being written.

A continued run asks the journal for each group it is about to roll out (``take``):

* a group whose branches all finished is reused as it is, if the version that sampled it
  is within ``max_staleness`` of the step that trains it;
* a group with branches in flight continues them from their last turn, if they were
  sampled on the weights the run samples on now (the checkpoint's, or the same update
  redone): each env is restored from its saved state, which replays the actions and checks
  every observation digest, and the restored chat must equal the journaled one; then the
  branch samples its next turn with the seed it would have had (seeds depend on the step,
  group, branch and turn only);
* any other group is dropped, its journaled branches counted (``Resumed``), and
  rolled out afresh.

So an episode is never lost (a kill costs at most the turn in progress) and never counted
twice (a group is taken whole or not at all). The journal of a step is forgotten once a
checkpoint holds its update (``forget_before``). A journal left by a run with other
settings (``fingerprint``) is discarded when the run opens, and said so.

The journal is read as untrusted: a record is reused only if it has the digest written
with it, a SHA-256 over the run's fingerprint, the record's place (step, purpose, group,
branch) and its content; one that fails is dropped with its group and rolled out afresh, so
a reward edited to 1000 is never trained on. A digest, not an HMAC: what it guards against
is a journal damaged, edited by hand or by a tool, left by another version, or copied
from another run or slot; whoever can write the run directory on purpose can as well
replace the checkpoint's weights beside it, and a key kept there would be theirs too. A
file that is not a readable SQLite database (cut, overwritten) is moved aside
(``rollouts.sqlite.damaged``) and reported in one line (``check_journal``).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent_gym import untrusted
from agent_gym.durable import set_aside
from agent_gym.env.state import EnvState, StateError
from agent_gym_train.run.episode import DatumError, Episode, TokenSequence
from agent_gym_train.run.files import RunConfigError

JOURNAL_FILE = "rollouts.sqlite"
# Settings that change how a run proceeds or where it runs, but not what its rollouts are:
# a rerun may change them and keep its journal (a vLLM server started again listens on
# another port; each branch records the weights version that sampled it).
NOT_FINGERPRINTED = frozenset({"out", "progress", "threads", "device", "ray", "api_key",
                               "concurrency", "steps", "save_every", "preset",
                               "activation_checkpointing", "vllm_url", "cpu_budget"})
MAX_RECORD_CHARS = 256 * 2**20  # a branch's transcript and tokens; a longer one is dropped
_COLUMNS = ["step", "purpose", "grp", "branch", "record", "digest"]


class JournalError(ValueError):
    """A journal record that cannot be read back."""


@dataclass
class BranchRecord:
    """One branch at its last turn boundary (``episode`` None) or finished."""

    version: int  # the weight version that sampled it
    state: EnvState | None  # the env after its last step (None once finished)
    tokens: list[int]  # the prompt to continue from
    messages: list[dict[str, Any]]  # the chat those tokens render
    sequence: TokenSequence
    rewards: list[float]
    invalid: int
    cut: int
    earlier: list[TokenSequence] = field(default_factory=list)  # closed by window cuts
    dropped: list[dict[str, Any]] = field(default_factory=list)  # messages cut from view
    episode: Episode | None = None

    def to_json(self) -> str:
        return json.dumps({
            "version": self.version,
            "state": None if self.state is None else json.loads(self.state.to_json()),
            "tokens": self.tokens, "messages": self.messages,
            "sequence": self.sequence.to_dict(), "rewards": self.rewards,
            "invalid": self.invalid, "cut": self.cut,
            "earlier": [s.to_dict() for s in self.earlier], "dropped": self.dropped,
            "episode": None if self.episode is None else _episode_to_dict(self.episode),
        })  # ASCII: a lone surrogate in a chat is stored escaped, not refused

    @classmethod
    def from_json(cls, text: str) -> BranchRecord:
        try:
            payload = untrusted.loads(text)
            state = payload["state"]
            episode = payload["episode"]
            record = cls(
                version=_int(payload["version"]),
                state=None if state is None else EnvState.from_dict(state),
                tokens=[_int(t) for t in payload["tokens"]],
                messages=[dict(m) for m in payload["messages"]],
                sequence=TokenSequence.from_dict(payload["sequence"]),
                rewards=[untrusted.finite(r, "reward") for r in payload["rewards"]],
                invalid=_int(payload["invalid"]), cut=_int(payload["cut"]),
                earlier=[TokenSequence.from_dict(s) for s in payload["earlier"]],
                dropped=[dict(m) for m in payload["dropped"]],
                episode=None if episode is None else _episode_from_dict(episode),
            )
        except (untrusted.UntrustedJSONError, StateError, DatumError, KeyError, TypeError,
                ValueError) as err:
            raise JournalError(f"a journaled branch cannot be read: {err}") from None
        if (record.state is None) == (record.episode is None):
            raise JournalError("a journaled branch is either in flight (an env state) or "
                               "finished (an episode)")
        return record


@dataclass(frozen=True)
class GroupJournal:
    """One group's place in the journal, and the weights it is sampled on now."""

    journal: Journal
    step: int
    purpose: str
    group: int
    version: int

    def take(self, branches: int) -> dict[int, BranchRecord]:
        return self.journal.take(self.step, self.purpose, self.group, version=self.version,
                                 branches=branches)

    def record(self, branch: int, record: BranchRecord) -> None:
        self.journal.record(self.step, self.purpose, self.group, branch, record)


@dataclass
class Resumed:
    """What a step's rollouts took from the journal, for its metrics line."""

    reused_episodes: int = 0  # finished episodes taken as they were
    resumed_branches: int = 0  # branches continued from their last turn
    dropped_branches: int = 0  # journaled branches thrown away (too stale, unreadable)


class Journal:
    """A run's journal of in-flight episodes (see the module docstring). Thread-safe: the
    rollout worker records while the learner forgets."""

    def __init__(self, path: Path, fingerprint: Mapping[str, object], max_staleness: int = 0
                 ) -> None:
        self.path = path
        self.max_staleness = max_staleness
        self._resumed: dict[int, Resumed] = {}
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # durable across a killed process
        self._db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)")
        self.discarded = 0  # branches thrown away on opening (another run's, unverifiable)
        columns = [row[1] for row in self._db.execute("PRAGMA table_info(branches)")]
        if columns and columns != _COLUMNS:  # an older journal: its records carry no digest
            self.discarded = self._db.execute("SELECT COUNT(*) FROM branches").fetchone()[0]
            self._db.execute("DROP TABLE branches")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS branches (step INTEGER, purpose TEXT, grp INTEGER, "
            "branch INTEGER, record TEXT, digest TEXT, PRIMARY KEY (step, purpose, grp, branch))")
        self._wanted = json.dumps(dict(fingerprint), sort_keys=True, default=str)
        row = self._db.execute("SELECT value FROM meta WHERE key = 'fingerprint'").fetchone()
        if row is not None and row[0] != self._wanted:
            self.discarded += self._db.execute("SELECT COUNT(*) FROM branches").fetchone()[0]
            self._db.execute("DELETE FROM branches")
        self._db.execute("INSERT OR REPLACE INTO meta VALUES ('fingerprint', ?)",
                         (self._wanted,))

    def _digest(self, step: int, purpose: str, group: int, branch: int, text: str) -> str:
        place = json.dumps([self._wanted, step, purpose, group, branch])
        return hashlib.sha256(f"{place}\n{text}".encode("utf-8", "surrogatepass")).hexdigest()

    def record(self, step: int, purpose: str, group: int, branch: int,
               record: BranchRecord) -> None:
        """A branch's latest turn boundary, or its end; replaces what was there."""
        text = record.to_json()
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO branches VALUES (?, ?, ?, ?, ?, ?)",
                             (step, purpose, group, branch, text,
                              self._digest(step, purpose, group, branch, text)))

    def take(self, step: int, purpose: str, group: int, *, version: int, branches: int
             ) -> dict[int, BranchRecord]:
        """What a continued run reuses of group ``group`` of ``step``, about to be sampled on
        weight ``version`` with ``branches`` branches, by branch (empty: roll it out afresh;
        see the module docstring)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT branch, CASE WHEN length(record) <= ? THEN record END, digest "
                "FROM branches WHERE step = ? AND purpose = ? AND grp = ?",
                (MAX_RECORD_CHARS, step, purpose, group)).fetchall()
        if not rows:
            return {}
        counts = self._resumed.setdefault(step, Resumed())
        try:
            found = {int(b): self._verified(step, purpose, group, b, text, digest)
                     for b, text, digest in rows}
        except JournalError:
            found = {}
        versions = {r.version for r in found.values()}
        finished = [b for b, r in found.items() if r.episode is not None]
        usable = (
            len(found) == len(rows) and len(versions) == 1
            and set(found) <= set(range(branches))
            and step - min(versions) <= self.max_staleness
            and (len(finished) == branches or versions == {version})
        )
        if not usable:
            self._drop(step, purpose, group)
            counts.dropped_branches += len(rows)
            return {}
        counts.reused_episodes += len(finished)
        counts.resumed_branches += len(found) - len(finished)
        return found

    def _verified(self, step: int, purpose: str, group: int, branch: object, text: object,
                  digest: object) -> BranchRecord:
        """A row read back, once its digest is the one written with it."""
        if not (type(branch) is int and isinstance(text, str) and isinstance(digest, str)
                and digest == self._digest(step, purpose, group, branch, text)):
            raise JournalError("a journaled branch is not as it was written (its digest "
                               "differs, or it is too long)")
        return BranchRecord.from_json(text)

    def resumed(self, step: int) -> Resumed:
        """What step ``step``'s rollouts took from the journal (all zero in a run that was
        never stopped)."""
        return self._resumed.pop(step, Resumed())

    def forget_before(self, step: int) -> None:
        """Steps before ``step`` are in a checkpoint: their rollouts are needed no more."""
        with self._lock:
            self._db.execute("DELETE FROM branches WHERE step < ?", (step,))

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _drop(self, step: int, purpose: str, group: int) -> None:
        with self._lock:
            self._db.execute("DELETE FROM branches WHERE step = ? AND purpose = ? AND grp = ?",
                             (step, purpose, group))


def check_journal(path: Path) -> None:
    """A ``RunConfigError`` when the journal at ``path`` (if any) is not a SQLite database
    whose pages all read, with the file (and its WAL) moved aside first: a journal cut in
    half or overwritten ended every resume in a traceback. Linear in the file's size."""
    if not path.exists():
        return
    try:
        db = sqlite3.connect(path)
        try:
            problems = [row[0] for row in db.execute("PRAGMA quick_check(1)")]
        finally:
            db.close()
        if problems == ["ok"]:
            return
        problem = problems[0] if problems else "no answer to a check"
    except sqlite3.Error as err:
        problem = str(err)
    aside = set_aside(path)
    for sibling in ("-wal", "-shm"):
        companion = path.with_name(path.name + sibling)
        if companion.exists():
            companion.rename(aside.with_name(aside.name + sibling))
    raise RunConfigError(f"{path} is not a readable journal ({problem}); moved to "
                         f"{aside.name}: run again to roll out its steps afresh")


def fingerprint(args: Mapping[str, object]) -> dict[str, object]:
    """The settings a journal's rollouts depend on (a run's arguments, as a dict)."""
    return {key: value for key, value in args.items() if key not in NOT_FINGERPRINTED}


def _int(value: object) -> int:
    if type(value) is not int:
        raise TypeError(f"expected an integer, got {type(value).__name__}")
    return value


def _episode_to_dict(episode: Episode) -> dict[str, Any]:
    return {
        "task_id": episode.task_id, "sequence": episode.sequence.to_dict(),
        "reward": episode.reward, "end_reason": episode.end_reason,
        "messages": episode.messages, "invalid_actions": episode.invalid_actions,
        "step_rewards": episode.step_rewards, "opening_messages": episode.opening_messages,
        "privileged": episode.privileged, "cut_replies": episode.cut_replies,
        "earlier": [s.to_dict() for s in episode.earlier], "version": episode.version,
    }


def _episode_from_dict(payload: Mapping[str, Any]) -> Episode:
    earlier: Sequence[Any] = payload["earlier"]
    return Episode(
        str(payload["task_id"]), TokenSequence.from_dict(payload["sequence"]),
        untrusted.finite(payload["reward"], "reward"), str(payload["end_reason"]),
        [dict(m) for m in payload["messages"]], _int(payload["invalid_actions"]),
        step_rewards=[untrusted.finite(r, "reward") for r in payload["step_rewards"]],
        opening_messages=_int(payload["opening_messages"]),
        privileged=dict(payload["privileged"]), cut_replies=_int(payload["cut_replies"]),
        earlier=tuple(TokenSequence.from_dict(s) for s in earlier),
        version=_int(payload["version"]),
    )
