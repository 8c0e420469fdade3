"""What multi-process runs need: the ``fsdp2`` strategy, FSDP2 sharding of the policy, per-rank state, gradient
averaging of replicated parameters, and the refusal of Lightning's FSDP1 strategy (docs/design.md, "Scale").

Under ``fsdp2`` (Lightning's ``ModelParallelStrategy``, data-parallel only) the module is not wrapped:
``BridgeModule.configure_model`` shards the policy with ``fully_shard`` (each decoder block, then the root, which
keeps the embeddings, the final norm and a tied LM head in one unit) and the PPO value head. The retriever towers
(φ, ψ, a trained passage tower) are small and stay replicated on every rank; their gradients are averaged across
ranks before each step (:func:`average_replicated_grads`), which is what DDP would do for them.

Ranks do different amounts of work in an iteration: their rollouts have different lengths, their batches
different numbers of micro-batches and LM-credit searches. Collectives must still line up, so:

- a unit's parameters are gathered at its first forward of an iteration (the rollout's prefill, which every rank
  runs) and stay gathered until ``BridgeModule`` reshards them at the end of the training step
  (``reshard_after_forward`` and ``reshard_after_backward`` off; the optimizer state stays sharded), so forwards that
  only some ranks run (generation steps, scoring passes, micro-batches) need no collective;
- a policy update accumulates each rank's own number of loss parts locally, then every rank runs one zero-loss
  backward pass with gradient reduction on (:class:`ShardedGradients`): one reduce-scatter per unit per update,
  whatever the parts;
- decisions that change the work (skip the θ step, skip a non-finite update) are taken over all ranks
  (:func:`any_across_ranks`).

Work that only some ranks do for a long time (an LLM judge's share of an evaluation set) must not end in a
collective: a rank that waits there longer than the process group's timeout (30 minutes by default) is killed.
:func:`wait_for_ranks` waits on the process group's store instead, which has no timeout, and the collective after
it finds every rank ready.
"""

from __future__ import annotations

import itertools
import time
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from torch import nn

FSDP1_REFUSAL = (
    "trainer.strategy: Lightning's FSDP1 strategy (FSDPStrategy, 'fsdp') does not support manual optimization, "
    "which BridgeModule uses (Lightning issues #19626 and #19685); use 'strategy: fsdp2' (FSDP2 through "
    "ModelParallelStrategy, data-parallel) or 'ddp'"
)
_ROOT_CALL = "bridge_call"  # the root's registered forward method: runs a function under its FSDP hooks
_WAITS = itertools.count()  # numbers the store waits: every rank makes them in the same order


class FSDP2Strategy(ModelParallelStrategy):
    """``strategy: fsdp2``: ``ModelParallelStrategy`` as pure data parallelism (every process one FSDP2 shard,
    tensor-parallel size 1), whatever the number of devices and nodes."""

    strategy_name = "fsdp2"

    def __init__(self, save_distributed_checkpoint: bool = True, process_group_backend: str | None = None,
                 timeout: timedelta = default_pg_timeout) -> None:
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_processes * self.num_nodes
        super().setup_environment()

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded checkpoint that holds only what trains (``BridgeModule`` leaves the frozen base weights
        out), with the optimizer states; returns the rest (the metadata file). Other checkpoints: as Lightning."""
        from lightning.fabric.strategies.model_parallel import _METADATA_FILENAME, _is_sharded_checkpoint
        from torch.distributed import checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(self.broadcast(checkpoint_path))
        if not _is_sharded_checkpoint(path):
            return super().load_checkpoint(checkpoint_path, weights_only)
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        state = {k: v for k, v in get_model_state_dict(self.model).items() if f"state_dict.{k}" in saved}
        dcp.load({"state_dict": state}, checkpoint_id=path)
        self.model.load_state_dict(state, strict=False)
        for idx, optimizer in enumerate(self.optimizers):
            optimizer_state = {f"optimizer_{idx}": get_optimizer_state_dict(self.model, optimizer)}
            dcp.load(optimizer_state, checkpoint_id=path)
            set_optimizer_state_dict(self.model, optimizer, optimizer_state[f"optimizer_{idx}"],
                                     options=StateDictOptions(cpu_offload=True))
        return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)


StrategyRegistry.register(FSDP2Strategy.strategy_name, FSDP2Strategy,
                          description="FSDP2 (fully_shard) data parallelism through ModelParallelStrategy")


def is_fsdp1(strategy: Any) -> bool:
    """Whether ``strategy`` (an instance, or a config value such as ``"fsdp"``) is Lightning's FSDP1 strategy."""
    from lightning.pytorch.strategies import FSDPStrategy

    if isinstance(strategy, str):
        return strategy.startswith("fsdp") and strategy != FSDP2Strategy.strategy_name
    class_path = strategy.get("class_path") if isinstance(strategy, dict) else getattr(strategy, "class_path", None)
    return isinstance(strategy, FSDPStrategy) or str(class_path or "").endswith(".FSDPStrategy")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (the first ``ModuleList`` of ``*DecoderLayer``s)."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) and type(module[0]).__name__.endswith("DecoderLayer"):
            return list(module)
    raise ValueError(f"{type(model).__name__}: no decoder layers found to shard")


