"""QAMetrics: values, empty state, input checks, dtype guard, and identical results on 1 and 2 processes."""

import socket
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bridge_pl.metrics import QAMetrics, valid_action_rate

# Five questions: (prediction, golds, turns, searches, valid_actions, actions).
ROWS = [
    ("The Beatles", ["beatles"], 2, 1, 2, 2),  # EM 1, F1 1, sub-EM 1
    ("Barack Obama", ["Obama"], 3, 2, 2, 3),  # EM 0, F1 2/3, sub-EM 1
    (None, ["Paris"], 4, 4, 1, 4),  # no answer: all 0
    ("new york new york", ["New York City"], 1, 0, 1, 1),  # F1 4/7
    ("Zürich", ["zurich", "Zurich, CH"], 2, 1, 2, 2),  # accents kept: all 0
]
EXPECTED = {
    "em": 1 / 5,
    "f1": (1 + 2 / 3 + 4 / 7) / 5,
    "sub_em": 2 / 5,
    "turns": 12 / 5,
    "searches": 8 / 5,
    "valid_action_rate": 8 / 12,
}
KEYS = sorted(EXPECTED)


def _update(metric: QAMetrics, rows: list[tuple]) -> None:
    predictions, golds, turns, searches, valid, actions = (list(column) for column in zip(*rows, strict=True))
    metric.update(predictions, golds, turns, searches, valid, actions)


def _as_floats(values: dict[str, torch.Tensor]) -> dict[str, float]:
    return {key: value.item() for key, value in values.items()}


def test_single_process_values_and_batching():
    whole, batched = QAMetrics(), QAMetrics()
    _update(whole, ROWS)
    for row in ROWS:
        _update(batched, [row])
    result = whole.compute()
    assert sorted(result) == KEYS
    assert all(value.dtype == torch.float32 and value.ndim == 0 for value in result.values())
    assert _as_floats(result) == pytest.approx(EXPECTED, abs=1e-6)
    assert _as_floats(batched.compute()) == pytest.approx(EXPECTED, abs=1e-6)


def test_empty_is_zero_without_warnings():
    metric = QAMetrics()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _as_floats(metric.compute()) == dict.fromkeys(KEYS, 0.0)
        _update(metric, ROWS)
        metric.reset()
        assert _as_floats(metric.compute()) == dict.fromkeys(KEYS, 0.0)
    metric.update([], [], [], [], [], [])
    assert _as_floats(metric.compute()) == dict.fromkeys(KEYS, 0.0)


def test_counts_accept_tensors():
    metric = QAMetrics()
    metric.update(["x"], [["x"]], torch.tensor([3]), torch.tensor([1]), torch.tensor([2]), torch.tensor([4]))
    assert _as_floats(metric.compute()) == pytest.approx(
        {"em": 1.0, "f1": 1.0, "sub_em": 1.0, "turns": 3.0, "searches": 1.0, "valid_action_rate": 0.5}
    )


def test_valid_action_rate_pools_integer_counts_of_a_training_batch():
    """The training log's rate (long counts per trajectory, as in a RolloutBatch) pools like QAMetrics'."""
    valid = torch.tensor([row[4] for row in ROWS])
    invalid = torch.tensor([row[5] - row[4] for row in ROWS])  # [0, 1, 3, 0, 0]
    assert valid_action_rate(valid, valid + invalid).item() == pytest.approx(EXPECTED["valid_action_rate"])
    empty = torch.zeros(0, dtype=torch.long)
    assert valid_action_rate(empty, empty).item() == 0.0


def test_update_rejects_bad_input():
    metric = QAMetrics()
    with pytest.raises(ValueError, match="turns has 1 entries, predictions has 2"):
        metric.update(["a", "b"], [["a"], ["b"]], [1], [1, 1], [1, 1], [1, 1])
    with pytest.raises(ValueError, match="valid_actions exceeds actions"):
        metric.update(["a"], [["a"]], [1], [1], [3], [2])
    with pytest.raises(ValueError, match="searches must be non-negative"):
        metric.update(["a"], [["a"]], [1], [-1], [1], [1])
    with pytest.raises(TypeError, match="list of answer strings"):
        metric.update(["a"], ["a"], [1], [1], [1], [1])


def test_states_keep_float64_when_the_module_is_cast():
    metric = QAMetrics()
    _update(metric, ROWS)
    metric.to(dtype=torch.bfloat16)  # what Lightning's "bf16-true" precision does to the LightningModule
    assert metric.f1.dtype == torch.float64
    assert _as_floats(metric.compute()) == pytest.approx(EXPECTED, abs=1e-6)
    metric.reset()
    assert metric.turns.dtype == torch.float64


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _distributed_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        uneven, one_sided = QAMetrics(), QAMetrics()
        _update(uneven, ROWS[:3] if rank == 0 else ROWS[3:])
        if rank == 0:  # rank 1 never updates this one, yet must still take part in the sync
            _update(one_sided, ROWS)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            results = {"uneven": _as_floats(uneven.compute()), "one_sided": _as_floats(one_sided.compute())}
        _update(uneven, ROWS)  # local accumulation goes on after a synced compute
        results["local_after"] = _as_floats(uneven.compute())
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_processes_match_one(tmp_path):
    single = QAMetrics()
    _update(single, ROWS)
    expected = _as_floats(single.compute())
    _update(single, ROWS)
    _update(single, ROWS)
    expected_after = _as_floats(single.compute())  # both ranks add all rows once more: 3x the data

    mp.spawn(_distributed_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)

    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        assert results["uneven"] == pytest.approx(expected, abs=1e-7)
        assert results["one_sided"] == pytest.approx(expected, abs=1e-7)
        assert results["local_after"] == pytest.approx(expected_after, abs=1e-7)
