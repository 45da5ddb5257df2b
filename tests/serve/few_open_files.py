"""Imported by a server under test (``--import tests.serve.few_open_files``) before it
serves: it starts with the soft limit of open files in ``$AGENT_GYM_TEST_SOFT_FILES``, as
one started from a shell after ``ulimit -Sn`` would. Never imported by a test itself."""

from __future__ import annotations

import os
import resource

resource.setrlimit(resource.RLIMIT_NOFILE, (int(os.environ["AGENT_GYM_TEST_SOFT_FILES"]),
                                            resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
