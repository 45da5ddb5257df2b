"""Generate the bundled search corpus: an original, fictional but consistent small world.

Provinces, rivers, towns, people, inventions and books are drawn from a seeded RNG, then
written as encyclopedia-style passages and question/answer pairs. Facts are stored once
and every passage and question is rendered from them, so answers always agree with the
text. Two-hop questions name an entity whose passage only leads to the answer's passage
(the inventor of X -> where that person was born), so they need two searches.

A world is drawn from a `Spec` (its name pools and sizes) and asked about by `Quotas`
(questions per template). The bundled set is one small world (`BUNDLED`); the larger
held-out set, two disjoint worlds sharing one corpus, is `agent_gym.search.world_large`.

Regenerate the shipped files (the output is byte-identical for a given seed)::

    python -m agent_gym.search.world agent_gym/datasets
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

# --help's description: the docstring's first paragraph, kept here (python -OO drops docstrings)
DESCRIPTION = ("Generate the bundled search corpus: an original, fictional but consistent small "
               "world.")
SEED = 20261130
HELD_OUT_EVERY = 4  # question i is in the test split when i % 4 == 3

_PROVINCES = ["Vellmark", "Ostrenne", "Dunhallow", "Marrowfield", "Kestria", "Lowenmoor",
              "Sarnholm", "Wyndale"]
_RIVERS = ["Orvane", "Tessaly", "Mirrow", "Halden", "Suvel", "Querrin", "Ambrel", "Listra",
           "Vey", "Kessa", "Ornith", "Belloc"]
_SOURCES = ["the Grauhorn Mountains", "the Selwyn Hills", "Lake Ombra", "the Pale Fells",
            "the Cinder Peaks", "the Mossback Uplands"]
_MOUTHS = ["the Grey Sea", "the Amber Gulf", "Lake Tarrow", "the Northern Strait",
           "the Bay of Lessing"]
_TOWN_ROOTS = ["Brenn", "Cald", "Dorn", "Elm", "Fenn", "Gall", "Harr", "Ister", "Kell", "Lorr",
               "Marl", "Norr", "Oat", "Pell", "Quenn", "Rask", "Sell", "Tarn", "Umber", "Vell",
               "Wick", "Yarr", "Zenn", "Ashen", "Birch", "Crow", "Dapple", "Ember", "Frost",
               "Glimmer"]
_TOWN_SUFFIXES = ["ford", "holm", "mere", "stead", "haven", "moor", "gate", "bury", "dale",
                  "ton", "vik", "brook", "fell", "wick"]
_GIVEN = ["Amara", "Bastian", "Corin", "Delphine", "Edric", "Fenna", "Gideon", "Hesper", "Ilse",
          "Jory", "Kasimir", "Liesl", "Matthias", "Nerys", "Osric", "Petra", "Quill",
          "Rosalind", "Silas", "Tamsin", "Ulric", "Vesna", "Wendel", "Ysolde", "Zora",
          "Anselm", "Brigid", "Cassius", "Dagny", "Eamon", "Florian", "Greta", "Hollis",
          "Ingrid", "Jasper", "Katrin", "Leopold", "Mireille", "Niall", "Oriana"]
_FAMILY_ROOTS = ["Ash", "Bran", "Cor", "Dun", "El", "Far", "Greav", "Hal", "Iv", "Jess", "Ket",
                 "Lor", "Mer", "Net", "Orr", "Pell", "Quar", "Rook", "Sal", "Thist", "Umb",
                 "Var", "Whit", "Yar", "Zel", "Bram", "Cress", "Dov", "Fitch", "Gorm"]
_FAMILY_SUFFIXES = ["ing", "ett", "ley", "man", "ridge", "worth", "field", "ock", "ander", "ow"]
_FOUNDER_PLACES = ["the Marsh", "the Hill", "the Ford"]
_TRADES = ["glassmaking", "the salt trade", "shipbuilding", "wool weaving", "clockmaking",
           "paper milling", "its cider orchards", "copper mining", "herring fishing",
           "printing", "tanning", "bell founding"]
_LANDMARKS = ["a seven-arched stone bridge", "a leaning bell tower", "a covered market hall",
              "a round lighthouse", "a walled herb garden", "a tidal mill",
              "an old customs house", "a clock tower with four faces"]
_FESTIVALS = ["Lantern Fair", "Herring Feast", "Midsummer Regatta", "Apple Moot",
              "Bellringers' Night", "Wool Market", "Kite Festival", "River Blessing"]
_MONTHS = ["March", "April", "May", "June", "July", "August", "September", "October"]
_INVENTOR_JOBS = ["engineer", "clockmaker", "instrument maker", "millwright", "glazier",
                  "chemist"]
_WRITER_JOBS = ["poet", "cartographer", "botanist", "historian", "physician", "astronomer"]
_INV_MATTER = ["tide", "salt", "wind", "copper", "glass", "reed", "frost", "signal", "ember",
               "river", "lantern", "amber"]
_INV_DEVICE = ["clock", "loom", "press", "pump", "compass", "kiln", "bellows", "plough",
               "sextant", "cistern", "crane", "lens"]
_PURPOSES = {
    "clock": "keeping time aboard ships and in harbour offices",
    "loom": "weaving patterned cloth twice as fast as a hand loom",
    "press": "pressing sheets and fibres evenly",
    "pump": "drawing water out of flooded mines and cellars",
    "compass": "holding a steady bearing in foul weather",
    "kiln": "firing pottery and bricks at an even heat",
    "bellows": "feeding air to forges without a second worker",
    "plough": "turning heavy clay soil",
    "sextant": "measuring the height of stars above the horizon",
    "cistern": "storing rainwater through the dry months",
    "crane": "lifting cargo from the holds of river barges",
    "lens": "grinding sharper spectacles and spyglasses",
    "lathe": "turning chair legs and spindles true",
    "sluice": "letting a measured flow through a mill dam",
    "beacon": "signalling to ships from a headland at night",
    "spindle": "spinning finer thread from short wool",
    "barometer": "foretelling storms from the weight of the air",
    "dredge": "clearing silt from harbour channels",
    "churn": "making butter in dairies by the hundredweight",
    "winch": "hauling boats up a slipway",
}
_BOOK_ADJ = ["Silent", "Amber", "Winter", "Lesser", "Drowned", "Patient", "Hollow", "Salt",
             "Northern", "Painted", "Second", "Crooked"]
_BOOK_NOUN = ["Almanac", "Ledger", "Atlas", "Herbal", "Chronicle", "Psalter", "Gazetteer",
              "Lexicon", "Survey", "Testament", "Orchard", "Harbour"]
_BOOK_KIND = {"poet": "a collection of poems", "cartographer": "an atlas",
              "botanist": "a herbal", "historian": "a chronicle",
              "physician": "a treatise on fevers", "astronomer": "a star catalogue"}


@dataclass
class Town:
    name: str
    province: str
    river: str
    founded: int
    founder: str
    population: int
    trade: str
    landmark: str
    festival: str
    month: str
    twin: str = ""


@dataclass
class Person:
    name: str
    born: int
    birthplace: str
    job: str
    died: int
    deathplace: str
    teacher: str = ""
    parent_trade: str = ""
    work: str = ""  # an invention (for inventors) or a book title (for writers)


@dataclass
class River:
    name: str
    length: int
    source: str
    mouth: str
    towns: list[str] = field(default_factory=list)


@dataclass
class World:
    provinces: dict[str, dict[str, str]]
    rivers: dict[str, River]
    towns: dict[str, Town]
    people: dict[str, Person]
    inventions: dict[str, tuple[str, int, str]]  # name -> (inventor, year, first used in town)
    books: dict[str, tuple[str, int]]  # title -> (author, year)


@dataclass(frozen=True)
class Spec:
    """The names one world may use and how big it is.

    Every entity's name comes from its spec (given names, trades, landmarks, festivals and
    months are shared words, never an entity on their own), so two worlds drawn from specs
    with disjoint pools share no entity: the guarantee `world_large`'s split rests on. The
    candidate lists are shuffled by the world's RNG and the first ones kept."""

    provinces: Sequence[str]
    rivers: Sequence[str]
    sources: Sequence[str]
    mouths: Sequence[str]
    town_names: Sequence[str]
    family_names: Sequence[str]
    founder_places: Sequence[str]  # founders are "<given name> of <place>"
    governor_names: Sequence[str]  # governors are "<given name> <governor name>"
    inventions: Sequence[str]  # "<matter> <device>", the device a key of _PURPOSES
    books: Sequence[str]
    n_towns: int  # even (towns are twinned in pairs), at least two per river
    n_people: int  # half inventors, half writers
    born_from: int = 1620
    born_span: int = 270  # births spread evenly over these years, plus up to two


