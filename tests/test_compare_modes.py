"""experiments/compare_modes.py end to end on the tiny config (one warm start per seed, table, plot, resume) and its
statistics against hand-computed numbers."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
from helpers import TINY, load_script

from bridge_pl.data.qa import write_qa
from bridge_pl.data.sources import world

TEST_QUESTIONS = 8  # of the world's 150 test questions: each run tests them whole, in every step of a comparison


@pytest.fixture(scope="module")
def world_test(tmp_path_factory) -> str:
    """``--data.test=`` for the first ``TEST_QUESTIONS`` of the world's test split, as a QA file (their metadata,
    the hop queries and gold passages the hop recall reads, kept): a run's test pass reads the same kind of
    questions in fewer batches."""
    path = write_qa(tmp_path_factory.mktemp("world_test") / "test.jsonl", world(0).test[:TEST_QUESTIONS])
    return f"--data.test={{world_test: {path}}}"


def test_compare_modes_shares_the_warm_start_and_writes_table_and_plot(tmp_path, capsys, world_test):
    argv = ["--config", TINY, "--modes", "frozen", "bridge", "--seeds", "0", "--max-steps", "1",
            "--out", str(tmp_path / "out"), "--runs", str(tmp_path / "runs"),
            world_test, "--trainer.val_check_interval=1",
            "--trainer.callbacks+=callbacks.WarmStart", "--trainer.callbacks.steps=2",
            "--trainer.callbacks.batch_size=2", "--trainer.callbacks.evaluate=false"]
    compare_modes = load_script("experiments", "compare_modes")
    compare_modes.main(argv)
    table = (tmp_path / "out/compare_modes.md").read_text()
    assert "| frozen |" in table and "| bridge |" in table and "--max-steps 1" in table
    assert (tmp_path / "out/compare_modes_dev_em.png").stat().st_size > 0
    records = tmp_path / "out/records"
    warm = json.loads((records / "warm_seed0.json").read_text())
    assert (Path(warm["adapter"]) / "adapter_config.json").is_file()
    assert warm["setup"]["max_steps"] == 1 and "--trainer.val_check_interval=1" in warm["setup"]["overrides"]
    for variant in ("frozen", "bridge"):
        result = json.loads((records / f"{variant}_seed0.json").read_text())
        assert result["commit"] == warm["commit"] and result["commit"] in table  # the commit each step ran at
        assert result["dev_curve"][0] == [0, warm["dev_em"]] and [s for s, _ in result["dev_curve"]] == [0, 1]
        assert 0.0 <= result["EM"] <= 1.0 and result["peak_rss_mb"] > 0
        assert 0.0 <= result["hop recall@k"] <= 1.0
        outcomes = compare_modes.question_outcomes(result)
        assert set(outcomes.values()) <= {0.0, 1.0}  # each test question's EM, for the claims
        assert len(outcomes) == TEST_QUESTIONS
        assert abs(sum(outcomes.values()) / len(outcomes) - result["EM"]) < 1e-6
        assert 0.0 <= result["no-search share"] <= 1.0
    assert 0.0 <= warm["EM"] <= 1.0 and 0.0 <= warm["hop recall@k"] <= 1.0  # the warm start's own test row
    assert compare_modes.question_outcomes(warm).keys() == outcomes.keys()  # the budget check is paired too
    assert "| warm start | 1 |" in table and "| bridge > frozen |" in table and "not tested" in table
    assert "| frozen > its warm start |" in table and "test no-search share" in table
    capsys.readouterr()
    compare_modes.main(argv)  # every step has a record: nothing is rerun, the table is rewritten
    assert "compare_modes: " not in capsys.readouterr().out

    # a fresh clone: the records, no run folders; a missing variant makes the warm start again, which must
    # reproduce the recorded dev EM, and the variants with records are not rerun
    shutil.rmtree(tmp_path / "runs")
    (records / "bridge_seed0.json").unlink()
    compare_modes.main(argv)
    assert capsys.readouterr().out.count("compare_modes: ") == 2  # warm, then bridge; not frozen
    assert json.loads((records / "bridge_seed0.json").read_text())["dev_curve"][0] == [0, warm["dev_em"]]

    with pytest.raises(ValueError, match="warm_seed0.json was made with setup"):  # another budget: refused
        compare_modes.main([*argv, "--max-steps", "2", "--table-only"])


def test_a_warm_start_that_does_not_reproduce_its_record_stops_the_comparison(tmp_path, world_test):
    compare_modes = load_script("experiments", "compare_modes")
    argv = ["--config", TINY, "--modes", "frozen", "--seeds", "0", "--max-steps", "1", "--runs", str(tmp_path / "runs"),
            "--out", str(tmp_path / "out"), world_test, "--trainer.callbacks+=callbacks.WarmStart",
            "--trainer.callbacks.steps=1", "--trainer.callbacks.batch_size=2", "--trainer.callbacks.evaluate=false"]
    records = tmp_path / "out/records"
    args, overrides = compare_modes.parse_args(argv)
    records.mkdir(parents=True)
    # a record from another machine whose warm start reached a dev EM this one cannot (above 1)
    (records / "warm_seed0.json").write_text(json.dumps(
        {"seed": 0, "adapter": "elsewhere/adapter", "dev_em": 2.0, "setup": compare_modes.setup(args, overrides)}))
    with pytest.raises(RuntimeError, match=r"seed 0 made again reached dev EM .*warm_seed0.json records 2.0"):
        compare_modes.main(argv)
    assert not (records / "frozen_seed0.json").exists()


class CrashAtIteration(L.Callback):
    """Raises when iteration ``step + 1`` starts, as an interrupted session would stop the run."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError(f"interrupted before iteration {self.step + 1}")


