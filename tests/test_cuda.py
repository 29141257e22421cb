"""The reference numerics on a GPU: same codes as on the CPU, same layer behaviour; and the `triton`
backend's layer against the reference backend's on the GPU.

Skipped where there is no CUDA GPU (CI); run on the device with ``python -m pytest -m cuda``.
"""

import pytest
import torch
import torch.nn as nn

import fp4train
from fp4train import hadamard, quantize

pytestmark = pytest.mark.cuda

CASES = [
    ("mxfp4", {}),
    ("mxfp4", dict(scale="ceil", block=(32, 32))),
    ("nvfp4", {}),
    ("nvfp4", dict(block=(16, 16), four_over_six=True)),
    ("mxfp8", {}),
    ("fp8", {}),
]


@pytest.mark.parametrize("fmt,kw", CASES)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_gpu_codes_equal_cpu_codes_bit_for_bit(fmt, kw, rounding):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 520, generator=g) * torch.rand(300, 1, generator=g) * 10
    x[5, 7] = float("nan")
    x[9, :] = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        xc = x.to(dtype)
        a = quantize(xc, fmt, rounding=rounding, seed=7, **kw)
        b = quantize(xc.cuda(), fmt, rounding=rounding, seed=7, **kw)
        assert torch.equal(a.codes, b.codes.cpu())
        torch.testing.assert_close(b.scales.cpu(), a.scales, rtol=0, atol=0, equal_nan=True)  # fp8: NaN row scale
        torch.testing.assert_close(b.dequantize().cpu(), a.dequantize(), rtol=0, atol=0, equal_nan=True)


def test_gpu_hadamard_matches_cpu():
    x = torch.randn(64, 1024)
    for b in (16, 32, 128):
        torch.testing.assert_close(hadamard(x.cuda(), b, seed=3).cpu(), hadamard(x, b, seed=3), rtol=1e-6, atol=1e-6)


def test_gpu_random_signs_are_the_hashs_copied_from_the_host_or_made_in_a_captured_graph():
    """Random Hadamard signs reach a GPU as one copy from pinned host memory, the hash's bits; inside a CUDA graph
    being captured they are made on the device instead, so that a replay does not read a reused host buffer."""
    from fp4train import counter_rng

    for s in (0, 12345, 2**62 - 1):
        assert torch.equal(counter_rng.random_signs(s, 64, device="cuda").cpu(), counter_rng.random_signs(s, 64))
    out = torch.zeros(16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(counter_rng.random_signs(7, 16, device="cuda"))
    for s in range(64):  # host buffers taken and given back meanwhile
        counter_rng.random_signs(s, 16, device="cuda")
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), counter_rng.random_signs(7, 16))


@pytest.mark.parametrize("name", ["fp8_rowwise", "mxfp4", "nvfp4", "hadamard_mxfp4", "tib2d"])
def test_gpu_layer_matches_cpu_layer(name):
    torch.manual_seed(0)
    lin = nn.Linear(256, 512)
    x = torch.randn(4, 64, 256)
    dy = torch.randn(4, 64, 512)
    outs = []
    for dev in ("cpu", "cuda"):
        m = nn.Sequential(nn.Linear(256, 512)).to(dev)
        m[0].load_state_dict(lin.state_dict())
        # the reference numerics on both devices; the fast backend's agreement is tests/test_fp8_blockwise.py's
        fp4train.convert(m, fp4train.recipes.get(name).replace(keep_last_blocks=0.0), backend="emulated")
        xa = x.detach().to(dev).requires_grad_()
        torch.manual_seed(1)  # same SR seeds on both devices (drawn from the CPU generator)
        y = m(xa)
        y.backward(dy.to(dev))
        outs.append([t.detach().cpu() for t in (y, xa.grad, m[0].weight.grad)])
    for c, g in zip(*outs):
        # same quantized operands; only FP32 accumulation order differs between CPU and GPU matmuls
        torch.testing.assert_close(g, c, rtol=1e-4, atol=1e-4 * c.abs().max().item())


