"""This rank's place in the pipeline and the transfers between stages (the only P2P code)."""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist


def default_device() -> torch.device:
    """This process's GPU if it has one (see `local_gpu`), else the CPU."""
    return local_gpu() if torch.cuda.is_available() else torch.device("cpu")


def local_gpu() -> torch.device:
    """The GPU of this process's local rank (LOCAL_RANK, as torchrun sets it), else the current one: the processes
    of a node each take their own, where the current device is cuda:0 in every one of them unless set."""
    local_rank = os.environ.get("LOCAL_RANK")
    return torch.device("cuda", int(local_rank) if local_rank is not None else torch.cuda.current_device())


def usable_device(device) -> tuple[torch.device, str | None]:
    """`device` and None if this process can hold tensors there; otherwise `default_device()`, for the
    ranks to agree on, and why `device` cannot be used (each rank reports it before any transfer)."""
    try:
        torch.empty(0, device=torch.device(device))
    except (TypeError, RuntimeError, AssertionError) as e:
        return default_device(), (f"device {str(device)!r} cannot be used on this machine ({e}); pass a device "
                                  "such as 'cpu' or 'cuda:0'")
    if torch.device(device).type == "meta":  # moving the model there would drop its weights; no transfer works
        return default_device(), ("device 'meta' cannot be used: a tensor there holds no values, so the model's "
                                  "weights would be lost; pass a device such as 'cpu' or 'cuda:0'")
    return torch.device(device), None


def _device_backends(group) -> dict[str, str]:
    """The backend that carries each device type's tensors in `group`, such as {"cpu": "gloo", "cuda": "nccl"}.

    `dist.get_backend` names a group as it was asked for: "undefined" for `init_process_group()`
    without a backend, though gloo carries its CPU tensors, or "cpu:gloo,cuda:nccl" as a whole.
    """
    return dict(entry.split(":", 1) for entry in dist.get_backend_config(group).split(","))


def _transfer_error(device: torch.device, backends: dict[str, str]) -> str | None:
    """Why a group with these `backends` (by device type) cannot carry P2P transfers of `device`'s tensors."""
    backend, kind = backends.get(device.type), device.type
    fitting = {"cpu": "'gloo' (or 'cpu:gloo,cuda:nccl')", "cuda": "'nccl' (or 'cpu:gloo,cuda:nccl')"}.get(
        kind, f"a backend for {kind} tensors")
    if backend is None:
        carried = ", ".join(f"{name} for {each}" for each, name in backends.items())
        return (f"the process group has no backend for {kind} tensors (only {carried}), so the stages on {device} "
                f"cannot send them: initialise it with {fitting}, or pass a device it carries")
    if backend == "gloo" and kind != "cpu":
        return (f"the process group sends {kind} tensors with gloo, whose point-to-point transfers take CPU tensors "
                f"only: initialise it with {fitting}, or pass device='cpu'")
    return None


