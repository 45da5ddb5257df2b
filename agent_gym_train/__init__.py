"""trainers: token-level episodes, Datums, rollouts, backends, GRPO and TEMPO."""
