"""Shared fixtures: every test imports agent_gym so the envs are registered."""

import agent_gym  # noqa: F401
