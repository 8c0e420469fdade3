"""``strategy: fsdp2`` (FSDP2 through ModelParallelStrategy) and ``ddp`` on 2 CPU processes (gloo), against one process
on the same global batch; resume from a sharded checkpoint. A vLLM engine per rank: tests/test_fsdp2_vllm.py.

The 2-process fits run in one subprocess (Lightning re-launches it as rank 1). Each rank saves its first rollout
batch; in this process the two batches are joined (``RolloutBatch.concat``) and one process takes the same
iteration on the joined batch. The update is then the same update: the losses aggregate as a mean over sequences
(``seq-mean-token-mean``) and every trajectory makes two searches, all LM-credited, so each rank's mean is half of
the global mean, and data-parallel gradients are averaged over ranks.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from helpers import fit_tiny, tiny_cli

from bridge_pl.rollout.batch import RolloutBatch
from callbacks.checkpoint import ValidatedCheckpoint

pytestmark = pytest.mark.slow  # multi-process or subprocess fits: `make test-fast` leaves them out

MODES = ["frozen", "policy_first", "retriever_first", "bridge", "implicit"]
DDP_MODES = ["frozen", "bridge"]
COMMON = ("--data.reward=plugins.DistinctWordsReward", "--model.rl.loss_agg=seq-mean-token-mean",
          "--model.retrieval.credit_queries=64", "--trainer.limit_val_batches=0",
          "--model.rl.micro_batch_tokens=256")  # several micro-batches per rank (unequal counts: the test below)
RTOL, ATOL = 1e-4, 1e-6  # float32 on both sides; the sharded run sums in another order


def _trained(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's trained tensors, gathered in full (every rank must call it under FSDP2)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    names = {n for n, p in module.named_parameters() if p.requires_grad}
    if dist.is_available() and dist.is_initialized():
        state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = module.state_dict()
    return {k: v.detach().cpu().clone() for k, v in state.items() if k in names}


class RecordSteps(L.Callback):
    """Each rank saves its first batch and its logged losses per iteration; rank 0 saves the trained tensors at the
    end of the fit."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.logs: list[dict[str, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 0:
            torch.save(batch, self.out / f"batch{trainer.global_rank}.pt")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.logs.append({k: float(v) for k, v in trainer.callback_metrics.items()
                          if k.startswith(("loss/", "grad_norm/", "policy/skipped", "policy/kl_ref",
                                           "policy/steps", "policy/approx_kl"))})

    def on_train_end(self, trainer, pl_module):
        (self.out / f"logs{trainer.global_rank}.json").write_text(json.dumps(self.logs))
        weights = _trained(pl_module)
        if trainer.global_rank == 0:
            torch.save(weights, self.out / "weights.pt")


def _run_2proc(out: Path, *args: str) -> None:
    """This file as a script on 2 processes: ``args`` are a job and its arguments, or several of
    ``ONE_PROCESS_JOBS``, run one after the other in the same two processes (a process's start, its imports and
    the process group, is most of a tiny 2-process fit's time)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent), str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, __file__, str(out), *args], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    """``{(strategy, mode): folder}`` of 2-process fits of one iteration."""
    out = tmp_path_factory.mktemp("two_process")
    _run_2proc(out, "first-step")
    return out


# The jobs the tests below read, each in its own folders of one output folder; run in one pair of processes.
ONE_PROCESS_JOBS = ("resume", "warm-start", "full-kl", "minibatches", "uneven-eval")


@pytest.fixture(scope="module")
def fsdp2_jobs(tmp_path_factory):
    """The output folder of ``ONE_PROCESS_JOBS``, run once for the tests that read them (one job alone:
    ``python tests/test_fsdp2.py OUT JOB``)."""
    out = tmp_path_factory.mktemp("fsdp2_jobs")
    _run_2proc(out, *ONE_PROCESS_JOBS)
    return out


def _one_process_step(tmp_path: Path, mode: str, folder: Path) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One process, same config and seed, one iteration on the two ranks' first batches joined."""
    cli = tiny_cli(tmp_path, *COMMON, f"--model.mode={mode}")
    module = cli.model
    module.setup("fit")
    batch = RolloutBatch.concat([torch.load(folder / f"batch{r}.pt", weights_only=False) for r in range(2)],
                                pad_token_id=module.policy.tokenizer.pad_token_id)
    optimizers, _ = module.configure_optimizers()
    logs = module.solver.step(module.problem(batch), module.updates_from(optimizers, backward=torch.Tensor.backward))
    return logs, _trained(module)


