"""DenseIndex: exact flat search, approximate IVF/HNSW recall, staleness, persistence."""

import numpy as np
import pytest
import torch

from bridge_pl.retrieval.index import DenseIndex, StaleIndexError, topk_overlap

# Recall@10 against exact search that IVF (default nprobe) and HNSW (default efSearch) must reach on
# the clustered set below.
MIN_RECALL_AT_10 = {"ivf": 0.95, "hnsw": 0.95}  # measured: ivf 0.998, hnsw 0.987


def clustered(n: int, dim: int, clusters: int, seed: int) -> np.ndarray:
    """``[n, dim]`` unit vectors drawn around ``clusters`` random centres."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, dim))
    x = centres[rng.integers(clusters, size=n)] + 0.5 * rng.normal(size=(n, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_flat_equals_brute_force():
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(300, 16)).astype(np.float32)
    q = torch.from_numpy(rng.normal(size=(7, 16)).astype(np.float32))
    scores, rows = DenseIndex.build(emb).search(q, 5)
    exact = q.numpy() @ emb.T
    want_rows = np.argsort(-exact, axis=1)[:, :5]
    assert rows.dtype == torch.int64 and scores.dtype == torch.float32
    assert np.array_equal(rows.numpy(), want_rows)
    np.testing.assert_allclose(scores.numpy(), np.take_along_axis(exact, want_rows, 1), rtol=1e-5, atol=1e-5)


def test_missing_results_are_padded():
    index = DenseIndex.build(np.eye(3, dtype=np.float32))
    scores, rows = index.search(np.eye(3, dtype=np.float32)[:1], 5)
    assert rows[0, 0].item() == 0 and set(rows[0, :3].tolist()) == {0, 1, 2}
    assert rows[0, 3:].tolist() == [-1, -1]
    assert torch.isneginf(scores[0, 3:]).all() and torch.isfinite(scores[0, :3]).all()


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_approximate_recall_at_10(kind):
    emb = clustered(5000, 32, clusters=50, seed=1)
    queries = clustered(200, 32, clusters=50, seed=2)
    _, exact = DenseIndex.build(emb).search(queries, 10)
    _, approx = DenseIndex.build(emb, kind=kind).search(queries, 10)
    recall = topk_overlap(approx, exact)
    assert recall >= MIN_RECALL_AT_10[kind], f"{kind} recall@10 = {recall:.3f}"


def test_stale_index_raises_unless_allowed():
    index = DenseIndex.build(np.eye(4, dtype=np.float32), fingerprint="enc-a")
    q = np.eye(4, dtype=np.float32)[:2]
    index.search(q, 2, expected_fingerprint="enc-a")
    with pytest.raises(StaleIndexError, match="enc-a"):
        index.search(q, 2, expected_fingerprint="enc-b")
    _, rows = index.search(q, 2, expected_fingerprint="enc-b", allow_stale=True)
    assert rows[:, 0].tolist() == [0, 1]


@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw"])
def test_save_load_round_trip(tmp_path, kind):
    emb = clustered(2000, 16, clusters=10, seed=3)
    index = DenseIndex.build(emb, kind=kind, fingerprint="enc-x", nprobe=4, ef_search=64)
    path = index.save(tmp_path / "sub" / "index.npz")
    # no temp file left behind; the digest that lets a later load detect damage
    assert sorted(p.name for p in path.parent.iterdir()) == ["index.npz", "index.npz.b2"]
    loaded = DenseIndex.load(path)
    assert (loaded.kind, loaded.fingerprint, loaded.ntotal, loaded.nprobe, loaded.ef_search) == (
        kind, "enc-x", 2000, 4, 64)
    for a, b in zip(index.search(emb[:20], 5), loaded.search(emb[:20], 5), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(StaleIndexError):
        loaded.search(emb[:1], 1, expected_fingerprint="enc-y")


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="kind"):
        DenseIndex(8, kind="lsh")
    index = DenseIndex.build(np.eye(4, dtype=np.float32))
    with pytest.raises(ValueError, match="width 3"):
        index.search(np.zeros((1, 3), np.float32), 1)
    with pytest.raises(FileNotFoundError, match="nope.npz"):
        DenseIndex.load("nope.npz")


def test_topk_overlap_ignores_padding():
    a = torch.tensor([[1, 2, -1], [4, 5, 6]])
    b = torch.tensor([[2, 9, -1], [6, 5, 4]])
    assert topk_overlap(a, b) == pytest.approx((1 + 3) / 6)
