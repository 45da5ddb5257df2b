"""The floors of DESIGN §6: a module imports only from its own floor or below.

The table below is the one statement of the floors; README's "Where things are" follows it.
Every import counts -- at the top, inside a function, under ``TYPE_CHECKING``, relative:
a lazy import is the same dependency, taken later.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The floors, bottom up. A row is a path under the repository: a folder ("x/") holds every
# module below it, a file only itself; the longest matching row places a module. To split a
# floor (agent_gym_train into backends < run < algorithms, say), add rows for its folders or
# modules at the heights they take.
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # cli/parsing.py is how every command parses, and needs only untrusted: serve's launcher
    # and the trainers share it without the rest of the command line.
    ("leaves", ("agent_gym/seeding.py", "agent_gym/untrusted.py", "agent_gym/durable.py",
                "agent_gym/extras.py",
                "agent_gym/paths.py", "agent_gym/hoststore.py", "agent_gym/cli/parsing.py")),
    ("engines", ("agent_gym/sandbox/", "agent_gym/search/", "agent_gym/alfworld/",
                 "agent_gym/actions/", "agent_gym/rewards.py", "agent_gym/render.py",
                 "agent_gym/data.py")),
    ("env", ("agent_gym/env/",)),
    # The package's own __init__ registers the envs; _moved aliases old paths by name only.
    ("envs", ("agent_gym/envs/", "agent_gym/__init__.py", "agent_gym/_moved.py")),
    ("eval, serve", ("agent_gym/eval/", "agent_gym/serve/")),
    ("adapters, cli", ("agent_gym/adapters/", "agent_gym/cli/")),
    # The trainers: the backends know nothing of a run; the run's pieces nothing of the
    # algorithms (none of them calls back into ``Run`` either: run/run.py is where they meet).
    ("trainer backends", ("agent_gym_train/backends/",)),
    ("trainer run", ("agent_gym_train/run/",)),
    ("trainers", ("agent_gym_train/",)),
    ("benchmarks", ("benchmarks/",)),
    ("deploy", ("deploy/",)),
)
# The folders whose imports are held; an import of any other top-level name is not ours.
HELD = ("agent_gym", "agent_gym_train", "benchmarks", "deploy")
# Folders that must be placed row by row: a new module there without a row fails.
PLACED = ("agent_gym", "agent_gym_train")


def floor_of(path: str) -> int | None:
    """The height of the longest row matching ``path`` (relative, posix), or None."""
    best: tuple[int, int] | None = None  # (row length, height)
    for height, (_, rows) in enumerate(FLOORS):
        for row in rows:
            if (path == row or (row.endswith("/") and path.startswith(row))) and (
                    best is None or len(row) > best[0]):
                best = (len(row), height)
    return None if best is None else best[1]


def module_file(name: str) -> str | None:
    """The file a dotted module name loads from (a module or a package's __init__)."""
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate.relative_to(ROOT).as_posix()
    return None


def imported_file(name: str) -> str:
    """Where an import of ``name`` lands: its own file, else its nearest existing package
    (an old path the shim aliases, or a name the package defines)."""
    parts = name.split(".")
    while parts:
        found = module_file(".".join(parts))
        if found is not None:
            return found
        parts.pop()
    raise AssertionError(f"{name} names no file under {ROOT}")


def imports(path: Path) -> set[tuple[int, str]]:
    """(line, module) of every import in a file. ``from a import b`` yields ``a.b`` when
    ``b`` is a module of its own, since that is what gets loaded."""
    package = path.relative_to(ROOT).parts[:-1]  # a module's and an __init__'s alike
    found: set[tuple[int, str]] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add((node.lineno, alias.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package[:len(package) - (node.level - 1)]
                module = ".".join([*anchor, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            for alias in node.names:
                submodule = f"{module}.{alias.name}"
                found.add((node.lineno, submodule if module_file(submodule) else module))
    return found


def sources() -> list[Path]:
    return sorted(path for top in HELD for path in (ROOT / top).rglob("*.py"))


def test_every_module_of_the_packages_has_a_floor() -> None:
    unplaced = [path.relative_to(ROOT).as_posix() for path in sources()
                if path.relative_to(ROOT).parts[0] in PLACED
                and floor_of(path.relative_to(ROOT).as_posix()) is None]
    assert unplaced == [], "add a row to FLOORS for each of these"


def test_no_module_imports_from_a_floor_above_its_own() -> None:
    upward = []
    for path in sources():
        importer = path.relative_to(ROOT).as_posix()
        own = floor_of(importer)
        assert own is not None, f"{importer} has no floor"
        for line, name in sorted(imports(path)):
            if name.split(".")[0] not in HELD:
                continue
            target = imported_file(name)
            height = floor_of(target)
            assert height is not None, f"{importer}:{line} imports {name}, which has no floor"
            if height > own:
                upward.append(f"{importer}:{line} ({FLOORS[own][0]}) imports {name} "
                              f"({FLOORS[height][0]})")
    assert not upward, "imports from a floor above:\n" + "\n".join(upward)


def test_the_readme_lists_the_same_floors_in_the_same_order() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Where things are", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1].strip() for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| floor ")]
    assert rows == [name for name, _ in FLOORS]


def test_no_piece_of_a_run_calls_back_into_the_run() -> None:
    """run/run.py composes the run's pieces; a piece that imported it would tie rollouts,
    the journal or the pipeline to one trainer loop's object."""
    run = "agent_gym_train/run/run.py"
    callers = [f"{path.relative_to(ROOT).as_posix()}:{line}"
               for path in (ROOT / "agent_gym_train" / "run").glob("*.py")
               if path.relative_to(ROOT).as_posix() != run
               for line, name in imports(path)
               if name.split(".")[0] == "agent_gym_train" and imported_file(name) == run]
    assert not callers, "pieces that import run/run.py: " + ", ".join(callers)


def test_the_trainers_import_no_module_in_a_circle() -> None:
    """A floor allows imports within itself; a circle among them is still a knot (the
    arguments and their parser, TEMPO and its critic were one)."""
    graph: dict[str, set[str]] = {}
    for path in sources():
        module = path.relative_to(ROOT).as_posix()
        if module.startswith("agent_gym_train/"):
            graph[module] = {target for _, name in imports(path)
                             if name.split(".")[0] == "agent_gym_train"
                             and (target := imported_file(name)) != module
                             and not target.endswith("/__init__.py")}
    circles = [path for path in _circles(graph) if len(path) > 1]
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found
