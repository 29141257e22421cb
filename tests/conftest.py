import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run in Triton's interpreter on a CPU (small shapes). Triton decides at import
    # whether it interprets, so this is set here, before any test module imports it.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 10 log10(|ref|^2 / |ref - approx|^2)."""
    ref, approx = ref.detach().double(), approx.detach().double()
    noise = (ref - approx).pow(2).sum()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(ref.pow(2).sum() / noise))


@pytest.fixture
def sqnr():
    return sqnr_db


#: a two-layer Hugging Face Llama-style model small enough for CPU tests (transformers' config arguments)
TINY_HF = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2)


@pytest.fixture
def tiny_hf_config():
    """``make(config_class_name="LlamaConfig", **overrides)``: a tiny Hugging Face config (skips without transformers)."""
    transformers = pytest.importorskip("transformers")

    def make(name: str = "LlamaConfig", **overrides):
        return getattr(transformers, name)(**{**TINY_HF, **overrides})

    return make


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="also run the slow checks (marked slow: ahead-of-time compiles)")


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped on CPU-only machines)")
    config.addinivalue_line("markers", "slow: minutes long; skipped unless --runslow (run them before touching kernels)")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--runslow"):
        slow = pytest.mark.skip(reason="slow check: run with --runslow")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU here; run on the device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _isolated_token_cache(tmp_path_factory):
    """Tokenized data goes to a per-session folder, never the user's ~/.cache."""
    import os

    old = os.environ.get("FP4TRAIN_CACHE")
    os.environ["FP4TRAIN_CACHE"] = str(tmp_path_factory.mktemp("token_cache"))
    yield
    if old is None:
        os.environ.pop("FP4TRAIN_CACHE", None)
    else:
        os.environ["FP4TRAIN_CACHE"] = old


def run_layer(lin, spec, x, dy, *, backend: str = "emulated", numerics: str = "eager"):
    """One forward + backward of ``lin`` converted to ``spec`` on ``backend`` with ``numerics``: ``(Y, dX, dW)``.
    The stochastic-rounding seeds are fixed (``torch.manual_seed(1)``), so two calls that differ
    only in how the numerics run must give the same bits."""
    import fp4train

    layer = fp4train.QuantizedLinear.from_linear(lin, spec, backend=backend, numerics=numerics)
    torch.manual_seed(1)
    xa = x.clone().requires_grad_()
    lin.weight.grad = None
    y = layer(xa)
    y.backward(dy)
    return y.detach(), xa.grad, lin.weight.grad.clone()


def layer_spec_of(name: str):
    """A preset's LinearSpec, ``"adahop-oe"`` (outlier extraction in fprop and wgrad, IHT in dgrad), or
    ``"tib2d-qk"`` (tib2d's MXFP8 q/k projections)."""
    import fp4train
    from fp4train.adahop.calibration import layer_spec

    if name == "adahop-oe":
        return layer_spec({"fprop": "oe", "dgrad": "iht", "wgrad": "oe"},
                          {"fprop": ("outer", "none"), "dgrad": ("none", "none"), "wgrad": ("none", "outer")}, k=4)
    if name == "tib2d-qk":
        return fp4train.recipes.get("tib2d").spec_for("model.layers.0.self_attn.q_proj")
    return fp4train.recipes.get(name).linear


@pytest.fixture
def layer_run():
    return run_layer


@pytest.fixture
def spec_of():
    return layer_spec_of


def tiny_loss_curve(out, recipe: str, steps: int, device: str, **cfg) -> list[float]:
    """Train ``tiny`` (sequence 32, batch 2, the default seed and data) for ``steps`` steps into ``out``
    with the given TrainConfig fields (``backend=``, ``numerics=``): the training loss at every step."""
    import json

    from fp4train.train import TrainConfig, train

    train(TrainConfig(model="tiny", recipe=recipe, seq_len=32, batch_size=2, max_steps=steps, log_every=1, eval_every=0,
                      eval_batches=1, ckpt_every=0, out=str(out), progress=False, tensorboard=False, device=device, **cfg))
    return [json.loads(ln)["loss"] for ln in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in ln]


@pytest.fixture
def tiny_curve():
    return tiny_loss_curve
