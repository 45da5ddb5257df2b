"""How to install an optional extra, said the same way by every module that needs one.

The package is installed from a clone (or a wheel built from one), not from PyPI, so the
hint names the clone's command: asking pip for the extra by the package's name would answer
"No matching distribution".
"""

from __future__ import annotations


def install_hint(extra: str) -> str:
    """The command that installs ``extra``, e.g. for an ImportError's message."""
    return f"install the {extra!r} extra (in the agent-gym checkout: pip install -e '.[{extra}]')"
