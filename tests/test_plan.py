"""A converted layer's operand plan: one implementation per operand role and one GEMM per GEMM, decided from
the layer's configuration (backend = which GEMMs, numerics = which quantizer implementation), shown by
``print(layer)``, and followed by the ops: under ``numerics="eager"`` no Triton kernel runs."""

import pytest
import torch
import torch.nn as nn

import fp4train
from fp4train.adahop.calibration import gemm_spec
from fp4train.adahop.strategy import Strategy
from fp4train.linear.plan import GEMMS, IMMEDIATE, PACKED, ROLES, Prep, Where, make_plan
from fp4train.recipes import LinearSpec

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PRESETS = [r for r in fp4train.recipes.names() if r != "bf16"]
#: every implementation a role may name
HOWS = {"bf16", *PACKED, *IMMEDIATE, "pair kernel", "shared X", "fprop.a", "fprop.b", "dgrad.a", "input", "outliers"}
GEMM_KINDS = {"fp8 blockwise", "fp8 rowwise", "bf16 split", "fp32", "outlier extraction"}
TRANSFORMS = {None, "kernel", "compiled", "reference", "fused"}


def _specs():
    out = [(r, fp4train.recipes.get(r).spec_for("layers.0.mlp.up_proj", 0, 4)) for r in PRESETS
           if not fp4train.recipes.get(r).calibrate]  # AdaHOP's specs come from calibration: its strategies below
    oe = LinearSpec(gemm_spec(Strategy.OE, "inner", "inner", 8), gemm_spec(Strategy.OE, "outer", "inner", 8),
                    gemm_spec(Strategy.OE, "outer", "outer", 8))
    iht = LinearSpec(gemm_spec(Strategy.IHT, "none", "none", 8), gemm_spec(Strategy.IHT, "none", "none", 8),
                     gemm_spec(Strategy.IHT, "none", "none", 8))
    return out + [("adahop-oe", oe), ("adahop-iht", iht)]


WHERES = [Where(n, fp8, cuda, usable) for n in ("eager", "compiled", "triton") for fp8 in (False, True)
          for cuda, usable in ((False, False), (False, True), (True, True))]


@pytest.mark.parametrize("name,spec", _specs(), ids=[n for n, _ in _specs()])
def test_every_role_and_gemm_has_exactly_one_implementation(name, spec):
    """Every preset (and AdaHOP's strategies) on every backend x numerics x device: six roles, each one named
    implementation (a role reusing another names that role), three GEMMs, each one kernel."""
    assert spec is not None and spec.quantized
    for where in WHERES:
        for m in (2048, 48):  # whole groups, and a token count no pair or fold takes
            plan = make_plan(spec, where, m, 256, 384, torch.bfloat16, torch.float32, torch.bfloat16)
            assert set(plan.preps) == set(ROLES) and set(plan.gemms) == set(GEMMS)
            for role, prep in plan.preps.items():
                assert prep.how in HOWS and prep.transform in TRANSFORMS, (name, where, role, prep)
                if prep.how == "outliers":
                    assert prep.residual.how in HOWS - {"outliers"}
                if prep.how in ("fprop.a", "fprop.b", "dgrad.a"):
                    assert plan.preps[prep.how].how not in ("fprop.a", "fprop.b", "dgrad.a")
            for g in plan.gemms.values():
                assert g.kind in GEMM_KINDS and (g.residual is None or g.residual.kind in GEMM_KINDS - {"outlier extraction"})
            if where.numerics == "eager":  # no Triton kernel anywhere in an eager plan
                text = plan.describe()
                assert "kernel" not in text.replace("Hadamard reference", ""), (name, where, text)
            if not where.cuda:
                assert all(g.kind in ("fp32", "outlier extraction") for g in plan.gemms.values())


def test_backend_means_the_gemms_and_numerics_the_quantizer():
    """The same recipe on one GPU: the FP8 backend multiplies MXFP4 on FP8 tensor cores whatever the numerics
    (its packed operands folded by the reference under eager numerics, by kernels under triton); the
    emulated backend never does."""
    spec = fp4train.recipes.get("mxfp4").linear
    gpu = dict(cuda=True, kernels_usable=True)

    def plan(numerics, fp8):
        return make_plan(spec, Where(numerics, fp8, **gpu), 2048, 256, 384, torch.bfloat16, torch.float32, torch.bfloat16)

    eager, fast, emulated = plan("eager", True), plan("triton", True), plan("triton", False)
    assert {g.kind for g in eager.gemms.values()} == {"fp8 blockwise"} and {g.fold for g in eager.gemms.values()} == {"reference"}
    assert {g.kind for g in fast.gemms.values()} == {"fp8 blockwise"} and fast["dgrad.b"].how == "fold kernel"
    assert {g.kind for g in emulated.gemms.values()} == {"bf16 split"} and emulated["dgrad.b"].how == "values kernel"
    assert eager["fprop.a"].how == "reference" and fast["fprop.a"].how == "shared X"
    assert plan("triton", True).shared_x == "mxfp4" and eager.shared_x is None


