"""Original ALFWorld games, built from what the alfworld wheel ships.

ALFWorld's own games come from recorded ALFRED trajectories, which are a separate
download. The wheel does ship the 120 floor plans (receptacle poses, the object types
present, the reachable floor grid), the PDDL domain, the goal library and ALFRED's tables
of which object fits which receptacle and which can be cleaned, heated or cooled. From
those this module writes new games of all six task types: a room with its receptacles,
objects placed where ALFRED allows them, a goal from the goal library, and a walkthrough
that is played on the real engine and kept only if it wins.

Splits follow ALFRED: ``train`` and ``valid_seen`` use the training floor plans,
``valid_unseen`` the six held-out plans of each room type. The large set
(`agent_gym.alfworld.large`) does the same: ``large_train`` on the training plans,
``large_test`` on the held-out ones. Every game is labelled synthetic in its
``traj_data.json``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from alfworld.gen import constants
from alfworld.gen import goal_library as goals

from agent_gym.alfworld.engine import Engine
from agent_gym.alfworld.games import (
    GAME_FILE,
    LARGE_SPLITS,
    SPLITS,
    TASK_TYPES,
    TRAJ_FILE,
    alfred_domain,
    alfred_grammar,
)

GRID = 0.25  # metres per step of ALFRED's navigation grid
ROOMS = {"Kitchen": range(1, 31), "LivingRoom": range(201, 231),
         "Bedroom": range(301, 331), "Bathroom": range(401, 431)}
UNSEEN_PLANS = frozenset(constants.TEST_SCENE_NUMBERS)
# Splits whose games are set in UNSEEN_PLANS only; every other split never uses them.
UNSEEN_SPLITS = frozenset({"valid_unseen", "large_test"})
# Where ALFRED's goal library lets each task happen (the light task needs a lamp too).
TASK_ROOMS = {task: constants.GOALS_VALID[task] for task in TASK_TYPES}
# Which appliance changes the object, with the verb and ALFRED's list of fitting objects.
TRANSFORMS = {
    "pick_clean_then_place_in_recep": ("SinkBasin", "clean", "Cleanable"),
    "pick_heat_then_place_in_recep": ("Microwave", "heat", "Heatable"),
    "pick_cool_then_place_in_recep": ("Fridge", "cool", "Coolable"),
}
LAMP = "DeskLamp"
LAMP_HOSTS = ("Desk", "SideTable", "Dresser")
STATIC_RECEPTACLES = frozenset(constants.VAL_RECEPTACLE_OBJECTS) - constants.MOVABLE_RECEPTACLES_SET
# Types the domain's actions name as constants; the problem must declare them.
DOMAIN_RTYPES = ("SinkBasin", "Microwave", "Fridge")
DOMAIN_OTYPES = ("Knife", "ButterKnife")
MAX_ATTEMPTS = 200


class GenerationError(RuntimeError):
    """No game of the requested kind could be built."""


@dataclass(frozen=True)
class Receptacle:
    id: str  # ALFRED's id, e.g. "Cabinet|+00.68|+00.50|-02.20"
    type: str
    location: str  # "loc|x|z|rotation|horizon" in grid units, as ALFWorld writes it


@dataclass(frozen=True)
class Item:
    id: str
    type: str
    receptacle: Receptacle


@dataclass(frozen=True)
class Goal:
    task_type: str
    object_target: str
    parent_target: str = ""  # the receptacle type it must end in ("" for the light task)
    toggle_target: str = ""  # the lamp of the light task

    def pddl(self) -> str:
        text = goals.gdict[self.task_type]["pddl"].format(
            obj=self.object_target, recep=self.parent_target, toggle=self.toggle_target
        )
        return " ".join(text.replace("#", "-").split())

    def describe(self, rng: random.Random) -> str:
        template = rng.choice(goals.gdict[self.task_type]["templates"])
        return template.format(obj=self.object_target.lower(), recep=self.parent_target.lower(),
                               toggle=self.toggle_target.lower())


@dataclass(frozen=True)
class Scene:
    floor_plan: int
    room: str
    receptacles: tuple[Receptacle, ...]
    items: tuple[Item, ...]
    agent_location: str


@dataclass(frozen=True)
class GeneratedGame:
    task_dir: str
    trial: str
    game: dict[str, Any]  # game.tw-pddl without domain and grammar
    traj: dict[str, Any]  # traj_data.json


# ----------------------------------------------------------------------------- scenes
def _layouts() -> Path:
    from alfworld.gen import __file__ as gen_init

    return Path(gen_init).parent / "layouts"


def _location(x: float, z: float, rotation: float, horizon: float) -> str:
    return f"loc|{round(x / GRID)}|{round(z / GRID)}|{round(rotation / 90) % 4}|{round(horizon)}"


def _coords(alfred_id: str) -> tuple[float, float, float]:
    x, y, z = (float(part) for part in alfred_id.split("|")[1:4])
    return x, y, z


def _object_id(kind: str, x: float, y: float, z: float) -> str:
    return f"{kind}|{x:+06.2f}|{y:+06.2f}|{z:+06.2f}"


def _receptacle_type(alfred_id: str) -> str:
    parts = alfred_id.split("|")
    return parts[-1] if parts[-1].endswith("Basin") else parts[0]


def build_room(floor_plan: int, rng: random.Random) -> tuple[list[Receptacle], list[str], str]:
    """The receptacles of a floor plan, the object types it holds, and a start location.

    Receptacles with a recorded pose keep ALFRED's id and pose; receptacle types the plan
    lists without a pose (stove burners, coffee machines, garbage cans...) get one
    instance, standing at a free point of the plan's reachable grid.
    """
    layouts = _layouts()
    kinds: list[str] = json.loads((layouts / f"FloorPlan{floor_plan}-objects.json").read_text())
    poses: dict[str, list[float]] = json.loads(
        (layouts / f"FloorPlan{floor_plan}-openable.json").read_text()
    )
    points = np.load(layouts / f"FloorPlan{floor_plan}-layout.npy")
    receptacles = [
        Receptacle(rid, _receptacle_type(rid), _location(*pose))
        for rid, pose in sorted(poses.items())
        if _receptacle_type(rid) in STATIC_RECEPTACLES
    ]
    used = {r.location for r in receptacles}
    present = {r.type for r in receptacles}
    for kind in sorted(set(kinds) & STATIC_RECEPTACLES - present):
        for _ in range(rng.randint(2, 4) if kind == "StoveBurner" else 1):
            x, z = (float(v) for v in points[rng.randrange(len(points))])
            rotation = rng.randrange(4)
            location = _location(x, z, rotation * 90, rng.choice((30, 45, 60)))
            if location in used:
                continue
            used.add(location)
            dx, dz = [(0, 1), (1, 0), (0, -1), (-1, 0)][rotation]
            rid = _object_id(kind, x + 0.75 * dx, rng.uniform(0.0, 0.9), z + 0.75 * dz)
            receptacles.append(Receptacle(rid, kind, location))
    while True:
        x, z = (float(v) for v in points[rng.randrange(len(points))])
        start = _location(x, z, rng.randrange(4) * 90, 30)
        if start not in used:
            return receptacles, kinds, start


def _holders(kind: str, receptacles: Sequence[Receptacle]) -> list[Receptacle]:
    return [r for r in receptacles
            if kind in constants.VAL_RECEPTACLE_OBJECTS.get(r.type, ()) or
            (kind == LAMP and r.type in LAMP_HOSTS)]


def choose_goal(
    task_type: str, receptacles: Sequence[Receptacle], kinds: Sequence[str], rng: random.Random
) -> Goal | None:
    """A goal the room can host, or None. The object must fit a receptacle other than its
    destination (so it can start away from it) and the appliances must be there."""
    types = {r.type for r in receptacles}
    movable = [k for k in sorted(set(kinds) - STATIC_RECEPTACLES) if _holders(k, receptacles)]
    if task_type == "look_at_obj_in_light":
        if LAMP not in kinds or not _holders(LAMP, receptacles):
            return None
        candidates = [k for k in movable if k != LAMP]
        return Goal(task_type, rng.choice(candidates), toggle_target=LAMP) if candidates else None
    transform = TRANSFORMS.get(task_type)
    appliance = transform[0] if transform else ""
    if appliance and appliance not in types:
        return None
    pairs = []
    for kind in movable:
        if kind == LAMP or (transform and kind not in constants.VAL_ACTION_OBJECTS[transform[2]]):
            continue
        holders = _holders(kind, receptacles)
        for destination in sorted({r.type for r in holders} - {appliance}):
            if any(r.type not in (destination, appliance) for r in holders):
                pairs.append((kind, destination))
    if not pairs:
        return None
    kind, destination = rng.choice(pairs)
    return Goal(task_type, kind, parent_target=destination)


def place_items(
    goal: Goal, receptacles: Sequence[Receptacle], kinds: Sequence[str], rng: random.Random
) -> list[Item]:
    """Instances of the target (away from its destination and appliance), a lamp for the
    light task, and a handful of other objects where ALFRED allows them."""
    avoid = {goal.parent_target, TRANSFORMS.get(goal.task_type, ("",))[0]}
    items: list[Item] = []
    taken: set[str] = set()

    def put(kind: str, spots: Sequence[Receptacle]) -> None:
        host = rng.choice(list(spots))
        x, y, z = _coords(host.id)
        while True:
            oid = _object_id(kind, x + rng.uniform(-0.3, 0.3), y + rng.uniform(0.0, 0.1),
                             z + rng.uniform(-0.3, 0.3))
            if oid not in taken:
                taken.add(oid)
                items.append(Item(oid, kind, host))
                return

    target_spots = [r for r in _holders(goal.object_target, receptacles) if r.type not in avoid]
    low = 2 if goal.task_type == "pick_two_obj_and_place" else 1
    for _ in range(rng.randint(low, 3)):
        put(goal.object_target, target_spots)
    if goal.toggle_target:
        put(goal.toggle_target, _holders(goal.toggle_target, receptacles))
    others = [k for k in sorted(set(kinds) - STATIC_RECEPTACLES)
              if k not in (goal.object_target, LAMP) and _holders(k, receptacles)]
    for kind in rng.sample(others, min(len(others), rng.randint(5, 8))):
        for _ in range(rng.randint(1, 2)):
            put(kind, _holders(kind, receptacles))
    return items


# ----------------------------------------------------------------------------- PDDL
def mangle(alfred_id: str) -> str:
    """ALFWorld's spelling of ALFRED ids as PDDL names (``|`` -> ``_bar_`` and so on)."""
    for char, word in (("-", "_minus_"), ("|", "_bar_"), ("+", "_plus_"), (".", "_dot_"),
                       (",", "_comma_")):
        alfred_id = alfred_id.replace(char, word)
    return alfred_id


