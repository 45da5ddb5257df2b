"""math-large: original grade-school word problems, 1000 train and 250 test, checkable.

The bundled GSM8K-style set has 54 problems: a 95% interval on it is about +-0.13, too wide
to see a 10-point gain. The real GSM8K is on the hub, which these machines cannot reach, and
its test set is in every pretraining corpus. So this set is generated: each problem comes
from one of ``len(TEMPLATES)`` templates of two to four arithmetic steps, with numbers drawn
so every intermediate quantity is a positive whole number, and carries the Python
expression that computes its answer (``program``) and a worked solution ending in GSM8K's
``#### n`` line. ``tests/envs/test_math_large.py`` evaluates every program against its
answer.

The splits are kept apart by construction: the people and the things a train problem
names come from pools no test problem draws on, and both splits use every template in the
same proportions (train four times test), so a held-out gain is a gain in procedure, not a
memorised name or number. The problems are made in memory (milliseconds) and checked
against the SHA-256 recorded below: a Python whose ``random`` draws another set is
refused, not silently measured on.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent_gym.data import DataError

NAME = "math-large"
SPLITS = ("train", "test")
SEED = 20261206
TEST_PER_TEMPLATE = 25  # x 10 templates = 250 test problems
TRAIN_SCALE = 4
# SHA-256 of the generated records (JSON lines, train then test). Changing the generator
# changes it: record the new one (the test shows it) and say so, since figures measured on
# the old set no longer compare.
DIGEST = "4fddff7009a6ed382fefaee6792112d33976b0c45b1e20b861399e200efe82f4"

_PEOPLE = {
    "train": ["Mara", "Theo", "Lena", "Omar", "Priya", "Jonas", "Ines", "Kofi", "Wren", "Dario",
              "Hana", "Felix", "Zuri", "Milo", "Ada", "Ravi", "Nell", "Tomas", "Yuki", "Bea"],
    "test": ["Sven", "Lucia", "Emeka", "Greta", "Arjun", "Colette", "Bodhi", "Ilse", "Mateo",
             "Saoirse", "Kenji", "Farah", "Otto", "Anouk", "Tariq", "Esme"],
}
# (plural noun, container) pairs: what is counted and what holds it
_GOODS = {
    "train": [("apples", "crate"), ("pencils", "box"), ("muffins", "tray"), ("marbles", "jar"),
              ("stickers", "sheet"), ("eggs", "carton"), ("candles", "bundle"),
              ("buttons", "tin"), ("coasters", "deck"), ("bolts", "bag")],
    "test": [("plums", "basket"), ("crayons", "case"), ("cookies", "bowl"), ("beads", "pouch"),
             ("stamps", "album"), ("lemons", "sack"), ("tiles", "stack"), ("seeds", "packet")],
}
_ITEMS = {  # things bought, with a price range in dollars
    "train": [("notebook", 2, 9), ("scarf", 8, 25), ("lamp", 12, 40), ("mug", 3, 12),
              ("kite", 5, 18), ("puzzle", 6, 20)],
    "test": [("umbrella", 6, 22), ("backpack", 15, 45), ("teapot", 9, 30), ("wallet", 7, 26),
             ("lantern", 4, 16), ("helmet", 18, 50)],
}


@dataclass(frozen=True)
class Problem:
    question: str
    steps: list[str]  # the worked solution's lines
    answer: int
    program: str  # a Python expression whose value is ``answer``


Template = Callable[[random.Random, str, tuple[str, str], tuple[str, int, int]], Problem]


def _packs_given_away(r: random.Random, who: str, goods: tuple[str, str],
                      _item: tuple[str, int, int]) -> Problem:
    noun, box = goods
    boxes, each = r.randint(3, 9), r.randint(6, 15)
    given = r.randint(5, boxes * each - 5)
    total = boxes * each
    return Problem(f"{who} has {boxes} {_plural(box)} of {noun} with {each} {noun} in each {box}. "
                   f"{who} gives away {given} {noun}. How many {noun} are left?",
                   [f"{boxes} * {each} = {total}", f"{total} - {given} = {total - given}"],
                   total - given, f"{boxes}*{each}-{given}")


def _change_from_bill(r: random.Random, who: str, _goods: tuple[str, str],
                      item: tuple[str, int, int]) -> Problem:
    name, low, high = item
    count, price, extra = r.randint(2, 5), r.randint(low, high), r.randint(1, 9)
    cost = count * price + extra
    bill = next(b for b in (20, 50, 100, 200, 500) if b > cost)
    return Problem(f"{who} buys {count} {_plural(name)} at ${price} each and a card for ${extra}. "
                   f"{who} pays with a ${bill} bill. How many dollars of change does {who} get?",
                   [f"{count} * {price} + {extra} = {cost}", f"{bill} - {cost} = {bill - cost}"],
                   bill - cost, f"{bill}-({count}*{price}+{extra})")


def _weekly_total(r: random.Random, who: str, goods: tuple[str, str],
                  _item: tuple[str, int, int]) -> Problem:
    noun = goods[0]
    weekday, weekend = r.randint(4, 20), r.randint(10, 40)
    a, b = 5 * weekday, 2 * weekend
    return Problem(f"{who} sorts {weekday} {noun} every weekday and {weekend} {noun} on each "
                   f"day of the weekend. How many {noun} does {who} sort in one week?",
                   [f"5 * {weekday} = {a}", f"2 * {weekend} = {b}", f"{a} + {b} = {a + b}"],
                   a + b, f"5*{weekday}+2*{weekend}")


def _share_equally(r: random.Random, who: str, goods: tuple[str, str],
                   _item: tuple[str, int, int]) -> Problem:
    noun = goods[0]
    friends, each, kept = r.randint(3, 8), r.randint(4, 12), r.randint(2, 9)
    total = friends * each + kept
    return Problem(f"{who} has {total} {noun}, keeps {kept} and shares the rest equally among "
                   f"{friends} friends. How many {noun} does each friend get?",
                   [f"{total} - {kept} = {total - kept}", f"{total - kept} / {friends} = {each}"],
                   each, f"({total}-{kept})//{friends}")


def _savings_weeks(r: random.Random, who: str, _goods: tuple[str, str],
                   item: tuple[str, int, int]) -> Problem:
    name = item[0]
    weekly, saved = r.randint(3, 12), r.randint(0, 30)
    weeks = r.randint(3, 12)
    price = saved + weekly * weeks
    return Problem(f"{_a(name).capitalize()} costs ${price}. {who} has saved ${saved} and "
                   f"saves ${weekly} more every week. How many weeks until {who} can buy the "
                   f"{name}?",
                   [f"{price} - {saved} = {price - saved}", f"{price - saved} / {weekly} = "
                    f"{weeks}"], weeks, f"({price}-{saved})//{weekly}")


def _bus_stops(r: random.Random, who: str, _goods: tuple[str, str],
               _item: tuple[str, int, int]) -> Problem:
    start = r.randint(20, 45)
    off1, on1 = r.randint(2, start - 5), r.randint(3, 15)
    middle = start - off1 + on1
    off2 = r.randint(2, middle - 2)
    end = middle - off2
    return Problem(f"{who}'s bus leaves with {start} passengers. At the first stop {off1} get "
                   f"off and {on1} get on. At the second stop {off2} get off. How many "
                   "passengers are on the bus now?",
                   [f"{start} - {off1} + {on1} = {middle}", f"{middle} - {off2} = {end}"],
                   end, f"{start}-{off1}+{on1}-{off2}")


def _rows_of_rows(r: random.Random, who: str, goods: tuple[str, str],
                  _item: tuple[str, int, int]) -> Problem:
    noun, box = goods
    shelves, boxes, each = r.randint(2, 6), r.randint(3, 8), r.randint(4, 12)
    per_shelf = boxes * each
    return Problem(f"{who}'s storeroom has {shelves} shelves. Each shelf holds {boxes} "
                   f"{_plural(box)} "
                   f"and each {box} holds {each} {noun}. How many {noun} are in the storeroom?",
                   [f"{boxes} * {each} = {per_shelf}",
                    f"{shelves} * {per_shelf} = {shelves * per_shelf}"],
                   shelves * per_shelf, f"{shelves}*{boxes}*{each}")


def _half_then_more(r: random.Random, who: str, goods: tuple[str, str],
                    _item: tuple[str, int, int]) -> Problem:
    noun = goods[0]
    half = r.randint(8, 40)
    start, bought = 2 * half, r.randint(3, 25)
    return Problem(f"{who} had {start} {noun} and used half of them. Then {who} bought "
                   f"{bought} more. How many {noun} does {who} have now?",
                   [f"{start} / 2 = {half}", f"{half} + {bought} = {half + bought}"],
                   half + bought, f"{start}//2+{bought}")


def _two_prices(r: random.Random, who: str, _goods: tuple[str, str],
                item: tuple[str, int, int]) -> Problem:
    name, low, high = item
    price = r.randint(low, high)
    discount = r.randint(1, max(1, price // 3))
    count_full, count_sale = r.randint(1, 4), r.randint(2, 6)
    full, sale = count_full * price, count_sale * (price - discount)
    return Problem(f"{_a(name).capitalize()} costs ${price}, or ${discount} less on sale "
                   f"day. {who} buys {count_full} at full price and {count_sale} on sale day. "
                   f"How many dollars does {who} spend?",
                   [f"{count_full} * {price} = {full}",
                    f"{count_sale} * ({price} - {discount}) = {sale}", f"{full} + {sale} = "
                    f"{full + sale}"], full + sale,
                   f"{count_full}*{price}+{count_sale}*({price}-{discount})")


def _leftover_after_packing(r: random.Random, who: str, goods: tuple[str, str],
                            _item: tuple[str, int, int]) -> Problem:
    noun, box = goods
    size, boxes = r.randint(4, 12), r.randint(3, 12)
    left = r.randint(1, size - 1)
    total = size * boxes + left
    return Problem(f"{who} packs {total} {noun} into {_plural(box)} of {size}, filling as "
                   f"many {_plural(box)} "
                   f"as possible. How many {noun} are left over?",
                   [f"{size} * {boxes} = {size * boxes}", f"{total} - {size * boxes} = {left}"],
                   left, f"{total}%{size}")


def _plural(noun: str) -> str:
    return noun + ("es" if noun.endswith(("s", "x", "ch", "sh")) else "s")


def _a(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


TEMPLATES: tuple[Template, ...] = (
    _packs_given_away, _change_from_bill, _weekly_total, _share_equally, _savings_weeks,
    _bus_stops, _rows_of_rows, _half_then_more, _two_prices, _leftover_after_packing,
)


def generate(seed: int = SEED) -> dict[str, list[dict[str, Any]]]:
    """The records of both splits: ``question`` and ``answer`` as GSM8K's loader reads them,
    the answer's ``value`` and the ``program`` that computes it."""
    rng = random.Random(seed)
    out: dict[str, list[dict[str, Any]]] = {}
    for split in SPLITS:
        per_template = TEST_PER_TEMPLATE * (TRAIN_SCALE if split == "train" else 1)
        made = []
        for number in range(per_template * len(TEMPLATES)):
            template = TEMPLATES[number % len(TEMPLATES)]
            problem = template(rng, rng.choice(_PEOPLE[split]), rng.choice(_GOODS[split]),
                               rng.choice(_ITEMS[split]))
            made.append({"id": f"{NAME}-{split}-{number:04d}", "question": problem.question,
                         "answer": ". ".join(problem.steps) + f". #### {problem.answer}",
                         "value": problem.answer, "program": problem.program})
        out[split] = made
    return out


def records(split: str | None) -> list[dict[str, Any]]:
    """One split (``train``, ``test``) or both (None), checked against ``DIGEST``."""
    if split not in (*SPLITS, None):
        raise DataError(f"{NAME} has the splits {SPLITS}, not {split!r}")
    made = _checked(SEED)
    return [dict(r) for r in (made[split] if split else [*made["train"], *made["test"]])]


@functools.cache
def _checked(seed: int) -> dict[str, list[dict[str, Any]]]:
    """The set generated and checked once per process: a run's env pool builds an env per
    concurrent branch, and each would otherwise draw and hash all 1250 problems again."""
    made = generate(seed)
    if digest(made) != DIGEST:
        raise DataError(f"this Python generated a different {NAME} set (digest {digest(made)}, "
                        f"recorded {DIGEST}); figures measured on it would not compare")
    return made


def digest(made: dict[str, list[dict[str, Any]]]) -> str:
    lines = (json.dumps(record, sort_keys=True) for split in SPLITS for record in made[split])
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()