def test_an_interrupted_run_resumes_from_its_checkpoint_to_the_uninterrupted_record(tmp_path, monkeypatch, world_test):
    compare_modes = load_script("experiments", "compare_modes")
    records = tmp_path / "records"

    def worker(runs: str) -> list[str]:  # one frozen step of a config without a warm start, validated every iteration
        return ["--config", TINY, "--seeds", "0", "--max-steps", "2", "--records", str(records), "--runs",
                str(tmp_path / runs), world_test, "--trainer.val_check_interval=1",
                "--worker", "frozen", "0"]

    records.mkdir()
    (records / "warm_seed0.json").write_text(json.dumps({"seed": 0, "adapter": None, "dev_em": 0.0}))
    compare_modes.main(worker("uninterrupted"))
    uninterrupted = json.loads((tmp_path / "uninterrupted/frozen_seed0/result.json").read_text())

    build_cli = compare_modes.build_cli
    with monkeypatch.context() as patch:
        def crashing_cli(*a):
            cli = build_cli(*a)
            cli.trainer.callbacks.append(CrashAtIteration(1))
            return cli
        patch.setattr(compare_modes, "build_cli", crashing_cli)
        with pytest.raises(RuntimeError, match="interrupted before iteration 2"):
            compare_modes.main(worker("runs"))
    checkpoints = tmp_path / "runs/frozen_seed0/checkpoints"
    assert (checkpoints / "last.ckpt").is_file()
    compare_modes.main(worker("runs"))
    resumed = json.loads((tmp_path / "runs/frozen_seed0/result.json").read_text())

    assert [(p["from_step"], p["to_step"]) for p in resumed["segments"]] == [(0, 1), (1, 2)]
    assert resumed["fit_s"] == pytest.approx(sum(p["seconds"] for p in resumed["segments"]))
    assert resumed["peak_rss_mb"] >= max(p["peak_rss_mb"] for p in resumed["segments"])
    assert "segments" not in uninterrupted
    assert resumed["dev_curve"] == uninterrupted["dev_curve"] and [s for s, _ in resumed["dev_curve"]] == [0, 1, 2]
    for key in ("EM", "F1", "hop recall@k", "test_outcomes"):
        assert resumed[key] == uninterrupted[key], key

    # a checkpoint left by a run of another budget is refused, naming it, and kept
    with pytest.raises(ValueError, match=r"frozen_seed0/checkpoints/last.ckpt belongs to a run that began with"):
        compare_modes.main([*worker("runs"), "--max-steps", "3"])
    assert (checkpoints / "last.ckpt").is_file()


