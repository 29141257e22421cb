"""Compile fp4train's Triton kernels for a Hopper GPU (sm90) on a machine without one.

The CPU tests run the kernels in Triton's interpreter, which accepts code the GPU compiler may
refuse (a type mismatch between the branches of an ``if``, an unsupported op) and says nothing
about registers. This script:

1. runs a set of kernel calls (small shapes, every code path of the wrappers) under the
   interpreter in a child process and records each launch: kernel, argument types, constexprs,
   ``num_warps``;
2. compiles every distinct launch ahead of time for ``sm_90a`` with Triton's own compiler (no GPU
   or driver needed), specialized as the JIT specializes it on a GPU (int arguments equal to 1 become
   constants; ints and tensor addresses divisible by 16 say so: what lets loads vectorize), and
3. asks ``ptxas -v`` for each kernel's registers and spill bytes, and ``nvdisasm`` for its SASS
   instruction count (for the fold and 32x32 tile kernels also per element: a static measure of the work that
   bounds a kernel which is not memory-bound).

    python scripts/aot_check.py [--json out.json] [--warps N]
    python scripts/aot_check.py --issue-ms RECORD.json [--elements N]   # a record's issue-bound time estimates

An issue-bound estimate is the time the GPU's schedulers need just to issue a kernel's warp instructions:
warp instructions per element x elements / (SMs x schedulers x clock), for an H200 (132 SMs, 4 schedulers each,
1.98 GHz boost). A pipe-bound estimate is the same for the busiest execution pipe, whose warp instructions each hold
it for several cycles (the integer ALU has 16 lanes a scheduler: 2 cycles; :data:`SASS_PIPES`). A kernel measured
far above both waits rather than computes; one near its pipe bound is compute-bound however far it is from memory's.

Exit status 1 if any kernel fails to compile, 3 if this Triton lacks the ahead-of-time API used here
(``triton.compiler.ASTSource``, ``GPUTarget``; written against 3.9). A spill is reported, not failed:
it costs speed, not correctness. Needs Triton's NVIDIA backend (the standard Linux wheel has it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

H200_ISSUE_PER_S = 132 * 4 * 1.98e9  # scheduler cycles an H200 has a second (one warp instruction issued each): SMs x schedulers x boost clock


def issue_bound_ms(cycles_per_element: float, elements: int) -> float:
    """The time (ms) an H200's schedulers need for ``elements`` elements at ``cycles_per_element`` scheduler cycles
    each: warp instructions per element (one issued a cycle) give the issue bound, a pipe's cycles per element
    (``pipe_cycles_per_element``) that pipe's bound (see the module docstring)."""
    return cycles_per_element * elements / H200_ISSUE_PER_S * 1e3


_TYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "uint8": "u8", "int32": "i32", "int64": "i64",
          "bool": "i1", "float8_e4m3fn": "fp8e4nv", "uint16": "u16", "int16": "i16", "int8": "i8"}


def _record() -> list[dict]:
    """Run the kernel calls under the interpreter, recording every launch (this runs in the child)."""
    import torch
    import triton.runtime.interpreter as interp

    launches: dict = {}
    real_run = interp.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        types, hints = [], []
        for a in args:
            hint = ""
            if isinstance(a, torch.Tensor):
                types.append("*" + _TYPES[str(a.dtype).replace("torch.", "")])
                hint = "D" if a.data_ptr() % 16 == 0 else ""
            elif isinstance(a, bool):
                types.append("i1")
            elif isinstance(a, int):
                types.append("i32" if -(2**31) <= a < 2**31 else "i64")
                hint = "1" if a == 1 else "D" if a % 16 == 0 else ""
            elif isinstance(a, float):
                types.append("fp32")
            else:
                types.append(type(a).__name__)
            hints.append(hint)
        consts = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
        key = json.dumps([self.fn.__module__, self.fn.__name__, types, hints, consts, kwargs.get("num_warps", 4)], sort_keys=True)
        launches[key] = {"module": self.fn.__module__, "kernel": self.fn.__name__, "types": types, "hints": hints,
                         "constexprs": consts, "num_warps": kwargs.get("num_warps", 4)}
        return real_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interp.InterpretedFunction.run = run
    _kernel_calls()
    return list(launches.values())


