"""fp4train train --hf-config: any Hugging Face causal LM from its config, trained, evaluated and exported."""

import json
import math
import warnings

import pytest
import torch

import fp4train

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


LLAMA = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}
BERT = {"model_type": "bert", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 128, "attention_probs_dropout_prob": 0.0, "hidden_dropout_prob": 0.0}
_CLI = ["train", "--recipe", "bf16", "--max-steps", "1", "--seq-len", "32", "--batch-size", "2", "--device", "cpu",
        "--no-progress", "--eval-every", "0"]


def _refused(tmp_path, capsys, config: dict, name: str, *extra) -> str:
    folder = _config(tmp_path, config, name)
    out, cache = tmp_path / f"run-{name}", tmp_path / f"cache-{name}"
    assert main(_CLI + ["--hf-config", str(folder / name), "--out", str(out), "--cache-dir", str(cache), *extra]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not out.exists() and not cache.exists()  # refused before the run folder, the tokenized data or the model
    return err


def test_a_config_that_is_not_a_causal_lm_is_refused_before_anything_is_built(tmp_path, capsys):
    """An encoder (BERT without is_decoder) trained as a causal LM would see its own targets; an encoder-decoder is not a
    decoder-only LM: both are refused in one line naming the field, before tokenizing or building."""
    err = _refused(tmp_path, capsys, BERT, "bert.json")
    assert "'bert' is an encoder" in err and 'set "is_decoder": true' in err
    err = _refused(tmp_path, capsys, {"model_type": "bart", "vocab_size": 128, "d_model": 64}, "bart.json")
    assert '"is_encoder_decoder": true' in err
    assert main(_CLI + ["--hf-config", str(_config(tmp_path, BERT | {"is_decoder": True}, "dec.json") / "dec.json"),
                        "--out", str(tmp_path / "dec")]) == 0  # a BERT decoder is causal: it trains


def test_a_model_whose_earlier_logits_see_later_tokens_is_refused():
    """The structural check behind the config's: whatever the config says, a built model whose logits at a position move
    with a later token is not trained as a causal LM."""
    from fp4train.models import hf

    torch.manual_seed(0)
    bidirectional = hf.HFCausalLM(transformers.BertConfig(**{k: v for k, v in BERT.items() if k != "model_type"}))
    with pytest.raises(ValueError, match="logits at earlier positions change with a later token"):
        hf.check_causal(bidirectional, "--hf-config bert")
    causal = hf.HFCausalLM(transformers.BertConfig(**{k: v for k, v in BERT.items() if k != "model_type"}, is_decoder=True))
    hf.check_causal(causal, "--hf-config bert")
    assert causal.training  # the probe runs in eval mode and leaves the mode as it was


def test_model_and_hf_config_together_are_refused_and_a_run_records_the_config_it_trained(tmp_path, capsys):
    for model in ("60m", "tiny"):  # the default named explicitly is refused too
        err = _refused(tmp_path, capsys, LLAMA, "llama.json", "--model", model)
        assert f"--model {model} and --hf-config" in err and "both name the model to train" in err
    with pytest.raises(ValueError, match="both name the model to train"):
        TrainConfig(model="60m", hf_config="x.json")
    path = str(_config(tmp_path, LLAMA, "llama.json") / "llama.json")
    assert main(_CLI + ["--hf-config", path, "--out", str(tmp_path / "run")]) == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["model"] == f"hf:{path}"


def test_the_trainer_converts_a_hugging_face_model_as_convert_does(tmp_path):
    """``--hf-config`` + fullstack: the trainer's model runs the NVFP4 attention, and its logits equal those of the same
    transformers model converted with ``fp4train.convert`` directly (one recipe, one numerics, whichever entry point)."""
    from fp4train.attention import HF_NAME

    cfg = TrainConfig(hf_config=str(_config(tmp_path, LLAMA) / "config.json"), recipe="fullstack", seq_len=32, batch_size=2,
                      max_steps=1, progress=False, tensorboard=False, device="cpu", out=str(tmp_path / "run"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "quantizes attention, but ..." warning: the attention is switched
        trainer = Trainer(cfg, log=lambda m: None, checkpoints=False)
    wrapped = trainer.model.hf
    assert wrapped.config._attn_implementation == HF_NAME
    config = transformers.AutoConfig.for_model(**LLAMA | {"vocab_size": wrapped.config.vocab_size})
    torch.manual_seed(cfg.seed)
    direct = transformers.AutoModelForCausalLM.from_config(config)
    fp4train.convert(direct, "fullstack")
    direct.load_state_dict(wrapped.state_dict())
    assert direct.config._attn_implementation == HF_NAME
    idx = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(trainer.model(idx), direct(input_ids=idx, use_cache=False).logits)
    trainer.close()


def test_an_attention_the_recipe_cannot_run_is_refused_at_conversion_before_any_change():
    """GPT-2 with attention dropout under a recipe with NVFP4 attention: refused by convert, naming the config field,
    with every layer as it was (not at the first forward pass)."""

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=128, n_positions=64))
    assert model.config.attn_pdrop > 0
    with pytest.raises(ValueError, match=r"quantizes attention \(NVFP4\).*attention dropout attn_pdrop=0.1: set it to 0"):
        fp4train.convert(model, "fullstack")
    assert not any(isinstance(m, fp4train.QuantizedLinear) for m in model.modules())
    assert model.config._attn_implementation != "fp4train_nvfp4"
    gemma = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
        "gemma2", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, attn_logit_softcapping=50.0))
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0: set it to null"):
        fp4train.convert(gemma, "fullstack")
    model.config.attn_pdrop = 0.0
    fp4train.convert(model, "fullstack")  # with the field changed as the error says, it converts
    assert model.config._attn_implementation == "fp4train_nvfp4"
