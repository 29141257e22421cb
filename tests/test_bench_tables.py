"""The benchmarks' shared code on a tiny case: bench/tables.py (ratios against the run's own BF16, failed rows,
block replacement) and bench/common.py (one results file per benchmark and device, provenance inside)."""

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))  # the scripts import their helper module as they do when run from there
import common  # noqa: E402
import tables  # noqa: E402


def test_results_files_are_named_per_benchmark_and_device_and_record_provenance(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "device_name", lambda: "NVIDIA H200")
    assert common.results_path("train_speed", "1b") == BENCH / "results/train_speed-1b-NVIDIA_H200.json"
    assert common.results_path("sqnr_formats", per_device=False) == BENCH / "results/sqnr_formats.json"
    path = tmp_path / "sub/x.json"
    written = common.write_results(path, [{"recipe": "bf16"}], model="1b")
    assert json.loads(path.read_text()) == written
    assert written["gpu"] == "NVIDIA H200" and written["model"] == "1b" and written["results"] == [{"recipe": "bf16"}]
    assert {"date", "commit", "torch"} <= written.keys()
    common.write_results(path, [])  # a rerun overwrites: one file, history is git's
    assert json.loads(path.read_text())["results"] == [] and len(list(path.parent.iterdir())) == 1


def test_a_sectioned_results_file_replaces_one_section_and_keeps_the_others(tmp_path):
    path = tmp_path / "root_orthogonality.json"
    common.write_section(path, "20m", [{"shape": 1}], model="20m", seeds=2)
    common.write_section(path, "1b", [{"shape": 2}], model="1b", seeds=1)
    common.write_section(path, "20m", [{"shape": 3}], model="20m", seeds=2)  # a rerun of one model
    sections = json.loads(path.read_text())["sections"]
    assert list(sections) == ["1b", "20m"] and sections["1b"]["results"] == [{"shape": 2}]
    assert sections["20m"]["results"] == [{"shape": 3}] and {"gpu", "date", "commit", "torch", "seeds"} <= sections["20m"].keys()


def _run(model, rows):
    return {"model": model, "gpu": "G", "torch": "2.11.0+cu130", "commit": "abc1234", "date": "2026-12-02", "batch_size": 8,
            "seq_len": 2048, "compile": True, "compile_mode": "reduce-overhead", "results": rows}


def test_train_table_rates_each_recipe_against_its_own_runs_bf16():
    runs = [_run("1b", [{"recipe": "bf16", "tokens_per_s": 1000.0, "peak_mem_gib": 10.0},
                        {"recipe": "mxfp4", "tokens_per_s": 1500.0, "peak_mem_gib": 8.0}]),
            _run("3b", [{"recipe": "bf16", "tokens_per_s": 400.0, "peak_mem_gib": 40.0},
                        {"recipe": "mxfp4", "error": "OutOfMemoryError"}, {"recipe": "tib2d", "tokens_per_s": 500.0}])]
    lines = tables.train_table(runs).splitlines()
    assert lines[2] == "| bf16 | 1.0k (1.00×) | 10.0 | 0.4k (1.00×) | 40.0 |"
    assert lines[3] == "| mxfp4 | 1.5k (1.50×) | 8.0 | failed | — |"
    assert lines[4] == "| tib2d | — | — | 0.5k (1.25×) | — |"
    assert "reduce-overhead" in lines[-2] and lines[-2].count("commit abc1234") == 1 and "1b:" not in lines[-2]
    assert lines[-1] == "_Failed: 3b mxfp4: OutOfMemoryError._"  # what broke, not only that it did
    runs[1]["commit"] = "def5678"  # models measured by different runs: each run named once, with its models
    last = tables.train_table(runs).splitlines()[-2]
    assert "1b: G, torch 2.11.0, commit abc1234" in last and "3b: G, torch 2.11.0, commit def5678" in last
    assert "synthetic batch" in last and "the trainer" not in last  # files made before the trainer drove the benchmark
    runs[0]["procedure"] = "trainer"
    assert "the trainer on real text" in tables.train_table(runs).splitlines()[-2]
    assert last.count("`python bench/train_speed.py`") == 1


