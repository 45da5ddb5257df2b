"""Passages, the backend interface and the corpus reader shared by every search backend.

Every backend answers a *batch* of queries at once (`search(queries, topk)`), because that is
what a retrieval server and a vectorised rollout want; a single query is a batch of one.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


class SearchError(RuntimeError):
    """A backend could not answer (server down, retries exhausted, malformed reply).

    Environments turn it into an error observation instead of crashing the episode.
    """


class CorpusError(ValueError):
    """A corpus file or record is malformed; the message names the file and line."""


@dataclass(frozen=True)
class Passage:
    """One retrieved passage. `score` is backend-specific and only used for ranking."""

    id: str
    title: str
    text: str
    score: float = 0.0

    @property
    def contents(self) -> str:
        """Search-R1's wire form: the title in quotes on the first line, then the text."""
        return f'"{self.title}"\n{self.text}'

    @classmethod
    def from_contents(cls, pid: str, contents: str, score: float = 0.0) -> Passage:
        """Split Search-R1's `'"Title"\\ntext'`; without a title line the title is empty."""
        head, sep, rest = contents.partition("\n")
        if sep and len(head) >= 2 and head.startswith('"') and head.endswith('"'):
            return cls(pid, head[1:-1], rest, score)
        return cls(pid, "", contents, score)

    @classmethod
    def from_record(cls, record: Any, default_id: str) -> Passage:
        """Read `{"id", "contents"}` (Search-R1) or `{"id"?, "title", "text"}` records."""
        if not isinstance(record, dict):
            raise CorpusError(f"expected a JSON object, got {type(record).__name__}")
        pid = str(record.get("id", default_id))
        if isinstance(record.get("contents"), str):
            return cls.from_contents(pid, record["contents"])
        title, text = record.get("title", ""), record.get("text")
        if not isinstance(text, str) or not isinstance(title, str):
            raise CorpusError('a passage needs a string "contents", or string "title" and "text"')
        return cls(pid, title, text)

    def to_wire(self) -> dict[str, Any]:
        """One hit of Search-R1's `/retrieve` reply."""
        return {"document": {"id": self.id, "contents": self.contents}, "score": self.score}

    @classmethod
    def from_wire(cls, hit: Any) -> Passage:
        """Parse one hit of a `/retrieve` reply, with or without scores."""
        # Errors name types, never repr the reply: a deeply nested one overflows repr's stack.
        doc = hit.get("document", hit) if isinstance(hit, dict) else None
        if not isinstance(doc, dict) or not isinstance(doc.get("contents"), str):
            raise ValueError(f"a hit needs a document with string contents, got "
                             f"{type(hit).__name__}")
        pid, score = doc.get("id", ""), hit.get("score", 0.0)
        if isinstance(pid, bool) or not isinstance(pid, str | int):
            raise ValueError(f"a document id must be a string or an integer, got "
                             f"{type(pid).__name__}")
        if isinstance(score, bool) or not isinstance(score, int | float):
            raise ValueError(f"a hit's score must be a number, got {type(score).__name__}")
        return cls.from_contents(str(pid), doc["contents"], float(score))

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "title": self.title, "text": self.text, "score": self.score}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Passage:
        return cls(str(data["id"]), data["title"], data["text"], float(data.get("score", 0.0)))


@runtime_checkable
class SearchBackend(Protocol):
    """What environments, the server and the cache need from a retriever.

    `name` identifies the backend *and the data behind it* (a corpus fingerprint, a URL), so
    a response cache never serves one corpus's results for another.
    """

    name: str

    def search(self, queries: Sequence[str], topk: int) -> list[list[Passage]]: ...

    def close(self) -> None: ...


def iter_corpus(path: str | Path) -> Iterator[Passage]:
    """Yield the passages of a JSONL (optionally .gz) corpus, naming the line of any bad record."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"corpus file not found: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                yield Passage.from_record(json.loads(line), default_id=str(line_no - 1))
            except (json.JSONDecodeError, CorpusError) as exc:
                raise CorpusError(f"{path}:{line_no}: {exc}") from None


def check_batch(queries: Sequence[str], topk: int) -> None:
    """Reject bad arguments before they reach an index or the network."""
    if isinstance(queries, str) or not all(isinstance(q, str) for q in queries):
        raise TypeError("queries must be a sequence of strings")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be a positive integer, got {topk!r}")
