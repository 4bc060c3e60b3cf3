"""STAND-IN for a container's PID 1 that does not reap (a shell, a supervisor not written to).

    python nonreaping_init.py HOLD_S COMMAND...

Runs COMMAND as its child and becomes the child subreaper of its tree (Linux `prctl`), so every
orphan of that tree is re-parented to it, as to a container's PID 1. It waits for COMMAND alone
(`waitpid` of that PID), never for the orphans, so an orphan that exits stays a zombie; after
COMMAND exits it holds them for HOLD_S seconds, then exits with COMMAND's status. SIGTERM and
SIGINT are passed on to COMMAND. Used by tests/test_cli.py: `lmserve` must reap its own tree.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36

if __name__ == "__main__":
    hold_s, command = float(sys.argv[1]), sys.argv[2:]
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        sys.exit("nonreaping_init: prctl(PR_SET_CHILD_SUBREAPER) failed")
    child = subprocess.Popen(command)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda s, _frame: child.send_signal(s))
    status = child.wait()
    time.sleep(hold_s)
    sys.exit(status if status >= 0 else 128 - status)