def test_replace_blocks_rewrites_only_named_blocks():
    text = "a\n<!-- table:train -->\nold\n<!-- /table -->\nb\n<!-- table:other -->\nkeep\n<!-- /table -->\n"
    out = tables.replace_blocks(text, {"train": "new"})
    assert out == "a\n<!-- table:train -->\nnew\n<!-- /table -->\nb\n<!-- table:other -->\nkeep\n<!-- /table -->\n"


def test_quickstart_times_the_readmes_own_commands_and_tables_them():
    import quickstart

    readme = ("# x\n\n## Quickstart\n\ntext\n\n```bash\nfp4train compare --model tiny --recipes mxfp4 --out runs/q\n"
              "python -m pytest -q         # the suite\n```\n\n## Training\n\n```bash\nfp4train train --model 60m\n```\n")
    compare, tests = quickstart.quickstart_commands(readme)
    assert compare == ["fp4train", "compare", "--model", "tiny", "--recipes", "mxfp4", "--out", "runs/q"]
    assert tests == ["python", "-m", "pytest", "-q"]
    assert quickstart._with_out(compare, "/tmp/o")[-2:] == ["--out", "/tmp/o"] and compare[-1] == "runs/q"
    report = "# Recipe comparison\n\ntext\n\n| recipe | val loss |\n|---|---:|\n| bf16 | 6.44 |\n\nOne seed: ...\n"
    timing = {"gpu": "cpu", "cores": 2, "torch": "2.13.0+cpu", "commit": "abc1234", "date": "2026-12-02",
              "results": {"compare_s": 165.2, "compare_disk_mb": 206.4, "tests_s": 541.0}}
    lines = tables.quickstart_table(report, timing).splitlines()
    assert lines[:3] == ["| recipe | val loss |", "|---|---:|", "| bf16 | 6.44 |"]
    assert lines[-1].startswith("_2-core CPU: the comparison 2 min 45 s, tokenization included (206 MB on disk); "
                                "the test suite 9 min 01 s; torch 2.13.0, commit abc1234")
    timing["results"]["tests_s"] = 119.6  # rounds up into the next minute, not to "1 min 60 s"
    assert "the test suite 2 min 00 s" in tables.quickstart_table(report, timing)
    timing["cpu"] = "AVX512"  # the FP4 rows depend on the CPU kernels' instruction set: the caption names it
    assert tables.quickstart_table(report, timing).splitlines()[-1].startswith("_2-core CPU (AVX512 kernels): ")


def test_train_speed_reports_the_trainers_own_figure(tmp_path):
    """bench/train_speed.py runs each recipe through the trainer (AdaHOP calibrating the trainer's way) and writes
    the trainer's steady tokens/s against the BF16 of the same call; a failing recipe is a row with its error."""
    import train_speed

    out = tmp_path / "speed.json"
    train_speed.main(["--model", "tiny", "--seq-len", "32", "--batch-size", "2", "--steps", "3", "--device", "cpu",
                      "--recipes", "bf16,adahop,no_such_recipe", "--json", str(out)])
    d = json.loads(out.read_text())
    assert d["procedure"] == "trainer" and d["compile"] is False and [r["recipe"] for r in d["results"]] == ["bf16", "adahop", "no_such_recipe"]
    bf16, adahop, bad = d["results"]
    assert bf16["speedup_vs_bf16"] == 1.0 and bf16["steady_steps"] == 2 and bf16["tokens_per_s"] > 0
    assert adahop["bf16_steps"] == 20 and adahop["steady_steps"] == 2 and sum(adahop["adahop_strategies"].values()) > 0
    assert adahop["speedup_vs_bf16"] == pytest.approx(adahop["tokens_per_s"] / bf16["tokens_per_s"])
    assert "no_such_recipe" in bad["error"]


