"""A run's checkpoints directory: saves published and rotated out, which are complete and intact, which is latest."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Callable

from ._checkpoint_files import file_differences
from ._files import atomic_write, json_hash, replace_dir
from .comm import PipeComm

CHECKPOINTS = "checkpoints"  # subdirectory of run_dir
LATEST = "latest"  # text file naming the newest complete checkpoint
META = "meta.json"  # step, world size, the caller's `extra`, the size and SHA-256 of every other file
_SEAL = "sha256"  # meta.json's own key: the SHA-256 of the rest of it, so that a bit flipped in a step is found
_STEP_DIR = re.compile(r"^step_(\d+)(\.old)?$")
_STALE_DIR = re.compile(r"^step_\d+\.(tmp|old)$")


class DamagedCheckpointError(ValueError):
    """A checkpoint that cannot be used as it was saved (`why`); `earlier` is the newest other one that can (None:
    none is left), which the message names to use instead."""

    def __init__(self, path: Path, why: str, earlier: Path | None):
        super().__init__(path, why, earlier)  # its arguments, so that it pickles (from one process to another)
        self.path, self.why, self.earlier = path, why, earlier

    def __str__(self) -> str:
        return self.advising(lambda earlier: f"use an earlier one, such as {earlier}")

    def advising(self, use: Callable[[Path], str]) -> str:
        """The message, saying how to use the earlier checkpoint: `use(its path)`, say a command that takes it."""
        instead = use(self.earlier) if self.earlier else "no earlier one is left"
        return f"checkpoint {self.path} is damaged ({self.why}); {instead}"


def clear_leftovers(ckpt_dir: Path) -> None:
    """Drop the leftovers of crashed saves in `ckpt_dir`, which are never loadable."""
    for path in _step_dirs(ckpt_dir):  # but a step a crashed re-save moved aside is still published
        if path.suffix == ".old":
            os.replace(path, path.with_suffix(""))
    for path in ckpt_dir.iterdir():
        if _STALE_DIR.match(path.name):
            shutil.rmtree(path, ignore_errors=True)


def next_save_order(ckpt_dir: Path) -> int:
    """The save number of the next checkpoint in `ckpt_dir`: after every published one's, so that rotation goes by
    when, not by step."""
    return max((_save_order(p)[0] for p in _step_dirs(ckpt_dir)), default=-1) + 1


def commit(tmp: Path, final: Path) -> None:
    """Publish a fully written checkpoint: rename it into place, then move `latest`."""
    # A step exists already when re-saved after resuming from an older checkpoint; a crash may leave it at .old.
    replace_dir(tmp, final, aside=final.with_name(final.name + ".old"))
    atomic_write(final.parent / LATEST, final.name + "\n")


def rotate(ckpt_dir: Path, final: Path, keep_last: int) -> None:
    """Remove checkpoints from `ckpt_dir` until `keep_last` are left, `final` (just saved) among them:
    those of a run this one abandoned first (`_abandoned`), then the least recently saved."""
    newest = _save_order(final)

    def abandoned_first(path: Path) -> tuple:
        order = _save_order(path)  # (save number, step)
        return not _abandoned(order, newest), order

    older = sorted((p for p in _step_dirs(ckpt_dir) if p != final), key=abandoned_first)
    for path in older[: max(0, len(older) - (keep_last - 1))]:
        shutil.rmtree(path, ignore_errors=True)


def _abandoned(order: tuple[float, int], by: tuple[float, int]) -> bool:
    """Whether the checkpoint saved as `order` (save number, step) belongs to a run that the one which saved `by`
    abandoned by resuming from an older step: a later step, saved before it."""
    return order[1] > by[1] and order[0] < by[0]


def published(path: Path) -> Path:
    """Where checkpoint `path` is now: one a crashed re-save left at step_N.old is step_N again once a later save
    has cleared the leftovers (`clear_leftovers`)."""
    if _STEP_DIR.match(path.name)[2] and not path.exists() and path.with_suffix("").exists():
        return path.with_suffix("")
    return path


def _missing_parts(path: Path) -> list[str]:
    """The files of a complete checkpoint that `path` lacks (none: it is complete)."""
    return [name for name in (".metadata", META) if not (path / name).is_file()]


def require_complete(path: Path) -> None:
    missing = _missing_parts(path)
    if missing:
        what = (f"is not a complete checkpoint (it lacks {' and '.join(missing)})" if path.exists()
                else "does not exist")
        raise FileNotFoundError(f"{path} {what}; pass a directory returned by latest_checkpoint()")


def _step_dirs(ckpt_dir: Path) -> list[Path]:
    """Published checkpoint directories, oldest step first.

    `step_N.old` stands for step N while `step_N` is missing: `commit` crashed between
    moving a re-saved step aside and renaming its replacement into place.
    """
    if not ckpt_dir.is_dir():
        return []
    found: dict[int, Path] = {}
    for path in ckpt_dir.iterdir():
        if m := _STEP_DIR.match(path.name):
            step = int(m[1])
            found[step] = found.get(step, path) if m[2] else path
    return [found[step] for step in sorted(found)]


def meta_text(meta: dict) -> str:
    """meta.json's text for `meta` (JSON values), sealed with the SHA-256 of its content as a load reads it
    back (keys as strings)."""
    content = json.loads(json.dumps(meta))
    return json.dumps({**content, _SEAL: json_hash(content)}, indent=1)


class _Unsealed(ValueError):
    """A meta.json whose content is not what its seal was taken of."""


def _meta(path: Path) -> dict:
    """A checkpoint's meta.json: format, step, world size, save number, the caller's `extra`; a ValueError if
    it is not JSON, or changed since it was saved (checkpoints saved before the seal are taken as they are, if
    they hold what a checkpoint's does)."""
    meta = json.loads((path / META).read_text())
    if isinstance(meta, dict) and _SEAL in meta:
        content = {key: value for key, value in meta.items() if key != _SEAL}
        if meta[_SEAL] != json_hash(content):
            raise _Unsealed(f"its {META} changed since it was saved (its {_SEAL} is not that of its content)")
        return content
    if not (isinstance(meta, dict) and {"format_version", "step", "extra"} <= meta.keys()):
        raise _Unsealed(f"its {META} is not a checkpoint's (it holds no format_version, step and extra)")
    return meta


def read_meta(path: Path) -> dict:
    """`_meta`, where a meta.json that is not JSON, or changed since it was saved, makes the checkpoint damaged."""
    try:
        return _meta(path)
    except ValueError as e:  # UnicodeDecodeError, json.JSONDecodeError, _Unsealed
        raise damaged(path, _meta_problem(e)) from None


def _meta_problem(e: Exception) -> str:
    """What is wrong with a meta.json that `_meta` failed on with `e`."""
    return str(e) if isinstance(e, _Unsealed) else f"its {META} cannot be read: {e}"


def damaged(path: Path, why: str, comm: PipeComm | None = None) -> DamagedCheckpointError:
    """The error for a checkpoint that cannot be used as it was saved, naming the most recently saved one before it
    that is complete; with `comm` (a load, whose every rank calls it) also whose files are as saved (`_intact`), where
    the ranks go through rank 0's list of checkpoints, so that all name the same one and none waits for another."""
    # Saved before it (a checkpoint named for a resume was chosen over the later ones), and not one of a run
    # abandoned for this one's: the run went on from an earlier step. A meta.json that cannot be read counts as the
    # newest save's, as that of the checkpoint a run resumes from mostly is.
    own = _save_order(path, unreadable=math.inf)
    orders = {p: _save_order(p) for p in _step_dirs(path.parent) if p != path}
    others = sorted((p for p, order in orders.items() if order < own and not _abandoned(order, own)), key=orders.get,
                    reverse=True)
    if comm is None:
        return DamagedCheckpointError(path, why, next((p for p in others if is_checkpoint(p)), None))
    others = comm.all_gather_object(others)[0]
    return DamagedCheckpointError(path, why, next((p for p in others if _intact(p, comm)), None))


def file_problems(path: Path, comm: PipeComm) -> list[str]:
    """How the files of checkpoint `path` differ from the record in its meta.json (see `file_differences`), the same on
    every rank of `comm`, which all call it: each hashes its share of the files."""
    mine = [f"it lacks {name}" for name in _missing_parts(path)]  # also where no record can tell
    try:
        mine += file_differences(path, _meta(path).get("files"), (comm.pp_rank, comm.pp_size))
    except (OSError, ValueError) as e:
        mine += [_meta_problem(e)]
    return list(dict.fromkeys(problem for problems in comm.all_gather_object(mine) for problem in problems))


def _intact(path: Path, comm: PipeComm) -> bool:
    """Whether checkpoint `path` is complete and its files are as saved, alike on every rank of `comm`, which all
    call it."""
    return not file_problems(path, comm)


def _save_order(path: Path, unreadable: float = -1) -> tuple[float, int]:
    """(save number, step) of a published checkpoint, to sort by when it was saved. Checkpoints from
    before save numbers (-1) count as older than any numbered one, in step order among themselves;
    one whose meta.json cannot be read as `unreadable`."""
    step = int(_STEP_DIR.match(path.name)[1])
    try:  # not read_meta: its error names another checkpoint, found by this order
        order = _meta(path).get("save_order", -1)
    except (OSError, ValueError):
        return (unreadable, step)
    return (order if isinstance(order, int) else -1, step)


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """Return the checkpoint under `run_dir/checkpoints` to resume from, or None.

    Follows the `latest` pointer: after a crash between a save's rename and the pointer update it
    still names the previous checkpoint, which is complete (the steps since are trained again). If
    the pointer is missing or names no checkpoint directory, the most recently saved complete one.
    A named directory that lacks a part was damaged after it was published: that raises, naming an
    earlier checkpoint, rather than silently going back to it.
    """
    ckpt_dir = Path(run_dir) / CHECKPOINTS
    try:
        named = ckpt_dir / (ckpt_dir / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):  # no pointer (or no readable one): the newest complete checkpoint
        named = None
    if named is not None and _STEP_DIR.match(named.name) and named.is_dir():
        refuse_incomplete(named)
        return named
    complete = [p for p in _step_dirs(ckpt_dir) if is_checkpoint(p)]
    return max(complete, key=_save_order) if complete else None


def refuse_incomplete(path: Path) -> None:
    """Raise DamagedCheckpointError if `path` is a published checkpoint directory that lacks a part: it was published
    whole, so a part missing now is damage, not a crash mid-save (whose directory is step_N.tmp)."""
    if _STEP_DIR.match(path.name) and path.is_dir():
        missing = _missing_parts(path)
        if missing:
            raise damaged(path, f"it lacks {' and '.join(missing)}")


def saved_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """The checkpoint directories a run in `run_dir` has published (whole or not), oldest step first."""
    return _step_dirs(Path(run_dir) / CHECKPOINTS)


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path` is a complete checkpoint directory (not a run directory, not a half-written save)."""
    return not _missing_parts(Path(path))


def save_identity(path: str | os.PathLike) -> str:
    """What tells one save from every other: the SHA-256 of its meta.json's content, which names its files' hashes
    and its place in the save order (the seal, for a sealed one)."""
    require_complete(Path(path))
    return json_hash(read_meta(Path(path)))


def read_extra(path: str | os.PathLike) -> dict:
    """The `extra` a checkpoint was saved with, without loading any tensor."""
    require_complete(Path(path))
    return read_meta(Path(path))["extra"]