def pddl_problem(name: str, scene: Scene, goal: Goal) -> str:
    """The problem in the shape of ALFWorld's own game files (same predicates, ids,
    locations); ``canContain`` lists only the types present."""
    m = mangle
    receptacles, items = scene.receptacles, scene.items
    rtypes = sorted({r.type for r in receptacles} | set(DOMAIN_RTYPES))
    otypes = sorted({i.type for i in items} | set(DOMAIN_OTYPES))
    locations = sorted({r.location for r in receptacles} | {scene.agent_location})
    objects = (["agent1 - agent"] + [f"{t}Type - otype" for t in otypes]
               + [f"{t}Type - rtype" for t in rtypes]
               + [f"{m(i.id)} - object" for i in items]
               + [f"{m(r.id)} - receptacle" for r in receptacles]
               + [f"{m(loc)} - location" for loc in locations])
    present = {r.type for r in receptacles}
    contain = sorted({(r, i.type) for r in present for i in items
                      if i.type in constants.VAL_RECEPTACLE_OBJECTS.get(r, ())})
    actions = constants.VAL_ACTION_OBJECTS
    init = [f"(receptacleType {m(r.id)} {r.type}Type)" for r in receptacles]
    init += [f"(objectType {m(i.id)} {i.type}Type)" for i in items]
    init += [f"(canContain {r}Type {o}Type)" for r, o in contain]
    init += [f"(pickupable {m(i.id)})" for i in items if i.type != LAMP]
    init += [f"(isReceptacleObject {m(i.id)})" for i in items
             if i.type in constants.MOVABLE_RECEPTACLES_SET]
    init += [f"(openable {m(r.id)})" for r in receptacles
             if r.type in constants.OPENABLE_CLASS_SET]
    init.append(f"(atLocation agent1 {m(scene.agent_location)})")
    for predicate, table in (("cleanable", "Cleanable"), ("heatable", "Heatable"),
                             ("coolable", "Coolable"), ("sliceable", "Sliceable"),
                             ("toggleable", "Toggleable")):
        init += [f"({predicate} {m(i.id)})" for i in items if i.type in actions[table]]
    init += [f"(inReceptacle {m(i.id)} {m(i.receptacle.id)})" for i in items]
    init += [f"(receptacleAtLocation {m(r.id)} {m(r.location)})" for r in receptacles]
    init += [f"(objectAtLocation {m(i.id)} {m(i.receptacle.location)})" for i in items]
    return "\n".join([
        f"(define (problem plan_{name})", "(:domain alfred)", "(:objects",
        *objects, ")", "(:init", *init, ")", goal.pddl(),
    ])


