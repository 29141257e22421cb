"""The performance tables of the docs, made from the committed result files.

Question: what do the benchmarks say, in one place? Reads ``bench/results/*-<gpu>.json`` (one file per
benchmark and GPU, as each script writes it) and rewrites the blocks between ``<!-- table:NAME -->`` and
``<!-- /table -->`` in ``docs/performance.md`` and ``README.md``; prints them with ``--print``. Other scripts that
keep a table in the docs (``sqnr_formats.py --update-docs``) use the same blocks through :func:`replace_blocks`.

    python bench/tables.py [--gpu NVIDIA_H200] [--print]
"""

from __future__ import annotations

import argparse
import json
import re

from common import RESULTS, ROOT

from fp4train.train.compare import report_markdown

DOCS = (ROOT / "docs/performance.md", ROOT / "docs/comparing.md", ROOT / "docs/models.md", ROOT / "docs/parallel.md",
        ROOT / "README.md")


def _load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def _newest(benchmark: str) -> dict | None:
    """The most recent of a benchmark's result files over every GPU (``<benchmark>-<gpu>.json``), for a table that
    follows the work wherever it was last measured (its caption names the GPU)."""
    found = [json.loads(p.read_text()) for p in sorted(RESULTS.glob(f"{benchmark}-*.json"))]
    return max(found, key=lambda d: d["date"], default=None)


def _provenance(d: dict, *, device: bool = True) -> str:
    """Where and from what a results file was made: device (unless named elsewhere), torch, commit, date."""
    what = f"torch {d['torch'].split('+')[0]}, commit {d['commit']}, {d['date']}"
    return f"{d['gpu']}, {what}" if device else what


def _source(d: dict, script: str) -> str:
    return f"_{_provenance(d)}; `python bench/{script}`._"


def train_table(runs: list[dict]) -> str:
    """Tokens/s of each recipe against the BF16 of its own run, one column per model."""
    models = [d["model"] for d in runs]
    recipes = []
    for d in runs:
        recipes += [r["recipe"] for r in d["results"] if r["recipe"] not in recipes]
    lines = ["| recipe | " + " | ".join(f"{m}: tokens/s (× BF16) | {m}: peak GiB" for m in models) + " |",
             "|---|" + "---:|---:|" * len(models)]
    for rec in recipes:
        cells = []
        for d in runs:
            r = next((r for r in d["results"] if r["recipe"] == rec), None)
            if r is None or "error" in r:
                cells += ["—" if r is None else "failed", "—"]
                continue
            # a row from another call (other code) is set against the BF16 of its own call and says which commit ran
            bf16 = r.get("bf16_tokens_per_s_same_call") or d["results"][0]["tokens_per_s"]
            other = f" [{r['commit']}]" if r.get("commit") not in (None, d["commit"]) else ""
            peak = f"{r['peak_mem_gib']:.1f}" if r.get("peak_mem_gib") else "—"
            cells += [f"{r['tokens_per_s'] / 1e3:,.1f}k ({r['tokens_per_s'] / bf16:.2f}×){other}", peak]
        lines.append(f"| {rec} | " + " | ".join(cells) + " |")
    settings = runs[0]
    mode = settings.get("compile_mode", "default") if settings.get("compile") else "eager"
    lines.append("")
    runs_by_source = {}  # each distinct run once, with the models it measured
    for d in runs:
        how = "the trainer on real text" if d.get("procedure") == "trainer" else "one synthetic batch (an earlier version of the script)"
        key = f"{_provenance(d)}, {how}"
        runs_by_source.setdefault(key, []).append(d["model"])
    sources = [f"{', '.join(ms)}: {key}" if len(runs_by_source) > 1 else key for key, ms in runs_by_source.items()]
    mixed = any(r.get("commit") not in (None, d["commit"]) for d in runs for r in d["results"])
    lines.append(f"_Batch {settings['batch_size']} × sequence {settings['seq_len']}, compiled ({mode}); " + "; ".join(sources)
                 + ("; [commit]: a row from a later call, against that call's BF16" if mixed else "")
                 + "; `python bench/train_speed.py`._")
    failed = [f"{d['model']} {r['recipe']}: {r['error']}" for d in runs for r in d["results"] if "error" in r]
    if failed:
        lines.append("_Failed: " + "; ".join(failed) + "._")
    return "\n".join(lines)