@pytest.mark.skipif(os.name == "nt", reason="gloo subprocess job")
@pytest.mark.parametrize("strategy, mode", [("fsdp2", m) for m in MODES] + [("ddp", m) for m in DDP_MODES])
def test_two_processes_make_the_one_process_update_on_the_same_global_batch(two_process_runs, tmp_path, strategy,
                                                                            mode):
    """``implicit``: its θ correction is a product of per-batch Hessian terms, so data parallelism averages the ranks'
    own hypergradient estimates, which is not the joined batch's; only its φ step (on G, a mean) is the same."""
    folder = two_process_runs / strategy / mode
    logs, weights = _one_process_step(tmp_path, mode, folder)
    ranks = [json.loads((folder / f"logs{r}.json").read_text())[0] for r in range(2)]
    assert ranks[0]["policy/skipped"] == 0.0, "the tiny run must make a θ step for this test to mean anything"
    exact = mode != "implicit"
    means = ("loss/policy", "loss/retriever_G", "loss/retriever_G_psi") if exact else ("loss/retriever_G",)
    norms = ("grad_norm/policy", "grad_norm/phi", "grad_norm/psi") if exact else ("grad_norm/phi",)
    for key in means:  # each rank's loss is the mean over its half of the batch
        if key in logs:
            assert logs[key] == pytest.approx((ranks[0][key] + ranks[1][key]) / 2, rel=RTOL, abs=ATOL), key
    for key in norms:  # norms of the rank-averaged gradient
        if key in logs:
            assert ranks[0][key] == pytest.approx(logs[key], rel=RTOL, abs=ATOL), key
            assert ranks[1][key] == pytest.approx(logs[key], rel=RTOL, abs=ATOL), key
    sharded = torch.load(folder / "weights.pt")
    assert sharded.keys() == weights.keys()
    for name, value in weights.items():
        if exact or name.startswith("retriever."):
            torch.testing.assert_close(sharded[name], value, rtol=RTOL, atol=ATOL, msg=name)
    assert any("lora_B" in n and sharded[n].abs().sum() > 0 for n in sharded), "the policy step changed nothing"


@pytest.mark.skipif(os.name == "nt", reason="gloo subprocess job")
def test_fsdp2_resume_from_a_sharded_checkpoint_repeats_the_next_steps(fsdp2_jobs):
    """``ValidatedCheckpoint`` on two ranks: iteration 2's sharded save waits for the validation after it (a
    collective write, so both ranks must defer alike), and the run resumed from it repeats iteration 3."""
    whole = torch.load(fsdp2_jobs / "whole" / "weights.pt")
    resumed = torch.load(fsdp2_jobs / "resumed" / "weights.pt")
    assert (fsdp2_jobs / "first" / "checkpoints" / "last.ckpt").is_dir(), "a sharded checkpoint is a folder"
    for name, value in whole.items():
        torch.testing.assert_close(resumed[name], value, rtol=RTOL, atol=ATOL, msg=name)
    for r in range(2):
        uninterrupted = json.loads((fsdp2_jobs / "whole" / f"logs{r}.json").read_text())
        after_resume = json.loads((fsdp2_jobs / "resumed" / f"logs{r}.json").read_text())
        assert after_resume[0] == pytest.approx(uninterrupted[2], rel=RTOL, abs=ATOL, nan_ok=True)


