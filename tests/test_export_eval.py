"""fp4train export (a Hugging Face folder with fp4train's logits) and fp4train eval (loss on any text)."""

import json
from pathlib import Path

import pytest
import torch

from fp4train.cli import main
from fp4train.evaluate import evaluate
from fp4train.export import export_hf, load_model
from fp4train.train import TrainConfig, Trainer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name, model, recipe in (("bf16", "tiny", "bf16"), ("fullstack", "tiny", "fullstack"), ("moe", "moe-tiny", "nvfp4")):
        d = tmp_path_factory.mktemp(name)
        cfg = TrainConfig(model=model, recipe=recipe, seq_len=32, batch_size=2, max_steps=2, eval_every=0, eval_batches=1,
                          log_every=1, progress=False, tensorboard=False, device="cpu", out=str(d / "run"))
        Trainer(cfg, log=lambda m: None).run()
        out[name] = d / "run"
    return out


@pytest.mark.parametrize("recipe", ["bf16", "fullstack", "moe"])
def test_export_loads_in_transformers_with_fp4trains_logits(runs, recipe, tmp_path):
    """The exported folder gives fp4train's logits in transformers (a mixture of experts as Mixtral: the same
    router arithmetic and expert layout)."""
    export_hf(runs[recipe], tmp_path / "hf", dtype="float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    model, ck = load_model(runs[recipe])
    if recipe == "fullstack":  # LoRA-SVD merged: the factors are gone, their product is in the weight
        assert any(k.endswith(".lora_a") for k in ck["model"]) and not any("lora" in k for k in model.state_dict())
    idx = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(hf(idx).logits, model(idx), atol=1e-4, rtol=1e-4)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.eos_token is not None and len(tok("To be or not")["input_ids"]) > 0
    with pytest.raises(ValueError, match="not empty"):
        export_hf(runs[recipe], tmp_path / "hf")


def test_eval_gives_the_recipes_forward_and_the_plain_one(runs, tmp_path, capsys):
    plain = evaluate(runs["bf16"], None, forward="bf16", max_tokens=3000, log=lambda m: None)
    as_trained = evaluate(runs["bf16"], None, forward="recipe", max_tokens=3000, log=lambda m: None)
    assert plain["loss"] == as_trained["loss"] and plain["tokens"] == 3000 // 33 * 32
    fq = evaluate(runs["fullstack"], None, forward="recipe", max_tokens=3000, log=lambda m: None)
    fb = evaluate(runs["fullstack"], None, forward="bf16", max_tokens=3000, log=lambda m: None)
    assert fq["loss"] != fb["loss"] and abs(fq["loss"] - fb["loss"]) < 0.05 * fb["loss"]  # quantized, and close
    assert main(["eval", "--run", str(runs["bf16"]), "--max-tokens", "3000", "--json", str(tmp_path / "e.json")]) == 0
    assert json.loads((tmp_path / "e.json").read_text())["loss"] == pytest.approx(plain["loss"])
    assert "perplexity" in capsys.readouterr().out


def test_eval_and_export_refuse_bad_input_in_one_line(runs, tmp_path, capsys):
    assert main(["eval", "--run", str(tmp_path / "none")]) == 2
    assert "is not a run directory" in capsys.readouterr().err
    (tmp_path / "short.txt").write_text("too short")
    assert main(["eval", "--run", str(runs["bf16"]), "--data", str(tmp_path / "short.txt")]) == 2
    assert "fewer than one window" in capsys.readouterr().err


def test_generate_continues_a_prompt_reproducibly(runs, capsys):
    from fp4train.evaluate import generate

    a = generate(runs["fullstack"], "To be", max_new_tokens=8, seed=3)
    assert a == generate(runs["fullstack"], "To be", max_new_tokens=8, seed=3)  # seeded
    assert generate(runs["bf16"], "To be", max_new_tokens=5, temperature=0) == generate(runs["bf16"], "To be",
                                                                                      max_new_tokens=5, temperature=0, seed=9)
    assert main(["generate", "--run", str(runs["bf16"]), "--prompt", "To be", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("To be")
    with pytest.raises(ValueError, match="max-new-tokens"):
        generate(runs["bf16"], "x", max_new_tokens=0)


def test_compare_eval_data_adds_loss_on_other_text_and_reuses_it(tmp_path):
    from fp4train.train.compare import compare

    base = TrainConfig(model="tiny", seq_len=32, batch_size=2, max_steps=2, eval_every=0, eval_batches=1, log_every=1,
                       progress=False, tensorboard=False, device="cpu")
    ood = tmp_path / "ood.txt"
    ood.write_text("Engines and trains, rivers and bridges. " * 300)
    (tmp_path / "x.md").write_text("# not a text source fp4train reads")
    with pytest.raises(ValueError, match="unsupported data file"):  # refused before any training
        compare(base, ["nvfp4"], [0], tmp_path / "cmp", eval_data=[str(tmp_path / "x.md")])
    assert not (tmp_path / "cmp" / "runs").exists()
    rep = compare(base, ["nvfp4"], [0], tmp_path / "cmp", eval_data=[str(ood)], eval_tokens=2000)
    ev = {r: x["eval"]["ood.txt"] for r, x in rep["recipes"].items()}
    assert ev["bf16"]["gap_pct_mean"] == 0 and ev["nvfp4"]["loss_mean"] > 0
    assert "Loss on `ood.txt`" in (tmp_path / "cmp" / "report.md").read_text()
    kept = tmp_path / "cmp" / "runs" / "nvfp4-seed0" / "eval-ood.txt.json"
    before = kept.stat().st_mtime_ns
    compare(base, ["nvfp4"], [0], tmp_path / "cmp", eval_data=[str(ood)], eval_tokens=2000)
    assert kept.stat().st_mtime_ns == before  # a finished run's evaluation is reused


def test_compare_gives_each_recipe_its_own_optimizer_unless_one_is_named(tmp_path, monkeypatch):
    import fp4train.train.compare as cmp

    seen = {}
    monkeypatch.setattr(cmp, "train", lambda cfg, **kw: seen.__setitem__(Path(cfg.out).name, (cfg.recipe, cfg.optimizer)))
    monkeypatch.setattr(cmp, "write_report", lambda *a, **kw: {})
    base = TrainConfig(model="tiny", seq_len=32, batch_size=2, max_steps=2, progress=False, tensorboard=False, device="cpu")
    cmp.compare(base, ["fullstack", "fullstack_qadamw"], [0], tmp_path / "a", recipe_optimizers=True)
    # fullstack trains with Q-Root: BF16 with Root + AdamW is run beside it as its baseline (the paper's pairing)
    assert seen == {"bf16-seed0": ("bf16", "adamw"), "bf16-root-seed0": ("bf16", "root"), "fullstack-seed0": ("fullstack", "qroot"),
                    "fullstack_qadamw-seed0": ("fullstack_qadamw", "qadamw")}
    seen.clear()
    cmp.compare(base, ["fullstack"], [0], tmp_path / "b")  # the base's optimizer, named: every run takes it
    assert seen == {"bf16-seed0": ("bf16", "adamw"), "fullstack-seed0": ("fullstack", "adamw")}
    assert main(["compare", "--model", "tiny", "--recipes", "fullstack", "--max-steps", "2", "--seq-len", "32",
                 "--batch-size", "2", "--out", str(tmp_path / "c"), "--no-progress"]) == 0
    assert seen["fullstack-seed0"] == ("fullstack", "qroot") and seen["bf16-root-seed0"] == ("bf16", "root")


def test_a_root_trained_recipe_is_measured_against_bf16_trained_with_root(tmp_path):
    """The report pairs a recipe trained with Root with BF16 trained with Root + AdamW, says so, and leaves it out
    while that baseline is unfinished; every other recipe (and the Root baseline itself) against BF16 with AdamW."""
    import fp4train.train.compare as cmp

    def run(name, seed, loss, optimizer):
        d = tmp_path / "runs" / cmp.run_name(name, seed)
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"final_val_loss": loss, "seed": seed, "optimizer": optimizer, "model": "tiny",
                                                    "tokens": 10, "steps": 2, "device": "cpu", "tokens_per_s": None,
                                                    "peak_mem_gib": None}))
        (d / "metrics.jsonl").write_text(json.dumps({"step": 2, "val_loss": loss}) + "\n")

    for s, (b, r, f, m) in enumerate([(4.0, 3.9, 4.1, 4.2), (4.2, 4.0, 4.2, 4.4)]):
        run("bf16", s, b, "adamw")
        run("fullstack", s, f, "qroot")
        run("mxfp4", s, m, "adamw")
        if s == 0:
            run("bf16-root", s, r, "root")
    recipes = ["bf16", "bf16-root", "fullstack", "mxfp4"]
    rep = cmp.write_report(tmp_path, recipes, [0, 1])
    assert "fullstack" in rep["unfinished"] and "fullstack" not in rep["recipes"]  # its baseline is not done for seed 1
    run("bf16-root", 1, 4.0, "root")
    rep = cmp.write_report(tmp_path, recipes, [0, 1])
    full, mx, root = rep["recipes"]["fullstack"], rep["recipes"]["mxfp4"], rep["recipes"]["bf16-root"]
    assert full["baseline"] == "bf16-root" and mx["baseline"] == root["baseline"] == "bf16"
    assert full["gap_pct_per_seed"] == pytest.approx({"0": (4.1 / 3.9 - 1) * 100, "1": (4.2 / 4.0 - 1) * 100})
    assert mx["gap_pct_per_seed"] == pytest.approx({"0": 5.0, "1": (4.4 / 4.2 - 1) * 100})
    assert "gap is to `bf16-root`" in (tmp_path / "report.md").read_text()