def test_a_worker_imports_the_code_of_the_checkout_that_runs_it(tmp_path, monkeypatch):
    """Run from a second worktree, a worker must train with that worktree's ``bridge_pl`` and ``callbacks`` (the
    commit its record names), not the ones the environment has installed."""
    compare_modes = load_script("experiments", "compare_modes")
    checkout = tmp_path / "worktree"
    for package in ("bridge_pl", "callbacks"):
        (checkout / package).mkdir(parents=True)
        (checkout / package / "__init__.py").write_text("")
    monkeypatch.setattr(compare_modes, "ROOT", checkout)
    args, _ = compare_modes.parse_args(["--runs", str(tmp_path / "runs")])

    run = subprocess.run

    def worker(command, check, env):  # the worker's interpreter and environment, asked where its imports come from
        code = "import bridge_pl, callbacks, json; print(json.dumps({'EM': [bridge_pl.__file__, callbacks.__file__]}))"
        # (from another folder: ``python -c`` would put the current one first, a script's run puts its own)
        out = run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, check=True)
        result = compare_modes.run_dir(args, "frozen", 0) / "result.json"
        result.parent.mkdir(parents=True)
        result.write_text(out.stdout)

    monkeypatch.setattr(compare_modes.subprocess, "run", worker)
    imported = compare_modes.run_step(args, [], "frozen", 0)["EM"]
    assert imported == [str(checkout / "bridge_pl/__init__.py"), str(checkout / "callbacks/__init__.py")]


def frozen_record(setup: dict) -> dict:
    """A hand-made record of ``frozen`` seed 0 (test EM 0.25, dev EM 0.2 -> 0.3) with the given setup."""
    return {"variant": "frozen", "seed": 0, "fit_s": 10.0, "dev_curve": [[0, 0.2], [4, 0.3]], "peak_rss_mb": 900.0,
            "EM": 0.25, "F1": 0.3, "retrieval-miss share": 0.5, "recall@k": 0.4, "hop recall@k": 0.6,
            "commit": "abc1234", "setup": setup}


def test_table_only_reports_the_finished_runs_and_names_the_missing(tmp_path):
    compare_modes = load_script("experiments", "compare_modes")
    records = tmp_path / "records"
    argv = ["--modes", "frozen", "bridge", "--seeds", "0", "1", "--table-only", "--records", str(records),
            "--out", str(tmp_path / "out")]
    args, overrides = compare_modes.parse_args(argv)
    records.mkdir()
    (records / "frozen_seed0.json").write_text(json.dumps(frozen_record(compare_modes.setup(args, overrides))))
    compare_modes.main(argv)
    table = (tmp_path / "out/compare_modes.md").read_text()
    assert "not yet run: frozen seed 1, bridge seed 0, bridge seed 1" in table
    assert "| frozen | 1 | 0.250 | 0.300 |" in table and "0.200 → 0.300" in table
    assert "| frozen | 0.250; 0.200 → 0.300 | not run |" in table  # per seed
    assert "made at: abc1234 (1 step); on: machine not recorded (1 step).\n" in table  # and no run was resumed
    assert "--table-only" not in table  # the command shown is the one that makes the runs


def test_the_committed_records_rebuild_their_table_from_their_own_config(tmp_path):
    """The study's records are keyed by a digest of its own config copy (``experiments/mode_comparison/demo.yaml``),
    so editing ``configs/demo.yaml`` does not refuse them; the table rebuilt from them matches the committed one."""
    compare_modes = load_script("experiments", "compare_modes")
    study = Path(__file__).resolve().parents[1] / "experiments/mode_comparison"
    compare_modes.main(["--config", str(study / "demo.yaml"), "--max-steps", "24", "--trainer.val_check_interval=8",
                        "--table-only", "--records", str(study / "records"), "--out", str(tmp_path)])
    rebuilt = (tmp_path / "compare_modes.md").read_text()
    assert "| frozen | 3 |" in rebuilt and "| bridge > frozen |" in rebuilt
    assert rebuilt.split("\n| mode |", 1)[1] == (study / "compare_modes.md").read_text().split("\n| mode |", 1)[1]


def test_a_warm_start_that_does_not_reproduce_names_the_machines(tmp_path, monkeypatch):
    """The usual cause is another CPU: without AVX512-BF16/AMX the policy's default ``auto`` dtype is float32, not
    bfloat16."""
    compare_modes = load_script("experiments", "compare_modes")
    args, _ = compare_modes.parse_args(["--records", str(tmp_path / "records"), "--runs", str(tmp_path / "runs")])
    elsewhere = {"cpu": "Intel Xeon", "auto_dtype": "bfloat16", "torch": "2.13.0+cpu", "transformers": "5.24.0"}
    record = compare_modes.record_path(args, compare_modes.WARM, 0)
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"seed": 0, "adapter": "somewhere", "dev_em": 0.2, "machine": elsewhere}))
    monkeypatch.setattr(compare_modes, "run_step", lambda *_: {"dev_em": 0.1})
    with pytest.raises(RuntimeError, match="reached dev EM 0.1") as error:
        compare_modes.ensure_warm_adapter(args, [], 0)
    assert f"recorded on {elsewhere}; this is {compare_modes.machine()}" in str(error.value)
    assert str(record) in str(error.value)


