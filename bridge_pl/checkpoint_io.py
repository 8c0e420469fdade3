"""Checkpoint files: written atomically with a digest beside them, verified before use, chosen with a fallback.

Writing ``X.ckpt`` (:meth:`AtomicCheckpointIO.save_checkpoint`) keeps a checkpoint and its digest ``X.ckpt.b2`` in
step at every moment, so that a process killed anywhere (a scheduler's SIGKILL after its grace period) leaves a
checkpoint its digest accepts:

1. The checkpoint goes to ``.X.ckpt.tmp-<pid>``, hashed (BLAKE2b) while it is written, and is synced to disk.
2. ``X.ckpt.b2`` is replaced (temp file, sync, rename) by a digest file that accepts the new bytes and those of the
   ``X.ckpt`` in place, if any (one digest a line).
3. The temp checkpoint is renamed to ``X.ckpt``.
4. ``X.ckpt.b2`` is replaced by the new digest alone.

The folder is synced after each rename, so the steps reach the disk in this order. Killed before step 3, the old
``X.ckpt`` is in place and accepted; from step 3 on, the new one. What a killed write leaves behind are its temp
files (removed by the next write of ``X.ckpt``) and, when ``X.ckpt`` did not exist yet, a digest without its
checkpoint (replaced when the resumed run writes ``X.ckpt`` again). A write that fails (no space left, a read-only
file system) removes its temp files and raises :class:`CheckpointWriteError` naming the path and why.

Before a run uses a checkpoint, :func:`resolve_checkpoint` checks it: against its digest when it has one; without
one (a checkpoint written by another tool, or one whose digest was lost), by the CRC of every record of its zip
archive and by reading it as a Lightning checkpoint; a bridge-pl checkpoint without its digest (it holds
``bridge_pl_config``) is also named in a warning. ``--ckpt_path last`` takes the newest whole checkpoint of the run's
checkpoint folder and names each damaged one it skips; an explicit path that is damaged, or not a checkpoint at all,
is an error naming it.

Each checkpoint holds the options of the run that wrote it (``bridge_pl_config``). A ``fit`` resumed under options
that change what the run trains (:data:`RUN_DEFINING`: the mode, the base models, the LoRA shape, the training data,
the corpus or index) is refused, naming each option that differs (:func:`config_problem`); other options (steps,
intervals, learning rates, logging, callbacks) may change. :func:`check_run_start` also refuses a ``fit`` that
would start over in a folder that holds a run's checkpoints.

When an iteration is saved: one that a validation follows (:func:`validation_follows`) is saved after that validation
(``callbacks.ValidatedCheckpoint``), and a run stopped by a signal stops at the newest whole checkpoint instead of
saving it early (:class:`~bridge_pl.signals.StopOnSignal`). The options of the callbacks a config names are checked
before anything loads (:func:`callback_problems`).
"""

from __future__ import annotations

import ast
import errno
import hashlib
import importlib
import os
import re
import time
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from bridge_pl.files import digest_path, file_digest, umask_mode

CONFIG_KEY = "bridge_pl_config"  # checkpoint entry: {"<option>": repr(value)} of the run that wrote it
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format is a zip archive
_MAX_VALUE = 200  # longer option values are stored shortened, with a digest of the whole

# Options that define what a run trains: a fit resumed with another value of one of these is refused. The retriever's
# keys hold for a plug-in retriever with options of the same names.
RUN_DEFINING = (
    "model.mode",
    "model.rl.algorithm",
    "model.policy.class_path",
    "model.policy.init_args.model",
    "model.policy.init_args.lora",
    "model.policy.init_args.lora_r",
    "model.policy.init_args.lora_alpha",
    "model.policy.init_args.target_modules",
    "model.retriever.class_path",
    "model.retriever.init_args.encoder",
    "model.retriever.init_args.passage_tower",
    "model.retriever.init_args.pooling",
    "model.retriever.init_args.normalize",
    "model.retriever.init_args.query_prefix",
    "model.retriever.init_args.passage_prefix",
    "model.retriever.init_args.corpus",
    "model.retriever.init_args.index_path",
    "data.train",
)
_STORED_DATA = ("data.train",)  # besides every model.* option


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and why."""


class CheckpointWriteError(OSError):
    """A checkpoint (or its digest) that could not be written; the message names the path and why. The write's
    temp files are removed; the checkpoint in place before it, if any, is unchanged."""


class ExistingRun(RuntimeError):
    """A ``fit`` that would start over in a folder holding a run's checkpoints; the message says how to go on."""


