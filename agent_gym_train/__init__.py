"""The trainers: SFT, GRPO, OPD and TEMPO on agent_gym envs, each its own loop, on the run
folder (``run/``) and the backends (``backends/``).

The flat layout's module paths (``agent_gym_train.args``, ``agent_gym_train.rollout``, ...)
still import until agent-gym ``agent_gym._moved.REMOVED_IN``, with a DeprecationWarning
naming the new path."""

from agent_gym import _moved

_RUN = "agent_gym_train.run"
_moved.register(
    {
        **{f"agent_gym_train.{old}": f"{_RUN}.{new}" for old, new in (
            ("args", "args"), ("options", "args"), ("clients", "clients"),
            ("envpool", "envpool"), ("runfiles", "files"), ("journal", "journal"),
            ("pipeline", "pipeline"), ("tasks", "tasks"), ("episode", "episode"),
            ("rollout", "rollout"), ("store", "store"), ("losses", "losses"))},
        "agent_gym_train.models": "agent_gym_train.backends.models",
        "agent_gym_train.chat_template": "agent_gym_train.backends.chat_template",
        "agent_gym_train.tempo_critic": "agent_gym_train.critic",
    },
    # ``agent_gym_train.run`` was the run module; it is the run folder now.
    {_RUN: dict.fromkeys(("Run", "open_run", "device_defaults", "final_line",
                          "idle_advice", "trained_datums"), f"{_RUN}.run")},
)
