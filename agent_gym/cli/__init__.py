"""The ``agent-gym`` command (``main``) and its run-file subcommands (``runs``).

``parsing`` is the one module of it that trainers import, so a trainer's command line looks
and fails like every other without pulling in the rest of the CLI.
"""

from agent_gym import _moved


def __getattr__(name: str) -> object:  # the flat module's names, for one release
    return _moved.moved_attribute(__name__, name)
