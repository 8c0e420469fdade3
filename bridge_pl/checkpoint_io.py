"""Checkpoint files: written atomically with a digest beside them, verified before use, chosen with a fallback.

``X.ckpt`` is written to a temp name and renamed into place; then its BLAKE2b digest goes to ``X.ckpt.b2`` (the pair
the caches use, :mod:`bridge_pl.files`). Before a run resumes, :func:`resolve_checkpoint` checks the file against its
digest: ``--ckpt_path last`` takes the newest whole checkpoint of the run's checkpoint folder and names each damaged
one it skips; an explicit path that is damaged, or not a checkpoint at all, is an error naming it. A checkpoint
without a digest (written by another tool) is used if ``torch.load`` reads it as a Lightning checkpoint.

Each checkpoint also holds the run's ``model.*`` settings (``bridge_pl_config``), so a resume whose config does not
fit the checkpoint names the options that differ (:func:`fit_problem`) instead of listing tensor size mismatches.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from bridge_pl.files import digest_path, file_digest, umask_mode, write_digest

CONFIG_KEY = "bridge_pl_config"  # checkpoint entry: {"model.<option>": repr(value)} of the run that wrote it
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format is a zip archive


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and why."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes checkpoints to a temp file, renames it into place, then writes its digest; loads with
    ``weights_only=True``. ``run_config`` (``{"model.<option>": repr(value)}``) is stored in each checkpoint."""

    def __init__(self, run_config: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self.run_config = dict(run_config or {})

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in path.parent.glob(f".{path.name}.tmp-*"):  # left by a process killed mid-write
            stale.unlink(missing_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        torch.save({**checkpoint, CONFIG_KEY: self.run_config}, tmp)
        os.chmod(tmp, umask_mode())
        # Killed between these two, the file and its digest disagree: the checkpoint counts as damaged, and a
        # resume falls back to the newest whole one.
        os.replace(tmp, path)
        write_digest(path)

    def load_checkpoint(self, path, map_location=None, weights_only: bool | None = None) -> dict[str, Any]:
        return torch.load(path, map_location=map_location or "cpu", weights_only=True)

    def remove_checkpoint(self, path) -> None:
        super().remove_checkpoint(path)
        digest_path(path).unlink(missing_ok=True)


def _read(path: Path) -> dict[str, Any]:
    """The checkpoint's dict, memory-mapped (cheap: tensors are read only when touched)."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def checkpoint_problem(path: str | Path) -> str | None:
    """Why ``path`` is not a whole bridge-pl/Lightning checkpoint (one short phrase), or None when it is."""
    path = Path(path)
    if path.is_dir():  # a sharded (FSDP2) checkpoint: its strategy loads and checks it
        return None if (path / "meta.pt").is_file() else "a folder that is not a sharded checkpoint (no meta.pt)"
    if not path.is_file():
        return "no such file"
    digest = digest_path(path)
    if digest.is_file():
        if digest.read_text().strip() != file_digest(path):
            return (f"damaged: its bytes do not match the digest written with it ({digest.name}); "
                    "the file was changed or cut short after it was saved")
        return None
    with open(path, "rb") as f:
        if f.read(4) != _ZIP_MAGIC:
            return "not a PyTorch checkpoint (no zip archive header)"
    try:
        content = _read(path)
    except Exception as error:  # torch names the archive problem but not the file
        return f"not a readable checkpoint ({type(error).__name__}: {str(error).splitlines()[0]})"
    if not isinstance(content, dict) or "state_dict" not in content:
        return "not a Lightning checkpoint (no state_dict)"
    return None


def _step_of(path: Path) -> int:
    match = re.search(r"step=(\d+)", path.name)
    return int(match[1]) if match else -1


def newest_first(folder: Path) -> list[Path]:
    """The ``*.ckpt`` files of ``folder``, newest first: ``last*.ckpt`` (by modification time), then the others by
    the step in their name (``...step=N...``), then by modification time. Names, not times, order the step files,
    since a copied folder's times are the copy's."""
    files = [p for p in folder.glob("*.ckpt") if p.is_file() or p.is_dir()]
    return sorted(files, key=lambda p: (p.name.startswith("last"), _step_of(p), p.stat().st_mtime), reverse=True)


def is_named(spec: str) -> bool:
    """Whether ``--ckpt_path spec`` is one of Lightning's names (``last``, ``best``, ``hpc``, ``registry...``)
    rather than a path."""
    return spec in ("last", "best", "hpc") or spec.startswith("registry")


def resolve_checkpoint(spec: str | None, folder: Path) -> tuple[str | None, list[str]]:
    """``(path to load, warnings)`` for ``--ckpt_path spec``; ``folder`` holds the run's checkpoints.

    ``last``: the newest whole checkpoint in ``folder`` (None with a warning when there is none yet: the run starts
    from the beginning); each damaged one skipped is named in a warning. Another path: the file itself, which must be
    whole. Lightning's other names (``best``, ``hpc``, ``registry``) pass through unchanged.

    Raises:
        CheckpointError: ``spec`` names a file that is missing, damaged or not a checkpoint, or ``last`` finds only
            damaged checkpoints.
    """
    if spec is None or (is_named(spec) and spec != "last"):
        return spec, []
    if spec != "last":
        if problem := checkpoint_problem(spec):
            whole = next((str(p) for p in newest_first(Path(spec).parent) if p != Path(spec)
                          and checkpoint_problem(p) is None), None) if Path(spec).parent.is_dir() else None
            hint = f"; the newest whole checkpoint beside it is {whole}" if whole else ""
            raise CheckpointError(f"--ckpt_path {spec}: {problem}{hint}")
        return spec, []
    candidates = newest_first(folder) if folder.is_dir() else []
    if not candidates:
        return None, [f"--ckpt_path last: no checkpoint in {folder} yet; training starts from the beginning"]
    skipped = []
    for path in candidates:
        if (problem := checkpoint_problem(path)) is None:
            notes = [f"checkpoint {p} is {why}; skipped" for p, why in skipped]
            if skipped:
                notes.append(f"--ckpt_path last: resuming from {path}, the newest whole checkpoint")
            return str(path), notes
        skipped.append((path, problem))
    raise CheckpointError(f"--ckpt_path last: no whole checkpoint in {folder}: "
                          + "; ".join(f"{p.name} is {why}" for p, why in skipped))


def fit_problem(path: str | Path, module: torch.nn.Module, run_config: Mapping[str, str]) -> str | None:
    """Why the checkpoint at ``path`` does not fit ``module`` (tensors it holds with other shapes), naming the
    ``model.*`` options whose values differ from those it was written with; None when it fits."""
    if Path(path).is_dir():
        return None
    content = _read(Path(path))
    own = module.state_dict()
    mismatched = [(name, tuple(t.shape), tuple(own[name].shape)) for name, t in content.get("state_dict", {}).items()
                  if isinstance(t, torch.Tensor) and isinstance(own.get(name), torch.Tensor)
                  and t.shape != own[name].shape]
    if not mismatched:
        return None
    saved = content.get(CONFIG_KEY) or {}
    differing = [f"{key} is {run_config.get(key, 'unset')} here, {saved.get(key, 'unset')} in the checkpoint"
                 for key in sorted(set(saved) | set(run_config)) if saved.get(key) != run_config.get(key)]
    if differing:
        return f"checkpoint {path} does not fit this config: " + "; ".join(differing)
    name, theirs, ours = mismatched[0]
    return (f"checkpoint {path} does not fit this config: {len(mismatched)} tensors differ in shape, e.g. {name} "
            f"is {list(theirs)} in the checkpoint, {list(ours)} here")


def flat_model_config(config: Any) -> dict[str, str]:
    """``{"model.<option>": repr(value)}`` of a parsed config's leaves (a jsonargparse Namespace)."""
    return {key: repr(value) for key, value in config.items() if key.startswith("model.")}
