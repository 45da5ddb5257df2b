"""world-large: the Search held-out set big enough to tell 10 points apart.

Its properties are checked on the generated files themselves: the recorded digests, the
sizes, that the two splits share no entity (found in the text, not taken from the
generator), that every answer is in its passage, that the env loads it by name, and that
a changed cache file or a differently drawn set is refused."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import gymnasium
import pytest

from agent_gym.data import DataError
from agent_gym.search import open_backend
from agent_gym.search import world_large as wl

ENV = "agent_gym/Search-v0"


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One private cache for the module: the set and its index are made once, never in the
    user's cache."""
    root = tmp_path_factory.mktemp("world-large-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AGENT_GYM_CACHE", str(root))
        yield root


@pytest.fixture(scope="module")
def files(cache: Path) -> Path:
    return wl.ensure()


@pytest.fixture(scope="module")
def passages(files: Path) -> dict[str, tuple[str, str]]:
    """Passage id -> (title, text)."""
    rows = map(json.loads, (files / wl.CORPUS_FILE).read_text(encoding="utf-8").splitlines())
    out = {}
    for row in rows:
        title, text = row["contents"].split("\n", 1)
        out[row["id"]] = (title.strip('"'), text)
    return out


@pytest.fixture(scope="module")
def qa(files: Path) -> list[dict]:
    return [json.loads(line)
            for line in (files / wl.QA_FILE).read_text(encoding="utf-8").splitlines()]


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text)


def entity(title: str) -> str:
    """The entity a passage is about, from its title ("History of X", "The tide clock")."""
    title = re.sub(r" \((river|career)\)$", "", title.removeprefix("History of "))
    if re.match(r"The [a-z]", title):  # an invention; a book's "The" is part of its title
        title = title.removeprefix("The ")
    return " ".join(words(title))


def entities(passages: dict[str, tuple[str, str]]) -> set[str]:
    """Every named thing in the corpus: what each passage is about, and the founders,
    governors, sources and mouths the passages name without a passage of their own."""
    names = {entity(title) for title, _ in passages.values()}
    patterns = [r"\b([A-Z]\w+ of the [A-Z]\w+)", r"governed by ([A-Z]\w+ [A-Z]\w+)\.",
                r"([A-Z]\w+ [A-Z]\w+) serves as governor", r"It rises in (?:the )?(.+?) and flows",
                r"and flows into (?:the )?(.+?)\."]
    for _, text in passages.values():
        for pattern in patterns:
            names.update(" ".join(words(m)) for m in re.findall(pattern, text))
    return names


def mentioned(text: str, names: set[str]) -> set[str]:
    """The names among ``names`` that ``text`` contains as whole words."""
    tokens = words(text)
    grams = {" ".join(tokens[i:i + n]) for n in range(1, 6) for i in range(len(tokens))}
    return grams & names


def test_generation_is_deterministic_and_matches_the_recorded_digests() -> None:
    first, second = wl.render(), wl.render()
    assert first == second
    assert {n: hashlib.sha256(b).hexdigest() for n, b in first.items()} == wl.DIGESTS
    # another process with another string-hash seed draws the same set (no set-order luck)
    code = ("from agent_gym.search import world_large as wl; import hashlib; "
            "print(sorted(hashlib.sha256(b).hexdigest() for b in wl.render().values()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONHASHSEED": "4242"}).stdout
    assert out.strip() == str(sorted(wl.DIGESTS.values()))


def test_sizes_and_hop_mix(qa: list[dict], passages: dict[str, tuple[str, str]]) -> None:
    splits = Counter(q["split"] for q in qa)
    assert splits == {"train": 1000, "test": 250} and len(passages) == 4120
    assert len({q["id"] for q in qa}) == len(qa) and len({q["question"] for q in qa}) == len(qa)
    hops = {s: Counter(q["hops"] for q in qa if q["split"] == s) for s in splits}
    for split, count in splits.items():  # the same template mix on both sides
        assert {h: n / count for h, n in hops[split].items()} == {1: 0.544, 2: 0.4, 3: 0.056}


