"""Every config in configs/ runs through ``bridge-pl fit`` as its header says, on the CPU, with tiny stand-ins.

The models become ``tiny-llama`` and ``tiny-bert``, a run is one iteration and one small validation; everything
else is the recipe's own (callbacks, precision, solver, the packaged data of the CPU configs). The GPU recipes open
a prebuilt index through ``index_path`` with ``corpus: null``, exactly as written: the stand-in index is built by
``bridge-pl index build`` from the files ``bridge-pl world`` writes (their FlashRAG jsonl is the QA data), and the
medical recipe's from small MedRAG chunk files, evaluated on a small MIRAGE ``benchmark.json``.
"""

from pathlib import Path

import pytest
from test_configs import CONFIGS, ROOT
from test_tensorboard import event_tags

from bridge_pl.cli import main

pytestmark = pytest.mark.slow  # seven real fits

DATA = Path(__file__).parent / "data"
MIRAGE = f"mirage:{DATA / 'mirage' / 'benchmark.json'}"
MODELS = ["--model.policy.init_args.model=tiny-llama", "--model.retriever.init_args.encoder=tiny-bert"]
ONE_PROCESS = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.strategy=auto"]
SMALL = [
    "--trainer.max_steps=1", "--trainer.val_check_interval=1", "--data.engine=hf",
    "--data.max_eval_examples=2", "--data.eval_batch_size=2", "--data.batch_size=1", "--data.n_samples=2",
    "--data.max_turns=1", "--data.max_new_tokens_per_turn=8", "--data.max_response_tokens=64",
    "--model.retrieval.credit_queries=2",
]


def _build_index(corpus: str, out: Path) -> Path:
    """``bridge-pl index build`` with the stand-in encoder and the recipes' E5 passage prefix."""
    main(["index", "build", "--corpus", corpus, "--encoder", "tiny-bert", "--passage-prefix", "passage: ",
          "--kind", "flat", "--quiet", "--out", str(out)])
    return out


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> dict[str, Path]:
    """FlashRAG jsonl files of the world, and the two prebuilt indexes the GPU recipes open."""
    root = tmp_path_factory.mktemp("stand_ins")
    main(["world", "--out", str(root / "world")])
    return {
        "world": root / "world",
        "wiki_index": _build_index(str(root / "world" / "corpus.jsonl"), root / "world_index"),
        "medrag_index": _build_index(f"medrag:{DATA / 'medrag'}", root / "medrag_index"),
    }


def _recipe_data(name: str, stand_ins: dict[str, Path]) -> list[str]:
    """The options that point a recipe at the stand-in files (none for the CPU configs: their data is packaged)."""
    if not name.startswith("qwen2.5/"):
        return []
    if name == "qwen2.5/medical_3b.yaml":
        return [f"--model.retriever.init_args.index_path={stand_ins['medrag_index']}",
                f"--data.train={MIRAGE}#medqa", f'--data.val={{"mirage": "{MIRAGE}"}}',
                f'--data.test={{"mirage": "{MIRAGE}"}}']
    world = stand_ins["world"]
    return [f"--model.retriever.init_args.index_path={stand_ins['wiki_index']}",
            f"--data.train={world / 'train.jsonl'}", f'--data.val={{"nq": "{world / "dev.jsonl"}"}}']


# smoke.yaml already runs tiny models without a logger or checkpoints; it is run as the README gives it below
RECIPES = [configs for configs in CONFIGS if configs[-1].name != "smoke.yaml"]


def test_the_smoke_run_runs_as_the_readme_gives_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the config writes to runs/smoke under the working directory
    main(["fit", "--config", str(ROOT / "smoke.yaml")])
    assert (tmp_path / "runs" / "smoke" / "config.yaml").is_file()


@pytest.mark.parametrize("configs", RECIPES, ids=lambda c: str(c[-1].relative_to(ROOT)))
def test_the_recipe_trains_and_validates_through_bridge_pl_fit(configs, stand_ins, tmp_path):
    name = str(configs[-1].relative_to(ROOT))
    recipe = [arg for config in configs for arg in ("--config", str(config))]
    args = [*recipe, *MODELS, *ONE_PROCESS, *SMALL, *_recipe_data(name, stand_ins),
            f"--trainer.default_root_dir={tmp_path}"]
    main(["fit", *args])

    (log_dir,) = {p.parent for p in tmp_path.rglob("events.out.tfevents.*")}
    events, tags = event_tags(log_dir)
    assert [tag for tag in tags["scalars"] if tag.startswith("val/") and tag.endswith(("/em", "/accuracy"))], tags
    assert events.Scalars("train/reward")[-1].step == 1
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert last.is_file()
    if name.startswith("qwen2.5/"):  # the header's second command: evaluate the trained checkpoint
        stage = "test" if name == "qwen2.5/medical_3b.yaml" else "validate"
        main([stage, *args, "--ckpt_path=last"])