def _write_all(file: BinaryIO, data) -> int:
    """Write all of ``data`` to the unbuffered ``file``, or raise (a write cut short by a full disk raises
    ``OSError`` no space left on the next try)."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        written = file.write(view[done:])
        if not written:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done += written
    return done


class _HashingWriter:
    """A write-only file for ``torch.save`` that hashes what passes through it (torch writes its zip archive in one
    pass, front to back), with the hash of :func:`bridge_pl.files.file_digest`. Each write is written whole or
    raises (a disk that fills up: ``OSError`` no space left), never cut short; the first such error is kept in
    ``error``, since torch may report it as a position mismatch of its own instead."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self._hash = hashlib.blake2b(digest_size=16)
        self.error: OSError | None = None

    def write(self, data) -> int:
        if self.error is not None:
            raise self.error
        view = memoryview(data).cast("B")
        self._hash.update(view)
        try:
            return _write_all(self._file, view)
        except OSError as error:
            self.error = error
            raise

    def save(self, content: dict[str, Any]) -> None:
        """``torch.save(content)`` into the file; a failed write raises its own ``OSError``."""
        try:
            torch.save(content, self)
        except Exception:
            if self.error is not None:
                raise self.error from None
            raise
        if self.error is not None:
            raise self.error

    def flush(self) -> None:
        self._file.flush()

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def _sync_folder(folder: Path) -> None:
    """Make the renames in ``folder`` durable, in the order they were made."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, write) -> None:
    """Create ``path`` (the umask's mode) by ``write(file)`` (an unbuffered file), then sync it to disk."""
    with open(path, "xb", buffering=0) as f:
        os.fchmod(f.fileno(), umask_mode())
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _accepted(digest: Path) -> list[str]:
    """The digests a digest file accepts (one a line), empty when it does not exist."""
    return digest.read_text().split() if digest.is_file() else []


def _reason(error: OSError) -> str:
    """Why a write failed, in words (``no space left on device``, ``read-only file system``, ...)."""
    return os.strerror(error.errno).lower() if error.errno else str(error)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint and its digest so that they agree whenever the process is killed (see the module
    doc); loads with ``weights_only=True``. ``run_config`` (:func:`flat_run_config`) is stored in each checkpoint."""

    def __init__(self, run_config: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self.run_config = dict(run_config or {})

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        path = Path(path)
        digest = digest_path(path)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        digest_tmp = digest.with_name(f".{digest.name}.tmp-{os.getpid()}")
        target = path  # the file being written, named when the write fails
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            for stale in [*path.parent.glob(f".{path.name}.tmp-*"), *path.parent.glob(f".{digest.name}.tmp-*")]:
                stale.unlink(missing_ok=True)  # left by a process killed mid-write
            writer: _HashingWriter | None = None

            def save(f: BinaryIO) -> None:
                nonlocal writer
                writer = _HashingWriter(f)
                writer.save({**checkpoint, CONFIG_KEY: self.run_config})

            _write_synced(tmp, save)
            new = writer.hexdigest()
            old = _accepted(digest) or ([file_digest(path)] if path.is_file() else [])
            target = digest
            self._replace_digest(digest, digest_tmp, [new, *(d for d in old if d != new)])
            target = path
            os.replace(tmp, path)
            _sync_folder(path.parent)
            target = digest
            self._replace_digest(digest, digest_tmp, [new])
        except OSError as error:
            raise CheckpointWriteError(f"could not write {target}: {_reason(error)}; no partial file was left"
                                       ) from error
        finally:
            tmp.unlink(missing_ok=True)
            digest_tmp.unlink(missing_ok=True)

    @staticmethod
    def _replace_digest(digest: Path, tmp: Path, accepted: list[str]) -> None:
        """Replace the digest file by one accepting ``accepted`` (temp file, sync, rename, sync the folder)."""
        tmp.unlink(missing_ok=True)
        _write_synced(tmp, lambda f: _write_all(f, "\n".join(accepted).encode() + b"\n"))
        os.replace(tmp, digest)
        _sync_folder(digest.parent)

    def load_checkpoint(self, path, map_location=None, weights_only: bool | None = None) -> dict[str, Any]:
        return torch.load(path, map_location=map_location or "cpu", weights_only=True)

    def remove_checkpoint(self, path) -> None:
        super().remove_checkpoint(path)
        digest_path(path).unlink(missing_ok=True)


def _read(path: Path) -> dict[str, Any]:
    """The checkpoint's dict, memory-mapped (cheap: tensors are read only when touched)."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


# Verdicts of checkpoint files already read by this process, by the file's and its digest's identity: a file is
# read in full once, however often it is checked (before the models load, when the run starts). A file changed
# within the last seconds is read again each time: a write in the same clock tick keeps its modification time.
_VERDICTS: dict[tuple, tuple[str | None, str | None]] = {}
_SETTLED_NS = 2_000_000_000


def _identity(path: Path) -> tuple[tuple, bool]:
    """``(what changes when path or its digest file is replaced or written to, whether either changed lately)``."""
    path, stats = path.resolve(), []
    for p in (path, digest_path(path)):
        try:
            s = p.stat()
        except FileNotFoundError:
            stats.append(None)
            continue
        stats.append((s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns))
    latest = max((s[3] for s in stats if s is not None), default=0)
    return (str(path), *stats), time.time_ns() - latest < _SETTLED_NS


def _crc_problem(path: Path) -> str | None:
    """Why the zip archive ``path`` is damaged (a record whose bytes fail its CRC, a broken directory), or None."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as error:
        return f"not a readable checkpoint ({type(error).__name__}: {str(error).splitlines()[0]})"
    if bad is not None:
        return f"damaged: its record {bad} fails its zip CRC check (it has no digest beside it)"
    return None


def _structure_problem(path: Path) -> tuple[str | None, dict | None]:
    """``(why path is not a readable Lightning checkpoint or None, its content when readable)``."""
    try:
        content = _read(path)
    except Exception as error:  # torch names the archive problem but not the file
        return f"not a readable checkpoint ({type(error).__name__}: {str(error).splitlines()[0]})", None
    if not isinstance(content, dict) or not isinstance(content.get("state_dict"), Mapping):
        return "not a Lightning checkpoint (no state_dict)", None
    if CONFIG_KEY in content and not isinstance(content[CONFIG_KEY], Mapping):
        return f"damaged: its {CONFIG_KEY} entry is not a mapping", None
    return None, content


def _inspect(path: Path) -> tuple[str | None, str | None]:
    """``(problem, note)``: why ``path`` is not a whole checkpoint (None when it is), and a warning about a whole one
    that could only be checked without its digest (None otherwise). A link (``save_last: link``) is checked with the
    digest of the file it points to."""
    digest = digest_path(path.resolve())
    if digest.is_file():
        if file_digest(path) not in _accepted(digest):
            return (f"damaged: its bytes do not match the digest written with it ({digest.name}); "
                    "the file was changed or cut short after it was saved"), None
        return None, None
    with open(path, "rb") as f:
        if f.read(4) != _ZIP_MAGIC:
            return "not a PyTorch checkpoint (no zip archive header)", None
    if problem := _crc_problem(path):
        return problem, None
    problem, content = _structure_problem(path)
    if problem is None and CONFIG_KEY in content:
        return None, (f"checkpoint {path} has no digest ({digest.name} is missing, though bridge-pl writes one with "
                      "each checkpoint): checked by its archive's CRCs and structure instead")
    return problem, None


def checkpoint_verdict(path: str | Path) -> tuple[str | None, str | None]:
    """``(problem, note)`` of the checkpoint at ``path``: why it is not a whole bridge-pl/Lightning checkpoint (one
    short phrase; None when it is), and a warning to show when it is used (None when there is nothing to say)."""
    path = Path(path)
    if path.is_dir():  # a sharded (FSDP2) checkpoint: its strategy loads and checks it
        sharded = (path / "meta.pt").is_file()
        return (None if sharded else "a folder that is not a sharded checkpoint (no meta.pt)"), None
    if not path.is_file():
        return "no such file", None
    key, recent = _identity(path)
    if key in _VERDICTS:
        return _VERDICTS[key]
    verdict = _inspect(path)
    if not recent:
        _VERDICTS[key] = verdict
    return verdict


def checkpoint_problem(path: str | Path) -> str | None:
    """Why ``path`` is not a whole bridge-pl/Lightning checkpoint (one short phrase), or None when it is."""
    return checkpoint_verdict(path)[0]


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
    whole. Lightning's other names (``best``, ``hpc``, ``registry``) pass through unchanged. A bridge-pl checkpoint
    used without its digest is named in a warning.

    Raises:
        CheckpointError: ``spec`` names a file that is missing, damaged or not a checkpoint, or ``last`` finds only
            damaged checkpoints.
    """
    if spec is None or (is_named(spec) and spec != "last"):
        return spec, []
    if spec != "last":
        problem, note = checkpoint_verdict(spec)
        if problem:
            whole = next((str(p) for p in newest_first(Path(spec).parent) if p != Path(spec)
                          and checkpoint_problem(p) is None), None) if Path(spec).parent.is_dir() else None
            hint = f"; the newest whole checkpoint beside it is {whole}" if whole else ""
            raise CheckpointError(f"--ckpt_path {spec}: {problem}{hint}")
        return spec, [note] if note else []
    candidates = newest_first(folder) if folder.is_dir() else []
    if not candidates:
        return None, [f"--ckpt_path last: no checkpoint in {folder} yet; training starts from the beginning"]
    skipped = []
    for path in candidates:
        problem, note = checkpoint_verdict(path)
        if problem is None:
            notes = [f"checkpoint {p} is {why}; skipped" for p, why in skipped]
            if skipped:
                notes.append(f"--ckpt_path last: resuming from {path}, the newest whole checkpoint")
            return str(path), notes + ([note] if note else [])
        skipped.append((path, problem))
    raise CheckpointError(f"--ckpt_path last: no whole checkpoint in {folder}: "
                          + "; ".join(f"{p.name} is {why}" for p, why in skipped))


def _shown(value: str | None) -> str:
    """A stored ``repr`` as the user wrote it (a string without its quotes); ``unset`` for None."""
    if value is None:
        return "unset"
    try:
        literal = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return value
    return literal if isinstance(literal, str) else value


def _differences(saved: Mapping[str, str], run_config: Mapping[str, str], keys) -> list[str]:
    return [f"{key} is {_shown(run_config.get(key))} here, {_shown(saved.get(key))} in the checkpoint"
            for key in keys if saved.get(key) != run_config.get(key)]


def _saved_config(path: Path) -> Mapping[str, str]:
    saved = _read(path).get(CONFIG_KEY)
    return saved if isinstance(saved, Mapping) else {}


def config_problem(path: str | Path, run_config: Mapping[str, str]) -> str | None:
    """Why a ``fit`` under ``run_config`` (:func:`flat_run_config`) cannot continue the checkpoint at ``path``: the
    :data:`RUN_DEFINING` options whose values differ from those it was written with (an option the checkpoint does
    not record is not compared); None when none differs, or for a sharded checkpoint."""
    if Path(path).is_dir():
        return None
    saved = _saved_config(Path(path))
    differing = _differences(saved, run_config, [key for key in RUN_DEFINING if key in saved])
    if not differing:
        return None
    return (f"checkpoint {path} does not fit this config: " + "; ".join(differing)
            + " (these options define what the run trains: resume with the checkpoint's values, or start a new run "
              "in another trainer.default_root_dir)")


def fit_problem(path: str | Path, module: torch.nn.Module, run_config: Mapping[str, str]) -> str | None:
    """Why the checkpoint at ``path`` does not fit ``module``: tensors it holds with other shapes, named by the
    options whose values differ from those it was written with; None when it fits."""
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
    differing = _differences(saved, run_config, sorted(set(saved) | set(run_config)))
    if differing:
        return f"checkpoint {path} does not fit this config: " + "; ".join(differing)
    name, theirs, ours = mismatched[0]
    return (f"checkpoint {path} does not fit this config: {len(mismatched)} tensors differ in shape, e.g. {name} "
            f"is {list(theirs)} in the checkpoint, {list(ours)} here")


def _stored(value: Any) -> str:
    """``repr(value)``, shortened with a digest of the whole when long (an inline list of records)."""
    text = repr(value)
    if len(text) <= _MAX_VALUE:
        return text
    whole = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
    return f"{text[:80]}... ({len(text)} characters, blake2b {whole})"


def flat_run_config(config: Any) -> dict[str, str]:
    """``{"<option>": repr(value)}`` of a parsed config's (a jsonargparse Namespace) ``model.*`` leaves and training
    data: what each checkpoint stores of the run that wrote it."""
    return {key: _stored(value) for key, value in config.items()
            if key.startswith("model.") or key in _STORED_DATA}


def _entries(callbacks: Any) -> list[Any]:
    """A parsed ``trainer.callbacks`` (one entry, a list of them, or None) as a list of entries."""
    if callbacks is None:
        return []
    return list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]


