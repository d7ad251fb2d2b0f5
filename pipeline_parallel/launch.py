"""How a process of the training program joins the run: its process group and device (under torchrun
or alone), the stop signals (Ctrl-C, SIGTERM) that end it with one exception, and the line it fails with
in torchrun's report."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .comm import local_gpu
from .config import Config, ConfigError


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def join_group(cfg: Config) -> bool:
    """Join torchrun's process group unless there is one; returns whether this call created it."""
    if world_size() == 1 or dist.is_initialized():
        return False
    with _stop_signals_end_the_process():
        if _use_cuda(cfg):
            # The current device first: NCCL's object collectives (the settings check) carry their bytes on it.
            gpu = local_gpu()
            torch.cuda.set_device(gpu)
            dist.init_process_group("nccl", device_id=gpu)
        else:
            dist.init_process_group("gloo")
    return True


@contextlib.contextmanager
def _stop_signals_end_the_process():
    """Inside, SIGINT and SIGTERM end the process at once, as by default. Waiting for the other ranks to join
    holds this process in torch's C++ code, where a Python handler runs only once they came: torchrun's SIGTERM,
    after a rank failed before joining (a command line it could not read), was then answered by its SIGKILL
    30 s later. Nothing is written before the group exists, so there is nothing to clean up."""
    main = threading.current_thread() is threading.main_thread()  # only it may set handlers
    with _stop_signals_handled_by(signal.SIG_DFL) if main else contextlib.nullcontext():
        yield


def setup_device(cfg: Config) -> torch.device:
    """This rank's device; on CPU also its share of the node's cores."""
    if _use_cuda(cfg):
        device = local_gpu()
        torch.cuda.set_device(device)
        return device
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(cfg.num_threads or max(1, cores // local_ranks))
    return torch.device("cpu")


def _use_cuda(cfg: Config) -> bool:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device = cuda, but this torch ({torch.__version__}) finds no CUDA GPU; "
                          "use device = cpu, or auto to take a GPU when there is one")
    use = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    local_ranks, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", 1)), torch.cuda.device_count() if use else 0
    if use and local_ranks > gpus:  # each rank takes the GPU of its local rank
        raise ConfigError(f"device = {cfg.device} takes a CUDA GPU for each process, but this node runs {local_ranks} "
                          f"and has {gpus}: launch at most {gpus} per node (torchrun --nproc-per-node {gpus}), or set "
                          "device = cpu to train on the CPU")
    return use


def tell_torchrun(message: str) -> None:
    """Write `message` where torchrun reads this rank's error, so its failure report shows it rather than a link
    to its docs, whichever rank it finds failed first (even one that printed nothing). As torch's
    `ErrorHandler.record_exception` writes it, with the message in place of a traceback; nothing without torchrun."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        error = {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}
        with contextlib.suppress(OSError):  # the report is a courtesy: the error itself is printed
            Path(path).write_text(json.dumps({"message": error}))


class Interrupted(KeyboardInterrupt):
    """A stop asked for from outside: Ctrl-C (SIGINT) or SIGTERM (a job scheduler, torchrun)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    def __reduce__(self):  # as DCP gathers a rank's failure to the others
        return type(self), (self.signum,)


_stops: list[Interrupted] = []  # the stop a signal raised in this process, since stop_signals_raise began


def stop_asked() -> Interrupted | None:
    """The Interrupted a stop signal raised in this process, if one came: also where it was caught on the
    way (DCP catches everything in a save) or where a peer that stopped at the same signal broke a transfer
    first, so that the error this rank then ends with is known for the stop's consequence."""
    return _stops[0] if _stops else None


def forget_stop() -> None:
    """Forget the stop a signal raised (see `stop_asked`) once the run it ended has told it: a later run in the same
    process, or a Trainer used after it, must not take its own failures for that stop's consequence."""
    _stops.clear()


@contextlib.contextmanager
def stop_signals_raise():
    """Inside, SIGINT and SIGTERM raise `Interrupted`; the handlers before are restored after. A signal
    the launcher ignores (SIGINT in a job started with `&` or nohup) stays ignored."""
    _stops.clear()
    with _stop_signals_handled_by(_on_signal):
        yield


@contextlib.contextmanager
def _stop_signals_handled_by(handler):
    """Inside, SIGINT and SIGTERM go to `handler`, but one the launcher ignores (SIGINT in a job started with `&`
    or nohup), which stays ignored; the handlers before are restored after."""
    before = {signum: signal.signal(signum, handler) for signum in (signal.SIGINT, signal.SIGTERM)
              if signal.getsignal(signum) != signal.SIG_IGN}
    try:
        yield
    finally:
        for signum, was in before.items():
            signal.signal(signum, was)


def _on_signal(signum, frame) -> None:
    # A second signal (torchrun hands on the Ctrl-C a rank got too, then sends SIGTERM) must not cut the
    # cleanup short.
    ignore_stops()
    _stops.append(Interrupted(signum))
    raise _stops[0]


def ignore_stops() -> None:
    """From now on SIGINT and SIGTERM find a handler that does nothing (SIG_IGN would print a race-condition
    warning). One the launcher ignores stays SIG_IGN, which the processes started later inherit."""
    for each in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(each) != signal.SIG_IGN:
            signal.signal(each, _ignore)


def _ignore(signum, frame) -> None:
    pass
