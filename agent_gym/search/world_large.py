"""world-large: a held-out set big enough to tell 10 points apart, kept apart by construction.

Two worlds are drawn by `agent_gym.search.world`'s generator from disjoint name pools and
written into one corpus: every question of the ``train`` split is about the train world,
every question of the ``test`` split about the test world. Each world's facts only ever
name entities of the same world (towns, people, rivers, provinces, sources and mouths,
founders, governors, inventions, books): the names of places and people are cut from
roots no other pool uses (no town of one world shares even its root with a town of the
other), founders come from places of their own world, and the invention and book names
are dealt out between the worlds. So nothing a train question asks or a passage it needs
says anything about a test question or its answer.
Both worlds are in the corpus, so every search still meets the other world's passages as
distractors. Both splits use the same templates in the same proportions (the train quotas
are four times the test ones), one-hop and multi-hop alike.

Generated once into the cache on first use (`ensure`) and checked against the SHA-256
digests recorded below: a Python whose `random` or text rendering draws another set is
refused rather than silently measured on, and a cached file that changed is refused too.
Print the directory of the files (say, for `agent-gym search index` and a server)::

    python -m agent_gym.search.world_large
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
from pathlib import Path

from agent_gym.data import DataError
from agent_gym.durable import SHARED_MODE, replace_file
from agent_gym.paths import cache_root
from agent_gym.search.bm25 import corpus_sha256
from agent_gym.search.world import Corpus, Quotas, Spec, build_world, jsonl, questions

NAME = "world-large"
DESCRIPTION = ("Generate the world-large search set into the cache (if not there yet), check "
               "it, and print its directory.")
CORPUS_FILE = "search_corpus.jsonl"
QA_FILE = "search_qa.jsonl"
# The SHA-256 of each generated file. Changing the generator changes these: record the new
# ones (tests/search/test_world_large.py shows them when it fails) and say so, since figures
# measured on the old set no longer compare. The cache directory is named after them, so an
# old set is never read as new.
DIGESTS = {
    CORPUS_FILE: "fac8af40e8e9a95973599156d479bb0e3d3e4680fc1a6f8857ef427795adc8d0",
    QA_FILE: "f1414fbf8677af28df7dae8c1febb48e82359e4453fb39697db3eefb2c6470ca",
}
SEED = 20270301
TEST_QUOTAS = Quotas(founded=26, town_river=20, inventor=20, author=16, capital=10, mouth=10,
                     deathplace=20, festival_month=14, inventor_birthplace=26, author_born=20,
                     birthplace_river=24, teacher_born=20, capital_founder=10,
                     inventor_birthplace_twin=14)
TRAIN_SCALE = 4  # the train world and its quotas are this many times the test world's

# Roots of every name: an onset, a vowel and a coda ("Br" + "ei" + "nd").
_ONSETS = ["B", "Br", "C", "Cr", "D", "Dr", "F", "G", "Gr", "H", "K", "L", "M", "N", "P",
           "R", "S", "Sk", "St", "T", "Th", "V", "W"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ei"]
_CODAS = ["rn", "sk", "nd", "rr", "lm", "rd", "lv", "rk", "lt", "nn", "th", "v"]
_TOWN_SUFFIXES = ["ford", "holm", "mere", "stead", "haven", "moor", "gate", "bury", "dale",
                  "ton", "vik", "brook", "fell", "wick"]
_FAMILY_SUFFIXES = ["ing", "ett", "ley", "man", "ridge", "worth", "field", "ock", "ander", "ow"]
_RIVER_ENDINGS = ["a", "is", "el", "ine", "ova"]
_PROVINCE_ENDINGS = ["mark", "reach", "land", "march", "shire"]
_SOURCE_FORMS = ["the {} Mountains", "the {} Hills", "Lake {}", "the {} Fells",
                 "the {} Uplands", "the {} Peaks"]
_MOUTH_FORMS = ["the {} Sea", "the Gulf of {}", "the Bay of {}", "the {} Strait"]
# Founders are "<given name> of <place>": each world has its own places.
_FOUNDER_PLACES = {"test": ["the Fen", "the Causeway", "the Spring"],
                   "train": ["the Marsh", "the Hill", "the Ford", "the Heath", "the Weir",
                             "the Crag", "the Mill", "the Orchard", "the Quarry", "the Dunes",
                             "the Pass", "the Grove"]}
_INV_MATTER = ["tide", "salt", "wind", "copper", "glass", "reed", "frost", "signal", "ember",
               "river", "lantern", "amber", "brass", "iron", "peat", "storm", "silt",
               "willow", "ash", "coal", "mist", "pitch", "chalk", "flint"]
_INV_DEVICE = ["clock", "loom", "press", "pump", "compass", "kiln", "bellows", "plough",
               "sextant", "cistern", "crane", "lens", "lathe", "sluice", "beacon", "spindle",
               "barometer", "dredge", "churn", "winch"]
_BOOK_ADJ = ["Silent", "Amber", "Winter", "Lesser", "Drowned", "Patient", "Hollow", "Salt",
             "Northern", "Painted", "Second", "Crooked", "Quiet", "Golden", "Lost", "Bitter",
             "Distant", "Green", "Sunken", "Wandering", "Last", "Open", "Broken", "Gentle"]
_BOOK_NOUN = ["Almanac", "Ledger", "Atlas", "Herbal", "Chronicle", "Psalter", "Gazetteer",
              "Lexicon", "Survey", "Testament", "Orchard", "Harbour", "Primer", "Calendar",
              "Register", "Bestiary", "Itinerary", "Garden", "Voyage", "Anthology"]
# The test world's size; the train world's is TRAIN_SCALE times it.
_TOWNS, _PEOPLE, _PROVINCES, _RIVERS, _SOURCES, _MOUTHS = 128, 180, 12, 16, 6, 5


class _Roots:
    """Hands out name roots, each at most once, so pools cut from them never meet."""

    def __init__(self, rng: random.Random) -> None:
        self._roots = [o + v + c for o in _ONSETS for v in _VOWELS for c in _CODAS]
        rng.shuffle(self._roots)

    def take(self, n: int) -> list[str]:
        taken, self._roots = self._roots[:n], self._roots[n:]
        return taken


def _spec(rng: random.Random, roots: _Roots, scale: int, split: str,
          inventions: list[str], books: list[str]) -> Spec:
    """One world's pools, each cut from roots no other pool uses."""
    def one_each(n: int, endings: list[str]) -> list[str]:
        return [root + rng.choice(endings) for root in roots.take(n)]

    def every(n: int, endings: list[str]) -> list[str]:
        # a quarter more candidates than needed, so the world's own shuffle picks among them
        count = -(-n * 5 // (4 * len(endings)))
        return [root + end for root in roots.take(count) for end in endings]

    n_towns, n_people = _TOWNS * scale, _PEOPLE * scale
    return Spec(
        provinces=one_each(_PROVINCES * scale, _PROVINCE_ENDINGS),
        rivers=one_each(_RIVERS * scale, _RIVER_ENDINGS),
        sources=[rng.choice(_SOURCE_FORMS).format(r) for r in roots.take(_SOURCES * scale)],
        mouths=[rng.choice(_MOUTH_FORMS).format(r) for r in roots.take(_MOUTHS * scale)],
        town_names=every(n_towns, _TOWN_SUFFIXES),
        family_names=every(n_people, _FAMILY_SUFFIXES),
        founder_places=_FOUNDER_PLACES[split],
        governor_names=[r + "ston" for r in roots.take(_PROVINCES * scale)],
        inventions=inventions, books=books,
        n_towns=n_towns, n_people=n_people, born_from=1560, born_span=330,
    )


def _halves(rng: random.Random, names: list[str], n_test: int) -> tuple[list[str], list[str]]:
    """Shuffle ``names`` and cut them in two: the test world's and the train world's."""
    names = list(names)
    rng.shuffle(names)
    return names[:n_test], names[n_test:]


def build() -> tuple[list[dict[str, str]], list[dict[str, object]]]:
    """The corpus records and the QA records (train first, then test)."""
    rng = random.Random(SEED)
    roots = _Roots(rng)
    works = _PEOPLE // 2 + 6  # each world's inventors (and writers) with a few to spare
    test_inv, train_inv = _halves(rng, [f"{m} {d}" for m in _INV_MATTER for d in _INV_DEVICE],
                                  works)
    test_books, train_books = _halves(rng, [f"The {a} {n}" for a in _BOOK_ADJ
                                            for n in _BOOK_NOUN], works)
    specs = {"train": _spec(rng, roots, TRAIN_SCALE, "train", train_inv, train_books),
             "test": _spec(rng, roots, 1, "test", test_inv, test_books)}
    quotas = {"train": Quotas(*(n * TRAIN_SCALE for n in TEST_QUOTAS)), "test": TEST_QUOTAS}
    corpus = Corpus()
    qa: list[dict[str, object]] = []
    for offset, split in ((10, "train"), (20, "test")):
        world = build_world(SEED + offset, specs[split])
        wording = random.Random(SEED + offset + 1)  # then the questions, as in `world`
        corpus.add_world(wording, world)
        qa += [corpus.record(f"{split}-{i:04d}", split, q)
               for i, q in enumerate(questions(wording, world, quotas[split]))]
    return corpus.rows, qa


def render() -> dict[str, bytes]:
    """The files' bytes, refused unless they are the recorded set."""
    corpus, qa = build()
    files = {CORPUS_FILE: jsonl(corpus), QA_FILE: jsonl(qa)}
    for name, content in files.items():
        got = hashlib.sha256(content).hexdigest()
        if got != DIGESTS[name]:
            raise DataError(
                f"{NAME}: this Python ({sys.version.split()[0]}) generates a {name} with "
                f"SHA-256 {got[:16]}..., not the recorded {DIGESTS[name][:16]}...: its random "
                "numbers or text differ (or the generator changed and its new digests were "
                "not recorded), so this would not be the published set"
            )
    return files


def ensure(root: Path | None = None) -> Path:
    """The directory of the set's two files under ``root`` (default: the search cache),
    generated on first use and checked against the recorded digests on every call (a
    file's hash is computed once per process while it is unchanged).

    Files are written to a temp file and renamed into place, so processes that start
    together never read a half-written one. A cached file whose digest differs was
    changed after it was written: it is refused, never overwritten."""
    directory = (root or cache_root() / "search") / f"{NAME}-{DIGESTS[QA_FILE][:12]}"
    if not all((directory / name).is_file() for name in DIGESTS):
        files = render()
        directory.mkdir(parents=True, exist_ok=True)
        for name, content in files.items():
            if not (directory / name).is_file():
                replace_file(directory / name, content, mode=SHARED_MODE)
    for name, want in DIGESTS.items():
        got = corpus_sha256(directory / name)
        if got != want:
            raise DataError(
                f"{directory / name} does not match the SHA-256 recorded for {NAME} "
                f"({got[:16]}... instead of {want[:16]}...): it changed after it was "
                "generated; delete it and it is generated again"
            )
    return directory


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=DESCRIPTION).parse_args(argv)
    try:
        print(ensure())
    except (DataError, OSError) as err:
        print(f"{NAME}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