def _kernel_calls() -> None:
    """Every wrapper, on small shapes, through its code paths (dtypes, axes, roundings, group sizes)."""
    import torch

    import fp4train
    from fp4train import counter_rng, kernels
    from fp4train.kernels import amax, fp8_values, mx_fold, mx_quantize, nvfp4_quantize
    from fp4train.transforms.hadamard import signs

    x32 = torch.randn(256, 256)
    for x in (x32, x32.bfloat16()):
        for rounding, seed in (("nearest", None), ("stochastic", 3)):
            for scale in ("floor", "ceil"):
                kernels.quantize_mxfp4(x, scale=scale, rounding=rounding, seed=seed)
                kernels.quantize_mxfp4(x, scale=scale, rounding=rounding, seed=seed, pairs=False)  # the reshape-packing kernel
                kernels.quantize_mxfp8(x, scale=scale, rounding=rounding, seed=seed)
                kernels.quantize_mxfp4_2d(x, scale=scale, rounding=rounding, seed=seed)
                for pairs in (True, False):  # the even/odd-column kernel and the general one, whichever the default
                    kernels.quantize_mxfp4_2d(x, scale=scale, rounding=rounding, seed=seed, pairs=pairs)
                kernels.quantize_mxfp8_2d(x, scale=scale, rounding=rounding, seed=seed)
                mx_quantize.quantize_mxfp4_columns(x, scale=scale, rounding=rounding, seed=seed)
                mx_quantize.quantize_mxfp8_columns(x, scale=scale, rounding=rounding, seed=seed)
                for axis in (1, 0, None):
                    kernels.mxfp4_values(x, axis=axis, scale=scale, rounding=rounding, seed=seed)
            kernels.mxfp8_values(x, axis=1, rounding=rounding, seed=seed)
            kernels.quantize_mxfp4_dual(x, rounding=(rounding, rounding), seed=(seed, seed))
            kernels.quantize_nvfp4(x, rounding=rounding, seed=seed)
            nvfp4_quantize.quantize_nvfp4_columns(x, rounding=rounding, seed=seed)
            for axis in (1, 0):
                kernels.nvfp4_values(x, axis=axis, rounding=rounding, seed=seed)
            kernels.quantize_nvfp4_2d(x, rounding=rounding, seed=seed)
            kernels.nvfp4_tile_values(x, rounding=rounding, seed=seed)
            for gr in (1, 128):
                for axis in (1, 0):
                    mx_fold.quantize_mxfp4_fp8(x, group_rows=gr, rounding=rounding, seed=seed, axis=axis)
                for axis in (1, 0):  # the fused transform along either dim (dY and W along dim 0 in backward)
                    mx_fold.quantize_mxfp4_fp8(x, group_rows=gr, rounding=rounding, seed=seed, hadamard_block=32,
                                               hadamard_signs=signs(5, 32), axis=axis)
                mx_fold.quantize_mxfp4_fp8(x, group_rows=gr, rounding=rounding, seed=seed, hadamard_block=128)
        for axis in (1, 0):
            fp8_values.fp8_rowwise_values(x, axis=axis)
            fp8_values.quantize_fp8_rowwise(x, axis=axis)
            amax.finite_amax_along(x, axis)
        fp8_values.quantize_fp8_rowwise_both(x)
        kernels.block_hadamard(x, None, block=32, axis=1)
    # the stochastic-rounding kernels with their keys read from a device tensor (KEYS_PTR: CUDA graphs' seeds)
    keys = counter_rng.seed_keys_tensor(torch.tensor(3, dtype=torch.int64))
    xb, sr = x32.bfloat16(), dict(rounding="stochastic", seed=keys)
    kernels.quantize_mxfp4(xb, **sr)
    kernels.quantize_mxfp4(xb, pairs=False, **sr)
    kernels.quantize_mxfp8(xb, **sr)
    for pairs in (True, False):
        kernels.quantize_mxfp4_2d(xb, scale="ceil", pairs=pairs, **sr)
    kernels.quantize_mxfp8_2d(xb, **sr)
    mx_quantize.quantize_mxfp4_columns(xb, **sr)
    mx_quantize.quantize_mxfp8_columns(xb, **sr)
    for axis in (1, 0, None):
        kernels.mxfp4_values(xb, axis=axis, **sr)
    kernels.mxfp8_values(xb, axis=1, **sr)
    kernels.quantize_mxfp4_dual(xb, rounding=("stochastic", "stochastic"), seed=(keys, keys))
    kernels.quantize_nvfp4(xb, **sr)
    nvfp4_quantize.quantize_nvfp4_columns(xb, **sr)
    for axis in (1, 0):
        kernels.nvfp4_values(xb, axis=axis, **sr)
        mx_fold.quantize_mxfp4_fp8(xb, group_rows=1, axis=axis, **sr)
    for gr in (1, 128):  # hadamard_mxfp4's dY: the fused Hadamard fold with stochastic rounding, along either dim
        for axis in (1, 0):
            mx_fold.quantize_mxfp4_fp8(xb, group_rows=gr, hadamard_block=32, axis=axis, **sr)
    kernels.quantize_nvfp4_2d(xb, **sr)
    from fp4train.kernels import seeds  # the device-seed chain in one launch each (CUDA graphs)

    seeds.stream_next(torch.tensor(7, dtype=torch.int64), torch.zeros((), dtype=torch.int64))
    for salt in ((), (1,), (1, 2)):
        seeds.derived_keys(torch.tensor(7, dtype=torch.int64), *salt)
    q = fp4train.quantize(x32, "mxfp4")
    kernels.decode_scaled_bf16(q)
    kernels.decode_scaled_bf16(fp4train.quantize(x32, "nvfp4"))
    for gr in (1, 128):
        mx_fold.fold_packed_mxfp4(q.codes, q.scales, group_rows=gr)
    t = fp4train.quantize(x32, "mxfp4", block=(32, 32))
    for transposed, gr, per_row in ((False, 1, False), (False, 128, False), (True, 128, False), (True, 128, True)):
        mx_fold.fold_tiles_mxfp4(t.codes, t.scales, transposed=transposed, group_rows=gr, scale_per_row=per_row)


