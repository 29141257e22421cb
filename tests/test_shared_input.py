"""Layers reading the same input (q/k/v, gate/up) quantize it once and save one packed copy,
with the same bits as when each quantizes it itself (fp4train/linear/shared_input.py: eagerly, the
memo of one converted model; under torch.compile the compiler merges the prepare_x calls)."""

import dataclasses
import gc

import pytest
import torch
import torch.nn as nn

import fp4train
from fp4train.linear import gemms as fn
from fp4train.linear.shared_input import SharedInput

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _qkv(spec, backend, memo, seed=0, numerics="triton"):
    torch.manual_seed(seed)
    return [fp4train.QuantizedLinear.from_linear(nn.Linear(384, n, bias=False).to(DEV), spec, backend=backend, numerics=numerics,
                                                 shared_input=memo)
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


# X's preparation for fprop and wgrad is shared where it is deterministic and the backend prepares its own
# operands with Triton numerics (MXFP4 pairs, FP8 rowwise, MXFP4 with a fused Hadamard); nvfp4's wgrad X has random
# Hadamard signs (RHT, a fresh draw per layer): nothing shared.
@pytest.mark.parametrize("recipe,shared", [("mxfp4", True), ("tib2d", True), ("fp8_rowwise", True), ("hadamard_mxfp4", True),
                                           ("nvfp4", False)])
def test_layers_on_one_input_share_its_preparation_bit_for_bit(recipe, shared):
    spec = fp4train.recipes.get(recipe).linear
    x = torch.randn(64, 384, device=DEV)
    memo = SharedInput()
    together = _step(_qkv(spec, "fp8_blockwise", memo), x)
    assert bool(memo._entries) == shared
    alone = _step(_qkv(spec, "fp8_blockwise", None), x)  # each layer its own memo
    assert all(torch.equal(a, b) for a, b in zip(together[0], alone[0]))  # outputs
    assert torch.equal(together[1], alone[1])  # dX
    assert all(torch.equal(a, b) for a, b in zip(together[2], alone[2]))  # dW

    def saved_bytes(ts):
        return sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in ts}.values())

    if shared:
        assert saved_bytes(together[3]) < saved_bytes(alone[3])  # one packed X saved for backward, not three
    else:
        assert saved_bytes(together[3]) == saved_bytes(alone[3])


def test_converting_a_model_gives_its_layers_one_memo_and_copies_start_empty():
    import copy

    m = fp4train.convert(nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 128)), "mxfp4")
    other = fp4train.convert(nn.Sequential(nn.Linear(128, 128)), "mxfp4")
    assert m[0].shared_input is m[1].shared_input and other[0].shared_input is not m[0].shared_input
    c = copy.deepcopy(m)
    assert c[0].shared_input is c[1].shared_input and c[0].shared_input is not m[0].shared_input


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
    SHARED = SharedInput()
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
