"""Integrity of what a run reads and writes, tried through real ``bridge-pl`` processes where the behaviour is the
process's (signals, the run-directory lock, exit statuses): a stop on SIGTERM / SIGINT checkpoints and exits
143 / 130 with a line saying how to resume; a damaged ``last.ckpt`` is named and skipped, and the resumed run ends
with the weights of an uninterrupted one; a copied run folder continues its ``last.ckpt``; a second run on a
directory in use stops at once naming the first; a stale lock is taken over; ``--ckpt_path`` to something that is not
a checkpoint, or one the config does not fit, is one line naming it; a fit that would start over in a folder holding
a run is refused; a checkpoint folder that takes no files is named before any model loads, and a disk that fills up
is named with the checkpoint's path, leaving no partial file. The last two run in a user and mount namespace
(``unshare``) over a real read-only or tiny tmpfs.
"""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TINY

from bridge_pl.checkpoint_io import checkpoint_problem
from bridge_pl.cli import main
from bridge_pl.files import umask_mode

TESTS = Path(__file__).parent
CHECKPOINTS = ["--trainer.enable_checkpointing=true", "--trainer.callbacks+=callbacks.checkpoint.ValidatedCheckpoint",
               "--trainer.callbacks.every_n_train_steps=1", "--trainer.callbacks.save_last=true",
               "--trainer.callbacks.keep_last=2", "--trainer.val_check_interval=100"]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)]), "OMP_NUM_THREADS": "1",
       "HF_HUB_DISABLE_PROGRESS_BARS": "0"}  # transformers' "Loading weights" bars kept in the captured output


def command(root: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "bridge_pl.cli", "fit", "--config", TINY, f"--trainer.default_root_dir={root}",
            *CHECKPOINTS, *extra]


def fit(root: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(command(root, *extra), env=ENV, capture_output=True, text=True, timeout=600)


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, weights_only=True)["state_dict"]


def damage(path: Path) -> None:
    """Overwrite 4 KiB in the middle of the file, as a bad disk or a stray write would."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(b"\xff" * 4096)


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("uninterrupted")
    done = fit(root, "--trainer.max_steps=2")
    assert done.returncode == 0, done.stderr[-2000:]
    return root


def test_sigterm_checkpoints_and_a_copied_run_resumes_past_a_damaged_checkpoint(tmp_path, uninterrupted):
    stopped = tmp_path / "stopped"
    run = fit(stopped, "--trainer.max_steps=2", "--trainer.callbacks+=plugins.KillAt",
              "--trainer.callbacks.point=rollout", "--trainer.callbacks.count=3",
              "--trainer.callbacks.signal_name=SIGTERM")  # a real SIGTERM, during the first iteration's rollout
    assert run.returncode == 143, run.stderr[-2000:]
    last = stopped / "checkpoints" / "last.ckpt"
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith("bridge-pl: stopped by SIGTERM at step 1; ") and f"checkpoint {last};" in line
    assert "resume with: bridge-pl fit" in line and line.endswith("--ckpt_path=last")
    assert torch.load(last, weights_only=True)["global_step"] == 1 and checkpoint_problem(last) is None
    assert last.stat().st_mode & 0o777 == umask_mode()  # files honour the umask

    copy = tmp_path / "copy"  # a run folder copied elsewhere, its last.ckpt then damaged, its lock left stale
    shutil.copytree(stopped, copy)
    damage(copy / "checkpoints" / "last.ckpt")
    (copy / ".bridge-pl.lock").write_text(json.dumps({"pid": dead_pid(), "host": "elsewhere", "started": 0}))
    resumed = fit(copy, "--trainer.max_steps=2", "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"checkpoint {copy / 'checkpoints' / 'last.ckpt'} is damaged" in resumed.stderr
    assert f"resuming from {copy / 'checkpoints' / 'epoch=0-step=1.ckpt'}" in resumed.stderr
    assert "took over the lock" in resumed.stderr and "on elsewhere" in resumed.stderr
    assert not list((copy / "checkpoints").glob("last-v*")), "the copy must continue its own last.ckpt"
    final = copy / "checkpoints" / "last.ckpt"
    assert checkpoint_problem(final) is None and torch.load(final, weights_only=True)["global_step"] == 2
    want, got = weights(uninterrupted / "checkpoints" / "last.ckpt"), weights(final)
    assert set(got) == set(want)
    for name, tensor in want.items():
        if isinstance(tensor, torch.Tensor):
            torch.testing.assert_close(got[name], tensor, rtol=1e-4, atol=1e-6, msg=name)


def test_a_second_run_on_a_directory_in_use_stops_at_once(tmp_path, capfd, weight_loads):
    """Another process holds the directory's lock (a light one: the lock is the same for any holder)."""
    root = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from bridge_pl.run_lock import RunLock; "
                               f"RunLock({str(root)!r}).acquire(); print('held', flush=True); sys.stdin.read()"],
                              env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SystemExit) as exit_info:
            main(["fit", "--config", TINY, f"--trainer.default_root_dir={root}"])
    finally:
        holder.communicate(input="")
    err = capfd.readouterr().err
    assert exit_info.value.code == 1
    assert f"run directory {root} is in use by another bridge-pl run (pid {holder.pid} on " in err
    assert "started 20" in err and "Loading weights" not in weight_loads  # stopped before any model loads
    assert "took over the lock" not in err


