"""On-disk index: the stores, ``bridge-pl index build`` (resume after ``kill -9``; a stop signal's line; an ``--out``
folder holding other files refused, none of them touched), ``index info``, bad input (damaged manifests, a damaged
``index.faiss`` refused at open), training with a prebuilt ``ivf_pq`` index, and two fsdp2 processes sharing one
index file.

The 2-process fit runs this file as a script (Lightning re-launches it as rank 1), as tests/test_fsdp2.py does.
"""

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import TINY, bridge_pl_process, finish, fit_tiny, searching, tiny_cli

from bridge_pl.cli import main
from bridge_pl.data.packaged import wikipedia_corpus
from bridge_pl.data.qa import write_corpus
from bridge_pl.records import Passage
from bridge_pl.retrieval.built_index import INDEX_FILE, BuiltIndex
from bridge_pl.retrieval.index import DenseIndex, default_nlist, default_pq_m, topk_overlap
from bridge_pl.retrieval.store import (
    EmbeddingStore,
    PassageStore,
    StoreError,
    shard_path,
    write_embedding_shard,
    write_passage_store,
)
from bridge_pl.terminal import Progress
from callbacks import LossLandscape, WarmStart

BUILD = ["index", "build", "--corpus", "world", "--encoder", "tiny-bert", "--kind", "ivf_pq", "--nbits", "4",
         "--chunk-size", "200", "--quiet"]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != "manifest.json"}


def _copy(folder: Path, to: Path) -> Path:
    to.mkdir(parents=True)
    for path in folder.iterdir():
        (to / path.name).write_bytes(path.read_bytes())
    return to


def _error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("bridge-pl: error:")]


@pytest.fixture(scope="module")
def world_index(tmp_path_factory) -> Path:
    """An uninterrupted ivf_pq build of the world with tiny-bert (1,844 passages, 10 shards)."""
    out = tmp_path_factory.mktemp("built") / "world"
    main([*BUILD, "--out", str(out)])
    return out


def test_passage_store_reads_rows_by_offset(tmp_path):
    passages = [Passage("a", "Ünïcode", "text with\nnewline"), Passage("b", "", ""), Passage("c", "T", "x" * 5000)]
    assert write_passage_store(passages, tmp_path) == 3
    store = PassageStore(tmp_path, rows=3)
    assert len(store) == 3 and store[0] == passages[0] and store[-1] == passages[2]
    assert store[1:] == passages[1:] and list(store) == passages
    with pytest.raises(IndexError):
        store[3]  # noqa: B018


def test_embedding_store_gives_float16_rows_as_float32(tmp_path):
    emb = np.random.default_rng(0).normal(size=(10, 6)).astype(np.float32)
    write_embedding_shard(tmp_path, 0, emb[:4])
    write_embedding_shard(tmp_path, 1, emb[4:8])
    write_embedding_shard(tmp_path, 2, emb[8:])
    store = EmbeddingStore(tmp_path, rows=10, dim=6, chunk_rows=4)
    rows = np.array([9, 0, 4, 4])
    np.testing.assert_array_equal(store[rows], emb[rows].astype(np.float16).astype(np.float32))
    assert store[rows].dtype == np.float32 and store.shard(2).shape == (2, 6)


@pytest.mark.parametrize("damage, message", [
    ("passages.jsonl", "passages.jsonl: "), ("passages.offsets.npy", "passages.offsets.npy"),
    ("emb-00003.f16", "emb-00003.f16: ")])
def test_a_truncated_or_missing_store_file_is_named(world_index, tmp_path, damage, message):
    folder = tmp_path / "copy"
    folder.mkdir()
    for path in world_index.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    (folder / damage).write_bytes((folder / damage).read_bytes()[:-10])
    with pytest.raises(StoreError, match=message):
        BuiltIndex(folder)
    (folder / damage).unlink()
    with pytest.raises(StoreError, match=f"{damage}.* missing"):
        BuiltIndex(folder)


