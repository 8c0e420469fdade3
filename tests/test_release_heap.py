"""callbacks.ReleaseHeap: the memory glibc keeps after freed tensors goes back to the OS at its hooks."""

import ctypes.util

import pytest
import torch

from bridge_pl.memory import rss
from callbacks import ReleaseHeap

MIB = 2**20


@pytest.mark.skipif(ctypes.util.find_library("c") is None or rss() is None, reason="needs glibc and /proc")
@pytest.mark.parametrize("hook", ["on_train_batch_start", "on_train_batch_end"])
def test_freed_tensors_kept_by_glibc_are_returned_at_each_hook(hook):
    # 64 KiB tensors sit under glibc's mmap threshold, so they come from its heap; the last one stays alive and keeps
    # the freed ones below it from being trimmed at free().
    blocks = [torch.ones(16 * 1024) for _ in range(3200)]  # 200 MiB
    pinned = torch.ones(16 * 1024)
    del blocks
    kept = rss()
    outputs_and_batch = (None, None) if hook == "on_train_batch_end" else (None,)
    getattr(ReleaseHeap(), hook)(None, None, *outputs_and_batch, 0)
    assert kept - rss() > 100 * MIB
    del pinned
