"""Layers reading the same input (q/k/v, gate/up) quantize it once and save one packed copy,
with the same bits as when each quantizes it itself (fp4train/linear/shared_input.py)."""

import dataclasses
import gc

from functools import partial

import pytest
import torch
import torch.nn as nn

import fp4train
from fp4train.linear import function as fn
from fp4train.linear.shared_input import SHARED

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _qkv(spec, backend, seed=0):
    torch.manual_seed(seed)
    return [fp4train.QuantizedLinear.from_linear(nn.Linear(384, n, bias=False).to(DEV), spec, backend=backend)
            for n in (256, 128, 128)]


def _step(layers, x):
    """One forward + backward of three layers on the same input; (outputs, dX, dWs, saved tensors)."""
    saved = []
    xa = x.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        torch.manual_seed(3)
        ys = [layer(xa) for layer in layers]
    sum(y.float().pow(2).sum() for y in ys).backward()
    return [y.detach() for y in ys], xa.grad, [layer.weight.grad for layer in layers], saved


@pytest.fixture
def no_sharing(monkeypatch):
    def off():
        monkeypatch.setattr(SHARED, "get", lambda x, key, make: make())
    return off


# (X's preparations for three layers on one input: shared, each on its own). mxfp4, tib2d: fprop's and
# wgrad's; fp8_blockwise: both from one pass; nvfp4: wgrad's X has random Hadamard signs (RHT, a fresh
# draw per layer), so only fprop's is shared - and the saved X is not.
@pytest.mark.parametrize("recipe,backend,preps", [("mxfp4", "emulated", (2, 6)), ("tib2d", "emulated", (2, 6)),
                                                  ("mxfp4", "fp8_blockwise", (1, 3)), ("nvfp4", "emulated", (4, 6))])
def test_layers_on_one_input_share_its_preparation_bit_for_bit(recipe, backend, preps, monkeypatch, no_sharing):
    spec = fp4train.recipes.get(recipe).linear
    x = torch.randn(64, 384, device=DEV)
    x_preps = []  # preparations of X ([64, 384]; W is [256 | 128, 384], dY [64, 256 | 128])

    def counted(real):
        return lambda t, *a, **k: (x_preps.append(1) if tuple(t.shape) == (64, 384) else None) or real(t, *a, **k)

    monkeypatch.setattr(fn, "prepare", counted(fn.prepare))
    monkeypatch.setattr(fn, "prepare_now", counted(fn.prepare_now))
    if backend == "fp8_blockwise":  # X for fprop and wgrad in one pass (operand_pair)
        from fp4train.backends.fp8_blockwise import Fp8BlockwiseBackend

        real_pair = Fp8BlockwiseBackend.operand_pair
        monkeypatch.setattr(Fp8BlockwiseBackend, "operand_pair", lambda self, t, *a, **k: counted(partial(real_pair, self))(t, *a, **k))
    layers = _qkv(spec, backend)
    shared = _step(layers, x)
    n_shared = len(x_preps)
    SHARED.clear()
    x_preps.clear()
    no_sharing()
    alone = _step(_qkv(spec, backend), x)
    n_alone = len(x_preps)
    assert all(torch.equal(a, b) for a, b in zip(shared[0], alone[0]))  # outputs
    assert torch.equal(shared[1], alone[1])  # dX
    assert all(torch.equal(a, b) for a, b in zip(shared[2], alone[2]))  # dW
    assert (n_shared, n_alone) == preps

    def saved_bytes(ts):
        return sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in ts}.values())

    if recipe != "nvfp4":
        assert saved_bytes(shared[3]) < saved_bytes(alone[3])  # one packed X saved for backward, not three
    else:
        assert saved_bytes(shared[3]) == saved_bytes(alone[3])


def test_stochastic_or_randomly_signed_operands_are_never_shared():
    """Two layers with one weight on one input: under stochastic rounding of X each draws its own
    rounding (outputs differ - a shared X would make them equal); under nearest they are equal."""
    base = fp4train.recipes.get("mxfp4").linear
    sr = dataclasses.replace(base.fprop.a, rounding="stochastic")
    assert not fn.deterministic(sr, None) and fn.deterministic(base.fprop.a, None)
    assert not fn.deterministic(base.fprop.a, fp4train.recipes.TransformSpec(block=32, random_signs=True))
    assert fn.deterministic(base.fprop.a, fp4train.recipes.TransformSpec(block=32))
    lin = nn.Linear(384, 128, bias=False).to(DEV)
    x = torch.randn(64, 384, device=DEV)
    for spec, same in ((dataclasses.replace(base, fprop=dataclasses.replace(base.fprop, a=sr)), False), (base, True)):
        a, b = (fp4train.QuantizedLinear.from_linear(lin, spec) for _ in range(2))
        with torch.no_grad():
            assert torch.equal(a(x), b(x)) is same


def test_the_memo_follows_its_input():
    x = torch.randn(64, 256)
    made = []
    make = lambda: made.append(1) or len(made)
    assert SHARED.get(x, "k", make) == 1 and SHARED.get(x.view(64, 256), "k", make) == 1  # a view of the same tensor
    x.mul_(2)  # changed in place: prepared again
    assert SHARED.get(x, "k", make) == 2
    assert SHARED.get(x, None, make) == 3 and SHARED.get(x, None, make) == 4  # no key: never shared
    y = torch.randn(64, 256)
    assert SHARED.get(y, "k", make) == 5 and SHARED.get(x, "k", make) == 6  # another input replaces the memo
    del x
    gc.collect()
    assert not SHARED._entries  # released with its input: the memo holds no memory past it
    with torch.inference_mode():
        z = torch.randn(4, 4)
        assert SHARED.get(z, "k", make) == 7 and SHARED.get(z, "k", make) == 8  # inference tensors: not memoized