def test_attention_table_gives_time_ratio_memory_and_sqnr():
    row = {"model": "1b", "heads": 32, "kv_heads": 8, "head_dim": 64, "batch": 8, "seq_len": 2048, "sdpa_ms": 1.0,
           "nvfp4_ms": 3.0, "nvfp4_vs_sdpa_time": 3.0, "sdpa_peak_mib": 400.0, "nvfp4_peak_mib": 450.0,
           "sqnr_db": {"O": 16.04, "dQ": 13.7, "dK": 13.8, "dV": 18.3}}
    d = {"gpu": "G", "torch": "2.11.0+cu130", "commit": "abc1234", "date": "2026-12-02", "results": [row]}
    lines = tables.attention_table(d).splitlines()
    assert lines[2] == "| 1b (32/8 heads, d 64), 8 × 2048 | 1.00 | 3.00 | 3.0× | 400 | 450 | 16.0 / 13.7 / 13.8 / 18.3 |"
    assert "commit abc1234" in lines[-1] and "attention_speed.py" in lines[-1]


def test_compare_table_gives_interval_and_verdict_and_names_what_is_missing():
    rep = {"model": "60m", "tokens_per_run": 1000, "seeds": [0, 1, 2], "gpu": "G", "date": "2026-12-02",
           "unfinished": ["mxfp4"], "noise_floor": {"seed_std_pct": 0.35, "reorder_abs_pct_mean": 0.39},
           "recipes": {"bf16": {"val_loss_mean": 6.0, "gap_pct_mean": 0.0},
                       "nvfp4": {"val_loss_mean": 6.1, "gap_pct_mean": 1.5, "gap_pct_ci95": [0.5, 2.5], "verdict": "resolved: worse than BF16"}}}
    lines = tables.compare_table(rep, "compare-60m-enwiki").splitlines()
    assert lines[2] == "| bf16 | 6.0000 | +0.00 | — | baseline |"
    assert lines[3] == "| nvfp4 | 6.1000 | +1.50 | [+0.50, +2.50] | resolved: worse than BF16 |"
    assert "0.35%" in lines[-1] and "Not run yet: mxfp4" in lines[-1]


def test_compare_table_adds_the_out_of_domain_gap_where_evaluated():
    rep = {"model": "20m", "tokens_per_run": 1000, "seeds": [0, 1, 2], "gpu": "G", "date": "2026-12-03",
           "noise_floor": {"seed_std_pct": 0.3, "reorder_abs_pct_mean": 0.2},
           "recipes": {"bf16": {"val_loss_mean": 5.0, "gap_pct_mean": 0.0, "eval": {"shakespeare": {"gap_pct_mean": 0.0}}},
                       "nvfp4": {"val_loss_mean": 5.1, "gap_pct_mean": 0.6, "gap_pct_ci95": [0.1, 1.1], "verdict": "resolved: worse than BF16",
                                 "eval": {"shakespeare": {"gap_pct_mean": 0.4, "gap_pct_ci95": [-1.6, 2.5]}}}}}
    lines = tables.compare_table(rep, "compare-20m-enwiki").splitlines()
    assert lines[0].endswith("| shakespeare: gap % [95% interval] |")
    assert lines[2].endswith("| baseline | — |")
    assert lines[3].endswith("| resolved: worse than BF16 | +0.40 [-1.60, +2.50] |")


def test_ablation_table_pairs_each_variant_with_the_full_recipe_by_seed():
    gap = lambda *g: {"gap_pct_per_seed": dict(zip("012", g)), "gap_pct_mean": sum(g) / 3,  # noqa: E731
                          "gap_pct_ci95": [min(g), max(g)], "baseline": "bf16-root"}
    rep = {"model": "20m", "tokens_per_run": 1000, "seeds": [0, 1, 2], "gpu": "G", "date": "2026-12-04",
           "recipes": {"bf16": {"gap_pct_mean": 0.0}, "bf16-root": {**gap(-3.0, -2.0, -2.5), "baseline": "bf16"},
                       "part": gap(0.0, 0.5, 1.0), "same": gap(1.1, 0.9, 1.6), "full": gap(1.0, 1.5, 2.0)}}
    lines = tables.ablation_table(rep, "f", "full").splitlines()
    assert not any(line.startswith("| bf16-root") for line in lines)  # its gap is to another baseline
    assert lines[2] == "| part | +0.50 [+0.00, +1.00] | -1.00 [-1.00, -1.00] | resolved: better than full |"
    assert lines[3].startswith("| same | +1.20 [+0.90, +1.60] | -0.30 [") and lines[3].endswith("| not resolved (the interval holds 0) |")
    assert lines[4].endswith("| — | the full recipe |") and "Gaps to bf16-root" in lines[-1]


