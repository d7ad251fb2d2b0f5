"""One run per run directory: a lock that the kernel drops when its process ends, however it ends.

Two runs writing one directory overwrite each other's checkpoints and metrics, and one run's
clean-up removes the other's half-written checkpoint. `flock` is held by an open file, so no lock
outlives a crash or `kill -9`; the file also says who holds it, for the error the next run gets.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import IO

try:
    import fcntl
except ImportError:  # not a POSIX system: no lock
    fcntl = None

LOCK_FILE = ".lock"
_held: dict[str, IO] = {}  # the directories this process holds, by absolute path


class DirectoryInUse(OSError):
    """Another process holds the directory."""


def lock_dir(path: Path) -> None:
    """Hold `path` for this process until `unlock_dir` (or the process ends); raises DirectoryInUse, naming
    the holder, if another process holds it. Locking a directory this process already holds does nothing,
    so a run left unfinished in a process (an error in a notebook) does not bar the next one there. On a
    file system without locks nothing is held."""
    key = os.path.abspath(path)
    if fcntl is None or key in _held:
        return
    file = open(Path(path) / LOCK_FILE, "a+")
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.seek(0)
        holder = file.read().strip() or "another process"
        file.close()
        raise DirectoryInUse(f"{path} is in use by another run ({holder})") from None
    except OSError:  # no locks on this file system (ENOLCK, EOPNOTSUPP)
        file.close()
        return
    file.truncate(0)
    file.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    file.flush()
    _held[key] = file


def unlock_dir(path: Path) -> None:
    """Let another process lock `path` (the file stays: removing it could race another's lock)."""
    file = _held.pop(os.path.abspath(path), None)
    if file is not None:
        file.close()