def gemm_table(d: dict) -> str:
    """TFLOP/s of BF16, FP8 rowwise and MXFP4 on FP8 tensor cores per GEMM shape."""
    lines = ["| shape | BF16 | FP8 rowwise | MXFP4 (FP8 blockwise) | MXFP4 × BF16 |", "|---|---:|---:|---:|---:|"]
    for r in d["results"]:
        lines.append(f"| {r['model']} {r['layer']} ({r['M']}×{r['N']}×{r['K']}) | {r['bf16']:.0f} | {r['fp8_rowwise']:.0f} | "
                     f"{r['mxfp4_fp8_blockwise']:.0f} | {r['mxfp4_fp8_blockwise'] / r['bf16']:.2f}× |")
    return "\n".join(lines + ["", _source(d, "gemm_speed.py")])


def quantize_table(d: dict) -> str:
    """Each quantize kernel's time and its fraction of the measured copy bandwidth."""
    lines = [f"| kernel ({'×'.join(map(str, d['shape']))} {d['dtype']}) | ms | GB/s | of copy |", "|---|---:|---:|---:|"]
    for name, r in d["results"].items():
        frac = f"{r['fraction_of_copy']:.0%}" if "fraction_of_copy" in r else "—"
        lines.append(f"| {name} | {r['ms']:.3f} | {r['GBps']:,.0f} | {frac} |")
    return "\n".join(lines + ["", _source(d, "quantize_speed.py")])