BUNDLED = Spec(
    provinces=_PROVINCES, rivers=_RIVERS, sources=_SOURCES, mouths=_MOUTHS,
    town_names=[r + s for r in _TOWN_ROOTS for s in _TOWN_SUFFIXES],
    family_names=[r + s for r in _FAMILY_ROOTS for s in _FAMILY_SUFFIXES],
    founder_places=_FOUNDER_PLACES, governor_names=[r + "ston" for r in _FAMILY_ROOTS],
    inventions=[f"{m} {d}" for m in _INV_MATTER for d in _INV_DEVICE],
    books=[f"The {a} {n}" for a in _BOOK_ADJ for n in _BOOK_NOUN],
    n_towns=64, n_people=90,
)


class Quotas(NamedTuple):
    """Questions per template, one-hop then multi-hop (the order they are asked in)."""

    founded: int
    town_river: int
    inventor: int
    author: int
    capital: int
    mouth: int
    deathplace: int
    festival_month: int
    inventor_birthplace: int
    author_born: int
    birthplace_river: int
    teacher_born: int
    capital_founder: int
    inventor_birthplace_twin: int


BUNDLED_QUOTAS = Quotas(8, 6, 6, 4, 4, 4, 6, 4, 8, 5, 6, 5, 4, 4)


def _first(rng: random.Random, candidates: Sequence[str], n: int) -> list[str]:
    names = list(candidates)
    rng.shuffle(names)
    return names[:n]