@pytest.mark.parametrize("name", ["fp8_rowwise", "mxfp4", "nvfp4", "hadamard_mxfp4", "tib2d"])
def test_gpu_fast_path_layer_matches_the_emulated_backend(name):
    """The fast path a GPU user gets (the `fp8_blockwise` backend: FP8 GEMMs, triton numerics: Triton kernels)
    against the reference backend on the same GPU, forward and both gradients. The operands are the same
    bits, so only the GEMMs' summation order and output rounding may differ. The `tiny` loss-curve test
    did not notice NVFP4 tiles carrying a neighbouring tile's scale: a layer's outputs do.
    Shapes whose tiles and groups are whole (128 rows, K and N multiples of 128)."""
    torch.manual_seed(0)
    lin = nn.Linear(256, 384)
    with torch.no_grad():  # rows of different scales: nn.Linear's uniform init gives every tile the same amax,
        lin.weight.copy_(torch.randn(384, 256) * torch.logspace(-2, 0, 384)[:, None])  # which hides a wrong tile scale
    x = torch.randn(2, 64, 256) * torch.logspace(-1, 1, 256)  # channel scales a few decades apart
    dy = torch.randn(2, 64, 384)
    outs = []
    for backend in ("emulated", "fp8_blockwise"):
        m = nn.Sequential(nn.Linear(256, 384)).cuda()
        m[0].load_state_dict(lin.state_dict())
        fp4train.convert(m, fp4train.recipes.get(name).replace(keep_last_blocks=0.0), backend=backend)
        assert m[0].backend.name == backend and m[0].numerics == ("triton" if backend == "fp8_blockwise" else "eager")
        xa = x.detach().cuda().requires_grad_()
        torch.manual_seed(1)  # the same stochastic-rounding seeds for both backends
        y = m(xa)
        y.backward(dy.cuda())
        outs.append([t.detach().float().cpu() for t in (y, xa.grad, m[0].weight.grad)])
    for what, e, t in zip(("y", "dX", "dW"), *outs):
        torch.testing.assert_close(t, e, rtol=1e-2, atol=1e-2 * e.abs().max().item(), msg=lambda m: f"{name} {what}: {m}")