def test_splits_share_no_entity(qa: list[dict], passages: dict[str, tuple[str, str]]) -> None:
    """No entity a test question asks about or its passages name is in any train question
    or in a passage a train question needs."""
    names = entities(passages)
    assert len(names) > 3000  # the extraction found the world, not a handful
    footprint: dict[str, set[str]] = {"train": set(), "test": set()}
    for q in qa:
        texts = [q["question"]] + [passages[p][1] for p in q["supporting"]]
        found = set().union(*(mentioned(t, names) for t in texts))
        # every passage's own entity, the question's answer among them, is seen
        assert {entity(passages[p][0]) for p in q["supporting"]} <= found
        footprint[q["split"]] |= found
    assert footprint["test"] and not footprint["test"] & footprint["train"]
    answers = {s: {" ".join(words(q["answers"][0])) for q in qa if q["split"] == s}
               for s in footprint}
    # the named answers (towns, people, rivers, waters) are in the test side's footprint
    named = {a for a in answers["test"] if not a.isdigit() and a not in MONTHS}
    assert named and named <= footprint["test"]


MONTHS = {"March", "April", "May", "June", "July", "August", "September", "October"}


def test_every_answer_and_bridge_is_in_the_text(
    qa: list[dict], passages: dict[str, tuple[str, str]]
) -> None:
    """The answer is stated by the last supporting passage, and each earlier passage names
    the entity of the next one (so the hops can be followed by reading)."""
    for q in qa:
        chain = [passages[p] for p in q["supporting"]]
        assert re.search(rf"\b{re.escape(q['answers'][0])}\b", chain[-1][1]), q["id"]
        for (_, text), (title, _) in pairwise(chain):
            assert mentioned(text, {entity(title)}), q["id"]


def test_oracle_searches_find_the_gold_passages(
    files: Path, qa: list[dict]
) -> None:
    """Every search of the train oracle finds its passage in the top 3 (so SFT
    demonstrations never answer from nothing); nearly every test one does too."""
    backend = open_backend("bm25", corpus=str(files / wl.CORPUS_FILE))
    try:
        missed = Counter()
        for split in ("train", "test"):
            hops = [(q, k) for q in qa if q["split"] == split for k in range(q["hops"])]
            results = backend.search([q["oracle_queries"][k] for q, k in hops], 3)
            missed[split] = sum(q["supporting"][k] not in [p.id for p in found]
                                for (q, k), found in zip(hops, results, strict=True))
    finally:
        backend.close()
    assert missed["train"] == 0 and missed["test"] <= 3  # of 1512 and 378 searches


def test_env_loads_it_by_name_and_the_oracle_solves_test_tasks(cache: Path) -> None:
    test = gymnasium.make(ENV, dataset="world-large", split="test")
    train = gymnasium.make(ENV, dataset="world-large", split="train")
    try:
        assert len(test.unwrapped.tasks) == 250 and len(train.unwrapped.tasks) == 1000
        corpus_sha = wl.DIGESTS[wl.CORPUS_FILE][:16]
        assert test.unwrapped.backend.name.endswith(corpus_sha)  # its own corpus, not bundled
        assert {t.task_id.split("-")[0] for t in test.unwrapped.tasks} == {"test"}
        for index in range(0, 250, 25):
            _, info = test.reset(options={"index": index})
            gold = info["privileged"]["gold_passage_ids"]
            seen: list[str] = []
            for action in info["privileged"]["oracle_actions"]:
                _, reward, terminated, _, step = test.step(action)
                seen += step.get("passage_ids", [])
            assert (reward, terminated) == (1.0, True) and set(gold) <= set(seen)
    finally:
        test.close()
        train.close()
    bundled = gymnasium.make(ENV, split="test")  # the small set is still the default
    assert len(bundled.unwrapped.tasks) == 18
    bundled.close()


def test_a_changed_cache_file_is_refused_and_kept(tmp_path: Path) -> None:
    directory = wl.ensure(tmp_path)
    qa_file = directory / wl.QA_FILE
    changed = qa_file.read_bytes().replace(b'"answers": ["', b'"answers": ["1', 1)
    qa_file.write_bytes(changed)
    with pytest.raises(DataError, match="does not match the SHA-256 recorded"):
        wl.ensure(tmp_path)
    assert qa_file.read_bytes() == changed  # the user's file is never overwritten
    qa_file.unlink()  # a missing file is generated again
    assert wl.ensure(tmp_path) == directory
    assert hashlib.sha256(qa_file.read_bytes()).hexdigest() == wl.DIGESTS[wl.QA_FILE]


def test_a_differently_drawn_set_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What another Python's random numbers would do: the output differs from the record."""
    monkeypatch.setattr(wl, "SEED", wl.SEED + 1)
    with pytest.raises(DataError, match="not the recorded"):
        wl.ensure(tmp_path)
    assert not any(tmp_path.rglob("*.jsonl"))  # nothing of it was written