def attention_table(d: dict) -> str:
    """NVFP4 attention against SDPA per model shape and length: forward + backward time, peak memory, SQNR."""
    lines = ["| shape | SDPA ms | NVFP4 ms | × SDPA | SDPA MiB | NVFP4 MiB | SQNR dB (O / dQ / dK / dV) |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in d["results"]:
        q = " / ".join(f"{r['sqnr_db'][k]:.1f}" for k in ("O", "dQ", "dK", "dV"))
        lines.append(f"| {r['model']} ({r['heads']}/{r['kv_heads']} heads, d {r['head_dim']}), {r['batch']} × {r['seq_len']} | "
                     f"{r['sdpa_ms']:.2f} | {r['nvfp4_ms']:.2f} | {r['nvfp4_vs_sdpa_time']:.1f}× | {r['sdpa_peak_mib']:.0f} | "
                     f"{r['nvfp4_peak_mib']:.0f} | {q} |")
    return "\n".join(lines + ["", _source(d, "attention_speed.py")])


def experts_table(d: dict) -> str:
    """A MoE block's experts, forward + backward: each recipe's quantized GEMMs (grouped, and looped over experts)
    against BF16 looped and grouped; with the GPU's kernel time where the results hold it (a wall time well
    above it is the host's launching)."""
    bf16 = d["results"][0]
    gpu = bf16.get("gpu_ms") is not None

    def row(name, ms, gpu_ms, looped, grouped):
        kernels = f" {gpu_ms:.2f} |" if gpu and gpu_ms is not None else " - |" if gpu else ""
        return f"| {name} | {ms:.2f} |{kernels} {looped:.2f}× | {grouped:.2f}× |"

    lines = [f"| experts ({d['model']}: {d['experts']} × {d['dim']}→{d['ffn_dim']}, top {d['experts_per_token']}, "
             f"{d['tokens']:,} tokens) | ms |" + (" GPU kernels (ms) |" if gpu else "") + " × BF16 looped | × BF16 grouped |",
             "|---|---:|" + ("---:|" if gpu else "") + "---:|---:|",
             row("bf16, grouped (`torch._grouped_mm`)", bf16["grouped_ms"], bf16.get("grouped_gpu_ms"),
                 bf16["ms"] / bf16["grouped_ms"], 1.0),
             row("bf16, looped", bf16["ms"], bf16.get("gpu_ms"), 1.0, bf16["grouped_ms"] / bf16["ms"])]
    for r in d["results"][1:]:
        lines.append(row(f"{r['recipe']}, {r.get('path', 'looped')}", r["ms"], r.get("gpu_ms"), r["vs_bf16_looped"],
                         r["vs_bf16_grouped"]))
        if "looped_ms" in r:
            lines.append(row(f"{r['recipe']}, looped", r["looped_ms"], r.get("looped_gpu_ms"), bf16["ms"] / r["looped_ms"],
                             bf16["grouped_ms"] / r["looped_ms"]))
    return "\n".join(lines + ["", _source(d, "experts_speed.py")])


def runs_table(folder: str) -> str:
    """The runs of a results folder (its ``runs.json``, from ``bench/bundle_runs.py``): how each ran, final
    validation loss, tokens/s, memory."""
    lines = ["| run | how | steps | tokens | val loss | tokens/s | peak GiB |", "|---|---|---:|---:|---:|---:|---:|"]
    summaries = [run["summary"] for run in json.loads((RESULTS / folder / "runs.json").read_text())["runs"].values()]
    for s in summaries:
        how = f"compiled ({s['compiled_graphs']} graphs)" if s["compile"] and s.get("compiled_graphs") else \
            "compiled" if s["compile"] else "eager"
        lines.append(f"| {s['model']} {s['recipe']} | {how} | {s['steps']} | {s['tokens']:,} | {s['final_val_loss']:.4f} | "
                     f"{s['tokens_per_s']:,.0f} | {s['peak_mem_gib']:.2f} |")
    s = summaries[0]
    commits = ", ".join(sorted({x["commit"] for x in summaries}))
    return "\n".join(lines + ["", f"_{s['gpu']}, torch {s['torch'].split('+')[0]}, commit{'s' if ',' in commits else ''} "
                               f"{commits}; `bench/results/{folder}/runs.json` holds each run's settings and curves._"])


def _minutes(s: float) -> str:
    whole = round(s)
    return f"{whole // 60} min {whole % 60:02d} s"


def quickstart_table(report_md: str, timing: dict) -> str:
    """The quickstart comparison's table (from its report, as markdown) and what the commands took (timing.json)."""
    table = [ln for ln in report_md.splitlines() if ln.startswith("|")]
    t = timing["results"]
    took = [f"the comparison {_minutes(t['compare_s'])}, tokenization included ({t['compare_disk_mb']:.0f} MB on disk)"]
    if "tests_s" in t:
        took.append(f"the test suite {_minutes(t['tests_s'])}")
    where = f"{timing['cores']}-core CPU" if timing["gpu"] == "cpu" else timing["gpu"]
    if timing.get("cpu"):
        where += f" ({timing['cpu']} kernels{', ' + timing['vendor'] if timing.get('vendor') else ''})"
    lines = table + ["", f"_{where}: {'; '.join(took)}; {_provenance(timing, device=False)}; "
                         "`python bench/quickstart.py --tests --platforms`._"]
    moved = platform_moves(timing.get("platforms") or [])
    if moved:
        lines += ["", "_The same comparison on this machine with other CPU kernels, largest change of a validation loss "
                      f"(BF16 / FP4 rows): {'; '.join(moved)}._"]
    return "\n".join(lines)


def platform_moves(platforms: list[dict]) -> list[str]:
    """For each run of the quickstart after the first (``--platforms``): its setting and how far its validation losses
    are from the first run's, the largest relative change of the BF16 row and of the other rows."""
    if len(platforms) < 2:
        return []
    first = platforms[0]["val_loss"]
    out = []
    for p in platforms[1:]:
        rel = {r: abs(v / first[r] - 1) * 100 for r, v in p["val_loss"].items() if r in first}
        fp4 = max((x for r, x in rel.items() if r != "bf16"), default=0.0)
        what = f"{p['kernels']} kernels, {p['threads']} thread{'s' if p['threads'] > 1 else ''}"
        out.append(f"{what} {rel.get('bf16', 0.0):.2f}% / {fp4:.2f}%")
    return out


def compare_table(rep: dict, folder: str) -> str:
    """A protocol comparison's gaps with their intervals and verdicts, its out-of-domain gaps where evaluated, and
    its noise floor (from report.json)."""
    texts = list(next(iter(rep["recipes"].values())).get("eval", {}))
    lines = [f"| recipe | val loss (mean of {len(rep['seeds'])}) | gap to BF16 % | 95% interval | verdict |"
             + "".join(f" {t}: gap % [95% interval] |" for t in texts),
             "|---|---:|---:|---|---|" + "---|" * len(texts)]
    for r, x in rep["recipes"].items():
        ci = x.get("gap_pct_ci95")
        to = f" (to {x['baseline']})" if x.get("baseline") not in (None, "bf16") else ""
        row = (f"| {r}{to} | {x['val_loss_mean']:.4f} | {x['gap_pct_mean']:+.2f} | "
               + (f"[{ci[0]:+.2f}, {ci[1]:+.2f}] | {x['verdict']} |" if ci else "— | baseline |"))
        for t in texts:
            e = x.get("eval", {}).get(t)
            eci = e and e.get("gap_pct_ci95")
            row += f" {e['gap_pct_mean']:+.2f} [{eci[0]:+.2f}, {eci[1]:+.2f}] |" if eci else " — |"
        lines.append(row)
    nf = rep["noise_floor"]
    note = (f"BF16 noise floor: seed-to-seed standard deviation {nf['seed_std_pct']:.2f}%, same initialization with the "
            f"data in another order {nf['reorder_abs_pct_mean']:.2f}% on average.")
    if rep.get("unfinished"):
        note += f" Not run yet: {', '.join(rep['unfinished'])}."
    return "\n".join(lines + ["", f"_{note} `{rep['model']}`, {rep['tokens_per_run']:,} tokens per run, seeds "
                                   f"{rep['seeds']}, {rep['gpu']}, {rep['date']}; `bench/results/{folder}/`._"])


def ablation_table(rep: dict, folder: str, full: str) -> str:
    """A method's ablation (one part changed at a time, from an ablation folder's report.json): each variant's gap to
    its baseline, and its paired difference to the full recipe ``full`` (per seed, mean with a 95% interval)."""
    from fp4train.train.compare import interval95, verdict

    seeds = [str(s) for s in rep["seeds"]]
    whole = rep["recipes"][full]["gap_pct_per_seed"]
    base = rep["recipes"][full].get("baseline", "bf16")
    lines = [f"| variant | gap % [95% interval] | − {full}, points [95% interval] | verdict against {full} |",
             "|---|---|---|---|"]
    for r, x in rep["recipes"].items():
        if x.get("gap_pct_ci95") is None or x.get("baseline", "bf16") != base:  # a baseline, or gaps to another one
            continue
        ci = x["gap_pct_ci95"]
        row = f"| {r} | {x['gap_pct_mean']:+.2f} [{ci[0]:+.2f}, {ci[1]:+.2f}] |"
        if r == full:
            lines.append(row + " — | the full recipe |")
            continue
        diff = [x["gap_pct_per_seed"][s] - whole[s] for s in seeds]
        d_ci = interval95(diff)
        mean = sum(diff) / len(diff)
        interval = f" [{d_ci[0]:+.2f}, {d_ci[1]:+.2f}]" if d_ci else ""
        lines.append(row + f" {mean:+.2f}{interval} | {verdict(d_ci, full)} |")
    return "\n".join(lines + ["", f"_Gaps to {base}; `{rep['model']}`, {rep['tokens_per_run']:,} tokens per run, "
                                   f"seeds {rep['seeds']}, {rep['gpu']}, {rep['date']}; `bench/results/{folder}/`._"])


def determinism_table(d: dict) -> str:
    lines = ["| recipe | repeats identical | steps | default run: largest loss difference | speed, deterministic / default |",
             "|---|---|---:|---:|---:|"]
    for r in d["results"]:
        if "error" in r:
            lines.append(f"| {r['recipe']} | failed: {r['error']} | | | |")
            continue
        lines.append(f"| {r['recipe']} | {'yes' if r['deterministic_repeat_identical'] else 'NO'} "
                     f"({r['deterministic_repeat_identical_steps']}/{r['steps']} steps) | {r['steps']} | "
                     f"{r['default_vs_deterministic_max_loss_diff']:.4f} | {r['deterministic_speed_ratio']:.2f}x |")
    return "\n".join(lines + ["", _source(d, "determinism.py")])


def scaling_table(d: dict) -> str:
    """Each recipe on N GPUs against one GPU at the same global batch: tokens/s, their ratio, the loss curves' gap."""
    n = d["gpus"]
    lines = [f"| recipe | 1 GPU: tokens/s | {n} GPU{'s' if n > 1 else ''} ({d['parallel']}): tokens/s | ratio | "
             "loss curves: largest gap | last 10 steps | final val loss, 1 / N |", "|---|---:|---:|---:|---:|---:|---:|"]
    for rec, r in d["results"].items():
        lines.append(f"| {rec} | {r['one']['tokens_per_s'] / 1e3:,.1f}k | {r['many']['tokens_per_s'] / 1e3:,.1f}k | "
                     f"{r['scaling']:.2f}× | {r['loss_rel_diff_max']:.2%} | {r['loss_rel_diff_last10']:.2%} | "
                     f"{r['one']['final_val_loss']:.3f} / {r['many']['final_val_loss']:.3f} |")
    how = (f"`{d['model']}`, global batch {d['global_batch']} × {d['seq_len']}, {d['steps']} steps at lr {d['lr']:g}, "
           f"{d['data']}, compiled (default mode)")
    return "\n".join(lines + ["", f"_{how}; {_provenance(d)}; `python bench/scaling.py --gpus {n} --parallel {d['parallel']}`._"])


def profile_table(d: dict) -> str:
    """Milliseconds of GPU kernels per training step by class, and each recipe's three costliest "other" kernels (operand preparation among them)."""
    lines = ["| recipe | step ms, wall (optimizer) | kernels ms/step | GEMM | attention | optimizer | other | largest other kernels "
             "(ms/step × calls) |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in d["results"]:
        if "error" in r:
            lines.append(f"| {r['recipe']} | failed | | | | | | {r['error'][:80]} |")
            continue
        wall = f"{r['wall_ms']:.1f} ({r['optimizer_wall_ms']:.1f})" if "wall_ms" in r else "—"
        top = [k for k in r["top_kernels"] if k["class"] == "other"][:3]
        tops = "; ".join(f"`{k['name'][:40]}` {k['ms']:.1f} × {k['calls']}" for k in top)
        # a row kept from an earlier run of other code says which
        label = r["recipe"] + (f" (commit {r['commit']})" if r.get("commit") not in (None, d["commit"]) else "")
        lines.append(f"| {label} | {wall} | {r['total_ms']:.1f} | {r['gemm_ms']:.1f} | {r['attention_ms']:.1f} | {r['optimizer_ms']:.1f} "
                     f"| {r['other_ms']:.1f} | {tops} |")
    how = f"{d['model']}, batch {d['batch_size']} × sequence {d['seq_len']}, compiled (default mode), {d['steps']} steps profiled"
    return "\n".join(lines + ["", f"_{how}; {_provenance(d)}; `python bench/profile_step.py`._"])


def tables(gpu: str) -> dict[str, str]:
    out = {}
    quick = RESULTS / "quickstart-cpu"
    if (quick / "timing.json").exists():
        out["quickstart"] = quickstart_table(report_markdown(json.loads((quick / "report.json").read_text())),
                                             json.loads((quick / "timing.json").read_text()))
    runs = [d for d in (_load(f"train_speed-{m}-{gpu}.json") for m in ("1b", "3b")) if d]
    if runs:
        out["train"] = train_table(runs)
    if d := _newest("train_speed-20m"):  # the comparison protocol's size and batch: Full-Stack FP4's, newest first
        out["train_20m"] = train_table([d])
    if d := _load(f"profile_step-1b-{gpu}.json"):
        out["profile"] = profile_table(d)
    if d := _newest("profile_step-20m"):  # Full-Stack FP4 at the comparison protocol's size
        out["profile_20m"] = profile_table(d)
    if d := _load(f"gemm_speed-{gpu}.json"):
        out["gemm"] = gemm_table(d)
    if d := _load(f"attention_speed-{gpu}.json"):
        out["attention"] = attention_table(d)
    if d := _load(f"quantize_speed-{gpu}.json"):
        out["quantize"] = quantize_table(d)
    if d := _load(f"experts_speed-moe-1b-{gpu}.json"):
        out["experts"] = experts_table(d)
    if (RESULTS / "moe-20m-enwiki-short" / "runs.json").exists():
        out["moe_runs"] = runs_table("moe-20m-enwiki-short")
    for model in ("20m", "60m"):
        folder = f"compare-{model}-enwiki"
        if (RESULTS / folder / "report.json").exists():
            out[f"compare_{model}"] = compare_table(json.loads((RESULTS / folder / "report.json").read_text()), folder)
    for name, full in (("tib2d", "tib2d"), ("fullstack", "fullstack")):
        folder = f"compare-20m-enwiki/{name}-ablation"
        if (RESULTS / folder / "report.json").exists():
            out[f"{name}_ablation"] = ablation_table(json.loads((RESULTS / folder / "report.json").read_text()), folder, full)
    if d := _load(f"determinism-20m-{gpu}.json"):
        out["determinism"] = determinism_table(d)
    for n in (8, 4, 2, 1):  # the widest run measured
        if d := _load(f"scaling-1b-{n}gpu-{gpu}.json"):
            out["scaling"] = scaling_table(d)
            break
    return out


def replace_blocks(text: str, blocks: dict[str, str]) -> str:
    """``text`` with each ``<!-- table:NAME -->...<!-- /table -->`` block's body replaced by ``blocks[NAME]``."""
    def sub(m):
        name = m.group(1)
        return f"<!-- table:{name} -->\n{blocks[name]}\n<!-- /table -->" if name in blocks else m.group(0)

    return re.sub(r"<!-- table:(\w+) -->.*?<!-- /table -->", sub, text, flags=re.S)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", default="NVIDIA_H200", help="the GPU part of the result file names")
    ap.add_argument("--print", action="store_true", help="print the tables instead of rewriting the docs")
    args = ap.parse_args(argv)
    blocks = tables(args.gpu)
    if args.print:
        for name, t in blocks.items():
            print(f"## {name}\n\n{t}\n")
        return
    for doc in DOCS:
        doc.write_text(replace_blocks(doc.read_text(), blocks))


if __name__ == "__main__":
    main()