@pytest.mark.skipif(os.name == "nt", reason="gloo subprocess job")
def test_fsdp2_warm_start_rebases_the_kl_reference_and_exports_the_gathered_adapter(fsdp2_jobs):
    """WarmStart under FSDP2: its steps, the reference snapshot swapped into the shards for the KL pass, and the
    peft adapter gathered and written by rank 0, which a plain single-process peft load reads back."""
    from peft import PeftModel

    from bridge_pl.models import load_causal_lm

    ranks = [json.loads((fsdp2_jobs / "warm" / f"logs{r}.json").read_text()) for r in range(2)]
    assert all(r[i]["policy/skipped"] == 0.0 for r in ranks for i in range(2))
    # iteration 1 scores under the warm-started snapshot, swapped into the shards (iteration 0: it is the policy)
    assert all(r[1]["policy/kl_ref"] > 0 for r in ranks)
    adapter = PeftModel.from_pretrained(load_causal_lm("tiny-llama", dtype=torch.float32),
                                        str(fsdp2_jobs / "warm" / "adapter"))
    lora_b = [p for n, p in adapter.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b)  # the warm start's steps are in the export


class RecordReferenceSharding(L.Callback):
    """After each iteration, whether the full-fine-tuning KL reference holds only its shards (DTensors)."""

    def __init__(self, out: Path) -> None:
        self.out, self.sharded = out, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from torch.distributed.tensor import DTensor

        self.sharded.append(all(isinstance(p, DTensor) for p in pl_module.policy.reference.parameters()))

    def on_train_end(self, trainer, pl_module):
        (self.out / f"reference{trainer.global_rank}.json").write_text(json.dumps(self.sharded))


@pytest.mark.skipif(os.name == "nt", reason="gloo subprocess job")
def test_fsdp2_frees_the_gathered_kl_reference_after_each_iteration(fsdp2_jobs):
    """Full fine-tuning with a KL penalty keeps a frozen reference copy, sharded like the policy and gathered for its
    forward. Each iteration ends with it resharded, as the policy is: a gathered float32 reference of a 7B model
    would hold about 30 GB on every GPU until the next iteration."""
    ranks = [json.loads((fsdp2_jobs / "full" / f"logs{r}.json").read_text()) for r in range(2)]
    assert all(r[1]["policy/kl_ref"] > 0 for r in ranks)  # iteration 1 scored under the (gathered) reference
    sharded = [json.loads((fsdp2_jobs / "full" / f"reference{r}.json").read_text()) for r in range(2)]
    assert sharded == [[True, True]] * 2


@pytest.mark.skipif(os.name == "nt", reason="gloo subprocess job")
def test_fsdp2_second_minibatch_runs_on_the_weights_the_first_step_made(fsdp2_jobs):
    """FSDP2 keeps its gathered parameters between forwards (no reshard after forward or backward), and the optimizer
    steps the shards: without a reshard after each policy step, the second mini-batch would run on the gathered
    copy of θ before the first step, its ratio exactly 1."""
    ranks = [json.loads((fsdp2_jobs / "minibatches" / f"logs{r}.json").read_text())[0] for r in range(2)]
    assert all(r["policy/steps"] == 2.0 for r in ranks), "both mini-batches must step for this test to mean anything"
    assert all(r["policy/approx_kl"] != 0.0 for r in ranks)


@pytest.mark.skipif(os.name == "nt", reason="gloo subprocess job")
def test_fsdp2_evaluates_with_unequal_numbers_of_batches_per_rank(fsdp2_jobs):
    """Validation between iterations, ranks with 2 and 1 eval batches: no collective waits on a forward, and the
    EM pooled over ranks is the same number on both."""
    ranks = [json.loads((fsdp2_jobs / "eval" / f"val{r}.json").read_text()) for r in range(2)]
    assert "val/world_dev/em" in ranks[0] and ranks[0] == ranks[1]


