"""Evaluating a policy on an env: the run loop, its policies, the run files it writes and the
commands that read them (compare, rescore, report)."""

from agent_gym import _moved


def __getattr__(name: str) -> object:  # the flat module's names, for one release
    return _moved.moved_attribute(__name__, name)
