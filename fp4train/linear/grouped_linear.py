"""The quantized linear of a mixture of experts' stacked weights: every expert's GEMMs in grouped calls.

The tokens come sorted by expert, each expert's rows zero-padded to whole groups (``sizes``). Each expert's six
operands are prepared exactly as that expert's weight would prepare them as a quantized linear of its own on its
rows (the layer's operand plan for BF16 tensor cores, :mod:`fp4train.linear.plan`; NVFP4's tensor scale per
expert, one seed per expert and call drawn as the linear op draws it), and each of the three GEMMs multiplies
all experts at once (:mod:`fp4train.backends.grouped`). What forward keeps for backward is what the linear op
keeps, per expert - held by the autograd function's context, not passed through ``save_for_backward``, so saved-
tensor hooks (activation offloading) do not see them. Not for GEMMs under outlier extraction or seeds drawn on the
device: those experts run as quantized linears one after another (:mod:`fp4train.linear.experts`).
"""

from __future__ import annotations

import itertools

import torch

from ..backends import grouped
from ..counter_rng import fresh_seed
from ..quantizer import kernels_usable_on
from ..recipes.spec import LinearSpec
from .gemms import backward_operands, fprop_operands, saved_operands
from .layer_config import LayerConfig, config_key, parse
from .op import call_settings
from .plan import plan_for

#: the backend whose operand plans the grouped GEMMs execute: BF16 tensor cores (exact BF16 splits)
BACKEND = "emulated"


def groupable(spec: LinearSpec, device_seeds: bool) -> bool:
    """Can an experts projection with ``spec`` run as grouped GEMMs (no outlier extraction, host seeds)?"""
    return not device_seeds and all(g.outliers is None for g in (spec.fprop, spec.dgrad, spec.wgrad))


def _expert_weight(w3: torch.Tensor, e: int, transposed: bool) -> torch.Tensor:
    return w3[e].mT if transposed else w3[e]  # [out, in]


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w3, b3, key, sizes, transposed, out_dtype, save_x, save_w):
        cfg = parse(key)
        spec, backend = cfg.spec, cfg.backend
        n = w3.shape[2] if transposed else w3.shape[1]
        starts = [0, *itertools.accumulate(sizes)][:-1]
        active = [e for e, s in enumerate(sizes) if s]
        usable = kernels_usable_on(x)
        plans, seeds, xs_saved, ws_saved, xas, wbs = [], [], [], [], [], []
        with torch.autocast(x.device.type, enabled=False):
            for e in active:
                xe, we = x[starts[e]:starts[e] + sizes[e]], _expert_weight(w3, e, transposed)
                plan = plan_for(key, sizes[e], x.shape[1], n, x.dtype, w3.dtype, out_dtype, x.is_cuda,
                                usable, save_x, save_w)
                seed = fresh_seed() if spec.needs_seed else 0
                xa, wb, _ = fprop_operands(xe, we, spec, plan, backend, seed, out_dtype)
                x_saved, w_saved = saved_operands(xe, xa, wb, None, spec, plan, backend, seed, out_dtype,
                                                  save_x=save_x, save_w=save_w)
                plans.append(plan), seeds.append(seed), xas.append(xa), wbs.append(wb)
                xs_saved.append(x_saved), ws_saved.append(w_saved)
            if not active:
                y = x.new_zeros((0, n), dtype=out_dtype)
            else:
                y = grouped.grouped_rows(xas, wbs, out_dtype, kernels=plans[0].gemms["fprop"].kernels)
            if b3 is not None and active:
                counts = torch.tensor([sizes[e] for e in active], device=x.device)
                y = y + b3[active].to(out_dtype).repeat_interleave(counts, dim=0, output_size=y.shape[0])
        ctx.save_for_backward(w3)
        ctx.state = (cfg, sizes, starts, active, plans, seeds, xs_saved, ws_saved, transposed, out_dtype, x.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        (w3,) = ctx.saved_tensors
        cfg, sizes, starts, active, plans, seeds, xs_saved, ws_saved, transposed, cdt, x_dtype = ctx.state
        needs = tuple(ctx.needs_input_grad[:3])
        spec, backend = cfg.spec, cfg.backend
        dx = dw = db = None
        dys_dgrad, ws_q, dys_wgrad = [], [], []
        with torch.autocast(dy.device.type, enabled=False):
            dy = dy.to(cdt)
            for i, e in enumerate(active):
                dye = dy[starts[e]:starts[e] + sizes[e]]
                d_a, w_q, w_a = backward_operands(dye, _expert_weight(w3, e, transposed), ws_saved[i], spec, plans[i],
                                                  backend, seeds[i], cdt, needs)
                dys_dgrad.append(d_a), ws_q.append(w_q), dys_wgrad.append(w_a)
            if needs[0]:
                dx = (grouped.grouped_rows(dys_dgrad, [w.t() for w in ws_q], x_dtype, kernels=plans[0].gemms["dgrad"].kernels)
                      if active else dy.new_zeros((0, w3.shape[1] if transposed else w3.shape[2]), dtype=x_dtype))
            if needs[1]:
                dw = torch.zeros_like(w3)
                if active:
                    part = grouped.grouped_inner([d.t() for d in dys_wgrad], [x.t() for x in xs_saved], w3.dtype,
                                                 kernels=plans[0].gemms["wgrad"].kernels)
                    dw[active] = part.mT if transposed else part
            if needs[2]:
                db = torch.zeros((len(sizes), dy.shape[1]), dtype=w3.dtype, device=dy.device)
                for e in active:
                    db[e] = dy[starts[e]:starts[e] + sizes[e]].float().sum(0).to(w3.dtype)
        return dx, dw, db, None, None, None, None, None, None


class GroupedLinear:
    """One projection of an experts module (``spec``) as grouped quantized GEMMs over its stacked weight."""

    def __init__(self, spec: LinearSpec, numerics: str):
        self.spec = spec
        self.key = config_key(LayerConfig(spec, BACKEND, numerics, False))

    def __call__(self, x: torch.Tensor, w3: torch.Tensor, b3: torch.Tensor | None, sizes: list[int],
                 transposed: bool) -> torch.Tensor:
        """``x [sum sizes, in]`` (expert ``e``'s rows the ``e``-th ``sizes[e]``) through each expert's weight of
        ``w3`` (``[E, out, in]``, or ``[E, in, out]`` where ``transposed``) and bias ``b3 [E, out]``."""
        out_dtype, save_x, save_w = call_settings(x, w3)
        return _GroupedLinear.apply(x, w3, b3, self.key, list(sizes), transposed, out_dtype, save_x, save_w)