def test_compare_table_names_a_rows_own_baseline():
    rep = {"model": "20m", "tokens_per_run": 1000, "seeds": [0, 1], "gpu": "G", "date": "2026-12-04",
           "noise_floor": {"seed_std_pct": 0.3, "reorder_abs_pct_mean": 0.2},
           "recipes": {"bf16": {"val_loss_mean": 5.0, "gap_pct_mean": 0.0},
                       "fullstack": {"val_loss_mean": 5.1, "gap_pct_mean": 0.7, "gap_pct_ci95": [0.4, 1.0],
                                     "verdict": "resolved: worse than BF16", "baseline": "bf16-root"}}}
    lines = tables.compare_table(rep, "c").splitlines()
    assert "mean of 2" in lines[0] and lines[3].startswith("| fullstack (to bf16-root) | 5.1000 |")


def test_determinism_table_says_whether_repeats_matched():
    d = {"gpu": "G", "torch": "2.11.0", "commit": "abc", "date": "2026-12-02", "results": [
        {"recipe": "bf16", "deterministic_repeat_identical": True, "deterministic_repeat_identical_steps": 5, "steps": 5,
         "default_vs_deterministic_max_loss_diff": 0.25, "deterministic_speed_ratio": 0.9},
        {"recipe": "x", "deterministic_repeat_identical": False, "deterministic_repeat_identical_steps": 3, "steps": 5,
         "default_vs_deterministic_max_loss_diff": 0.0, "deterministic_speed_ratio": 0.5},
        {"recipe": "y", "error": "RuntimeError: no deterministic kernel"}]}
    lines = tables.determinism_table(d).splitlines()
    assert lines[2] == "| bf16 | yes (5/5 steps) | 5 | 0.2500 | 0.90x |"
    assert lines[3].startswith("| x | NO (3/5 steps)") and "failed: RuntimeError" in lines[4]


def test_determinism_check_finds_cpu_repeats_identical(tmp_path):
    import determinism

    determinism.main(["--model", "tiny", "--recipes", "bf16", "--steps", "3", "--seq-len", "32", "--batch-size", "2",
                      "--json", str(tmp_path / "d.json")])
    row = json.loads((tmp_path / "d.json").read_text())["results"][0]
    assert row["deterministic_repeat_identical"] and row["deterministic_repeat_identical_steps"] == 3


def test_protocol_components_each_take_one_part_out_of_fullstack(tmp_path):
    import compare_protocol

    import fp4train

    full = fp4train.recipes.get("fullstack")
    got = {Path(p).stem: fp4train.recipes.get(p) for p in compare_protocol.fullstack_components(tmp_path)}
    assert got["fullstack_bf16_attention"].attention is None and got["fullstack_bf16_attention"].lora_svd == full.lora_svd
    assert got["fullstack_adamw"].optimizer is None and got["fullstack_adamw"].attention == full.attention
    assert got["fullstack_no_lora"].lora_svd is None and got["fullstack_no_lora"].optimizer == full.optimizer
    assert all(r.linear == full.linear for r in got.values())


def test_protocol_fullstack_ablation_adds_one_part_at_a_time_all_trained_with_root(tmp_path):
    import compare_protocol

    import fp4train
    from fp4train.train.compare import ROOT_FAMILY, recipe_label, run_name

    full = fp4train.recipes.get("fullstack")
    paths = compare_protocol.fullstack_ablation(tmp_path)
    got = {recipe_label(p): fp4train.recipes.get(p) for p in paths}
    assert list(got) == ["fullstack_linear", "fullstack_linear_optimizer", "fullstack_linear_attention", "fullstack"]
    assert [(r.attention, r.optimizer) for r in got.values()] == [(None, "root"), (None, full.optimizer),
                                                                  (full.attention, "root"), (full.attention, full.optimizer)]
    assert all(r.linear == full.linear and r.lora_svd == full.lora_svd for r in got.values())
    assert all(r.optimizer in ROOT_FAMILY for r in got.values())  # every one paired to BF16 Root + AdamW
    assert run_name(paths[0], 2) == "fullstack_linear-seed2"


