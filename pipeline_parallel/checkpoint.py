"""Crash-safe, reshardable pipeline-stage checkpoints built on torch.distributed.checkpoint."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict)

from ._checkpoint_dirs import (CHECKPOINTS, META, DamagedCheckpointError, clear_leftovers, commit, damaged,
                               file_problems, is_checkpoint, latest_checkpoint, meta_text, next_save_order, published,
                               read_extra, read_meta, require_complete, rotate, save_identity, saved_checkpoints)
from ._checkpoint_files import RecordingWriter, SafeFileSystemReader, SafeLoadPlanner, UnsafeCheckpointError
from ._files import atomic_write
from .comm import PipeComm
from .models.materialize import shared_parameters
from .runtime import out_of_memory

__all__ = ["DamagedCheckpointError", "UnsafeCheckpointError", "is_checkpoint", "latest_checkpoint", "load_checkpoint",
           "published", "read_extra", "save_checkpoint", "save_identity", "saved_checkpoints"]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
# Flattened optimizer state is keyed by parameter FQN ("state.<fqn>.exp_avg",
# "param_groups.<fqn>.lr"), so any pipeline split can load any other split's.
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _quiet_if_single_process():
    """Without a process group dcp warns at every save and load that it assumes one process, which it is."""
    with warnings.catch_warnings():
        if not _distributed():
            warnings.filterwarnings("ignore", "torch.distributed is (disabled, )?unavailable or uninitialized")
        yield


def _on_rank0(fn: Callable[[], None], comm: PipeComm, what: str) -> None:
    """Run `fn` (file work) on rank 0 only; if it fails, raise an OSError saying why on every rank
    instead of hanging them."""
    error = None
    if comm.pp_rank == 0:
        try:
            fn()
        except Exception as e:
            error = e
    reason = comm.all_gather_object(None if error is None else f"{type(error).__name__}: {error}")[0]
    if reason is not None:
        raise OSError(f"could not {what} ({reason}); the previous checkpoint is untouched") from error


def _stage_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    """This rank's model (and optimizer) state, keyed by original parameter FQN."""
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:  # also creates AdamW's lazy state (a zero-lr step)
        state["optim"] = get_optimizer_state_dict(model, optimizer, options=_OPTIM_OPTIONS)
    return state


def _add_tied_aliases(model: torch.nn.Module, optim: dict) -> dict:
    """Copy a tied parameter's optimizer state to its other FQNs (e.g. lm_head.weight).

    DCP stores it under one name only, but a pipeline split that puts the tied copies
    on different ranks must find it under each of them.
    """
    out = dict(optim)
    for tied in shared_parameters(model):
        for key, value in optim.items():
            kind, _, rest = key.partition(".")  # "state"|"param_groups", "<fqn>.<field>"
            for name in (n for n in tied if rest.startswith(n + ".")):
                for alias in tied:
                    out[f"{kind}.{alias}.{rest[len(name) + 1:]}"] = value
    return out


def _rng_state() -> dict[str, torch.Tensor]:
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    return rng


def _shortened(text: str, most: int = 300) -> str:
    """`text` cut to about `most` characters at the end of a sentence, for an error message."""
    if len(text) <= most:
        return text
    cut = text[:most]
    return cut[: cut.rfind(". ") + 1] if ". " in cut else cut.rstrip() + "..."


def _alike(fn: Callable[[], Any], comm: PipeComm) -> Any:
    """`fn()`, file work done on every rank of `comm`, whose first failure is raised on every rank alike: each rank
    may see the files otherwise (another node's view), and none must go on to wait for one that stopped, nor take
    another way out of the load than the others."""
    try:
        result, error = fn(), None
    except Exception as e:
        result, error = None, e
    failed = next((e for e in comm.all_gather_object(_portable(error)) if e is not None), None)
    if failed is not None:
        raise failed
    return result


