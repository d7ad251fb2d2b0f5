"""Which tensors an op makes: to show that a pass never holds more than a chunk of a large tensor."""

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
import torch


class RowsMade(TorchDispatchMode):
    """Records the number of rows of each tensor made (not a view of an operand) whose last dimension is `width`."""

    def __init__(self, width: int):
        super().__init__()
        self.width, self.rows = width, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given \
                    and t.shape[-1:] == (self.width,):
                self.rows.append(t.numel() // self.width)
        return out
