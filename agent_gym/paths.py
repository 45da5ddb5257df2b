"""Where agent_gym keeps what it builds, a leaf: one answer for every cache in the package
and its trainers, so an index, a response cache, the host store and a model download never
end up in two places."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The cache directory: `$AGENT_GYM_CACHE`, else `~/.cache/agent_gym`."""
    return Path(os.environ.get("AGENT_GYM_CACHE") or Path.home() / ".cache" / "agent_gym")
