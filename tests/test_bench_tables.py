"""bench/tables.py's logic on a tiny case: ratios against the run's own BF16, failed rows, block replacement."""

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("tables", Path(__file__).resolve().parent.parent / "bench/tables.py")
tables = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tables)


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
    assert "reduce-overhead" in lines[-1] and lines[-1].count("commit abc1234") == 1


def test_replace_blocks_rewrites_only_named_blocks():
    text = "a\n<!-- table:train -->\nold\n<!-- /table -->\nb\n<!-- table:other -->\nkeep\n<!-- /table -->\n"
    out = tables.replace_blocks(text, {"train": "new"})
    assert out == "a\n<!-- table:train -->\nnew\n<!-- /table -->\nb\n<!-- table:other -->\nkeep\n<!-- /table -->\n"