class PipeComm:
    """The pipeline's process group, this rank's `pp_rank` in it, and the transfers it makes.

    Passed around instead of global state, so a pipeline can live in a sub-group (one pipeline
    per data-parallel replica). Without an initialised process group it is a one-rank pipeline
    that never communicates.
    """

    def __init__(self, group=None, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.broken_by: str | None = None  # set by a step stopped mid-transfer: see `check_in_step`
        if not (dist.is_available() and dist.is_initialized()):
            self.group, self.pp_rank, self.pp_size, self.global_ranks = None, 0, 1, [0]
            self.backends: dict[str, str] = {}
            self.prefetch_receives = False
            return
        self.group = group or dist.group.WORLD
        self.pp_rank = dist.get_rank(self.group)
        if self.pp_rank < 0:  # torch's stand-in for a group this process was left out of
            raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the given group, so "
                             "it has no stage in that pipeline; build the Pipeline only on the group's ranks")
        self.pp_size = dist.get_world_size(self.group)
        self.global_ranks = dist.get_process_group_ranks(self.group)
        self.backends = _device_backends(self.group)
        # Posting a receive early overlaps the transfer with compute on gloo, whose transfers are
        # independent. NCCL runs a pair's transfers in order on one stream and a batch completes
        # as a whole, so an early receive can block the sends queued behind it: post just in time.
        self.prefetch_receives = self.backends.get(self.device.type) == "gloo"

    def check_transfers(self, device_error: str | None = None) -> None:
        """Raise a ValueError if this group cannot carry transfers of this rank's device's tensors (`device_error`,
        why the device asked for is not this one, if given). Alike on every rank, before the ranks first agree,
        which they could not do over such a group; torch's own error, at the first transfer, says nothing of what
        to change."""
        error = _transfer_error(self.device, self.backends) if self.group is not None else None
        if error is not None:
            raise ValueError(device_error or error)

    def check_in_step(self) -> None:
        """Refuse to communicate once a step stopped in the middle of its transfers (an interrupt, a failed
        transfer): its unmatched sends and receives would pair with the next ones, which then hang or
        carry another microbatch's data; and once the process group is gone."""
        if self.pp_size > 1 and not dist.is_initialized():
            raise RuntimeError("the process group this pipeline communicates over was destroyed "
                               "(destroy_process_group); build the Pipeline again after init_process_group")
        if self.broken_by is not None:
            raise RuntimeError(
                f"an earlier pipeline step stopped in the middle of its transfers ({self.broken_by}), so the "
                "ranks' transfers are out of step: a further step would hang or mix up microbatches. Start the "
                "processes again (from a checkpoint, to go on training)")

    def post(self, ops: list[tuple[str, torch.Tensor, int]]) -> list:
        """Start sends and receives [("send" | "recv", tensor, peer pp_rank)] together; returns Work handles.

        Posting a step's neighbouring sends and receives as one batch lets NCCL pair them
        (a lone blocking send facing a lone blocking send would deadlock).
        """
        if not ops:
            return []
        self.check_in_step()
        p2p = [
            dist.P2POp(dist.isend if op == "send" else dist.irecv, tensor, self.global_ranks[peer], self.group)
            for op, tensor, peer in ops
        ]
        with self._on_device():
            return dist.batch_isend_irecv(p2p)

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's list of ints (same length everywhere), indexed by pp_rank."""
        if self.pp_size == 1:
            return [list(values)]
        self.check_in_step()
        local = torch.tensor(values, dtype=torch.int64, device=self.device)
        gathered = [torch.empty_like(local) for _ in range(self.pp_size)]
        dist.all_gather(gathered, local, group=self.group)
        return [t.tolist() for t in gathered]

    def all_gather_object(self, value) -> list:
        """Every rank's picklable `value`, indexed by pp_rank (for error reports, not for tensors)."""
        if self.pp_size == 1:
            return [value]
        self.check_in_step()
        values = [None] * self.pp_size
        with self._on_device():
            dist.all_gather_object(values, value, group=self.group)
        return values

    def _on_device(self):
        """Inside, this rank's GPU is the current device: NCCL's object collectives carry their bytes on the
        current device, and its P2P batches expect it set, where it is cuda:0 in every process unless set."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the pipeline ranks, in place."""
        if self.pp_size > 1:
            self.check_in_step()
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def share_from_first_(self, tensor: torch.Tensor, is_first: bool, checksum: torch.Tensor | None = None) -> None:
        """The last rank's `tensor` becomes the first rank's (one matrix held at both ends, as tying
        does in one process); called by those two ranks. Their checksums tell whether the ends
        differ, so equal ones cost one read of the matrix and no transfer of it (`checksum`: ours, if
        taken already)."""
        peer = self._other_end(is_first)
        mine = bits_checksum(tensor) if checksum is None else checksum
        if not torch.equal(mine, self._swap(mine, peer)):
            for work in self.post([("send" if is_first else "recv", tensor, peer)]):
                work.wait()

    def exchange_add_(self, tensor: torch.Tensor, is_first: bool, into: torch.Tensor | None = None) -> None:
        """Add the other end's copy of `tensor` (received in `into`, if given) to ours while it adds ours to its own
        (the two parts of a tied weight's gradient); called by the first and last ranks."""
        tensor.add_(self.other_end(tensor, is_first, into))

    def other_end(self, tensor: torch.Tensor, is_first: bool, into: torch.Tensor | None = None) -> torch.Tensor:
        """The other end's copy of `tensor` (a tied weight; in `into`, if given), for ours; called by the first and
        last ranks."""
        return self._swap(tensor, self._other_end(is_first), into)

    def _other_end(self, is_first: bool) -> int:
        """The last rank for the first, the first for the last: the two ends of a tied weight."""
        return self.pp_size - 1 if is_first else 0

    def _swap(self, tensor: torch.Tensor, peer: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """The peer's copy of `tensor` (in `into`, if given), for ours."""
        received = torch.empty_like(tensor) if into is None else into
        for work in self.post([("send", tensor, peer), ("recv", received, peer)]):
            work.wait()
        return received


def bits_checksum(tensor: torch.Tensor) -> torch.Tensor:
    """Checksums of the tensor's bytes taken four at a time as wrapping int32s, laid out in rows of 64:
    the sums of its columns and of its rows, each weighted by its place, so that ends holding the same
    values in another order (rows swapped, say) differ. Equal tensors give equal sums on any device and
    thread count (integer sums do not depend on their order): 0.12 s for a 32k x 2048 matrix on one
    thread, where a float64 sum took 0.6 s."""
    data = tensor.detach().contiguous().view(-1).view(torch.uint8)
    if data.numel() % 256 or data.storage_offset() % 4:
        data = torch.cat([data, data.new_zeros(-data.numel() % 256)])  # a copy, aligned and padded
    words = data.view(torch.int32).view(-1, 64)
    sums = [words.sum(dim, dtype=torch.int32).long() for dim in (0, 1)]
    # Each weighted sum modulo a prime below 2**31, so that no int64 product or total overflows.
    weighted = [(part * torch.arange(1, len(part) + 1, device=part.device)).remainder_(_PRIME).sum() for part in sums]
    return torch.stack([*weighted, torch.tensor(data.numel(), device=data.device)])


_PRIME = 2**31 - 1