def build_world(seed: int = SEED, spec: Spec = BUNDLED) -> World:
    """Draw every fact of the world from one RNG, in a fixed order."""
    rng = random.Random(seed)
    town_names = _first(rng, spec.town_names, spec.n_towns)
    families = _first(rng, spec.family_names, spec.n_people)
    givens = [rng.choice(_GIVEN) for _ in families]
    names = [f"{g} {f}" for g, f in zip(givens, families, strict=True)]
    founders = [f"{rng.choice(_GIVEN)} of {rng.choice(spec.founder_places)}"
                for _ in town_names]

    rivers = {
        r: River(r, rng.randrange(60, 900, 5), rng.choice(spec.sources), rng.choice(spec.mouths))
        for r in spec.rivers
    }
    towns: dict[str, Town] = {}
    for i, t in enumerate(town_names):
        river = spec.rivers[i % len(spec.rivers)]
        rivers[river].towns.append(t)
        towns[t] = Town(
            name=t, province=spec.provinces[i % len(spec.provinces)], river=river,
            founded=rng.randrange(880, 1600), founder=founders[i],
            population=rng.randrange(800, 90000, 10), trade=rng.choice(_TRADES),
            landmark=rng.choice(_LANDMARKS), festival=rng.choice(_FESTIVALS),
            month=rng.choice(_MONTHS),
        )
    order = list(towns)
    rng.shuffle(order)
    for a, b in zip(order[0::2], order[1::2], strict=True):
        towns[a].twin, towns[b].twin = b, a
    provinces = {
        p: {"capital": next(t for t in order if towns[t].province == p),
            "governor": rng.choice(_GIVEN) + " " + rng.choice(spec.governor_names)}
        for p in spec.provinces
    }

    people: dict[str, Person] = {}
    for i, name in enumerate(names):
        born = spec.born_from + i * spec.born_span // spec.n_people + rng.randrange(0, 3)
        job = _INVENTOR_JOBS[i % 6] if i % 2 == 0 else _WRITER_JOBS[i % 6]
        birthplace = rng.choice(order)
        deathplace = rng.choice([t for t in order if t != birthplace])
        person = Person(name, born, birthplace, job, born + rng.randrange(48, 90), deathplace,
                        parent_trade=rng.choice(_TRADES))
        older = [p for p in people.values() if 20 <= born - p.born <= 60]
        if older:
            person.teacher = rng.choice(older).name
        people[name] = person

    inventions: dict[str, tuple[str, int, str]] = {}
    books: dict[str, tuple[str, int]] = {}
    free_inventions = list(spec.inventions)
    free_books = list(spec.books)
    rng.shuffle(free_inventions)
    rng.shuffle(free_books)
    for person in people.values():
        year = person.born + rng.randrange(24, 45)
        if person.job in _INVENTOR_JOBS:
            device = free_inventions.pop()
            place = rng.choice([t for t in order if t != person.birthplace])
            inventions[device] = (person.name, year, place)
            person.work = device
        else:
            title = free_books.pop()
            books[title] = (person.name, year)
            person.work = title
    return World(provinces, rivers, towns, people, inventions, books)