# elements one program covers, from its constexprs: the fold kernels (rows x 128 columns), the 32x32 tile kernels,
# the 1D MX kernels (blocks of 32 of one row)
_PROGRAM_ELEMENTS = {
    "_mx_kernel": lambda c: c["BLOCKS"] * 32,
    "_mxfp4_pairs_kernel": lambda c: c["BLOCKS"] * 32,
    "_fold_kernel": lambda c: c["RB"] * 128,
    "_packed_fold_kernel": lambda c: c["RB"] * 128,
    "_packed_fold_t_kernel": lambda c: 128 * 128,
    "_mx_tile_kernel": lambda c: c["TC"] * 1024,
    "_mxfp4_tile_kernel": lambda c: c["TC"] * 1024,
}


#: SASS opcodes by the sm90 pipe that executes them, and the cycles a warp instruction holds that pipe of its
#: scheduler (32 threads / the pipe's lanes; CUDA C Programming Guide, "Arithmetic Instructions", compute
#: capability 9.0: FP32 add/mul/fma 128 results a clock per SM, 32-bit integer add/shift/compare/min/max/logic and
#: integer multiply 64, conversions and special functions 16; Nsight Compute's pipe names). Load/store, uniform,
#: branch and barrier instructions are left out: they do not bound these kernels (ncu: LSU busy 12%).
SASS_PIPES = {
    "alu": (2, {"LOP", "LOP3", "PLOP3", "SHF", "SHL", "SHR", "IADD", "IADD3", "ISETP", "FSETP", "HSETP2", "SEL", "FSEL",
                "PRMT", "IMNMX", "VIMNMX", "VIADDMNMX", "FMNMX", "HMNMX2", "LEA", "SGXT", "BMSK", "P2R", "R2P", "MOV",
                "F2FP", "IABS", "CS2R"}),
    "fma_int": (2, {"IMAD", "IMUL", "VIADD", "IDP"}),  # integer multiply-add: only the FMA pipe's heavy half (16 lanes)
    "fma": (1, {"FFMA", "FADD", "FMUL", "HFMA2", "HADD2", "HMUL2"}),
    "xu": (8, {"MUFU", "F2F", "F2I", "I2F", "I2FP", "F2IP", "FRND", "FLO", "POPC", "BREV"}),
}


