"""A dispatch mode that records the aten ops a block runs, for the tests that count kernels, copies or passes."""

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OpLog(TorchDispatchMode):
    """Every aten op run inside the block, in order, as ``ops``: (name, e.g. "mm.default"; whether it is a view;
    the numel of its first tensor output, 0 without one). ``count``: the ops by name without overload ("mm"),
    views too."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, bool, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = next((t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)), None)
        self.ops.append((func.__name__, func.is_view, 0 if first is None else first.numel()))
        return out

    @property
    def count(self) -> Counter:
        return Counter(name.split(".")[0] for name, _, _ in self.ops)
