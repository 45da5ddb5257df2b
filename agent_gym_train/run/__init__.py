"""What every trainer's run shares: ``run.py`` opens a run and is where the pieces beside it
meet (none of them imports it)."""

from agent_gym import _moved


def __getattr__(name: str) -> object:  # the names of the flat layout's run module
    return _moved.moved_attribute(__name__, name)
