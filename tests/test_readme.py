"""The README's example is part of the contract: it must run as written."""

import re
from pathlib import Path


def test_readme_example_runs() -> None:
    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL)
    assert blocks, "the README should show the env contract in a python example"
    exec(compile(blocks[0], "README.md", "exec"), {})


def test_make_run_is_the_documented_demo_and_the_eval_suite_stays_documented() -> None:
    root = Path(__file__).parents[1]
    readme = (root / "README.md").read_text(encoding="utf-8")
    makefile = (root / "Makefile").read_text(encoding="utf-8")
    run = re.search(r"^run: setup\n\t\$\(BIN\)/(agent-gym [^\n]+)", makefile, flags=re.M)
    assert run is not None and run.group(1) == "agent-gym train demo --out runs/demo"
    assert f"`make run` is `{run.group(1)}`" in readme
    assert "agent-gym eval --suite default --max-tokens 160 --out runs/eval-default" in readme


def test_the_readme_says_what_make_from_state_returns_and_where_random_plays() -> None:
    """Both as the code has them: a tuple to unpack, and a policy for envs listing
    admissible actions (eval refuses it elsewhere, naming ALFWorld-v0)."""
    import inspect

    import agent_gym

    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    returned = inspect.signature(agent_gym.make_from_state).return_annotation
    assert "tuple[gymnasium.Env, str, dict[str, Any]]" in str(returned)
    assert "`env, observation, info = agent_gym.make_from_state(state)`" in readme
    (row,) = [line for line in readme.splitlines() if line.startswith("| `agent-gym eval ENV")]
    assert "random (envs that list admissible actions: ALFWorld)" in row