def pipe_cycles(ops: list[str]) -> dict:
    """Cycles each pipe of a scheduler is busy for one pass of a warp over ``ops`` (SASS opcodes, suffixes
    dropped), by :data:`SASS_PIPES`; a kernel whose busiest pipe needs more cycles than it has instructions is
    bound by that pipe rather than by instruction issue (one instruction a cycle per scheduler)."""
    return {pipe: cycles * sum(op in names for op in ops) for pipe, (cycles, names) in SASS_PIPES.items()}


def _sass_counts(cubin: bytes, nvdisasm: str, launch: dict) -> dict:
    """Static SASS instruction count of the kernel (``nvdisasm``), and for the fold kernels the warp
    instructions per element: warps x instructions / elements per program (:data:`_PROGRAM_ELEMENTS`). The kernels are straight-line
    code (unrolled, no loops), so every warp issues each instruction at most once; branches make the
    static count an upper bound of what runs (the fold's near and general paths are both counted)."""
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    r = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True)
    os.unlink(f.name)
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", r.stdout)
    out: dict = {"sass_instructions": len(ops) or None,
                 # data movement between threads: shared-memory loads/stores and barriers (layout conversions,
                 # reductions across warps), warp shuffles
                 "shared_memory_instructions": sum(op.startswith(("LDS", "STS", "BAR", "LDSM", "STSM")) for op in ops),
                 "shuffles": sum(op.startswith("SHFL") for op in ops)}
    elements = _PROGRAM_ELEMENTS.get(launch["kernel"])
    if ops and elements:
        per = launch["num_warps"] / elements(launch["constexprs"])
        out["warp_instructions_per_element"] = per * len(ops)
        # the same per element in each pipe's cycles: the pipe bound that --issue-ms prints beside the issue bound
        out["pipe_cycles_per_element"] = {p: per * c for p, c in pipe_cycles(ops).items()}
    return out


