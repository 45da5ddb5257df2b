"""The one seed hash, a leaf every layer may import: evaluation, rollouts and the trainers
derive every seed from what it is for, so no two of them can drift apart."""

from __future__ import annotations

import hashlib


def derive_seed(*parts: object) -> int:
    """The one seed derivation: a 31-bit seed from (run seed, episode, rollout, turn, ...).

    Seeds depend on what they are for, never on scheduling order, so a resumed or
    concurrent run draws what an uninterrupted sequential one would (``agent_gym_train.run.run``
    derives its step and group seeds with it too).
    """
    key = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=4).digest()
    return int.from_bytes(key, "little") & 0x7FFFFFFF
