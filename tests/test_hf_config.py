"""fp4train train --hf-config: any Hugging Face causal LM from its config, trained, evaluated and exported."""

import json
import math

import pytest
import torch

from fp4train.cli import main
from fp4train.evaluate import evaluate
from fp4train.export import export_hf, load_model
from fp4train.train import TrainConfig, Trainer

transformers = pytest.importorskip("transformers")

MIXTRAL = {"model_type": "mixtral", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
           "max_position_embeddings": 128}


def _config(tmp_path, d=MIXTRAL, name="config.json"):
    folder = tmp_path / "cfg"
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(json.dumps(d))
    return folder


def test_a_mixtral_style_config_trains_evaluates_and_exports(tmp_path):
    """From a config folder: the model is the transformers one (vocabulary raised to the tokenizer's), its loss
    falls over 20 steps, and eval and export rebuild it from the checkpoint; the exported folder loads in
    transformers with the run's own logits."""
    logs = []
    cfg = TrainConfig(hf_config=str(_config(tmp_path)), recipe="bf16", seq_len=32, batch_size=4, max_steps=20, lr=3e-3,
                      warmup_steps=2, eval_every=0, eval_batches=1, log_every=1, progress=False, tensorboard=False, device="cpu",
                      out=str(tmp_path / "run"))
    Trainer(cfg, log=logs.append).run()
    assert any("vocab_size 128 raised to the tokenizer's" in m for m in logs)
    assert any("model MixtralForCausalLM from" in m for m in logs)
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert len(losses) >= 20 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5
    res = evaluate(tmp_path / "run", None, device="cpu", max_tokens=500, log=lambda m: None)
    assert math.isfinite(res["loss"]) and res["step"] == 20
    export_hf(tmp_path / "run", tmp_path / "hf", dtype="float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    model, _ = load_model(tmp_path / "run")
    assert type(hf).__name__ == "MixtralForCausalLM"
    idx = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx), atol=1e-4, rtol=1e-4)


def test_bad_hf_configs_are_refused_in_one_line(tmp_path, capsys):
    base = ["train", "--recipe", "bf16", "--max-steps", "1", "--seq-len", "32", "--batch-size", "2", "--device", "cpu",
            "--no-progress", "--out", str(tmp_path / "r")]
    cases = [
        (str(tmp_path / "none.json"), "no such file"),
        (str(tmp_path / "empty"), "the folder has no config.json"),
        (str(_config(tmp_path, {"hidden_size": 64}, "a.json") / "a.json"), "names its model_type"),
        (str(_config(tmp_path, {"model_type": "nonsense"}, "b.json") / "b.json"), "does not know model_type 'nonsense'"),
        (str(_config(tmp_path, {"model_type": "vit"}, "c.json") / "c.json"), "has no vocab_size"),
        (str(_config(tmp_path, {"model_type": "t5", "vocab_size": 128}, "e.json") / "e.json"), "'t5' has no causal LM in transformers"),
        (str(_config(tmp_path, MIXTRAL | {"max_position_embeddings": 16}, "d.json") / "d.json"), "--seq-len 32 exceeds the positions"),
    ]
    (tmp_path / "empty").mkdir()
    for path, msg in cases:
        assert main(base + ["--hf-config", path, "--overwrite"]) == 2
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1, (path, err[-400:])