def _callback_entries(config: Any) -> list[Any]:
    return _entries(config.get("trainer.callbacks"))


def entry_class(entry: Any) -> type | None:
    """The class a parsed config entry (``class_path`` and ``init_args``) names; None when it names none."""
    module, _, name = (getattr(entry, "class_path", None) or "").rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None
    return cls if isinstance(cls, type) else None


def callback_problems(callbacks: Any) -> list[str]:
    """What is wrong with the options of the entries of a parsed config's ``trainer.callbacks`` (class path and init
    args, before anything is instantiated), each message naming the entry and the option.

    A callback class checks its own options with a static method ``init_args_problem(init_args) -> str | None``
    (the entry's parsed ``init_args``, None when it has none; e.g. ``callbacks.ValidatedCheckpoint``'s
    ``keep_last``); entries whose class has none are not checked here.
    """
    problems = []
    for index, entry in enumerate(_entries(callbacks)):
        cls = entry_class(entry)
        check = getattr(cls, "init_args_problem", None)
        if callable(check) and (problem := check(getattr(entry, "init_args", None))):
            problems.append(f"trainer.callbacks[{index}] ({cls.__name__}): {problem}")
    return problems


def validation_follows(trainer: pl.Trainer) -> bool:
    """Whether a validation with at least one batch runs right after the training iteration that just ended.

    Uses the training loop's own test (Lightning-private; ``tests/test_fault_injection.py`` and
    ``tests/test_checkpoint.py`` pin what it gives); a validation without batches (no dev set) never calls
    ``on_validation_end``, so it does not count.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    if not epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher):
        return False
    epoch_loop.val_loop.setup_data()  # what the loop does next anyway (a no-op once set up)
    return not epoch_loop.val_loop.skip


def _is_checkpoint_callback(entry: Any) -> bool:
    """Whether a ``trainer.callbacks`` entry of a parsed config is a ``ModelCheckpoint``."""
    cls = entry_class(entry)
    return cls is not None and issubclass(cls, ModelCheckpoint)


def checkpoint_folders(config: Any) -> list[Path]:
    """Where a ``fit`` under ``config`` writes checkpoints: each checkpoint callback's ``dirpath``, and
    ``<trainer.default_root_dir>/checkpoints`` for one without (the CLI puts it there) or when none is configured;
    the first is where ``--ckpt_path last`` looks."""
    root = Path(config.get("trainer.default_root_dir") or os.getcwd())
    folders = []
    for entry in filter(_is_checkpoint_callback, _callback_entries(config)):
        dirpath = getattr(getattr(entry, "init_args", None), "dirpath", None)
        folder = Path(dirpath) if dirpath else root / "checkpoints"
        if folder not in folders:
            folders.append(folder)
    return folders or [root / "checkpoints"]


def _step_note(path: Path) -> str:
    """``"last.ckpt at step N"`` (without the step when the file does not say)."""
    try:
        step = _read(path).get("global_step") if path.is_file() else None
    except Exception:  # a damaged file: its name alone
        step = None
    return f"{path.name} at step {step}" if isinstance(step, int) else path.name


def _held_run(folders: list[Path]) -> Path | None:
    """The newest checkpoint in ``folders``, None when they hold none."""
    for folder in folders:
        if folder.is_dir() and (files := newest_first(folder)):
            return files[0]
    return None


def check_run_start(config: Any) -> None:
    """Checked before a ``fit`` loads any model: a folder that holds a run's checkpoints is continued
    (``--ckpt_path last``, or one of its own checkpoints), never started over beside them; a resume whose
    :data:`RUN_DEFINING` options differ from the checkpoint's is refused (:func:`config_problem`).

    Raises:
        ExistingRun: the fit would start over in a folder holding a run's checkpoints.
        CheckpointError: the checkpoint to resume from is damaged, missing, or written under other run-defining
            options.
    """
    folders = checkpoint_folders(config)
    spec = config.get("ckpt_path")
    held = _held_run(folders)
    if held is not None and (spec is None or (not is_named(spec) and Path(spec).resolve().parent
                                              not in {f.resolve() for f in folders})):
        root = Path(config.get("trainer.default_root_dir") or os.getcwd())
        where = root if held.parent == root / "checkpoints" else held.parent
        start = "" if spec is None else f"; to start from {spec}, use another trainer.default_root_dir"
        raise ExistingRun(f"{where} holds a run ({_step_note(held)}): resume it with --ckpt_path last, or choose "
                          f"another trainer.default_root_dir{start}")
    if spec is None or (is_named(spec) and spec != "last"):
        return
    path, _ = resolve_checkpoint(spec, folders[0])
    if path is not None and (problem := config_problem(path, flat_run_config(config))):
        raise CheckpointError(problem)