def test_protocol_tib2d_ablation_changes_one_part_at_a_time(tmp_path):
    """Each variant differs from tib2d in one part only, everywhere that part occurs (Q/K overrides included), and
    a model converted with it runs that part (a recipe file that only looked right would fail the last check)."""
    import compare_protocol

    import fp4train
    from fp4train.train.compare import recipe_label

    base = fp4train.recipes.get("tib2d")
    paths = compare_protocol.tib2d_ablation(tmp_path)
    got = {recipe_label(p): fp4train.recipes.get(p) for p in paths}
    assert list(got) == ["tib2d_1d", "tib2d_floor", "tib2d_nearest", "tib2d_fp4_qk", "tib2d"]

    def quants(r):
        specs = [r.linear] + [o.linear for o in r.overrides if o.linear is not None]
        return [getattr(getattr(s, g), o) for s in specs for g in ("fprop", "dgrad", "wgrad") for o in "ab"]

    pairs = {name: list(zip(quants(base), quants(r))) for name, r in got.items() if name not in ("tib2d", "tib2d_fp4_qk")}
    assert all(b.is_2d == (b.block != q.block) and not q.is_2d and q.block_size == b.block_size and q.scale == b.scale
               and q.rounding == b.rounding for b, q in pairs["tib2d_1d"])
    assert any(b.is_2d for b, _ in pairs["tib2d_1d"])
    assert all(q.scale == "floor" and (q.block, q.rounding, q.format) == (b.block, b.rounding, b.format) for b, q in pairs["tib2d_floor"])
    assert all(q.rounding == "nearest" and (q.block, q.scale) == (b.block, b.scale) for b, q in pairs["tib2d_nearest"])
    assert any(b.rounding == "stochastic" for b, _ in pairs["tib2d_nearest"])
    qk = got["tib2d_fp4_qk"]
    assert qk.linear == base.linear and len(qk.overrides) == len(base.overrides) - 2
    assert not any(o.pattern.startswith("role:") and o.pattern != "role:lm_head" for o in qk.overrides)
    model = fp4train.models.build("tiny")
    fp4train.convert(model, got["tib2d_1d"])
    assert not any(m.spec.fprop.b.is_2d for m in model.modules() if isinstance(m, fp4train.QuantizedLinear))


