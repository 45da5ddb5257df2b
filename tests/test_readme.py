"""The README's example is part of the contract: it must run as written."""

import re
from pathlib import Path


def test_readme_example_runs() -> None:
    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL)
    assert blocks, "the README should show the env contract in a python example"
    exec(compile(blocks[0], "README.md", "exec"), {})