def _compile(launch: dict, ptxas: str | None, nvdisasm: str | None = None) -> dict:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    names = fn.arg_names
    consts = launch["constexprs"]
    positional = [n for n in names if n not in consts]
    sig = dict(zip(positional, launch["types"]))
    # the JIT's specialization on a GPU: an int argument equal to 1 becomes the constant 1, and one divisible by
    # 16 - or a tensor whose address is - carries that divisibility (vector loads, cheaper index arithmetic);
    # not for the parameters the kernel marks do_not_specialize
    fixed = {p.name for p in getattr(fn, "params", ()) if p.do_not_specialize}
    hints = dict(zip(positional, launch.get("hints", [""] * len(positional))))
    ones = {n: 1 for n, h in hints.items() if h == "1" and n not in fixed}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, h in hints.items() if h == "D" and n not in fixed}
    sig.update({n: "constexpr" for n in {**consts, **ones}})
    src = ASTSource(fn, sig, constexprs={(names.index(n),): v for n, v in {**consts, **ones}.items()}, attrs=attrs)
    out = {"kernel": f"{launch['module'].split('.')[-1]}.{launch['kernel']}", "constexprs": consts, "num_warps": launch["num_warps"],
           "specialized": {"equal_to_1": sorted(ones), "divisible_by_16": sorted(n for n, h in hints.items() if h == "D" and n not in fixed)}}
    try:
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": launch["num_warps"]})
    except Exception as e:  # noqa: BLE001 - reported per kernel
        out["error"] = f"{type(e).__name__}: {e}"[:2000]
        return out
    if nvdisasm and "cubin" in k.asm:
        out.update(_sass_counts(k.asm["cubin"], nvdisasm, launch))
    if ptxas:
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(k.asm["ptx"])
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
        os.unlink(f.name)
        info = r.stdout + r.stderr
        regs = re.search(r"Used (\d+) registers", info)
        spill = re.search(r"(\d+) bytes spill stores", info)
        out["registers"] = int(regs.group(1)) if regs else None
        out["spill_store_bytes"] = int(spill.group(1)) if spill else None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--warps", type=int, help="compile every launch with this many warps instead of its own (what a launch change would do)")
    ap.add_argument("--only", help="compile only the kernels whose name contains one of these (comma list)")
    ap.add_argument("--record-only", action="store_true", help=argparse.SUPPRESS)  # the child's job
    ap.add_argument("--issue-ms", type=Path, metavar="RECORD", help="print a committed record's issue-bound estimates, and exit")
    ap.add_argument("--elements", type=int, default=16384 * 8192, help="with --issue-ms (default: quantize_speed's 16384 x 8192)")
    args = ap.parse_args(argv)
    if args.issue_ms:
        for r in json.loads(args.issue_ms.read_text())["results"]:
            if "warp_instructions_per_element" in r:
                pipes = r.get("pipe_cycles_per_element", {})
                busiest = max(pipes, key=pipes.get) if pipes else None
                print(f"{r['kernel']:<40} warps {r['num_warps']} {json.dumps(r['constexprs'], sort_keys=True)[:90]:<90} "
                      f"{r['warp_instructions_per_element']:.2f} per element: {issue_bound_ms(r['warp_instructions_per_element'], args.elements):.3f} ms"
                      + (f"; {busiest} pipe {pipes[busiest]:.2f} cycles per element: {issue_bound_ms(pipes[busiest], args.elements):.3f} ms"
                         if busiest else ""))
        return 0
    if args.record_only:
        print(json.dumps(_record()))
        return 0
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.run([sys.executable, __file__, "--record-only"], capture_output=True, text=True, env=env)
    if child.returncode:
        sys.stderr.write(child.stderr)
        return 2
    launches = json.loads(child.stdout.strip().splitlines()[-1])
    if args.only:
        launches = [x for x in launches if any(k in x["kernel"] for k in args.only.split(","))]
    if args.warps:
        launches = list({json.dumps(x, sort_keys=True): x for x in ({**x, "num_warps": args.warps} for x in launches)}.values())
    os.environ.pop("TRITON_INTERPRET", None)
    import triton

    bins = Path(triton.__file__).parent / "backends/nvidia/bin"
    ptxas = next((p for p in (bins / "ptxas-blackwell", bins / "ptxas") if p.exists()), None)  # the newer one reads Triton's PTX
    nvdisasm = str(bins / "nvdisasm") if (bins / "nvdisasm").exists() else None
    try:
        results = [_compile(launch, str(ptxas) if ptxas else None, nvdisasm) for launch in launches]
    except (ImportError, TypeError, AttributeError) as e:  # the ahead-of-time API itself (it moves between Triton versions)
        print(f"this Triton ({triton.__version__}) does not offer the ahead-of-time compile API used here: {e}")
        return 3
    failed = [r for r in results if "error" in r]
    for r in results:
        what = r.get("error", f"{r.get('registers')} registers, {r.get('spill_store_bytes')} bytes spilled, "
                              f"{r.get('sass_instructions')} SASS instructions"
                              + (f" ({r['warp_instructions_per_element']:.2f} warp instructions per element)"
                                 if "warp_instructions_per_element" in r else "")
                              + (f", {r['shared_memory_instructions']} shared-memory, {r['shuffles']} shuffles"
                                 if "shuffles" in r else ""))
        print(f"{r['kernel']:<40} warps {r['num_warps']} {json.dumps(r['constexprs'], sort_keys=True)[:110]:<110} {what[:340]}")
    print(f"{len(results)} launches compiled for sm90, {len(failed)} failed, "
          f"{sum(1 for r in results if (r.get('spill_store_bytes') or 0) > 0)} spill")
    if args.json:
        args.json.write_text(json.dumps({"target": "cuda sm90", "triton": triton.__version__, "results": results}, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
