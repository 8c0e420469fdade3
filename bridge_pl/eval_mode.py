"""``eval_mode``: evaluate modules without dropout and restore every submodule's own train/eval flag after."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


@contextmanager
def eval_mode(*modules: nn.Module) -> Iterator[None]:
    """Put ``modules`` (and all their submodules) in eval mode for the block; then give each submodule back the
    flag it had (a frozen submodule kept in eval mode inside a training module stays so)."""
    flags = [(m, m.training) for module in modules for m in module.modules()]
    try:
        for module in modules:
            module.eval()
        yield
    finally:
        for m, flag in flags:
            m.training = flag
