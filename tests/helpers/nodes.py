"""File-system nodes that are not regular files, for tests of what writers refuse."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def special_nodes(directory: Path) -> list[Path]:
    """A FIFO, and (where this user may make one) a character device of ``/dev/null``'s
    numbers, made in ``directory``: a writer that replaced one would harm nothing outside,
    which a test on the real ``/dev/null`` run as root could not promise."""
    fifo = directory / "fifo"
    os.mkfifo(fifo)
    nodes = [fifo]
    try:
        os.mknod(directory / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        pass
    else:
        nodes.append(directory / "null")
    return nodes
