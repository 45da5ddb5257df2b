"""One small module per environment, each on top of ``agent_gym.env.base.TextEnv``."""