def _pick(rng: random.Random, *options: str) -> str:
    return rng.choice(options)


def _town_passages(rng: random.Random, t: Town, w: World) -> tuple[str, str]:
    capital = w.provinces[t.province]["capital"] == t.name
    role = f"the capital of {t.province}" if capital else f"a town in the province of {t.province}"
    overview = " ".join([
        f"{t.name} is {role}, on the banks of the river {t.river}.",
        _pick(rng, f"It has about {t.population:,} inhabitants",
              f"The last census counted {t.population:,} residents",
              f"Some {t.population:,} people live there"),
        _pick(rng, f"and the town is best known for {t.trade}.",
              f"and the town has long lived from {t.trade}.",
              f"and its fortune was made by {t.trade}."),
        _pick(rng, f"The town's most familiar sight is {t.landmark}.",
              f"Visitors usually come to see {t.landmark}.",
              f"Its skyline is dominated by {t.landmark}."),
        _pick(rng, f"Barges on the {t.river} still call at the quay of {t.name}.",
              f"Floods from the {t.river} have reached the market square of {t.name} "
              "more than once.",
              f"The old road along the {t.river} runs through the centre of {t.name}."),
    ])
    history = " ".join([
        _pick(rng, f"{t.name} was founded in {t.founded} by {t.founder}.",
              f"According to the town charter, {t.founder} founded {t.name} in {t.founded}.",
              f"The settlement of {t.name} dates from {t.founded}, when {t.founder} "
              "built the first houses there."),
        _pick(rng, f"Every {t.month} the town holds the {t.festival},",
              f"Each year in {t.month} the streets fill for the {t.festival},"),
        _pick(rng, "which draws visitors from across the province.",
              "a custom older than the town walls.", "first recorded in the parish books."),
        f"{t.name} is twinned with {t.twin}.",
    ])
    return overview, history


def _person_passages(rng: random.Random, p: Person, w: World) -> tuple[str, str]:
    teacher = (
        _pick(rng, f"As a young {p.job} {p.name.split()[0]} studied under {p.teacher}.",
              f"{p.name.split()[0]} was apprenticed to {p.teacher}.",
              f"Their teacher was {p.teacher}.")
        if p.teacher else "Nothing is known of any formal teacher."
    )
    upbringing = _pick(rng, f"grew up in a family that worked in {p.parent_trade}.",
                       f"came from a household that lived from {p.parent_trade}.")
    early = " ".join([
        _pick(rng, f"{p.name} was born in {p.birthplace} in {p.born} and {upbringing}",
              f"{p.name}, born in {p.born} in {p.birthplace}, {upbringing}",
              f"Born in {p.born} in the town of {p.birthplace}, {p.name} {upbringing}"),
        teacher,
        _pick(rng, f"{p.name.split()[0]} left {p.birthplace} before the age of twenty.",
              f"Letters from these years describe {p.birthplace} as cramped and damp.",
              f"Childhood in {p.birthplace} left a lifelong fondness for river boats."),
    ])
    if p.job in _INVENTOR_JOBS:
        _, year, _ = w.inventions[p.work]
        deed = _pick(rng, f"{p.name} is remembered as the {p.job} who invented the {p.work} "
                     f"in {year}.",
                     f"In {year} {p.name}, by then an established {p.job}, built the first "
                     f"{p.work}.")
    else:
        _, year = w.books[p.work]
        deed = _pick(rng, f"{p.name} was a {p.job} whose best-known work, {p.work}, "
                     f"appeared in {year}.",
                     f"As a {p.job}, {p.name} published {p.work} in {year}.")
    later = " ".join([
        deed,
        _pick(rng, f"{p.name.split()[0]} died in {p.deathplace} in {p.died}.",
              f"In later life {p.name} settled in {p.deathplace} and died there in {p.died}.",
              f"Death came in {p.died}, in {p.deathplace}."),
    ])
    return early, later


