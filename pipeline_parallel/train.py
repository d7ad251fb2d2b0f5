"""Pretraining program, one process per pipeline stage: `torchrun --nproc-per-node N -m pipeline_parallel.train`."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import NoReturn

import torch.distributed as dist

from .checkpoint import latest_checkpoint, save_identity
from .config import Config, ConfigError, parse_args
from .export import EXPORT_DIR, export_command, exported_checkpoint
from .launch import (Interrupted, forget_stop, ignore_stops, stop_asked, stop_signals_raise, tell_torchrun,
                     world_size)
from .resume import RunComplete
from .trainer import CheckpointNotSaved, Trainer, TrainingDiverged


def run(cfg: Config) -> list[dict]:
    """Train as `cfg` says (on every rank of the process group, or launched by torchrun)."""
    trainer = Trainer(cfg)
    try:
        return trainer.fit()
    except BaseException as error:  # for the stop's message: run_dir's newest may be a checkpoint this run abandoned
        stop = _stop_behind(error)
        if stop is not None:
            stop.checkpoint, stop.trained = trainer.last_checkpoint, trainer.trained
        raise


def _stop_behind(error: BaseException) -> Interrupted | None:
    """The stop signal `error` comes of: itself, or (for an error that is no failure of the run's own) the
    one this rank got before, which a peer stopping at the same signal or a library catching it turned
    into this error; None if there was none."""
    if isinstance(error, Interrupted):
        return error
    return None if isinstance(error, (*_FAILURES, SystemExit)) else stop_asked()


def _interrupted(cfg: Config, stop: Interrupted) -> str:
    """The one line an interrupted run ends with: the checkpoint it resumed from or saved last (if it
    stopped while starting, the one it was to resume from), and how to resume from it; or, stopped after
    its last step was saved (while exporting), how to export that."""
    if hasattr(stop, "checkpoint"):  # set by run() once the Trainer was built
        checkpoint = stop.checkpoint
    elif cfg.resume not in ("auto", "latest", "never"):
        checkpoint = Path(cfg.resume)
    else:
        try:
            checkpoint = latest_checkpoint(cfg.run_dir)
        except ValueError:  # a damaged one: the next start names it
            checkpoint = None
    if getattr(stop, "trained", False):  # while exporting or sampling
        where = f"training had ended, and {checkpoint} holds its last step"
        if cfg.export.at_end:  # stopped while exporting, or in the sample after the export
            export_dir = Path(cfg.run_dir) / EXPORT_DIR
            where += (f", exported to {export_dir}" if _exported(checkpoint, export_dir)
                      else f"; to export it: {export_command(checkpoint, dtype=cfg.export.dtype)}")
    elif checkpoint is None:
        where = "it saved no checkpoint yet, so the same command starts it again"
    elif cfg.resume in ("auto", "latest"):
        where = (f"run the same command to resume from its latest checkpoint, {checkpoint} (steps after it are "
                 "trained again)")
    elif checkpoint == Path(cfg.resume):  # it saved none since
        where = f"run the same command to resume from {checkpoint} again (steps after it are trained again)"
    else:  # the same command would start from `resume` again (or refuse a run_dir that holds a run)
        where = f"run the same command with --resume latest to resume from its latest checkpoint, {checkpoint}"
    return f"interrupted by {signal.Signals(stop.signum).name}: {where}"


def _exported(checkpoint: Path, export_dir: Path) -> bool:
    """Whether `export_dir` holds the export of `checkpoint`, as the last rank wrote it to the directory all share."""
    try:
        return exported_checkpoint(export_dir) == save_identity(checkpoint)
    except (OSError, ValueError):  # the checkpoint damaged or gone since: the message says how to export it
        return False


_FAILURES = (ConfigError, TrainingDiverged, CheckpointNotSaved)  # raised alike on every rank; end with one line


def _fail(message: str, code: int, show: bool) -> NoReturn:
    """End this rank with exit `code`, `message` printed if `show` and written for torchrun's report on every rank."""
    tell_torchrun(message)
    if show:
        print(message, file=sys.stderr)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: a config error, divergence or interruption ends every rank with one line,
    no traceback; so does a start on a run that is complete, with exit code 0.

    A rank that cannot read its command line says so itself (they have not met yet); once the
    ranks have met and agreed on the settings, every error is raised alike everywhere and rank 0
    prints it. Ctrl-C and SIGTERM, which torchrun hands on to every rank, end the run with exit code
    128 + the signal's number, as a shell reports a process the signal ended.
    """
    rank = int(os.environ.get("RANK", 0)) if world_size() > 1 else 0  # alone, it speaks (a stray RANK aside)
    try:
        cfg = parse_args(argv)
    except ConfigError as e:
        _fail(f"error: {e}" if world_size() == 1 else f"error: rank {rank}: {e}", 2, show=True)
    try:
        _run_to_its_end(cfg, rank)
    finally:
        forget_stop()


def _run_to_its_end(cfg: Config, rank: int) -> None:
    """Run `cfg`, then end as `main` says: return, or exit with its one line."""
    joins = not dist.is_initialized()
    try:
        with stop_signals_raise():
            try:
                run(cfg)
            finally:  # a group left to the interpreter's exit can abort the process (SIGABRT) instead of exiting
                if joins and dist.is_initialized():
                    dist.destroy_process_group()
    except RunComplete as e:  # not a failure: a job started again after it finished succeeds
        if rank == 0:
            print(e)
        return
    except (*_FAILURES, Interrupted) as e:
        stop = e
    except Exception as e:
        stop = _stop_behind(e)
        if stop is None:
            raise
    else:
        return
    if isinstance(stop, Interrupted) and isinstance(stop.__context__, _FAILURES):
        stop = stop.__context__  # torchrun stopping this rank because another one already failed with it
    if isinstance(stop, Interrupted):
        if rank == 0:
            print(_interrupted(cfg, stop), file=sys.stderr)
        sys.exit(128 + stop.signum)
    _fail(f"error: {stop}", 2 if isinstance(stop, ConfigError) else 1, show=rank == 0)


def program(argv: list[str] | None = None) -> None:
    """`main` as this process's whole program (a torchrun worker, the console script): once it ends, a stop signal
    that comes while the interpreter shuts down, such as torchrun's copy of a Ctrl-C the rank got too, is let go.
    Raised there, it printed a traceback after the run's one line, or made a finished rank's exit a failure."""
    try:
        main(argv)
    finally:
        ignore_stops()


if __name__ == "__main__":
    program()
