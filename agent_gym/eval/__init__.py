"""Evaluating a policy on an env: the run loop, its policies, the run files it writes and the
commands that read them (compare, rescore, report)."""
