"""Probe: what stops torch.compile from tracing the quantized linear as part of the model's graph?

Issue #5's peak-memory and host-overhead findings point at the graph break at every quantized linear
(``torch.compiler.disable`` in ``linear/module.py``). This probe lifts that break for a small MLP on the
CPU (``emulated`` backend, reference numerics) and reports, per recipe:

1. graph breaks that ``torch._dynamo.explain`` finds with the shared-input memo in place, then without
   it (``linear/shared_input.SHARED`` keys on ``x.is_inference()`` and ``x.storage_offset()``);
2. whether one compiled forward + backward, with every stochastic-rounding seed pinned, gives the
   eager gradients bit for bit;
3. whether, with fresh seeds drawn inside the graph (``counter_rng.fresh_seed``), the compiled
   gradients still equal eager ones from the same ``torch.manual_seed``.

    python scripts/probes/trace_quantized_linear.py --recipes mxfp4,tib2d

Kept as the record of session 10's finding; what it led to is ``fp4train/linear/graph_op.py`` (session 11):
under torch.compile the quantized linear is now torch.library ops, with the seed drawn inside the op.
The probe still lifts the older graph break (``_UNCOMPILED``) to trace the layer's Python itself.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn

import fp4train
import fp4train.linear.function as function
import fp4train.linear.module as module


def _model(recipe: str) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    fp4train.convert(m, recipe)
    module._make_uncompiled()
    module.set_in_graph(False)  # not the graph op: the layer's own Python, traced by dynamo
    module._UNCOMPILED = module.QuantizedLinear._quantized  # lift the graph break
    return m


def _grads(m: nn.Module, fwd, x, seed: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    m.zero_grad()
    fwd(x).square().sum().backward()
    return [m[0].weight.grad.clone(), m[2].weight.grad.clone()]


def probe(recipe: str) -> dict:
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    m = _model(recipe)
    breaks_memo = torch._dynamo.explain(m)(x).graph_break_count
    get = function.SHARED.get
    function.SHARED.get = lambda t, key, make: make()  # no memo
    fresh = module.fresh_seed
    try:
        torch._dynamo.reset()
        breaks = torch._dynamo.explain(m)(x).graph_break_count
        module.fresh_seed = lambda: 12345  # pinned seeds
        torch._dynamo.reset()
        pinned = all(torch.equal(a, b) for a, b in zip(_grads(m, m, x, 2), _grads(m, torch.compile(m, fullgraph=True), x, 2)))
        module.fresh_seed = fresh
        torch._dynamo.reset()
        drawn = all(torch.equal(a, b) for a, b in zip(_grads(m, m, x, 2), _grads(m, torch.compile(m, fullgraph=True), x, 2)))
    finally:
        function.SHARED.get, module.fresh_seed = get, fresh
        torch._dynamo.reset()
    return {"recipe": recipe, "breaks_with_memo": breaks_memo, "breaks_without_memo": breaks,
            "pinned_seeds_equal_eager": pinned, "fresh_seeds_equal_eager": drawn}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipes", default="mxfp4,tib2d")
    args = ap.parse_args(argv)
    for r in args.recipes.split(","):
        print(probe(r), flush=True)


if __name__ == "__main__":
    main()
