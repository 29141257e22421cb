"""The Full-Stack FP4 measurement scripts' arithmetic on small synthetic cases (bench/qadamw_states.py,
bench/lora_svd_sqnr.py); the committed results come from real runs."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import lora_svd_sqnr  # noqa: E402
import qadamw_states  # noqa: E402


def test_qadamw_states_sees_direct_storage_break_the_update_on_a_heavy_tailed_state():
    g = torch.Generator().manual_seed(0)
    grads = torch.randn(200, 64, 64, generator=g) * torch.logspace(-4, 0, 64)  # columns at very different scales
    m, v = grads.mean(0), grads.square().mean(0)
    res = qadamw_states.errors([{"exp_avg": m, "exp_avg_sq": v}])
    assert res["u_rel_error_direct"] > 10 * res["u_rel_error_transform"]
    assert res["r_rel_error_transform"] < res["r_rel_error_direct"]
    exact = qadamw_states.errors([{"exp_avg": m, "exp_avg_sq": v.clamp_min(1.0)}])  # a flat state: both ways fine
    assert exact["u_rel_error_direct"] < 0.5


def test_lora_svd_sqnr_finds_the_split_helps_on_a_low_rank_plus_noise_weight():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 8, generator=g) @ torch.randn(8, 128, generator=g) + 0.05 * torch.randn(64, 128, generator=g)
    x, dy = torch.randn(256, 128, generator=g), torch.randn(256, 64, generator=g)
    res = lora_svd_sqnr.compare({"l": (w, x, dy)}, rank=8)
    assert res["w_rel_error_lora"] < 0.5 * res["w_rel_error_plain"]
    assert res["y_error_reduction"] > 0.3 and res["dx_error_reduction"] > 0.3
    none = lora_svd_sqnr.compare({"l": (torch.randn(64, 128, generator=g), x, dy)}, rank=8)  # no low-rank part
    assert abs(none["w_error_reduction"]) < 0.2
    # 4/6 scaling reaches every operand (X's error, hence Y's, falls on Gaussian data), and oversampling the SVD
    adaptive = lora_svd_sqnr.compare({"l": (w, x, dy)}, rank=8, four_over_six=True)
    assert adaptive["y_rel_error_plain"] < 0.985 * res["y_rel_error_plain"]
    assert adaptive["dx_rel_error_plain"] < 0.985 * res["dx_rel_error_plain"]
    over = lora_svd_sqnr.compare({"l": (w, x, dy)}, rank=8, oversample=8)
    assert over["w_rel_error_lora"] <= 1.02 * res["w_rel_error_lora"] and over["w_rel_error_plain"] == res["w_rel_error_plain"]
