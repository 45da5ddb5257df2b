"""One small module per environment, each on top of ``agent_gym.env.base.TextEnv``; beside
them ``mixture`` (several envs as one, each with a weight) and ``math_large`` (the generated
word problems GSM8K-v0 and CodeInterpreter-v0 share)."""