def test_protocol_budget_by_tokens_per_parameter_matches_the_fixed_protocol_at_20m():
    import compare_protocol

    b = compare_protocol.budget("20m", 0.9)
    assert abs(b["max_steps"] - compare_protocol.PROTOCOL["max_steps"]) <= 5  # 600 steps are 0.9 tokens per parameter
    assert (b["warmup_steps"], b["eval_every"], b["seq_len"]) == (b["max_steps"] // 6, b["max_steps"] // 12, 512)
    big = compare_protocol.budget("60m", 0.9)
    assert 2.5 < big["max_steps"] / b["max_steps"] < 3.0  # 60.4M against 21.7M parameters


def test_scaling_table_reports_both_runs_and_their_gap():
    one = {"tokens_per_s": 80000.0, "final_val_loss": 7.5, "peak_mem_gib": 20.0}
    many = {"tokens_per_s": 150000.0, "final_val_loss": 7.51, "peak_mem_gib": 12.0, "processes": 2}
    d = {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "commit": "abc1234", "date": "2026-12-03", "model": "1b", "gpus": 2,
         "parallel": "ddp", "seq_len": 1024, "global_batch": 8, "steps": 30, "lr": 3e-4, "warmup_steps": 10, "data": "enwiki",
         "results": {"bf16": {"one": one, "many": many, "scaling": 1.875, "steps_compared": 30, "loss_rel_diff_max": 0.004,
                              "loss_rel_diff_last10": 0.001}}}
    lines = tables.scaling_table(d).splitlines()
    assert "2 GPUs (ddp): tokens/s" in lines[0]
    assert lines[2] == "| bf16 | 80.0k | 150.0k | 1.88× | 0.40% | 0.10% | 7.500 / 7.510 |"
    assert "30 steps at lr 0.0003" in lines[-1] and "`python bench/scaling.py --gpus 2 --parallel ddp`" in lines[-1]


def test_a_step_profile_puts_each_kernel_in_one_class_and_tables_the_preparation():
    import profile_step

    cls = {n: profile_step.kernel_class(n) for n in (
        "nvjet_sm90_tss_256x128_64x4_1x2_h_bz_coopA_NNT", "sm90_xmma_gemm_e4m3", "cudnn_generated_fort_native_sdpa_sm90_flash_fprop",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata>", "_hadamard_kernel",
        "triton_per_fused__fused_rms_norm_backward_3", "_scale_output_kernel")}
    assert list(cls.values()) == ["gemm", "gemm", "attention", "optimizer", "other", "other", "other"]  # hadamard is not adam
    d = {"model": "1b", "gpu": "G", "torch": "2.11.0", "commit": "abc1234", "date": "2026-12-03", "batch_size": 8, "seq_len": 2048,
         "steps": 2, "results": [
             {"recipe": "bf16", "total_ms": 200.0, "gemm_ms": 140.0, "attention_ms": 25.0, "optimizer_ms": 12.0, "other_ms": 23.0,
              "top_kernels": [{"name": "nvjet", "class": "gemm", "ms": 40.0, "calls": 80}]},
             {"recipe": "nvfp4", "wall_ms": 400.25, "optimizer_wall_ms": 12.5, "total_ms": 366.5, "gemm_ms": 126.5, "attention_ms": 21.1, "optimizer_ms": 11.7, "other_ms": 207.2,
              "top_kernels": [{"name": "nvjet", "class": "gemm", "ms": 31.9, "calls": 70},
                              {"name": "_cols_kernel", "class": "other", "ms": 34.1, "calls": 98}]},
             {"recipe": "tib2d", "error": "OutOfMemoryError: CUDA out of memory"}]}
    t = tables.profile_table(d)
    assert "| nvfp4 | 400.2 (12.5) | 366.5 | 126.5 | 21.1 | 11.7 | 207.2 | `_cols_kernel` 34.1 × 98 |" in t
    assert "| bf16 | — | 200.0 |" in t  # a row profiled before wall times were taken
    assert "| tib2d | failed |" in t and "`nvjet`" not in t and "python bench/profile_step.py" in t


@pytest.mark.parametrize("gpu", [True, False])
def test_experts_table_gives_each_path_its_ratios_to_bf16_and_its_kernel_time_where_measured(gpu):
    bf16 = {"recipe": "bf16", "ms": 12.0, "grouped_ms": 6.0, "gpu_ms": 10.0 if gpu else None,
            "grouped_gpu_ms": 5.0 if gpu else None}
    nv = {"recipe": "nvfp4", "ms": 24.0, "vs_bf16_looped": 0.5, "vs_bf16_grouped": 0.25, "path": "grouped",
          "gpu_ms": 8.0 if gpu else None, "looped_ms": 48.0, "looped_gpu_ms": 9.0 if gpu else None}
    d = {"model": "moe-x", "experts": 8, "dim": 64, "ffn_dim": 32, "experts_per_token": 2, "tokens": 1024,
         "gpu": "G", "torch": "2.11.0", "commit": "abc1234", "date": "2026-12-04", "results": [bf16, nv]}
    lines = tables.experts_table(d).splitlines()
    if gpu:
        assert lines[0].endswith("| ms | GPU kernels (ms) | × BF16 looped | × BF16 grouped |")
        assert lines[2:6] == ["| bf16, grouped (`torch._grouped_mm`) | 6.00 | 5.00 | 2.00× | 1.00× |",
                              "| bf16, looped | 12.00 | 10.00 | 1.00× | 0.50× |",
                              "| nvfp4, grouped | 24.00 | 8.00 | 0.50× | 0.25× |",
                              "| nvfp4, looped | 48.00 | 9.00 | 0.25× | 0.12× |"]
    else:
        assert "GPU kernels" not in lines[0]
        assert lines[4:6] == ["| nvfp4, grouped | 24.00 | 0.50× | 0.25× |", "| nvfp4, looped | 48.00 | 0.25× | 0.12× |"]


def test_quickstart_table_says_how_far_the_losses_move_with_other_cpu_kernels():
    report = "| recipe | val loss |\n|---|---:|\n| bf16 | 6.44 |\n"
    timing = {"gpu": "cpu", "cores": 2, "torch": "2.13.0+cpu", "commit": "abc1234", "date": "2026-12-05", "cpu": "AVX512",
              "vendor": "GenuineIntel", "results": {"compare_s": 120.0, "compare_disk_mb": 200.0},
              "platforms": [{"kernels": "AVX512", "threads": 2, "vendor": "GenuineIntel", "val_loss": {"bf16": 6.0, "mxfp4": 6.0}},
                            {"kernels": "AVX2", "threads": 2, "vendor": "GenuineIntel", "val_loss": {"bf16": 6.0, "mxfp4": 6.06}},
                            {"kernels": "AVX512", "threads": 1, "vendor": "GenuineIntel", "val_loss": {"bf16": 6.003, "mxfp4": 5.97}}]}
    text = tables.quickstart_table(report, timing)
    assert "_2-core CPU (AVX512 kernels, GenuineIntel): " in text
    assert text.splitlines()[-1] == ("_The same comparison on this machine with other CPU kernels, largest change of a "
                                     "validation loss (BF16 / FP4 rows): AVX2 kernels, 2 threads 0.00% / 1.00%; AVX512 "
                                     "kernels, 1 thread 0.05% / 0.50%._")
    timing["platforms"] = timing["platforms"][:1]
    assert "other CPU kernels" not in tables.quickstart_table(report, timing)


def test_a_folder_of_runs_becomes_one_results_file_and_its_table(tmp_path, monkeypatch):
    """bench/bundle_runs.py keeps of each finished run its summary, settings and curves, in one file that the docs'
    table reads; a run without a summary (unfinished) is left out, and a folder with none is an error."""
    import bundle_runs

    def run(sub, name, loss, compiled):
        d = tmp_path / "r" / sub / name
        d.mkdir(parents=True)
        summary = {"model": "m", "recipe": name, "compile": compiled, "compiled_graphs": 2 if compiled else 0, "steps": 2,
                   "tokens": 64, "final_val_loss": loss, "tokens_per_s": 1000.0, "peak_mem_gib": 1.5, "gpu": "G",
                   "torch": "2.11.0+cu130", "commit": "abc1234"}
        (d / "summary.json").write_text(json.dumps(summary))
        (d / "config.json").write_text(json.dumps({"recipe": name}))
        (d / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "loss": 8.0, "val_loss": %s}\n' % loss)

    run("runs", "bf16", 7.5, False)
    run("runs-compiled", "nvfp4", 7.6, True)
    (tmp_path / "r" / "runs" / "cut-short").mkdir()  # no summary: unfinished
    bundle_runs.main([str(tmp_path / "r"), "runs", "runs-compiled"])
    runs = json.loads((tmp_path / "r" / "runs.json").read_text())["runs"]
    assert list(runs) == ["runs/bf16", "runs-compiled/nvfp4"]
    assert runs["runs/bf16"]["curve"] == [[2, 7.5]] and runs["runs/bf16"]["train_curve"] == [[1, 9.0], [2, 8.0]]
    assert runs["runs-compiled/nvfp4"]["config"] == {"recipe": "nvfp4"}
    monkeypatch.setattr(tables, "RESULTS", tmp_path)
    lines = tables.runs_table("r").splitlines()
    assert lines[2:4] == ["| m bf16 | eager | 2 | 64 | 7.5000 | 1,000 | 1.50 |",
                          "| m nvfp4 | compiled (2 graphs) | 2 | 64 | 7.6000 | 1,000 | 1.50 |"]
    with pytest.raises(FileNotFoundError, match="no finished run"):
        bundle_runs.bundle(tmp_path / "r", ["nowhere"])
