"""benchmarks/coupling_probe.py: the split of bridge's θ gradient into its RL and coupling parts."""

import math

import torch
from helpers import TINY, load_benchmark, searching

probe = load_benchmark("coupling_probe")


def test_split_stats_hand_computed():
    rl_grad = torch.tensor([3.0, 0.0, -1.0, 1.0])
    coupling_grad = torch.tensor([-1.0, 2.0, 2.0, 0.0])
    stats = probe.split_stats(rl_grad, coupling_grad)
    # ‖g_F‖ = √11, ‖g_C‖ = 3; g_C·g_F = -3 - 2 = -5; g_F + g_C = [2, 2, 1, 1], ·g_F = 6 - 1 + 1 = 6, norm √10;
    # signs over the 3 coordinates with g_F ≠ 0: [+,+,+] vs [+,-,+] -> 1 of 3 flipped
    assert math.isclose(stats["coupling_to_rl"], 3 / math.sqrt(11), rel_tol=1e-6)
    assert math.isclose(stats["cos_coupling_rl"], -5 / (3 * math.sqrt(11)), rel_tol=1e-6)
    assert math.isclose(stats["cos_step_rl"], 6 / (math.sqrt(10) * math.sqrt(11)), rel_tol=1e-6)
    assert math.isclose(stats["sign_flips"], 1 / 3, rel_tol=1e-6)


def test_search_noise_stats_hand_computed():
    rl_grad = torch.tensor([0.0, 2.0])
    # n = 2 searches, g_C = [4, 0]; h_s = 2 g_s = [2, 0], [6, 0]; V = (2² + 2²) / 1 = 8, V / n = 4 of ‖g_C‖² = 16
    stats = probe.search_noise_stats(torch.tensor([[1.0, 0.0], [3.0, 0.0]]), rl_grad)
    assert math.isclose(stats["coupling_noise_share"], 0.25, rel_tol=1e-6)
    assert math.isclose(stats["coupling_mean_to_rl"], math.sqrt(16 - 4) / 2, rel_tol=1e-6)
    # nearly cancelling shares: g_C = [1, 0], h = [4, 0], [-2, 0], V = 18, V / n = 9 > ‖g_C‖² = 1: all noise
    stats = probe.search_noise_stats(torch.tensor([[2.0, 0.0], [-1.0, 0.0]]), rl_grad)
    assert math.isclose(stats["coupling_noise_share"], 9.0, rel_tol=1e-6)
    assert stats["coupling_mean_to_rl"] == 0.0


def test_probe_records_every_iteration_of_a_real_bridge_fit(tmp_path):
    """Plumbing on the tiny config: one record per iteration, after the inner steps, with a non-zero coupling."""
    cli = probe.probed_cli(TINY, 0, 2, tmp_path, ["--data.reward=plugins.DistinctWordsReward",
                                                  "--model.retrieval.credit_queries=64"])
    with searching(cli.model.policy):  # the random tiny policy searches, so there are LM-credit searches
        records = probe.probe(cli)
    assert len(records) == 2 and all(set(probe.COLUMNS) <= r.keys() for r in records)
    assert all(math.isfinite(v) for r in records for v in r.values())
    assert any(r["coupling_to_rl"] > 0 for r in records)
    coupled = [r for r in records if r["coupling_to_rl"] > 0]
    assert all(r["search_sum_error"] < 1e-3 for r in coupled)  # the per-search shares add up to g_C