def _invention_passage(rng: random.Random, name: str, w: World) -> str:
    inventor, year, place = w.inventions[name]
    device = name.split()[-1]
    return " ".join([
        _pick(rng, f"The {name} is a device for {_PURPOSES[device]}.",
              f"The {name} was designed for {_PURPOSES[device]}."),
        _pick(rng, f"It was invented by {inventor} in {year}",
              f"{inventor} invented it in {year}", f"{inventor} built the first one in {year}"),
        _pick(rng, f"and was first put to use in {place}.",
              f"and the first working model was installed in {place}."),
        _pick(rng, "Copies spread along the rivers within a generation.",
              "Early models were expensive and often broke.",
              "Several guilds opposed it at first."),
    ])


def _book_passage(rng: random.Random, title: str, w: World) -> str:
    author, year = w.books[title]
    kind = _BOOK_KIND[w.people[author].job]
    return " ".join([
        _pick(rng, f"{title} is {kind} written by {author} and first printed in {year}.",
              f"{title}, {kind} by {author}, was published in {year}."),
        _pick(rng, "Only a handful of first editions survive.",
              "It was reprinted many times in the following century.",
              "Its engravings are still admired."),
    ])


def _river_passage(rng: random.Random, r: River) -> str:
    listed = ", ".join(r.towns[:-1]) + f" and {r.towns[-1]}"
    return " ".join([
        _pick(rng, f"The {r.name} is a river {r.length} kilometres long.",
              f"The river {r.name} runs for {r.length} kilometres."),
        f"It rises in {r.source} and flows into {r.mouth}.",
        f"Towns on the {r.name} include {listed}.",
    ])


def _province_passage(rng: random.Random, name: str, w: World) -> str:
    info = w.provinces[name]
    others = [t for t in w.towns.values() if t.province == name and t.name != info["capital"]]
    listed = ", ".join(t.name for t in others[:5])
    return " ".join([
        f"{name} is a province whose capital is {info['capital']}.",
        f"Its other towns include {listed}.",
        _pick(rng, f"The province is governed by {info['governor']}.",
              f"{info['governor']} serves as governor of {name}."),
    ])


# A question, its answer, and the keys of the passages it needs (the answer's last).
Question = tuple[str, str | int, list[str]]


class Corpus:
    """Passages of one or more worlds, numbered in the order they are added, and the QA
    records that point into them."""

    def __init__(self) -> None:
        self.rows: list[dict[str, str]] = []
        self._ids: dict[str, str] = {}
        self._titles: dict[str, str] = {}

    def _add(self, key: str, title: str, text: str) -> None:
        pid = f"p{len(self.rows):04d}"
        self._ids[key], self._titles[key] = pid, title
        self.rows.append({"id": pid, "contents": f'"{title}"\n{text}'})

    def add_world(self, rng: random.Random, w: World) -> None:
        """Every passage of ``w``, rendered with ``rng``'s choices of wording."""
        for name in w.provinces:
            self._add(f"province:{name}", name, _province_passage(rng, name, w))
        for r in w.rivers.values():
            self._add(f"river:{r.name}", f"{r.name} (river)", _river_passage(rng, r))
        for t in w.towns.values():
            overview, history = _town_passages(rng, t, w)
            self._add(f"town:{t.name}", t.name, overview)
            self._add(f"town-history:{t.name}", f"History of {t.name}", history)
        for p in w.people.values():
            early, later = _person_passages(rng, p, w)
            self._add(f"person:{p.name}", p.name, early)
            self._add(f"person-career:{p.name}", f"{p.name} (career)", later)
        for name in w.inventions:
            self._add(f"invention:{name}", f"The {name}", _invention_passage(rng, name, w))
        for title in w.books:
            self._add(f"book:{title}", title, _book_passage(rng, title, w))

    def record(self, qid: str, split: str, question: Question) -> dict[str, object]:
        """A QA record; `oracle_queries` (the supporting passages' titles) script the
        oracle baseline, `supporting` lists their ids in hop order, the answer's last."""
        text, answer, keys = question
        return {"id": qid, "question": text, "answers": [str(answer)], "hops": len(keys),
                "supporting": [self._ids[k] for k in keys],
                "oracle_queries": [self._titles[k] for k in keys], "split": split}


def build_dataset(seed: int = SEED) -> tuple[list[dict[str, str]], list[dict[str, object]]]:
    """The corpus records ({"id", "contents"}, Search-R1 style) and the QA records.

    Every fourth question is held out (``test``); questions come template by template,
    so each template has questions on both sides and a model that learns on ``train`` is
    scored on the same procedures over entities it never trained on. (In this small world
    the two sides do share towns and people; `world_large` keeps them apart.)"""
    w = build_world(seed)
    rng = random.Random(seed + 1)
    corpus = Corpus()
    corpus.add_world(rng, w)
    qa = [corpus.record(f"q{i:03d}",
                        "test" if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else "train", q)
          for i, q in enumerate(questions(rng, w, BUNDLED_QUOTAS))]
    return corpus.rows, qa


