#!/usr/bin/env python3
"""Runs a command as a child subreaper and fails if it leaves processes behind.

    scripts/reap.py COMMAND [ARG...]

Every process the command starts, however it detaches (a background job
whose parent exited, a daemon in its own session), is re-parented to this
process when its parent dies (Linux's PR_SET_CHILD_SUBREAPER). When the
command exits, any such process still alive is named, killed and reaped,
and the exit status is non-zero: a test run must stop everything it
started.
"""

import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def children(pid):
    """The live processes whose parent is `pid`, with their command lines."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
            # The command name is in parentheses and may hold spaces.
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[1]) != pid or fields[0] == "Z":
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError, IndexError):
            continue
        found.append((int(entry), cmd))
    return found


def reap_zombies():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main():
    if len(sys.argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print("reap.py: prctl(PR_SET_CHILD_SUBREAPER) failed; leftover check off", file=sys.stderr)
        return subprocess.call(sys.argv[1:])
    # The command's own signals (Ctrl-C) reach it; this process only waits.
    proc = subprocess.Popen(sys.argv[1:])
    while True:
        try:
            rc = proc.wait()
            break
        except KeyboardInterrupt:
            continue
    # Orphans re-parented a moment ago may still be exiting on their own.
    deadline = time.monotonic() + 2.0
    while True:
        reap_zombies()
        left = children(os.getpid())
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if left:
        print(f"== leftover processes: {len(left)} still running after the suite (killed now):", file=sys.stderr)
        for pid, cmd in left:
            print(f"   pid {pid}: {cmd[:200]}", file=sys.stderr)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
        reap_zombies()
        return rc or 1
    print("== leftover processes: none")
    return rc


if __name__ == "__main__":
    sys.exit(main())