# ----------------------------------------------------------------------------- walkthrough
def walkthrough(scene: Scene, goal: Goal, names: dict[str, str]) -> list[str]:
    """A rule-based solution: fetch the object (opening what is closed), use the
    appliance, carry it to the destination (or to the lamp); twice for pick-two."""
    def name(alfred_id: str) -> str:
        return names[mangle(alfred_id).lower()]

    commands: list[str] = []
    here = scene.agent_location
    opened: set[str] = set()

    def go(receptacle: Receptacle) -> None:
        nonlocal here
        if here != receptacle.location:
            commands.append(f"go to {name(receptacle.id)}")
            here = receptacle.location
        if receptacle.type in constants.OPENABLE_CLASS_SET and receptacle.id not in opened:
            commands.append(f"open {name(receptacle.id)}")
            opened.add(receptacle.id)

    def first(kind: str) -> Receptacle:
        return min((r for r in scene.receptacles if r.type == kind), key=lambda r: name(r.id))

    targets = sorted((i for i in scene.items if i.type == goal.object_target),
                     key=lambda i: name(i.id))
    count = 2 if goal.task_type == "pick_two_obj_and_place" else 1
    for item in targets[:count]:
        go(item.receptacle)
        commands.append(f"take {name(item.id)} from {name(item.receptacle.id)}")
        if goal.task_type in TRANSFORMS:
            appliance, verb, _ = TRANSFORMS[goal.task_type]
            station = first(appliance)
            go(station)
            commands.append(f"{verb} {name(item.id)} with {name(station.id)}")
        if goal.toggle_target:
            lamp = next(i for i in scene.items if i.type == goal.toggle_target)
            go(lamp.receptacle)
            commands.append(f"use {name(lamp.id)}")
        else:
            destination = first(goal.parent_target)
            go(destination)
            commands.append(f"move {name(item.id)} to {name(destination.id)}")
    return commands