def test_sigint_stops_at_the_iteration_boundary_with_a_checkpoint(tmp_path, capfd):
    """A real SIGINT (Ctrl-C) to this process during the second iteration's rollout: that iteration ends, is
    saved, and bridge-pl exits 130 saying where the checkpoint is."""
    root = tmp_path / "run"
    handler = signal.getsignal(signal.SIGINT)  # Python's default_int_handler, or SIG_IGN under a background job
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", TINY, f"--trainer.default_root_dir={root}", *CHECKPOINTS, "--trainer.max_steps=4",
              "--trainer.callbacks+=plugins.KillAt", "--trainer.callbacks.point=rollout",
              "--trainer.callbacks.count=5", "--trainer.callbacks.signal_name=SIGINT"])
    assert exit_info.value.code == 130
    last = root / "checkpoints" / "last.ckpt"
    step = torch.load(last, weights_only=True)["global_step"]
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("bridge-pl:")]
    assert lines[-1].startswith(f"bridge-pl: stopped by SIGINT at step {step}; checkpoint {last}; resume with: ")
    assert 1 <= step < 4 and checkpoint_problem(last) is None
    assert signal.getsignal(signal.SIGINT) is handler  # the handler is restored


def _refused(tmp_path, capfd, weight_loads, *args: str) -> str:
    root = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", TINY, f"--trainer.default_root_dir={root}", *args])
    out, err = capfd.readouterr()
    assert exit_info.value.code == 1 and "Traceback" not in err
    assert "Loading weights" not in weight_loads  # refused before any model loads
    return err