def shard_root(root: nn.Module, mesh, blocks: Sequence[nn.Module] = ()) -> None:
    """``fully_shard`` each of ``blocks``, then ``root``, and register ``root.bridge_call(fn, *args)``, which runs
    ``fn`` under the root's FSDP forward hooks (its parameters gathered), for code that calls submodules."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(root, mesh=mesh, reshard_after_forward=False)
    root.set_reshard_after_backward(False, recurse=True)
    setattr(root, _ROOT_CALL, types.MethodType(lambda self, fn, *args, **kwargs: fn(*args, **kwargs), root))
    register_fsdp_forward_method(root, _ROOT_CALL)


def reshard(root: nn.Module) -> None:
    """Free the gathered parameters of every FSDP2 unit under ``root`` (local; no collective)."""
    from torch.distributed.fsdp import FSDPModule

    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


class ShardedGradients:
    """Gradient reduction for an update of FSDP2-sharded parameters whose loss has a rank-dependent number of parts.

    Args:
        roots: the sharded roots whose gradients the update reduces (the policy, a value head).
        zero_pass: a loss of value 0 whose backward reaches every unit of ``roots``.
    """

    def __init__(self, roots: Sequence[nn.Module], zero_pass: Callable[[], torch.Tensor]) -> None:
        self.roots, self.zero_pass = list(roots), zero_pass

    @contextmanager
    def accumulating(self) -> Iterator[None]:
        """Backward passes inside accumulate unreduced gradients locally (no collective)."""
        for root in self.roots:
            root.set_requires_gradient_sync(False, recurse=True)
        try:
            yield
        finally:
            for root in self.roots:
                root.set_requires_gradient_sync(True, recurse=True)

    def reduce(self, backward: Callable[[torch.Tensor], None]) -> None:
        """Reduce-scatter what was accumulated, on every rank: one backward of the zero pass with reduction on."""
        backward(self.zero_pass())


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP2 root sharded by :func:`shard_root`."""
    return hasattr(module, _ROOT_CALL)