def test_index_build_resumes_after_kill_9_and_equals_an_uninterrupted_build(world_index, tmp_path):
    out = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # One passage per forward so the encode lasts long enough to be killed after two of its ten shards.
    cmd = [sys.executable, "-m", "bridge_pl.cli", *BUILD, "--out", str(out), "--batch-size", "1"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not Path(str(shard_path(out, 1)) + ".b2").exists() and proc.poll() is None:
        assert time.monotonic() < deadline, "the build wrote no shard in 120 s"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("emb-*.f16")}
    assert not (out / INDEX_FILE).exists() and 2 <= len(kept) < 10
    # A kill inside a file write leaves a temp file (atomic_write's name: <file>.<8 random characters>.tmp); one
    # between a shard and its digest, a shard without one.
    (out / "emb-00009.f16.u1_x7k3q.tmp").write_bytes(b"torn")
    last = max(kept)
    Path(str(out / last) + ".b2").unlink()
    main([*BUILD, "--out", str(out)])
    assert _files(out) == _files(world_index)
    kept.pop(last)
    assert all((out / name).stat().st_mtime_ns == mtime for name, mtime in kept.items())  # finished: skipped


def test_info_prints_kind_size_corpus_and_encoder(world_index, capsys):
    main(["index", "info", str(world_index), "--verify"])
    out = capsys.readouterr().out
    manifest = json.loads((world_index / "manifest.json").read_text())
    assert "kind:     ivf_pq  nlist=" in out and "m=4, nbits=4, opq=False" in out
    assert manifest["encoder"]["fingerprint"] in out and manifest["corpus_fingerprint"] in out
    assert "1,844 passages" in out and "(float16, 10/10 shards)" in out and "all digests match" in out


def test_packaged_wikipedia_text_round_trips_and_an_opq_index_opens_memory_mapped(tmp_path):
    corpus = tmp_path / "wiki.jsonl"
    write_corpus(corpus, wikipedia_corpus()[:300])
    out = tmp_path / "wiki"
    main(["index", "build", "--corpus", str(corpus), "--encoder", "tiny-bert", "--kind", "ivf_pq", "--opq",
          "--nbits", "4", "--nlist", "4", "--out", str(out), "--quiet"])
    built = BuiltIndex(out)
    assert list(built.passages) == wikipedia_corpus()[:300]
    maps = Path("/proc/self/maps")
    if maps.exists():  # Linux: the index file is mapped, not read into private memory
        assert str(out / INDEX_FILE) in maps.read_text()
    q = torch.from_numpy(built.embeddings[np.arange(0, 300, 30)])
    scores, rows = built.search(q, 5, rerank_factor=8)
    assert rows.shape == (10, 5) and bool((rows >= 0).all()) and bool((scores[:, :-1] >= scores[:, 1:]).all())
    torch.testing.assert_close(scores, (q.unsqueeze(1) * built.rows(rows)).sum(-1))  # exact float16-row scores


def test_default_ivf_pq_sizes():
    assert [default_pq_m(d) for d in (768, 384, 32, 7)] == [96, 48, 4, 1]
    assert [default_nlist(n) for n in (10_000, 1_000_000, 20)] == [256, 4000, 1]  # 4 sqrt(N), at most N // 39


def test_progress_without_a_terminal_prints_plain_lines_with_an_eta():
    stream = io.StringIO()
    bar = Progress(100, "encode passages", "psg", stream=stream, every_s=0.0)
    bar.skip(20)  # done by an earlier run: not in the rate
    bar.update(20)
    assert stream.getvalue().startswith("encode passages: 40/100 psg (40.0%), ")
    assert bar.line(elapsed=4.0) == "encode passages: 40/100 psg (40.0%), 5.0 psg/s, ETA 00:00:12"


def test_ivf_pq_with_exact_rescoring_finds_the_exact_top_10():
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(20, 64))
    x = centres[rng.integers(20, size=4000)] + 0.5 * rng.normal(size=(4000, 64))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    q = torch.from_numpy(x[:100] + 0.1 * rng.normal(size=(100, 64)).astype(np.float32))
    index = DenseIndex.build(x, kind="ivf_pq", m=16, nbits=8, nlist=32, nprobe=8)
    _, cand = index.search(q, 100)
    rescored = (q.unsqueeze(1) * torch.from_numpy(x)[cand]).sum(-1)
    rows = cand.gather(1, rescored.topk(10).indices)
    assert topk_overlap(rows, (q @ torch.from_numpy(x).T).topk(10).indices) >= 0.95