def play(engine: Engine, commands: Sequence[str]) -> str | None:
    """Play a walkthrough from the loaded game's start; None if it wins exactly at its
    last command, else what went wrong."""
    frame = engine.frame
    if frame.won:
        return "the game is won before any action"
    for number, command in enumerate(commands, start=1):
        if frame.won:
            return f"won early, before command {number}"
        if command not in frame.admissible:
            return f"command {number} {command!r} is not admissible"
        frame = engine.step(command)
    return None if frame.won else "the walkthrough ends without winning"


# ----------------------------------------------------------------------------- games
def generate_game(
    task_type: str, split: str, seed: int, index: int, engine: Engine
) -> GeneratedGame:
    """One verified game; the same arguments always give the same game."""
    if task_type not in TASK_TYPES:
        raise GenerationError(f"unknown task type {task_type!r}")
    if split not in SPLITS + LARGE_SPLITS:
        raise GenerationError(f"unknown split {split!r}")
    rng = random.Random(f"agent_gym.alfworld/{seed}/{split}/{task_type}/{index}")
    plans = [(room, n) for room in sorted(TASK_ROOMS[task_type]) for n in ROOMS[room]
             if (n in UNSEEN_PLANS) == (split in UNSEEN_SPLITS)]
    trial = f"trial_synthetic_{seed}_{index:04d}"
    for _ in range(MAX_ATTEMPTS):
        room, floor_plan = rng.choice(plans)
        receptacles, kinds, start = build_room(floor_plan, rng)
        goal = choose_goal(task_type, receptacles, kinds, rng)
        if goal is None:
            continue
        items = place_items(goal, receptacles, kinds, rng)
        scene = Scene(floor_plan, room, tuple(receptacles), tuple(items), start)
        description = goal.describe(rng)
        problem = pddl_problem(trial, scene, goal)
        engine.load({"pddl_domain": alfred_domain(), "grammar": alfred_grammar(description),
                     "pddl_problem": problem, "solvable": True})
        commands = walkthrough(scene, goal, engine.names())
        if play(engine, commands) is not None:
            continue
        recep = goal.parent_target or goal.toggle_target
        return GeneratedGame(
            task_dir=f"{task_type}-{goal.object_target}-None-{recep}-{floor_plan}",
            trial=trial,
            game={"pddl_problem": problem, "solvable": True, "walkthrough": commands},
            traj={
                "task_id": trial,
                "task_type": task_type,
                "split": split,
                "scene": {"floor_plan": f"FloorPlan{floor_plan}", "scene_num": floor_plan,
                          "room": room},
                "pddl_params": {
                    "object_target": goal.object_target, "parent_target": goal.parent_target,
                    "toggle_target": goal.toggle_target, "mrecep_target": "",
                    "object_sliced": False,
                },
                "turk_annotations": {"anns": [{"task_desc": description}]},
                "synthetic": True,
                "generator": {"name": "agent_gym.alfworld", "seed": seed, "index": index},
            },
        )
    raise GenerationError(
        f"no verified {task_type} game for split {split} after {MAX_ATTEMPTS} attempts"
    )


