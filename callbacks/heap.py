"""``ReleaseHeap``: hand the memory glibc keeps after each phase back to the OS, so a CPU run's peak is its live
memory plus one phase's rise rather than that plus what earlier phases freed.

glibc keeps freed blocks in its arenas instead of returning them (``bridge_pl.memory.heap``'s ``free``). In the demo
that is 1.2-2.0 GiB after every update and rollout, and a later phase's tensors fit into it only partly, so it adds
to the update's peak (``benchmarks/results/memory_bench.md``). This callback runs ``gc.collect()`` and
``malloc_trim(0)`` (``bridge_pl.memory.release_heap``) after each training rollout (before the update) and after
each update. Each call costs the collection (tens of milliseconds here) and the pages the next phase faults in
again; it changes no number the run computes. Without glibc (macOS, musl) it only collects.
"""

from __future__ import annotations

import lightning as L

from bridge_pl.memory import release_heap


class ReleaseHeap(L.Callback):
    """Trim the process heap around every update (module doc). On a GPU run it only trims host memory."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        release_heap()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        release_heap()