@pytest.mark.parametrize("args, message", [
    (["--m", "5"], "index option 'm'=5 must divide the embedding width D=32"),
    (["--nlist", "5000"], "index option 'nlist'=5000 is larger than the corpus (1844 passages)"),
    (["--nprobe", "0"], "index build option '--nprobe' must be >= 1"),
])
def test_bad_build_options_end_in_one_line(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        main([*BUILD, "--out", str(tmp_path / "x"), *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and message in err and "Traceback" not in err


@pytest.mark.parametrize("override, message", [
    ("--model.retriever.init_args.passage_prefix=passage: ", "was built with passage encoder 'tiny-bert'"),
    ("--model.retriever.init_args.corpus=world:1", "was built for corpus 'world'"),
    ("--model.retriever.init_args.index_path=/nonexistent/index", "/nonexistent/index: not a built index"),
])
def test_a_config_pointing_at_the_wrong_index_fails_in_one_line(world_index, tmp_path, capsys, override, message):
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", TINY,
              f"--trainer.default_root_dir={tmp_path}", f"--model.retriever.init_args.index_path={world_index}",
              override])
    errors = [line for line in capsys.readouterr().err.splitlines() if "bridge-pl: error:" in line]
    assert exit_.value.code == 1 and len(errors) == 1 and message in errors[0]


def test_the_tiny_config_trains_with_a_prebuilt_ivf_pq_index(world_index, tmp_path):
    cli = fit_tiny(tmp_path, f"--model.retriever.init_args.index_path={world_index}",
                   "--model.retriever.init_args.corpus=null")
    retriever = cli.model.retriever
    assert cli.trainer.global_step == 2 and retriever.version == 2
    assert isinstance(retriever.passages, PassageStore) and retriever.index.kind == "ivf_pq"
    queries = ["who studied under a physician"]
    scores, rows = retriever.search(queries, 4)
    torch.testing.assert_close(retriever.score(queries, rows).detach(), scores)


@pytest.mark.slow
def test_the_demo_trains_with_a_prebuilt_ivf_pq_index_of_its_own_encoder(tmp_path):
    """``configs/demo.yaml`` (SmolLM2 and MiniLM, unchanged) for one iteration over an ivf_pq index built with the
    demo's MiniLM, fewer prompts and samples per iteration, shorter turns (a steered search is a few tokens) and two
    validation questions; its warm start and landscape probe are left out (their cost is not the index's)."""
    index = tmp_path / "world-minilm"
    main(["index", "build", "--corpus", "world", "--encoder", "minilm-l6", "--kind", "ivf_pq", "--nbits", "4",
          "--quiet", "--out", str(index)])
    demo = str(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml")
    cli = tiny_cli(tmp_path / "fit", f"--model.retriever.init_args.index_path={index}",
                   "--model.retriever.init_args.corpus=null", "--trainer.max_steps=1", "--trainer.val_check_interval=1",
                   "--data.batch_size=2", "--data.n_samples=2", "--data.max_sampling_rounds=1",
                   "--data.max_new_tokens_per_turn=16", "--data.max_eval_examples=2", "--data.eval_batch_size=2",
                   "--data.engine=hf", configs=(demo,))
    cli.trainer.callbacks[:] = [c for c in cli.trainer.callbacks if not isinstance(c, WarmStart | LossLandscape)]
    with searching(cli.model.policy):  # the base policy, not warm-started, steered to search
        cli.trainer.fit(cli.model, cli.datamodule)
    retriever = cli.model.retriever
    assert cli.trainer.global_step == 1 and retriever.version == 1
    assert isinstance(retriever.passages, PassageStore) and retriever.index.kind == "ivf_pq"
    assert "val/world_dev/em" in cli.trainer.callback_metrics


@pytest.mark.skipif(os.name == "nt", reason="gloo subprocess job")
def test_two_fsdp2_processes_open_one_shared_index_file(world_index, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent), str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, __file__, str(tmp_path), str(world_index)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["mapped"] and r["steps"] == 1 for r in ranks)
    assert ranks[0]["rows"] == ranks[1]["rows"]


def _two_process_fit(out: Path, index: Path) -> None:
    """Rank 0 and its re-launched rank 1: one fsdp2 iteration over the prebuilt index; each records whether the
    index file is mapped into it and what it retrieves for a fixed query."""
    torch.set_num_threads(1)
    cli = fit_tiny(out, "--trainer.devices=2", "--trainer.strategy=fsdp2", "--trainer.max_steps=1",
                   "--trainer.val_check_interval=null", "--trainer.limit_val_batches=0",
                   f"--model.retriever.init_args.index_path={index}", "--model.retriever.init_args.corpus=null")
    _, rows = cli.model.retriever.search(["a physician born in 1868"], 4)
    record = {"mapped": str(index / INDEX_FILE) in Path("/proc/self/maps").read_text(),
              "steps": cli.trainer.global_step, "rows": rows.tolist()}
    (out / f"rank{cli.trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    _two_process_fit(Path(sys.argv[1]), Path(sys.argv[2]))


def _build_until_two_shards(out: Path) -> subprocess.Popen:
    """``bridge-pl index build`` started as a user starts it, one passage per forward, once two shards are done."""
    run = bridge_pl_process(*BUILD, "--out", str(out), "--batch-size", "1")
    deadline = time.monotonic() + 120
    while not Path(str(shard_path(out, 1)) + ".b2").exists():
        assert run.poll() is None, finish(run)[1][-3000:]
        assert time.monotonic() < deadline, "the build wrote no shard in 120 s"
        time.sleep(0.005)
    return run


@pytest.mark.skipif(os.name == "nt", reason="POSIX signals")
@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_stop_signal_during_index_build_says_what_was_kept_and_how_to_resume(world_index, tmp_path, name):
    out = tmp_path / "stopped"
    run = _build_until_two_shards(out)
    run.send_signal(signal.Signals[name])
    status, output = finish(run, timeout=120)
    assert status == 128 + signal.Signals[name], output[-3000:]
    line = output.strip().splitlines()[-1]
    kept = len(list(out.glob("emb-*.f16.b2")))
    assert line.startswith(f"bridge-pl: index build stopped by {name}; {out} keeps the passage text store, "
                           f"{kept} of 10 embedding shards (")
    assert kept >= 2 and not list(out.glob("*.tmp"))  # the file being written when it stopped is gone
    rerun = line.split("; resume with: ")[1]
    assert rerun == f"bridge-pl {' '.join(BUILD)} --out {out} --batch-size 1"
    finished = {p.name: p.stat().st_mtime_ns for p in out.glob("emb-*.f16") if Path(f"{p}.b2").exists()}
    main(rerun.split()[1:])
    assert {name: (out / name).stat().st_mtime_ns for name in finished} == finished  # kept, not redone
    assert BuiltIndex(out).index.ntotal == 1844


def test_build_refuses_an_out_folder_holding_other_files_and_touches_none(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    theirs = {"notes.txt": b"keep me", "draft.tmp": b"a temp file of another program", "passages.jsonl": b"[]\n"}
    for name, data in theirs.items():
        (out / name).write_bytes(data)
    with pytest.raises(SystemExit) as exit_:
        main([*BUILD, "--out", str(out)])
    (error,) = _error_lines(capsys)
    assert exit_.value.code == 1
    assert f"--out {out} holds files that are not part of a bridge-pl index build (draft.tmp, notes.txt, " \
           "passages.jsonl) and no manifest.json; give a new or empty folder" in error
    assert {p.name: p.read_bytes() for p in out.iterdir()} == theirs


def test_build_into_a_finished_build_with_a_foreign_file_refuses_and_keeps_it(world_index, tmp_path, capsys):
    out = _copy(world_index, tmp_path / "copy")
    (out / "results.tmp").write_text("someone's")
    with pytest.raises(SystemExit):
        main([*BUILD, "--out", str(out)])
    (error,) = _error_lines(capsys)
    assert "(results.tmp); give a new or empty folder" in error
    assert (out / "results.tmp").read_text() == "someone's"


def test_build_refuses_another_corpus_before_touching_the_folder(world_index, tmp_path, capsys):
    """A folder that holds a build of another corpus, with a temp file of that build's: refused, the temp file kept."""
    out = _copy(world_index, tmp_path / "copy")
    torn = out / "emb-00003.f16.k2x9_q0a.tmp"
    torn.write_bytes(b"torn")
    corpus = tmp_path / "other.jsonl"
    write_corpus(corpus, wikipedia_corpus()[:100])
    args = [*BUILD, "--out", str(out)]
    args[args.index("world")] = str(corpus)
    with pytest.raises(SystemExit):
        main(args)
    (error,) = _error_lines(capsys)
    assert f"{out}: holds a build with another corpus" in error and torn.read_bytes() == b"torn"


@pytest.mark.parametrize("damage, problem", [
    (lambda m: [m], "manifest.json holds a JSON list, not an object"),
    (lambda m: {k: v for k, v in m.items() if k != "passages"}, "manifest.json lacks 'passages'"),
    (lambda m: {**m, "chunk_rows": 0}, "manifest.json holds 'chunk_rows' = 0, expected a whole number >= 1"),
    (lambda m: {**m, "encoder": {k: v for k, v in m["encoder"].items() if k != "fingerprint"}},
     "manifest.json lacks encoder 'fingerprint'"),
    (lambda m: {**m, "index": {**m["index"], "kind": "lsh"}}, "manifest.json holds index kind 'lsh'"),
    (lambda m: {**m, "index": ["ivf_pq"]}, "manifest.json holds 'index' = ['ivf_pq'], expected an object"),
], ids=["a-list", "no-passages", "chunk-rows-0", "no-encoder-fingerprint", "unknown-kind", "index-a-list"])
def test_a_damaged_manifest_is_named_in_one_line(world_index, tmp_path, capsys, damage, problem):
    folder = _copy(world_index, tmp_path / "copy")
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps(damage(manifest)))
    want = f"damaged index folder {folder}: {problem}"
    with pytest.raises(StoreError, match="rebuild with `bridge-pl index build`") as error:
        BuiltIndex(folder)
    assert str(error.value).startswith(want)
    with pytest.raises(SystemExit) as exit_:
        main(["index", "info", str(folder)])
    (line,) = _error_lines(capsys)
    assert exit_.value.code == 1 and want in line


def _zero(path: Path, at: int, size: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(bytes(size))


def test_a_damaged_index_file_is_refused_when_opened_and_a_rerun_rebuilds_it(world_index, tmp_path, capsys):
    folder = _copy(world_index, tmp_path / "copy")
    index = folder / INDEX_FILE
    _zero(index, index.stat().st_size // 2 - 4096, 8192)  # 8 KiB zeroed: same size, FAISS reads it
    main(["index", "info", str(folder), "--verify"])
    assert "damaged or missing: index.faiss" in capsys.readouterr().out
    with pytest.raises(StoreError) as error:
        BuiltIndex(folder)
    assert str(error.value) == (
        f"{index} is damaged (its bytes do not match index.faiss.b2); rebuild it by rerunning its `bridge-pl index "
        f"build` command (the embeddings are kept), and see `bridge-pl index info {folder} --verify` for the other "
        "files")
    with pytest.raises(SystemExit) as exit_:  # what a training run does with it
        main(["fit", "--config", TINY, f"--trainer.default_root_dir={tmp_path / 'fit'}",
              f"--model.retriever.init_args.index_path={folder}", "--model.retriever.init_args.corpus=null"])
    (line,) = _error_lines(capsys)
    assert exit_.value.code == 1 and f"{index} is damaged" in line
    shards = {p.name: p.stat().st_mtime_ns for p in folder.glob("emb-*.f16")}
    main([*BUILD, "--out", str(folder)])
    assert _files(folder) == _files(world_index)
    assert {p.name: p.stat().st_mtime_ns for p in folder.glob("emb-*.f16")} == shards  # only the index rebuilt
    (folder / "index.faiss.b2").unlink()
    with pytest.raises(StoreError, match="index.faiss has no digest"):
        BuiltIndex(folder)