def test_the_table_names_the_runs_that_were_resumed():
    compare_modes = load_script("experiments", "compare_modes")
    resumed = {**frozen_record({}), "seed": 1, "segments": [{"from_step": 0}, {"from_step": 5}]}
    assert compare_modes.resumed_runs({"frozen": [frozen_record({}), resumed]}).endswith(": frozen seed 1 (2 parts).")
    assert compare_modes.resumed_runs({"frozen": [frozen_record({})]}) == ""


def test_a_record_made_before_the_config_was_edited_is_refused(tmp_path):
    compare_modes = load_script("experiments", "compare_modes")
    config = tmp_path / "config.yaml"
    config.write_text(Path(TINY).read_text())
    records = tmp_path / "records"
    argv = ["--config", str(config), "--modes", "frozen", "--seeds", "0", "--table-only", "--records", str(records),
            "--out", str(tmp_path / "out")]
    args, overrides = compare_modes.parse_args(argv)
    records.mkdir()
    (records / "frozen_seed0.json").write_text(json.dumps(frozen_record(compare_modes.setup(args, overrides))))
    config.write_text("# a comment and another layout do not change the content\n" + Path(TINY).read_text() + "\n")
    compare_modes.main(argv)
    # nor what every run sets or drops: the seed, the run folder, the config's checkpoints and landscape probes
    runs_replace = Path(TINY).read_text().replace("seed_everything: 0", "seed_everything: 5").replace(
        "  accelerator: cpu\n", "  accelerator: cpu\n  default_root_dir: elsewhere\n  callbacks:\n"
        "    - class_path: callbacks.ValidatedCheckpoint\n    - class_path: callbacks.LossLandscape\n")
    config.write_text(runs_replace)
    compare_modes.main(argv)
    for edited in (Path(TINY).read_text().replace("n_samples: 2", "n_samples: 3"),
                   runs_replace.replace("callbacks.LossLandscape", "callbacks.MissReport")):
        config.write_text(edited)
        with pytest.raises(ValueError, match="frozen_seed0.json was made with setup .*config_sha256"):
            compare_modes.main(argv)


def test_a_value_the_command_replaces_may_change_under_a_record(tmp_path):
    """``--max-steps`` and ``--trainer.x=`` overrides set those keys for every run, so the demo's own iteration count
    and validation interval may change without refusing the comparison's records; a key no override sets still
    counts."""
    compare_modes = load_script("experiments", "compare_modes")
    config = tmp_path / "config.yaml"
    config.write_text(Path(TINY).read_text())
    records = tmp_path / "records"
    argv = ["--config", str(config), "--modes", "frozen", "--seeds", "0", "--max-steps", "2",
            "--trainer.val_check_interval=1", "--table-only", "--records", str(records), "--out", str(tmp_path / "out")]
    args, overrides = compare_modes.parse_args(argv)
    records.mkdir()
    (records / "frozen_seed0.json").write_text(json.dumps(frozen_record(compare_modes.setup(args, overrides))))
    replaced = Path(TINY).read_text().replace("max_steps: 2", "max_steps: 8").replace("val_check_interval: 2",
                                                                                     "val_check_interval: 4")
    config.write_text(replaced)
    compare_modes.main(argv)
    config.write_text(replaced.replace("limit_val_batches: 1", "limit_val_batches: 2"))
    with pytest.raises(ValueError, match="frozen_seed0.json was made with setup"):
        compare_modes.main(argv)