def test_a_report_of_runs_on_two_gpus_names_each_gpus_recipes(tmp_path):
    """A comparison continued on another machine (a recipe added later): the report names every GPU and what ran on
    it, not the first run's alone."""
    import fp4train.train.compare as cmp

    def run(name, seed, loss, gpu):
        d = tmp_path / "runs" / cmp.run_name(name, seed)
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"final_val_loss": loss, "seed": seed, "optimizer": "adamw", "model": "tiny",
                                                    "tokens": 10, "steps": 2, "device": "cuda", "gpu": gpu,
                                                    "tokens_per_s": 5.0, "peak_mem_gib": None}))
        (d / "metrics.jsonl").write_text(json.dumps({"step": 2, "val_loss": loss}) + "\n")

    run("bf16", 0, 4.0, "NVIDIA H200")
    run("mxfp4", 0, 4.1, "NVIDIA H100 80GB HBM3")
    rep = cmp.write_report(tmp_path, ["bf16", "mxfp4"], [0])
    assert rep["hardware"] == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"] and rep["recipes"]["mxfp4"]["hardware"] == [
        "NVIDIA H100 80GB HBM3"]
    assert ("Hardware: NVIDIA H100 80GB HBM3 (mxfp4); NVIDIA H200 (bf16) - tokens/s compare within one."
            in (tmp_path / "report.md").read_text())
    run("mxfp4", 1, 4.1, "NVIDIA H200")
    run("bf16", 1, 4.0, "NVIDIA H200")
    rep = cmp.write_report(tmp_path, ["bf16", "mxfp4"], [1])
    assert "Hardware: NVIDIA H200. Date" in (tmp_path / "report.md").read_text()