def questions(rng: random.Random, w: World, quotas: Quotas) -> list[Question]:
    """``quotas`` questions per template about ``w``, each template's drawn without
    repeats; every fact asked is one a passage of ``w`` states."""
    asked: list[Question] = []

    def ask(question: str, answer: str | int, keys: list[str]) -> None:
        asked.append((question, answer, keys))

    towns = sorted(w.towns.values(), key=lambda t: t.name)
    people = sorted(w.people.values(), key=lambda p: p.name)
    inventions = sorted(w.inventions.items())
    books = sorted(w.books.items())
    for t in rng.sample(towns, quotas.founded):
        ask(f"In what year was the town of {t.name} founded?", t.founded,
            [f"town-history:{t.name}"])
    for t in rng.sample(towns, quotas.town_river):
        ask(f"Which river flows through {t.name}?", t.river, [f"town:{t.name}"])
    for name, (inventor, _, _) in rng.sample(inventions, quotas.inventor):
        ask(f"Who invented the {name}?", inventor, [f"invention:{name}"])
    for title, (author, _) in rng.sample(books, quotas.author):
        ask(f"Who wrote {title}?", author, [f"book:{title}"])
    for name in rng.sample(sorted(w.provinces), quotas.capital):
        ask(f"What is the capital of {name}?", w.provinces[name]["capital"],
            [f"province:{name}"])
    for r in rng.sample(sorted(w.rivers.values(), key=lambda r: r.name), quotas.mouth):
        ask(f"Into which body of water does the river {r.name} flow?",
            r.mouth.removeprefix("the "), [f"river:{r.name}"])
    for p in rng.sample(people, quotas.deathplace):
        ask(f"In which town did {p.name} die?", p.deathplace, [f"person-career:{p.name}"])
    for t in rng.sample(towns, quotas.festival_month):
        ask(f"In which month is the {t.festival} held in {t.name}?", t.month,
            [f"town-history:{t.name}"])

    for name, (inventor, _, _) in rng.sample(inventions, quotas.inventor_birthplace):
        ask(f"In which town was the inventor of the {name} born?",
            w.people[inventor].birthplace, [f"invention:{name}", f"person:{inventor}"])
    for title, (author, _) in rng.sample(books, quotas.author_born):
        ask(f"In what year was the author of {title} born?", w.people[author].born,
            [f"book:{title}", f"person:{author}"])
    for p in rng.sample(people, quotas.birthplace_river):
        ask(f"Which river flows through the town where {p.name} was born?",
            w.towns[p.birthplace].river, [f"person:{p.name}", f"town:{p.birthplace}"])
    taught = [p for p in people if p.teacher]
    for p in rng.sample(taught, quotas.teacher_born):
        ask(f"In what year was the teacher of {p.name} born?", w.people[p.teacher].born,
            [f"person:{p.name}", f"person:{p.teacher}"])
    for name in rng.sample(sorted(w.provinces), quotas.capital_founder):
        capital = w.provinces[name]["capital"]
        ask(f"Who founded the capital of {name}?", w.towns[capital].founder,
            [f"province:{name}", f"town-history:{capital}"])
    for name, (inventor, _, _) in rng.sample(inventions, quotas.inventor_birthplace_twin):
        ask(f"Which town is the birthplace of the inventor of the {name} twinned with?",
            w.towns[w.people[inventor].birthplace].twin,
            [f"invention:{name}", f"person:{inventor}", f"town-history:"
             f"{w.people[inventor].birthplace}"])
    return asked


def jsonl(rows: Sequence[dict[str, str]] | Sequence[dict[str, object]]) -> bytes:
    """The bytes of a JSONL file, one record a line (what the digests are taken over)."""
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode()


def write(out_dir: Path, seed: int = SEED) -> None:
    corpus, qa = build_dataset(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "search_corpus.jsonl").write_bytes(jsonl(corpus))
    (out_dir / "search_qa.jsonl").write_bytes(jsonl(qa))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=DESCRIPTION)
    parser.add_argument("out_dir", type=Path, help="where to write search_corpus/qa.jsonl")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    write(args.out_dir, args.seed)


if __name__ == "__main__":
    main()
