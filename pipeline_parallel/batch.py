"""The ranks agree before any transfer: on their settings (`Pipeline()`, `clip_grad_norm_`), on a step's batch, which
the ranks that hold it check, and on any rank's error, which every rank then raises alike."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from .comm import PipeComm
from .loss import IGNORE_INDEX


@dataclass(frozen=True)
class BatchInfo:
    """What all ranks know about a step's batch after they agreed on it."""

    batch_size: int
    seq_len: int
    num_target_tokens: int  # labels that are not IGNORE_INDEX, over the whole batch
    facts: tuple = ()  # each rank's `facts`, indexed by rank


def fingerprint(**settings) -> dict[str, int]:
    """A checksum per setting that must be equal on every rank, e.g. schedule or layer split."""
    return {name: zlib.crc32(repr(_canonical(value)).encode()) & 0x7FFFFFFF for name, value in settings.items()}


def mode_setting(model) -> tuple[dict[str, int], dict[str, dict]]:
    """The model's train or eval mode as a setting the ranks agree on, with its details: a step with dropout on some
    stages only would be no one process's."""
    training = getattr(model, "training", None)
    return fingerprint(mode=training), {"mode": {"model.training": training}}


def _canonical(value):
    """`value` with every dict's entries in key order, so equal settings read alike on every rank."""
    if isinstance(value, dict):
        return sorted(((repr(key), _canonical(item)) for key, item in value.items()), key=lambda entry: entry[0])
    if isinstance(value, (list, tuple)):
        return type(value)(_canonical(item) for item in value)
    return value


def _token_tensor_error(tensor, name: str, vocab_size: int, allow_ignore: bool) -> str | None:
    """Why `tensor` is not a valid [batch, seq_len] tensor of token IDs, or None if it is."""
    if not isinstance(tensor, torch.Tensor):
        return f"{name} must be a torch.Tensor of token IDs shaped [batch, seq_len], got {type(tensor).__name__}"
    if tensor.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        return f"{name} must hold integer token IDs (torch.long), got dtype {tensor.dtype}"
    if allow_ignore and not tensor.dtype.is_signed:  # -100 would wrap around to a token ID (156 in uint8)
        return (f"{name} must hold signed integers, as {IGNORE_INDEX} marks a token to ignore, got dtype "
                f"{tensor.dtype}; pass {name}.long()")
    if tensor.dim() != 2 or tensor.numel() == 0:
        return f"{name} must be shaped [batch, seq_len] with both > 0, got shape {tuple(tensor.shape)}"
    if tensor.layout != torch.strided or tensor.is_meta:
        where = "on the meta device (no values)" if tensor.is_meta else f"{tensor.layout}"
        return f"{name} must be a dense tensor holding its values, got one {where}"
    valid = tensor[tensor != IGNORE_INDEX] if allow_ignore else tensor
    if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= vocab_size):
        allowed = f"0..{vocab_size - 1}" + (f" or {IGNORE_INDEX} (ignored)" if allow_ignore else "")
        return (
            f"{name} holds token IDs from {int(valid.min())} to {int(valid.max())}, but the model's vocabulary "
            f"allows {allowed}; check the tokenizer matches the model's vocab_size"
        )
    return None


def agree_on_batch(
    comm: PipeComm,
    input_ids,
    labels,
    *,
    call: str,
    vocab_size: int,
    num_microbatches: int,
    settings: dict[str, int],
    local_error: str | Exception | None = None,
    details: dict[str, dict] | None = None,
    facts: list[int] = (),
) -> BatchInfo:
    """Check the batch where it is held, then share the facts so every rank raises the same error.

    `input_ids` is given on the first stage and `labels` on the last (None elsewhere). One small
    all-gather carries each rank's shapes, target count, settings checksums and an error flag, and
    the caller's `facts` (ints, as many on every rank); no rank can wait on a peer that has already
    given up, so bad input never hangs. `call` names what the user called (see `_gather_checked`).
    """
    error = local_error
    batch = [-1] * 5  # input batch, input seq, label batch, label seq, target tokens
    try:
        if error is None and input_ids is not None:
            error = _token_tensor_error(input_ids, "input_ids", vocab_size, allow_ignore=False)
            if error is None:
                batch[0:2] = input_ids.shape
        if error is None and labels is not None:
            error = _token_tensor_error(labels, "labels", vocab_size, allow_ignore=True)
            if error is None:
                batch[2:5] = [*labels.shape, int((labels != IGNORE_INDEX).sum())]
    except Exception as e:  # a tensor the checks cannot read: raised on every rank below, not here alone
        error = ValueError(f"the batch could not be checked ({type(e).__name__}: {e}); pass input_ids and labels "
                           "as plain dense tensors of token IDs")
    rows = _gather_checked(comm, call, error, batch + list(facts), settings, details)
    inputs = [row[0:2] for row in rows if row[0] >= 0]
    targets = [row[2:5] for row in rows if row[2] >= 0]
    if not inputs or not targets:
        raise ValueError("the first pipeline rank must pass input_ids and the last must pass labels")
    (batch_size, seq_len), (label_batch, label_seq, num_targets) = inputs[0], targets[0]
    if (label_batch, label_seq) != (batch_size, seq_len):
        raise ValueError(
            f"labels are shaped {[label_batch, label_seq]} but input_ids {[batch_size, seq_len]}; "
            "give one (already shifted) target per input token"
        )
    if batch_size % num_microbatches:
        raise ValueError(
            f"a batch of {batch_size} sequences does not split into {num_microbatches} equal microbatches; "
            f"use a batch size that is a multiple of num_microbatches"
        )
    return BatchInfo(batch_size, seq_len, num_targets, tuple(tuple(row[len(batch):]) for row in rows))


