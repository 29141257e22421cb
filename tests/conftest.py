import pytest
import torch


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


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped on CPU-only machines)")


def pytest_collection_modifyitems(config, items):
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