def _spawned_worker(rank: int, port: int, out: str) -> None:
    """The workers below, one after the other in one gloo group of 2 processes (a process's start, its imports, is
    most of each one's time)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    _pad_worker(rank, str(Path(out) / "w.pt"))
    dist.barrier()
    _mixed_dtype_worker(rank, str(Path(out) / "r.json"))
    dist.barrier()  # every rank done with its collectives before gloo is torn down
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> Path:
    """The output folder of ``_spawned_worker`` on 2 processes."""
    import socket

    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("spawned")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_spawned_worker, args=(port, str(out)), nprocs=2, join=True)
    return out


def _pad_worker(rank: int, out: str) -> None:
    """Rank 0's loss has two parts, rank 1's one; one update step with ShardedGradients."""
    from torch.distributed.device_mesh import init_device_mesh

    from bridge_pl.bilevel import ParamUpdate
    from bridge_pl.distributed import ShardedGradients, any_across_ranks, call_under_root, shard_root

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    shard_root(model, init_device_mesh("cpu", (2,)), blocks=[model[0]])
    inputs = torch.arange(12.0).view(3, 4) / 10

    def loss(x: torch.Tensor) -> torch.Tensor:
        return call_under_root(model, lambda: model[1](model[0](x)).sum() ** 2)

    zero = ShardedGradients([model], lambda: call_under_root(model, lambda: model[1](model[0](inputs[0])).sum() * 0))
    update = ParamUpdate(torch.optim.SGD(model.parameters(), lr=0.1), sharded=zero)
    parts = [loss(inputs[0]), loss(inputs[1])] if rank == 0 else [loss(inputs[2])]
    update.step_parts(iter(parts))
    assert any_across_ranks(rank == 1) and not any_across_ranks(False)
    weights = _trained(model)
    if rank == 0:
        torch.save(weights, out)


def test_a_rank_with_fewer_loss_parts_gets_the_ranks_average_update(spawned):
    """Gradients accumulate locally over each rank's own parts and are reduced once (a reduction per part would
    leave rank 0 waiting for a second one that rank 1 never joins)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    inputs = torch.arange(12.0).view(3, 4) / 10
    total = (sum(model(x).sum() ** 2 for x in inputs[:2]) + model(inputs[2]).sum() ** 2) / 2  # mean over ranks
    total.backward()
    with torch.no_grad():
        expected = {name: p - 0.1 * p.grad for name, p in model.named_parameters()}
    got = torch.load(spawned / "w.pt")
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _mixed_dtype_worker(rank: int, out: str) -> None:
    """A bfloat16 base under float32 LoRA weights (peft's default), sharded, then one forward, backward and step."""
    from torch.distributed.device_mesh import init_device_mesh

    from bridge_pl.policy import Policy

    torch.manual_seed(0)
    policy = Policy("tiny-llama", lora_r=4, dtype="bfloat16")
    dtypes = sorted({str(p.dtype) for p in policy.model.parameters()})
    policy.shard(init_device_mesh("cpu", (2,)))
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-2)  # over the shards, as the module builds it
    ids = torch.randint(5, 200, (2, 9), generator=torch.Generator().manual_seed(rank))
    logp, _, _ = policy(ids, torch.ones_like(ids))
    (-logp.sum()).backward()
    optimizer.step()
    moved = any(float(v.abs().sum()) > 0 for k, v in _trained(policy).items() if "lora_B" in k)
    if rank == 0:
        Path(out).write_text(json.dumps({"dtypes": dtypes, "finite": bool(torch.isfinite(logp).all()), "moved": moved}))


def test_a_bfloat16_base_with_float32_lora_weights_shards_and_trains(spawned):
    """Early FSDP2 needed one dtype per unit; the installed torch shards and trains a block that mixes a bfloat16
    base with peft's float32 LoRA weights (``Policy.shard`` relies on it)."""
    result = json.loads((spawned / "r.json").read_text())
    assert result == {"dtypes": ["torch.bfloat16", "torch.float32"], "finite": True, "moved": True}