_HINTS = {
    "tied_embedding": "model.lm_head.weight is model.model.embed_tokens.weight on some ranks only; tie them on "
                      "every rank (model.tie_weights()) or on none",
    "pipeline": "the ranks called different Pipelines; every rank must call the Pipeline it built with the others",
    "mode": "the model is in train mode on some ranks and in eval mode on others, so dropout would act on some "
            "stages only: call model.train() or model.eval() on every rank alike",
    "max_norm": "every rank must call clip_grad_norm_ with the same max_norm",
    "norm_type": "every rank must call clip_grad_norm_ with the same norm_type",
}


def agree_on_settings(comm: PipeComm, settings: dict[str, int], *, call: str,
                      local_error: str | Exception | None = None, details: dict[str, dict] | None = None,
                      facts: list[int] = ()) -> list[list[int]]:
    """Raise the same clear error on every rank if any rank failed or the ranks' settings differ; for a
    setting that is a dict in `details`, the error names the entries that differ and their values.
    Returns every rank's `facts` (ints, as many on every rank), which travel along, indexed by rank.
    `call` names what the user called (see `_gather_checked`)."""
    return _gather_checked(comm, call, local_error, list(facts), settings, details)


# The ints each rank sends to agree, at the least: as long as every call's row fits, the ranks' rows have
# one length even where they agree on different calls, which gloo would otherwise abort the process for.
_ROW_LENGTH = 32


def _gather_checked(comm: PipeComm, call: str, error: str | Exception | None, facts: list[int],
                    settings: dict[str, int], details: dict[str, dict] | None = None) -> list[list[int]]:
    """All ranks' `facts` (lists of ints of one length); raises on every rank if the ranks are in
    different `call`s (such as "step()" and "clip_grad_norm_()"), if any rank failed, or if the ranks'
    settings differ, naming for a setting in `details` which of its entries differ."""
    details = details or {}
    names = sorted(settings)
    mine = [fingerprint(call=call)["call"], int(error is not None), *facts, *(settings[n] for n in names)]
    assert len(mine) <= _ROW_LENGTH, f"{call} agrees on {len(mine)} ints: raise _ROW_LENGTH to at least that"
    rows = comm.all_gather_ints(mine + [0] * (_ROW_LENGTH - len(mine)))
    if len({row[0] for row in rows}) > 1:
        calls = ", ".join(f"{each} on rank {rank}" for rank, each in enumerate(comm.all_gather_object(call)))
        raise ValueError(f"the pipeline ranks are in different calls: {calls}; every rank must make the same "
                         "calls in the same order")
    failed = [rank for rank, row in enumerate(rows) if row[1]]
    if failed:
        _raise_shared_error(comm, error, failed)
    offset = 2 + len(facts)
    differ = [name for i, name in enumerate(names) if len({row[offset + i] for row in rows}) > 1]
    if differ:  # the same on every rank, so they all gather the details together
        described = [f"{name!r} ({differences(comm.all_gather_object(details[name]))})" if name in details
                     else repr(name) for name in differ]
        others = [name for name in differ if name not in _HINTS]
        what = "; ".join([_HINTS[name] for name in differ if name in _HINTS] + (
            [f"every rank must construct the pipeline and call the step with the same {' and '.join(others)}"]
            if others else []))
        raise ValueError(f"the pipeline ranks disagree on {', '.join(described)}: {what}")
    return [row[2:offset] for row in rows]


_SHOWN_DIFFERENCES = 4  # keys a message spells out; the rest it counts


def differences(by_rank: list[dict]) -> str:
    """What differs between the ranks' dicts, e.g. "rope_theta: 10000.0 on rank 0, 1000000.0 on rank 1"
    ("" if nothing does); past the first `_SHOWN_DIFFERENCES` keys, how many more."""
    keys = sorted({key for values in by_rank for key in values}, key=lambda key: (key != "model_type", key))
    differ = [key for key in keys if len({repr(_canonical(values.get(key))) for values in by_rank}) > 1]
    shown = [f"{key}: " + ", ".join(f"{values.get(key)!r} on rank {rank}" for rank, values in enumerate(by_rank))
             for key in differ[:_SHOWN_DIFFERENCES]]
    hidden = len(differ) - len(shown)
    return "; ".join(shown + ([f"{hidden} more"] if hidden else []))


def _raise_shared_error(comm: PipeComm, error: str | Exception | None, failed: list[int]) -> None:
    """Raise the first failing rank's error on every rank: a check's (a message, a TypeError or a ValueError) as
    itself; another (out of memory, say) as a RuntimeError naming it, but on each rank that failed so, its own."""
    if error is None:
        local = None
    elif isinstance(error, TypeError):
        local = ("TypeError", str(error))
    elif isinstance(error, (str, ValueError)):
        local = ("ValueError", str(error))
    else:
        local = ("other", f"{type(error).__name__}: {error}")
    kind, message = comm.all_gather_object(local)[failed[0]]
    if local is not None and local[0] == "other":
        raise error
    prefix = "" if comm.pp_size == 1 else f"pipeline rank {failed[0]}: "
    raise {"TypeError": TypeError, "ValueError": ValueError}.get(kind, RuntimeError)(prefix + message)