def test_gpu_autocast_bf16():
    m = fp4train.convert(nn.Sequential(nn.Linear(256, 256)).cuda(), "tib2d")
    x = torch.randn(128, 256, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert m[0].weight.grad.dtype == torch.float32 and torch.isfinite(m[0].weight.grad).all()


def test_gpu_adahop_outlier_extraction_layer_matches_cpu():
    from fp4train.adahop.calibration import gemm_spec
    from fp4train.adahop.strategy import Strategy
    from fp4train.recipes import LinearSpec

    torch.manual_seed(0)
    lin = nn.Linear(256, 128)
    spec = LinearSpec(gemm_spec(Strategy.OE, "inner", "none", 8), gemm_spec(Strategy.OE, "outer", "none", 8),
                      gemm_spec(Strategy.OE, "outer", "outer", 8))
    x = torch.randn(96, 256)
    x[:, [5, 77, 200]] *= 50  # unambiguous outlier channels: FOID picks the same ones on both devices
    dy = torch.randn(96, 128)
    dy[[3, 40]] *= 50
    outs = []
    for dev in ("cpu", "cuda"):
        layer = fp4train.QuantizedLinear.from_linear(nn.Linear(256, 128).to(dev), spec)
        layer.load_state_dict(lin.state_dict())
        xa = x.detach().to(dev).requires_grad_()
        y = layer(xa)
        y.backward(dy.to(dev))
        outs.append([t.detach().cpu() for t in (y, xa.grad, layer.weight.grad)])
    for c, g in zip(*outs):
        torch.testing.assert_close(g, c, rtol=1e-4, atol=1e-4 * c.abs().max().item())


@pytest.mark.parametrize("backend", ["emulated", "fp8_blockwise"])
def test_gpu_adahop_outlier_extraction_layer_is_captured_in_a_cuda_graph(backend):
    """Every op of an AdaHOP outlier-extraction layer (FOID, the union of two operands' inner channels, the
    scatters) runs inside a CUDA-graph capture - no host sync (torch.unique made one: the 1b AdaHOP run with
    mode="reduce-overhead" failed in capture on the H200) - and a replay on new inputs gives the eager result."""
    from fp4train.adahop.calibration import gemm_spec
    from fp4train.adahop.strategy import Strategy
    from fp4train.recipes import LinearSpec

    torch.manual_seed(0)
    spec = LinearSpec(gemm_spec(Strategy.OE, "inner", "inner", 8), gemm_spec(Strategy.OE, "outer", "inner", 8),
                      gemm_spec(Strategy.OE, "outer", "outer", 8))
    layer = fp4train.QuantizedLinear.from_linear(nn.Linear(256, 128).cuda(), spec, backend=backend,
                                                 numerics="triton" if backend == "fp8_blockwise" else "eager")
    x = torch.randn(128, 256, device="cuda", requires_grad=True)
    dy = torch.randn(128, 128, device="cuda")

    def step():
        x.grad = layer.weight.grad = layer.bias.grad = None
        y = layer(x)
        y.backward(dy)
        return y.detach(), x.grad, layer.weight.grad

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture (lazy state, kernel compilation)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    with torch.no_grad():
        x.copy_(torch.randn_like(x) * torch.where(torch.rand(256, device="cuda") < 0.03, 30.0, 1.0))
        dy.copy_(torch.randn_like(dy))
    graph.replay()
    torch.cuda.synchronize()
    replayed = [t.clone() for t in outs]
    eager = step()
    for r, e in zip(replayed, eager):
        torch.testing.assert_close(r, e, rtol=0, atol=0)


def test_gpu_training_resumes_from_a_checkpoint(tmp_path):
    """A checkpoint is loaded onto the GPU; the CPU and CUDA RNG states in it must go back as
    CPU byte tensors (found when the first resumed 60m comparison runs failed on the H200)."""
    from fp4train.train import Checkpoints, TrainConfig, Trainer

    cfg = TrainConfig(model="tiny", recipe="mxfp4", seq_len=32, batch_size=2, max_steps=4, ckpt_every=2, eval_every=0,
                      eval_batches=1, out=str(tmp_path), progress=False, tensorboard=False, device="cuda")
    Trainer(cfg).run()
    (tmp_path / "summary.json").unlink()
    Checkpoints(tmp_path)._write_manifest(Checkpoints(tmp_path).entries()[:1])  # back to step 2
    log = []
    assert Trainer(cfg, resume=True, log=log.append).run()["steps"] == 4
    assert any(f"resumed {tmp_path} at step 2" in m for m in log)  # continued, not restarted


def test_gpu_nvfp4_newton_schulz_products_are_the_dequantized_operands_products():
    """The NVFP4 iteration's products on the GPU (exact BF16 splits of the NVFP4 operands on BF16 tensor cores, FP32
    accumulation, tensor scales in the epilogue) are the FP32 products of the dequantized operands, as on the CPU."""
    from fp4train.optim.newton_schulz import _nvfp4_mm

    g = torch.Generator().manual_seed(0)
    for m, k, n in ((384, 384, 384), (256, 1024, 256), (48, 128, 64)):
        x = torch.randn(m, k, generator=g) * torch.logspace(0, -3, k)
        y = torch.randn(k, n, generator=g) * 5
        cpu = _nvfp4_mm(x, y)
        gpu = _nvfp4_mm(x.cuda(), y.cuda()).cpu()
        scale = (x.abs() @ y.abs()).clamp(min=1e-30)
        assert ((gpu - cpu).abs() / scale).max() < 1e-5  # the same products, summed in another order
        assert ((gpu - x @ y).abs() / scale).max() > 1e-3  # the operands were quantized


def test_gpu_stacked_nvfp4_products_are_each_matrixs_product():
    """Q-Root's same-shape updates go through the NVFP4 iteration as one stack: on the GPU the stacked product (Triton
    kernels, one launch a pass, then a batched BF16 GEMM with FP32 accumulation) is each matrix's own product up to
    the GEMM's summation order, and a compiled stacked step orthogonalizes each update as well as its own eager step.
    (Not closer: the NVFP4 iteration amplifies a rounding flipped by another summation order into a different point
    of its error ball - a 1e-6 relative change of the input moves the result by percents at the same distance to
    the orthogonal factor, docs/findings.md.)"""
    from fp4train.optim.newton_schulz import nvfp4_kernel_mm
    from fp4train.optim.ns_coefficients import nvfp4_coefficients
    from fp4train.optim.nvfp4_ns_fit import fitted_distance, polar
    from fp4train.optim.qmuon import _orthogonalized_step, _stacked_orthogonalized_steps

    g = torch.Generator().manual_seed(1)
    x = (torch.randn(6, 384, 1024, generator=g) * torch.logspace(-3, 1, 6)[:, None, None]).cuda()
    y = torch.randn(6, 1024, 384, generator=g).cuda()
    stacked = nvfp4_kernel_mm(x, y)
    for i in range(6):
        alone = nvfp4_kernel_mm(x[i], y[i])
        torch.testing.assert_close(stacked[i], alone, rtol=1e-5, atol=1e-5 * alone.abs().max().item())
    updates = torch.randn(6, 1024, 384, generator=g).cuda() * torch.logspace(-3, 0, 6, device="cuda")[:, None, None]
    step = dict(coefficients=nvfp4_coefficients(384, 1024), ns_steps=5, ns_matmul="nvfp4", decay=0.99, step_lr=0.05)
    w = torch.randn(6, 1024, 384, generator=g).cuda()
    one = [w[i].clone() for i in range(6)]
    for i in range(6):
        _orthogonalized_step(one[i], updates[i], None, **step)
    together = [w[i].clone() for i in range(6)]
    torch.compile(_stacked_orthogonalized_steps)(together, updates, None, **step)
    for a, b, w0, u in zip(one, together, w, updates):
        target = polar(u.float())
        d_one, _ = fitted_distance((0.99 * w0 - a) / 0.05, target)
        d_stack, _ = fitted_distance((0.99 * w0 - b) / 0.05, target)
        assert d_one < 0.3 and abs(d_stack - d_one) < 0.01, (d_one, d_stack)
        assert (b - a).norm() < (a - 0.99 * w0).norm()  # the same step's size, not another one


def test_gpu_nvfp4_newton_schulz_lands_where_the_cpu_iteration_lands():
    """Five NVFP4 Newton-Schulz steps on the GPU: the same distance to the orthogonal factor as on the CPU (FP32
    summation order may flip an operand's rounding, so near, not equal) and no singular value above 1.5."""
    from fp4train.optim.newton_schulz import newton_schulz
    from fp4train.optim.ns_coefficients import nvfp4_coefficients
    from fp4train.optim.nvfp4_ns_fit import fitted_distance, polar, spectrum_classes

    for m, n in ((384, 384), (384, 1024), (130, 200)):
        coefficients = nvfp4_coefficients(m, n)
        for kind, x in spectrum_classes(m, n, 5).items():
            target = polar(x)
            cpu = newton_schulz(x, coefficients, matmul="nvfp4")
            gpu = newton_schulz(x.cuda(), coefficients, matmul="nvfp4").cpu()
            d_cpu, _ = fitted_distance(cpu, target)
            d_gpu, _ = fitted_distance(gpu, target)
            assert abs(float(d_gpu) - float(d_cpu)) <= 0.02 * float(d_cpu) + 1e-3, (m, n, kind, d_cpu, d_gpu)
            assert float(torch.linalg.matrix_norm(gpu.double(), ord=2)) <= 1.5, (m, n, kind)


def test_gpu_full_stack_fp4_trains_compiled_with_cuda_graphs(tmp_path):
    """Full-Stack FP4 through the trainer's default GPU path (torch.compile, mode="reduce-overhead"): its NVFP4
    operands with 4/6 quantized by Triton kernels inside the model's CUDA graphs, Q-Root's NVFP4 products by the same
    kernels inside its compiled step. Its first compiled steps failed on fake modes mixed, on ``CantSplit`` for a
    symbolic width, on a table kept from the warm-up in the graph's memory pool and on a core compiling during the
    capture (when compiled reference cores quantized the operands), then took minutes to compile Q-Root's step."""
    import math

    from fp4train.train import TrainConfig, Trainer

    cfg = TrainConfig(model="tiny", recipe="fullstack", seq_len=32, batch_size=2, max_steps=3, ckpt_every=0,
                      eval_every=0, eval_batches=1, out=str(tmp_path), progress=False, tensorboard=False, device="cuda")
    summary = Trainer(cfg).run()
    assert summary["compile_mode"] == "reduce-overhead", summary
    assert summary["steps"] == 3 and math.isfinite(summary["final_val_loss"]), summary