def generate(
    out_dir: Path,
    splits: Sequence[str],
    per_type: int,
    *,
    task_types: Sequence[str] = TASK_TYPES,
    seed: int = 0,
    strip: bool = False,
    progress: Callable[[GeneratedGame], None] | None = None,
) -> list[Path]:
    """Write ``per_type`` games of each task type into ``out_dir/<split>/`` in ALFWorld's
    layout; return the game files. ``strip`` leaves the domain and grammar out (the
    loader fills them in), as the bundled set does."""
    if per_type < 1:
        raise GenerationError(f"per_type must be at least 1, got {per_type}")
    engine = Engine()
    written = []
    try:
        for split, task_type, index in _plan(splits, task_types, per_type):
            made = generate_game(task_type, split, seed, index, engine)
            folder = out_dir / split / made.task_dir / made.trial
            folder.mkdir(parents=True, exist_ok=True)
            game = dict(made.game)
            if not strip:
                game = {"pddl_domain": alfred_domain(),
                        "grammar": alfred_grammar(made.traj["turk_annotations"]["anns"][0]
                                                  ["task_desc"]), **game}
            (folder / GAME_FILE).write_text(json.dumps(game) + "\n", encoding="utf-8")
            (folder / TRAJ_FILE).write_text(json.dumps(made.traj, indent=1) + "\n",
                                            encoding="utf-8")
            written.append(folder / GAME_FILE)
            if progress is not None:
                progress(made)
    finally:
        engine.close()
    return written


def _plan(
    splits: Sequence[str], task_types: Sequence[str], per_type: int
) -> Iterator[tuple[str, str, int]]:
    """Indices count per split and type, so asking for more games keeps the first ones."""
    for split in splits:
        for task_type in task_types:
            for index in range(per_type):
                yield split, task_type, index
