"""How a hint names a command (`rewind log RUN`, `tensorboard --logdir ...`) so that it runs when pasted.

The quick start installs rewind into `.venv` without activating it, so in the user's shell `rewind`
(and `tensorboard`, installed beside it) is not on the PATH: a hint that says `rewind log runs/abcd`
fails with "command not found" there. A hint names the program as the shell finds it: its bare name
where the PATH leads to the script this environment installed, else that script's path.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys


def invocation(program: str) -> str:
    """`program` (a script installed beside this Python: rewind, tensorboard) as the user's shell runs
    it from the working directory: the bare name where the PATH finds this environment's script, else
    its path (relative when under the working directory: `.venv/bin/rewind` after the quick start).
    The bare name where this environment has no such script (nothing better is known)."""
    script = os.path.join(os.path.dirname(sys.executable), program)
    if not os.path.isfile(script):
        return program
    found = shutil.which(program)
    if found is not None and os.path.samefile(found, script):
        return program
    relative = os.path.relpath(script)
    if relative.startswith(os.pardir + os.sep):
        return shlex.quote(script)
    return shlex.quote(relative if os.sep in relative else os.path.join(os.curdir, relative))