def call_under_root(root: nn.Module, fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)``, under the FSDP2 forward hooks of ``root`` when it is sharded."""
    if is_sharded(root):
        return getattr(root, _ROOT_CALL)(fn, *args, **kwargs)
    return fn(*args, **kwargs)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def max_across_ranks(value: int) -> int:
    """The largest of the ranks' ``value`` (collective: every rank must call it). One process: ``value``."""
    if not _distributed():
        return value
    # NCCL reduces only CUDA tensors; a gloo or a mixed "cpu:gloo,cuda:nccl" group reduces a CPU one
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def any_across_ranks(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank (collective: every rank must call it). One process: ``flag``."""
    return bool(max_across_ranks(int(flag)))


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (an FSDP2 shard, or a value computed from shards)."""
    return hasattr(t, "full_tensor")


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` as one whole tensor: a DTensor is gathered (collective: every rank must call it), else ``t``."""
    return t.full_tensor() if is_dtensor(t) else t


def shard_like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``full`` (the same on every rank) in ``param``'s device and dtype, sharded like ``param`` if it is a DTensor
    (each rank keeps its own piece; no communication)."""
    full = full.to(device=param.device, dtype=param.dtype)
    if not is_dtensor(param):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)


def average_replicated_grads(params: Sequence[torch.Tensor]) -> None:
    """Average the plain-tensor gradients of ``params`` over all ranks (sharded DTensor gradients were already
    reduced by FSDP). A no-op in one process."""
    if not _distributed():
        return
    grads = [p.grad for p in params if p.grad is not None and not is_dtensor(p.grad)]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()


def gather_per_rank(state: Any) -> list[Any]:
    """``[state of rank 0, state of rank 1, ...]`` (an all-gather; every rank must call it). One process: ``[state]``.

    For what each rank holds differently (RNG states, sampling generators) in a checkpoint that rank 0 writes.
    """
    if not _distributed():
        return [state]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return states


def this_ranks(states: Any) -> Any:
    """This rank's entry of a :func:`gather_per_rank` list (a checkpoint from before per-rank states: as is)."""
    if not isinstance(states, list):
        return states
    rank = process_rank()
    if rank >= len(states):
        raise ValueError(f"the checkpoint holds per-rank state for {len(states)} processes; this is rank {rank}: "
                         "resume with the world size it was saved with")
    return states[rank]


def process_rank() -> int:
    """This process's global rank (0 without ``torch.distributed``)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """The number of processes of the run (1 without ``torch.distributed``)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def share_from_rank_zero(items: list[Any] | None) -> list[Any]:
    """This rank's share of rank 0's ``items``: ``items[rank::world]`` (a scatter: every rank must call it; only rank
    0's ``items`` is read). One process: ``items``."""
    if not _distributed():
        return items
    world = dist.get_world_size()
    shares = [items[r::world] for r in range(world)] if dist.get_rank() == 0 else None
    share: list[Any] = [None]
    dist.scatter_object_list(share, shares, src=0)
    return share[0]


def join_at_rank_zero(share: list[Any]) -> list[Any] | None:
    """Every rank's :func:`share_from_rank_zero` share (or one result per item of it) back in rank 0's order, on rank 0;
    None on other ranks (a gather: every rank must call it). One process: ``share``."""
    if not _distributed():
        return share
    world = dist.get_world_size()
    parts: list[list[Any]] | None = [[] for _ in range(world)] if dist.get_rank() == 0 else None
    dist.gather_object(share, parts, dst=0)
    return interleave(parts) if parts is not None else None


def interleave(parts: list[list[Any]]) -> list[Any]:
    """Per-rank lists back in the order they were dealt from: rank r's i-th item is item ``i * world + r``."""
    return [part[i] for i in range(max(map(len, parts), default=0)) for part in parts if i < len(part)]


def wait_for_ranks(what: str, poll_s: float = 0.5, report: Callable[[int, int], None] | None = None,
                   report_every_s: float = 30.0) -> None:
    """Return once every rank has called this (each rank's n-th call waits for every rank's n-th call), however
    long that takes: for work that may outlast the process group's timeout, where a barrier would fail.

    Each rank counts itself in on the process group's store and polls the count every ``poll_s`` seconds (a store
    ``add`` answers at once, so no timeout applies). ``report(done, world)`` is called every ``report_every_s``
    seconds of waiting. ``what`` names the wait in the store key; it must be the same on every rank. A rank that
    dies is not noticed here: the launcher (Lightning's, torchrun) ends the others. One process: returns at once.
    """
    if not _distributed():
        return
    store = dist.distributed_c10d._get_default_store()
    key = f"bridge_pl/wait/{next(_WAITS)}/{what}"
    world = dist.get_world_size()
    done, last_report = store.add(key, 1), time.monotonic()
    while done < world:
        time.sleep(poll_s)
        done = store.add(key, 0)
        if report is not None and time.monotonic() - last_report >= report_every_s:
            report(done, world)
            last_report = time.monotonic()