def main(out: Path, job: str) -> None:
    """2-process fits (this script is re-launched as rank 1 by Lightning)."""
    torch.set_num_threads(1)
    if job in ONE_PROCESS_JOBS:  # one or several of them, in the order given
        for name in sys.argv[2:]:
            _fsdp2_job(out, name)
        return
    two = ("--trainer.devices=2", "--trainer.enable_checkpointing=false")
    if job == "first-step":
        jobs = [("fsdp2", MODES), ("ddp_find_unused_parameters_true", DDP_MODES)]
        if len(sys.argv) > 3:  # one strategy and mode, to look at it alone
            jobs = [(sys.argv[3], [sys.argv[4]])]
        for strategy, modes in jobs:
            for mode in modes:
                folder = out / strategy.split("_")[0] / mode
                folder.mkdir(parents=True, exist_ok=True)
                fit_tiny(folder, *COMMON, *two, f"--trainer.strategy={strategy}", f"--model.mode={mode}",
                         "--trainer.max_steps=1", callbacks=(RecordSteps(folder),))
        return


def _fsdp2_job(out: Path, job: str) -> None:
    """One of ``ONE_PROCESS_JOBS``, writing under its own folders of ``out``."""
    fsdp2 = ("--trainer.devices=2", "--trainer.strategy=fsdp2", *COMMON, "--model.mode=bridge")
    if job == "uneven-eval":  # 12 dev questions in batches of 4: rank 0 evaluates two batches, rank 1 one
        (out / "eval").mkdir(parents=True, exist_ok=True)
        cli = fit_tiny(out / "eval", *fsdp2, "--trainer.max_steps=2", "--trainer.val_check_interval=1",
                       "--trainer.limit_val_batches=null", "--data.max_eval_examples=12")
        metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items() if k.startswith("val/")}
        (out / "eval" / f"val{cli.trainer.global_rank}.json").write_text(json.dumps(metrics))
        return
    if job == "minibatches":
        (out / "minibatches").mkdir(parents=True, exist_ok=True)
        fit_tiny(out / "minibatches", *fsdp2, "--trainer.max_steps=1", "--model.rl.minibatches=2",
                 "--data.batch_size=4", callbacks=(RecordSteps(out / "minibatches"),))
        return
    if job == "full-kl":
        (out / "full").mkdir(parents=True, exist_ok=True)
        fit_tiny(out / "full", *fsdp2, "--trainer.max_steps=2", "--model.rl.kl_coef=0.05",
                 "--model.policy.init_args.lora=false",
                 callbacks=(RecordSteps(out / "full"), RecordReferenceSharding(out / "full")))
        return
    if job == "warm-start":
        from callbacks.warm_start import WarmStart

        (out / "warm").mkdir(parents=True, exist_ok=True)
        warm = WarmStart(steps=2, batch_size=2, evaluate=False, save_to=str(out / "warm" / "adapter"))
        fit_tiny(out / "warm", *fsdp2, "--trainer.max_steps=2", "--model.rl.kl_coef=0.05",
                 callbacks=(warm, RecordSteps(out / "warm")))
        return
    for name in ("whole", "first", "resumed"):
        (out / name).mkdir(parents=True, exist_ok=True)

    def checkpoints() -> ValidatedCheckpoint:  # iteration 2's sharded save waits for its validation, on both ranks
        return ValidatedCheckpoint(dirpath=out / "first" / "checkpoints", every_n_train_steps=1, save_last=True)

    validated = (*fsdp2, "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1")
    fit_tiny(out / "whole", *validated, "--trainer.max_steps=3", callbacks=(RecordSteps(out / "whole"),))
    fit_tiny(out / "first", *validated, "--trainer.max_steps=2",
             callbacks=(RecordSteps(out / "first"), checkpoints()))
    fit_tiny(out / "first", *validated, "--trainer.max_steps=3", ckpt_path="last",
             callbacks=(RecordSteps(out / "resumed"), checkpoints()))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