def test_a_ckpt_path_that_is_not_a_whole_checkpoint_is_named(tmp_path, capfd, weight_loads, uninterrupted):
    not_json = tmp_path / "model.json"
    not_json.write_text('{"lr": 0.1}')
    empty = tmp_path / "empty.ckpt"
    empty.touch()
    cut = tmp_path / "cut.ckpt"  # cut short, with no digest beside it
    cut.write_bytes((uninterrupted / "checkpoints" / "last.ckpt").read_bytes()[:100_000])
    damaged = tmp_path / "damaged.ckpt"  # with its digest
    shutil.copy(uninterrupted / "checkpoints" / "last.ckpt", damaged)
    shutil.copy(uninterrupted / "checkpoints" / "last.ckpt.b2", tmp_path / "damaged.ckpt.b2")
    damage(damaged)
    zeroed = tmp_path / "zeroed.ckpt"  # a bridge-pl checkpoint that lost its digest, then 4 KiB of its bytes
    shutil.copy(uninterrupted / "checkpoints" / "last.ckpt", zeroed)
    with open(zeroed, "r+b") as f:
        f.seek(zeroed.stat().st_size // 2)
        f.write(bytes(4096))
    for path, why in [(not_json, "not a PyTorch checkpoint"), (empty, "not a PyTorch checkpoint"),
                      (cut, "not a readable checkpoint"), (damaged, "damaged: its bytes do not match the digest"),
                      (zeroed, "damaged: its record "), (tmp_path / "missing.ckpt", "no such file")]:
        lines = [line for line in _refused(tmp_path, capfd, weight_loads, f"--ckpt_path={path}").splitlines()
                 if line.startswith("bridge-pl:")]
        assert len(lines) == 1 and f"--ckpt_path {path}: {why}" in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_a_resume_whose_config_does_not_fit_names_the_option(tmp_path, capfd, weight_loads, uninterrupted):
    checkpoint = uninterrupted / "checkpoints" / "last.ckpt"
    err = _refused(tmp_path, capfd, weight_loads, f"--ckpt_path={checkpoint}", "--model.policy.init_args.lora_r=8")
    assert f"checkpoint {checkpoint} does not fit this config: model.policy.init_args.lora_r is 8 here, 4 in" in err


@pytest.mark.parametrize(("option", "said"), [
    ("--model.mode=frozen", "model.mode is frozen here, bridge in the checkpoint"),
    ("--model.policy.init_args.model=tiny-llama-hd32",  # another base model whose LoRA tensors have the same shapes
     "model.policy.init_args.model is tiny-llama-hd32 here, tiny-llama in the checkpoint"),
    ("--data.train=world/dev", "data.train is world/dev here, world/train in the checkpoint"),
])
def test_a_resume_under_options_that_change_the_run_is_refused_naming_them(tmp_path, capfd, weight_loads,
                                                                            uninterrupted, option, said):
    checkpoint = uninterrupted / "checkpoints" / "last.ckpt"
    err = _refused(tmp_path, capfd, weight_loads, f"--ckpt_path={checkpoint}", option)
    lines = [line for line in err.splitlines() if line.startswith("bridge-pl:")]
    assert len(lines) == 1 and f"checkpoint {checkpoint} does not fit this config: {said}" in lines[0], lines


def _files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


def test_a_fit_that_would_start_over_in_a_folder_holding_a_run_is_refused(tmp_path, capfd, weight_loads,
                                                                         uninterrupted):
    root = tmp_path / "run"
    shutil.copytree(uninterrupted, root)
    before = _files(root)
    elsewhere = tmp_path / "elsewhere.ckpt"
    shutil.copy(uninterrupted / "checkpoints" / "last.ckpt", elsewhere)
    for extra, said in [((), ""), ((f"--ckpt_path={elsewhere}",),
                                   f"; to start from {elsewhere}, use another trainer.default_root_dir")]:
        with pytest.raises(SystemExit) as exit_info:
            main(["fit", "--config", TINY, f"--trainer.default_root_dir={root}", *CHECKPOINTS, *extra])
        out, err = capfd.readouterr()
        assert exit_info.value.code == 1 and "Loading weights" not in weight_loads
        assert (f"bridge-pl: error: ExistingRun: {root} holds a run (last.ckpt at step 2): resume it with "
                f"--ckpt_path last, or choose another trainer.default_root_dir{said}\n") in err
    after = _files(root)
    assert {name: t for name, t in after.items() if name != ".bridge-pl.lock"} == {
        name: t for name, t in before.items() if name != ".bridge-pl.lock"}  # nothing written: no -v1 copies


def _in_mount_namespace(mount: str, folder: Path, command: list[str], listing: Path) -> subprocess.CompletedProcess:
    """``command`` run as root of a user and mount namespace in which ``folder`` is a fresh tmpfs mounted with
    ``mount`` options; what ``folder`` holds when it ends is written to ``listing``. Skips when ``unshare`` cannot
    make the namespace."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode:
        pytest.skip("needs unshare and user namespaces to mount a tmpfs")
    folder.mkdir(parents=True, exist_ok=True)
    script = (f"mount -t tmpfs -o {mount} tmpfs {shlex.quote(str(folder))} || exit 99; {shlex.join(command)}; "
              f"status=$?; ls -A {shlex.quote(str(folder))} > {shlex.quote(str(listing))}; exit $status")
    return subprocess.run(["unshare", "-rm", "sh", "-c", script], env=ENV, capture_output=True, text=True,
                          timeout=600)


def test_a_read_only_checkpoint_folder_is_named_before_any_model_loads(tmp_path):
    root, listing = tmp_path / "run", tmp_path / "listing"
    run = _in_mount_namespace("ro,size=64k", root / "checkpoints", command(root), listing)
    assert run.returncode == 1, run.stderr[-3000:]
    assert run.stderr.strip().splitlines()[-2] == (
        f"bridge-pl: error: FolderNotWritable: cannot write to {root / 'checkpoints'}: read-only file system "
        "(the run's checkpoints)")
    assert "Loading weights" not in run.stdout + run.stderr


def test_a_full_disk_names_the_checkpoint_and_leaves_no_partial_file(tmp_path):
    root, listing = tmp_path / "run", tmp_path / "listing"
    run = _in_mount_namespace("size=256k", root / "checkpoints", command(root, "--trainer.max_steps=1"), listing)
    assert run.returncode == 1, run.stderr[-3000:]
    line = run.stderr.strip().splitlines()[-2]
    assert re.fullmatch(rf"bridge-pl: error: CheckpointWriteError: could not write {re.escape(str(root))}/checkpoints/"
                        r"\S+\.ckpt: no space left on device; no partial file was left", line), line
    assert listing.read_text() == ""  # the tmpfs held nothing after the failed write


def test_validate_without_a_checkpoint_warns_that_it_scores_untrained_weights(tmp_path, capfd, uninterrupted):
    main(["validate", "--config", TINY, f"--trainer.default_root_dir={tmp_path}"])
    assert "validate without --ckpt_path or model.policy.init_args.adapter scores the untrained weights" in (
        capfd.readouterr().err)
    main(["validate", "--config", TINY, f"--trainer.default_root_dir={tmp_path}",
          f"--ckpt_path={uninterrupted / 'checkpoints' / 'last.ckpt'}"])
    assert "untrained" not in capfd.readouterr().err


def test_last_takes_the_newest_whole_checkpoint_and_refuses_when_none_is_whole(tmp_path):
    """``--ckpt_path last`` on small real checkpoint files: last.ckpt first, then by the step in the name (a copied
    folder's modification times are the copy's); damaged ones named and skipped; none whole is an error."""
    from bridge_pl.checkpoint_io import AtomicCheckpointIO, CheckpointError, resolve_checkpoint

    io = AtomicCheckpointIO({"model.mode": "'bridge'"})
    for name in ("epoch=0-step=10.ckpt", "epoch=0-step=9.ckpt", "last.ckpt"):
        io.save_checkpoint({"state_dict": {"w": torch.zeros(64, 64)}, "global_step": 1}, tmp_path / name)
    os.utime(tmp_path / "epoch=0-step=9.ckpt")  # touched last: times do not decide
    assert resolve_checkpoint("last", tmp_path) == (str(tmp_path / "last.ckpt"), [])
    damage(tmp_path / "last.ckpt")
    damage(tmp_path / "epoch=0-step=10.ckpt")
    path, notes = resolve_checkpoint("last", tmp_path)
    assert path == str(tmp_path / "epoch=0-step=9.ckpt")
    assert [n.split(" is ")[0] for n in notes[:2]] == [f"checkpoint {tmp_path / 'last.ckpt'}",
                                                       f"checkpoint {tmp_path / 'epoch=0-step=10.ckpt'}"]
    io.remove_checkpoint(tmp_path / "epoch=0-step=9.ckpt")
    assert not (tmp_path / "epoch=0-step=9.ckpt.b2").exists()  # the digest goes with its checkpoint
    with pytest.raises(CheckpointError, match=r"no whole checkpoint in .*: last.ckpt is damaged.*step=10.ckpt is"):
        resolve_checkpoint("last", tmp_path)
    assert resolve_checkpoint("last", tmp_path / "none")[0] is None  # nothing yet: the run starts from the beginning