def test_paired_difference_and_verdict_by_hand():
    compare_modes = load_script("experiments", "compare_modes")
    # differences 0.1, 0.3, 0.2 (seed 3 only in a: unpaired): mean 0.2, sample std 0.1, SE 0.1 / √3
    mean, se, n = compare_modes.paired_difference({0: 0.5, 1: 0.6, 2: 0.4, 3: 0.9}, {0: 0.4, 1: 0.3, 2: 0.2})
    assert (n, round(mean, 12), round(se, 12)) == (3, 0.2, round(0.1 / math.sqrt(3), 12))
    # no question error: df = seeds − 1 = 2, 0.2 ± 4.303 × 0.0577 = 0.2 ± 0.248 contains 0
    low, high = compare_modes.claim_interval(mean, se, n, 0.0, 150)
    assert (round(low, 3), round(high, 3)) == (-0.048, 0.448)
    assert compare_modes.verdict((low, high), n) == "within noise"
    # +0.11 in 3 seeds, SE 0.01 over seeds, 0.03 over 150 questions: Welch–Satterthwaite
    # df = (1e-4 + 9e-4)² / (1e-8 / 2 + 8.1e-7 / 149) = 95.8 → t of df 60 = 2.000; 0.11 ± 2 × √1e-3 = 0.11 ± 0.063.
    # With the seeds' df (t = 4.303) the interval would be ± 0.136 and contain 0.
    low, high = compare_modes.claim_interval(0.11, 0.01, 3, 0.03, 150)
    assert (round(low, 4), round(high, 4)) == (0.0468, 0.1732)
    assert compare_modes.verdict((low, high), 3) == "reproduced"
    assert compare_modes.verdict(compare_modes.claim_interval(-0.11, 0.01, 3, 0.03, 150), 3) == "refuted"
    assert compare_modes.verdict(compare_modes.claim_interval(0.3, math.nan, 1, 0.04, 150), 1).startswith("not tested")
    assert compare_modes.verdict((0.02, 0.03), 2).startswith("not tested")  # the minimum is 3 seeds
    assert compare_modes.verdict(compare_modes.claim_interval(0.1, 0.01, 3, math.nan, 0), 3) == (
        "not tested (no per-question outcomes)")
    assert compare_modes.claim_interval(0.0, 0.0, 3, 0.0, 150) == (0.0, 0.0)  # identical modes
    assert compare_modes.paired_difference({0: 0.1}, {1: 0.2})[2] == 0
    assert [compare_modes.t95(df) for df in (1, 2, 2.7, 11, 95.8, 500)] == [12.706, 4.303, 4.303, 2.228, 2.0, 1.96]


def test_equal_seed_differences_still_carry_the_question_sampling_error():
    """Three seeds that differ by the same 1 of 4 questions: SE over seeds 0, but the four questions are a sample."""
    compare_modes = load_script("experiments", "compare_modes")
    a = {s: {"q1": 1.0, "q2": 1.0, "q3": 0.0, "q4": 0.0} for s in range(3)}
    b = {s: {"q1": 1.0, "q2": 0.0, "q3": 0.0, "q4": 0.0, "extra": 1.0} for s in range(3)}  # "extra": unpaired
    mean, se, n = compare_modes.paired_difference({s: 0.5 for s in a}, {s: 0.25 for s in b})
    assert (mean, se, n) == (0.25, 0.0, 3)
    # per-question differences 0, 1, 0, 0: sample std 0.5, over √4; df = questions − 1 = 3, t = 3.182
    assert compare_modes.question_se(a, b) == (0.25, 4)
    low, high = compare_modes.claim_interval(mean, se, n, 0.25, 4)
    assert (round(low, 4), round(high, 4)) == (-0.5455, 1.0455)
    assert compare_modes.verdict((low, high), n) == "within noise"
    # seeds disagree per question: each question's difference is averaged over the seeds first
    a[1]["q3"] = 1.0  # seed 1 also gains q3: per question 0, 1, 1/3, 0
    expected = math.sqrt(sum((d - 1 / 3) ** 2 for d in (0, 1, 1 / 3, 0)) / 3) / 2
    assert math.isclose(compare_modes.question_se(a, b)[0], expected)
    assert math.isnan(compare_modes.question_se({0: {}}, b)[0])  # a run without per-question outcomes


def test_predictions_summary_counts_answers_without_a_search(tmp_path):
    compare_modes = load_script("experiments", "compare_modes")
    search = {"query": "Kigix Society", "titles": ["Kigix Society"], "ids": ["w00530"]}
    rows = [{"id": "q1", "em": 1.0, "searches": [search]}, {"id": "q2", "em": 0.0, "searches": []},
            {"id": "q3", "em": 1.0, "searches": []}, {"id": "q4", "em": 0.0, "searches": [search, search]}]
    path = tmp_path / "test_world_test_step8.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    summary = compare_modes.predictions_summary(path)
    assert summary == {"no-search share": 0.5, "test_outcomes": {"q1": 1.0, "q2": 0.0, "q3": 1.0, "q4": 0.0}}
