"""Adapters that put agent_gym envs behind other trainers' in-process env contracts.

* ``agent_gym.adapters.trl``: a class for TRL's ``GRPOTrainer(environment_factory=...)``.
* ``agent_gym.adapters.tinker``: an ``EnvGroupBuilder`` for tinker-cookbook's RL loops.
* ``agent_gym.adapters.openenv``: an OpenEnv ``Environment`` (NeMo-Gym's and SkyRL's
  in-process contract, and what OpenEnv's own ``create_app`` serves).

Each is imported on its own, so using one never needs the other trainer installed.
verifiers and GEM need no adapter: see docs/serving.md.
"""