def test_print_layer_shows_its_plan():
    layer = fp4train.convert(nn.Sequential(nn.Linear(256, 384)), "nvfp4", backend="emulated", numerics="eager")[0]
    text = repr(layer)
    for role in ROLES:
        assert f"{role}: " in text
    assert "wgrad.b: reference after the Hadamard reference" in text and "dgrad.b: fprop.b" in text
    assert "fprop GEMM: fp32" in text and "saved for backward: X as wgrad.b, W as fprop.b" in text
    plain = fp4train.convert(nn.Sequential(nn.Linear(256, 384)), "bf16")[0]
    assert plain.plan() is None and "fprop.a" not in repr(plain)  # nothing quantized: F.linear, nothing to plan


def test_nvfp4_wgrad_operands_have_their_hadamard_fused_on_a_gpu():
    """NVIDIA's recipe on a GPU with Triton numerics: both wgrad operands (dY values, X kept packed) take their RHT
    inside the NVFP4 kernel; eager numerics transform first, by the reference."""
    spec = fp4train.recipes.get("nvfp4").linear

    def plan(numerics):
        return make_plan(spec, Where(numerics, True, True, True), 2048, 256, 384, torch.bfloat16, torch.float32, torch.bfloat16)

    fast, eager = plan("triton"), plan("eager")
    assert fast["wgrad.a"] == Prep("values kernel", "fused") and fast["wgrad.b"] == Prep("kernel", "fused")
    assert fast["fprop.a"] == Prep("values kernel") and fast["dgrad.a"] == Prep("values kernel")
    assert eager["wgrad.a"].transform == eager["wgrad.b"].transform == "reference"
    assert "wgrad.a: values kernel (Hadamard fused)" in fast.describe()


@pytest.fixture
def triton_launches(monkeypatch):
    """Counts Triton kernel launches (compiled and interpreted)."""
    triton = pytest.importorskip("triton")
    from triton.runtime.jit import JITFunction

    calls = []

    def counting(cls):
        real = cls.run

        def run(self, *args, **kwargs):
            calls.append(getattr(self, "__name__", getattr(getattr(self, "fn", None), "__name__", "?")))
            return real(self, *args, **kwargs)

        monkeypatch.setattr(cls, "run", run)

    counting(JITFunction)
    try:
        from triton.runtime.interpreter import InterpretedFunction

        counting(InterpretedFunction)
    except ImportError:
        pass
    del triton
    return calls


# one preset per family on the CPU interpreter (minutes each otherwise); every preset with --runslow
@pytest.mark.parametrize("recipe", ["mxfp4", "nvfp4", *(pytest.param(r, marks=pytest.mark.slow)
                                                        for r in ("tib2d", "fp8_rowwise", "hadamard_mxfp4", "fullstack"))])
def test_eager_numerics_launch_no_triton_kernel(recipe, triton_launches):
    """The FP8 backend under ``numerics="eager"``: a forward and backward launch no Triton kernel (its operands are
    the reference's, folded by the reference), and give the Triton numerics' bits. The same layer under
    ``numerics="triton"`` launches kernels - so the counter sees them."""
    torch.manual_seed(0)
    base = nn.Linear(256, 384).to(DEV)
    x0 = torch.randn(128, 256, device=DEV)
    dy = torch.randn(128, 384, device=DEV)
    outs = {}
    for numerics in ("eager", "triton"):
        lin = nn.Linear(256, 384).to(DEV)
        lin.load_state_dict(base.state_dict())
        layer = fp4train.QuantizedLinear.from_linear(lin, fp4train.recipes.get(recipe).linear, backend="fp8_blockwise",
                                                     numerics=numerics)
        x = x0.clone().requires_grad_()
        triton_launches.clear()
        torch.manual_seed(2)  # the same stochastic-rounding and sign seeds
        y = layer(x)
        y.backward(dy)
        outs[numerics] = (y.detach(), x.grad, lin.weight.grad)
        if numerics == "eager":
            assert triton_launches == [], triton_launches
        else:
            assert triton_launches, "the Triton numerics launched nothing: the counter is blind"
    for a, b in zip(outs["eager"], outs["triton"]):
        if DEV == "cpu":
            assert torch.equal(a, b)
        else:  # the same operands; the GEMMs' summation order may differ
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3 * a.abs().max().item())


def _gpu_plans() -> dict[str, str]:
    """Every preset's (and AdaHOP's strategies') plan for a GPU with Triton kernels, on both backends, as text."""
    out = {}
    for name, spec in _specs():
        for fp8 in (False, True):
            for m in (2048, 48):
                plan = make_plan(spec, Where("triton", fp8, True, True), m, 256, 384, torch.bfloat16, torch.float32,
                                 torch.bfloat16)
                out[f"{name} fp8={fp8} m={m}"] = plan.describe()
    return out


def test_every_preset_plans_for_a_gpu_without_importing_triton():
    """What a kernel covers is plain data (fp4train.kernel_coverage): a GPU's plan - Triton kernels named where they
    would run - is made with Triton unimportable, the same plan as with it; only running a kernel imports Triton."""
    import json
    import subprocess
    import sys

    code = ("import sys; sys.modules['triton'] = None\n"  # import triton raises ImportError
            "sys.path.insert(0, 'tests'); import json, test_plan\n"
            "plans = test_plan._gpu_plans()\n"
            "assert not any(m == 'triton' or m.startswith('triton.') for m in sys.modules if sys.modules[m] is not None)\n"
            "print(json.dumps(plans))")
    root = __import__("pathlib").Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    without = json.loads(r.stdout.strip().splitlines()[-1])
    assert without == _gpu_plans()
    assert sum("kernel" in text for text in without.values()) > len(without) // 2  # kernels are planned, not dropped