def _portable(error: Exception | None) -> Exception | None:
    """`error` if it can go to another process as it is (file errors do), else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def _meta_to_load(path: Path, optimizer: torch.optim.Optimizer | None) -> dict:
    """The meta.json of checkpoint `path`, which a load with `optimizer` can use; else why not."""
    require_complete(path)
    meta = read_meta(path)
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path} has checkpoint format {meta.get('format_version')!r}; "
                         f"this version of pipeline_parallel reads format {FORMAT_VERSION}")
    if optimizer is not None and not meta["has_optimizer"]:
        raise ValueError(f"{path} was saved without optimizer state; pass optimizer=None")
    return meta


def _saved_entries(path: Path, reader: SafeFileSystemReader) -> dict:
    """The entries checkpoint `path` holds, from its .metadata; an UnsafeCheckpointError if that is a pickle of other
    things, a DamagedCheckpointError if it cannot be read."""
    try:
        return reader.read_metadata().state_dict_metadata
    except UnsafeCheckpointError:
        raise
    except (OSError, EOFError, pickle.UnpicklingError) as e:
        raise DamagedCheckpointError(path, f"its .metadata cannot be read: {type(e).__name__}: {e}", None) from None


def _listed(problems: list[str], most: int = 3) -> str:
    """The first `most` of `problems`, and how many more, for an error message."""
    more = len(problems) - most
    return "; ".join(problems[:most]) + (f"; and {more} more" if more > 0 else "")


def save_checkpoint(run_dir: str | os.PathLike, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None, extra: dict, keep_last: int,
                    group: Any = None) -> Path:
    """Save this stage's model, optimizer and RNG state as `run_dir/checkpoints/step_NNNNNN`.

    Every rank of `group` (default: all ranks) must call it. Ranks write into
    `step_NNNNNN.tmp/`; once all are done rank 0 renames it into place and then updates
    `latest`, so a crash mid-save never touches the previous checkpoint. meta.json records the
    size and SHA-256 of every file, each hashed by the rank that wrote it, for loads to check.
    `extra` must be JSON-serialisable and is taken from rank 0. Keeps the newest `keep_last`
    checkpoints (0 keeps all). Returns the checkpoint directory.
    """
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if keep_last < 0:
        raise ValueError(f"keep_last must be >= 0 (0 keeps every checkpoint), got {keep_last}")
    comm = PipeComm(group)
    rank, world_size = comm.pp_rank, comm.pp_size
    rng = _rng_state()
    meta = {"format_version": FORMAT_VERSION, "step": step, "world_size": world_size,
            "has_optimizer": optimizer is not None, "rng_devices": sorted(rng), "extra": extra}
    try:  # checked now, on every rank, before anything is written
        json.dumps(meta)
    except (TypeError, ValueError) as e:
        raise TypeError(f"save_checkpoint: extra must be JSON-serialisable (dict, list, str, "
                        f"number, bool, None); convert tensors with .tolist()/.item(): {e}") from e

    ckpt_dir = Path(run_dir) / CHECKPOINTS
    final = ckpt_dir / f"step_{step:06d}"
    tmp = final.with_name(final.name + ".tmp")

    def prepare() -> None:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        clear_leftovers(ckpt_dir)
        tmp.mkdir()

    def publish() -> None:
        try:
            order = next_save_order(ckpt_dir)
            atomic_write(tmp / META, meta_text({**meta, "save_order": order, "files": files}))
            commit(tmp, final)
        except Exception:  # not published (else tmp is gone): what was written of it goes
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    _on_rank0(prepare, comm, f"create {tmp}")  # before anyone writes into it

    state = _stage_state(model, optimizer)
    if optimizer is not None:
        state["optim"] = _add_tied_aliases(model, state["optim"])
    state["rng"] = {f"rank{rank}": rng}  # RNG is per rank: its own keys
    writer = RecordingWriter(tmp)
    try:
        with _quiet_if_single_process():
            dcp.save(state, storage_writer=writer, process_group=group)
    except CheckpointException as e:  # on every rank: DCP gathers the ranks' failures, once all have stopped writing
        if rank == 0:  # what was written of it goes: a run restarted on a full disk must find the room it took
            shutil.rmtree(tmp, ignore_errors=True)
        _raise_interruption(e)
        failed, (first, _) = next(iter(e.failures.items()))
        raise OSError(f"could not write {tmp} (rank {failed}: {type(first).__name__}: {first}); the previous "
                      "checkpoint is untouched") from None
    files = {}  # every rank's files are on disk (and fsynced) once gathered
    for written in comm.all_gather_object(writer.files):
        files |= written
    _on_rank0(publish, comm, f"publish {final}")
    if rank == 0 and keep_last > 0:
        rotate(ckpt_dir, final, keep_last)
    return final


def _raise_interruption(e: CheckpointException) -> None:
    """Raise the Ctrl-C (or other KeyboardInterrupt) that DCP caught as a rank's failure, on every rank: the
    save or load was stopped, not broken, and the checkpoint is no more damaged than it was."""
    for failure, _ in e.failures.values():
        if isinstance(failure, KeyboardInterrupt):
            raise failure from None


def _raise_out_of_memory(e: CheckpointException, path: Path) -> None:
    """Raise a rank's running out of memory as it read the checkpoint as that, on every rank: called damaged, an
    intact checkpoint would send its user to an older one (or to delete it)."""
    for rank, (failure, _) in sorted(e.failures.items()):
        if out_of_memory(failure):
            raise RuntimeError(f"loading {path} ran out of memory on rank {rank} ({type(failure).__name__}: "
                               f"{_shortened(str(failure).splitlines()[0])}); the checkpoint is not damaged: free "
                               "memory there and load it again") from None


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None, group: Any = None) -> dict:
    """Load the parameters this stage owns, and their optimizer state; return `extra`.

    Works across pipeline sizes: every rank asks DCP only for its own FQNs. RNG states
    are per rank, so they are restored only if the checkpoint was saved on the same
    number of ranks; otherwise every rank keeps its current RNG (a warning is logged).
    With an optimizer, pending gradients are dropped (its state is created lazily from them).
    Pass optimizer=None to load only the model; then `.grad` is left as it is.

    First the files are compared with the record meta.json holds (the ranks hash a share each):
    one lost, resized or changed raises DamagedCheckpointError on every rank, naming it
    and the newest checkpoint that is intact. A checkpoint saved before records loads unchecked.
    """
    path, comm = Path(path), PipeComm(group)
    rank, world_size = comm.pp_rank, comm.pp_size
    try:
        meta = _alike(lambda: _meta_to_load(path, optimizer), comm)
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)  # else the lazy optimizer state is not created
        state = _stage_state(model, optimizer)
        restore_rng = meta["world_size"] == world_size
        if restore_rng:  # current states serve as right-shaped buffers for dcp.load to fill
            current = _rng_state()
            state["rng"] = {f"rank{rank}": {d: current[d] for d in meta["rng_devices"] if d in current}}

        problems = file_problems(path, comm)  # before any file is read
        if problems:
            raise DamagedCheckpointError(path, _listed(problems), None)
        reader = SafeFileSystemReader(path)
        saved = _alike(lambda: _saved_entries(path, reader), comm)  # refuses unsafe pickles up front
        wanted = [f"model.{k}" for k in state["model"]] + [f"optim.{k}" for k in state.get("optim", {})]
        missing = [k for k in wanted if k not in saved]
        reports = comm.all_gather_object((len(missing), missing[:3]))
        lacking = [(r, count, some) for r, (count, some) in enumerate(reports) if count]
        if lacking:  # on every rank alike, rather than leave the others waiting
            failed, count, some = lacking[0]
            raise ValueError(f"{path} lacks {count} entries rank {failed} needs, e.g. {some}; was it saved from a "
                             "different model or config?")
        try:
            with _quiet_if_single_process():
                dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), process_group=group)
        except CheckpointException as e:  # on every rank: DCP gathers the ranks' failures
            _raise_interruption(e)
            _raise_out_of_memory(e, path)
            first = next((f"{type(f).__name__}: {f}".rstrip(": ") for f, _ in e.failures.values()), str(e))
            first = _shortened(first.splitlines()[0])
            raise DamagedCheckpointError(path, f"its tensors cannot be read, or it was saved from another model: "
                                               f"{first}", None) from None
    except DamagedCheckpointError as e:  # on every rank alike, which name the newest intact checkpoint together
        raise damaged(path, e.why, comm) from None

    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"], options=_OPTIM_OPTIONS)
    if restore_rng:
        rng = state["rng"][f"rank{rank}"]
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"])
    elif rank == 0:  # one note for the run, not one per rank
        logger.warning("%s was saved on %d rank(s), loading on %d: RNG states not restored",
                       path, meta["world_size"], world_size)
    return meta["extra"]
