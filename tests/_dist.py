"""Test helper: run a function on N forked gloo ranks and collect the results."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import queue
import signal
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RemoteTraceback(Exception):
    """Carries a child rank's formatted traceback as the cause of the re-raised error."""

    def __str__(self) -> str:
        return self.args[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable, rank: int, world_size: int, port: int, timeout: float,
           results: Any, args: tuple, backend: str | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # where a rank hangs, when it times out
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException as e:  # report first: the other ranks may be stuck waiting on us
        try:
            exc = pickle.dumps(e)
        except Exception:
            exc = None
        results.put((rank, False, (exc, traceback.format_exc())))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 60,
                    backend: str | None = "gloo") -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` forked gloo ranks.

    `backend=None` initialises the process group without naming a backend, as many scripts do.
    Returns the per-rank return values (which must be picklable), in rank order.
    The first rank to fail has its exception re-raised here, chained to its traceback
    text; ranks still running after `timeout` seconds are killed and TimeoutError raised.
    """
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, timeout, results, args, backend),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) < world_size:
            pending = [r for r in range(world_size) if r not in outputs]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                for r in pending:  # each prints its Python stack to stderr
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(procs[r].pid, signal.SIGUSR1)
                time.sleep(1)
                raise TimeoutError(
                    f"run_distributed: ranks {pending} of {world_size} did not finish within "
                    f"{timeout}s (deadlock, or a rank waiting on a collective? their stacks are on stderr); "
                    "killed them"
                )
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = {r: procs[r].exitcode for r in pending if procs[r].exitcode not in (None, 0)}
                if dead and results.empty():
                    raise RuntimeError(f"run_distributed: ranks died without reporting a result "
                                       f"(rank: exit code {dead}); segfault or os._exit?") from None
                continue
            if ok:
                outputs[rank] = pickle.loads(payload)
                continue
            exc_bytes, tb = payload
            remote = RemoteTraceback(f"\nrank {rank} of {world_size} failed:\n{tb}")
            try:
                exc = pickle.loads(exc_bytes) if exc_bytes else None
            except Exception:
                exc = None
            if isinstance(exc, BaseException):
                raise exc from remote
            raise RuntimeError(f"rank {rank} of {world_size} failed") from remote
    finally:
        for p in procs:
            p.join(timeout=5 if len(outputs) == world_size else 0)
            if p.is_alive():
                p.kill()
                p.join()
    return [outputs[r] for r in range(world_size)]
