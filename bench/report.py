"""Results → ``results.json``, ``README.md`` (tables) and PNG charts, all in one folder.

    python -m bench.report bench/results/results.json     # redraw tables and charts from the JSON

The Markdown and the charts are made from the JSON alone, so a past run can be re-rendered.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from .steady import CHUNK

COLD_CHART = "coldstart.png"
STEADY_CHART = "steady.png"


def write_all(results: dict[str, Any], out: Path) -> list[Path]:
    """Write results.json, README.md and the charts into ``out``; return the files written."""
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "results.json"
    json_path.write_text(json.dumps(results, indent=1), encoding="utf-8")
    charts = [cold_chart(results, out / COLD_CHART), steady_chart(results, out / STEADY_CHART)]
    md = out / "README.md"
    md.write_text(markdown(results), encoding="utf-8")
    return [json_path, md, *charts]


# --- Markdown --------------------------------------------------------------------------------------


def _mb(n: int | None) -> str:
    return "–" if n is None else f"{n / 2**20:.1f}"


def _err(e: float | None) -> str:
    return "–" if e is None else f"{e:.0e}"


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    s = results["sizes"]
    v = m["versions"]
    lines = [
        "# Benchmark results" + (" (quick smoke run: not for reading)" if results["mode"] == "quick" else ""),
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads), {m['memory_gb']} GB, "
        f"{m['platform']}, CPU capability {m['cpu_capability']}. "
        f"torch {v['torch']}, transformers {v.get('transformers', '–')}, Python {v['python']}. Run {m['date']}, "
        f"{results['seconds'] / 60:.1f} minutes in all.",
        "",
        f"Produced by `{results.get('command', 'python -m bench')}`: "
        f"{s['runs']} cold start(s) per method, {s['requests']} steady-state requests per method drawn from each "
        "profile's distribution after the same warm-up. Raw numbers: [results.json](results.json).",
        "",
        "How: a cold start is the wall time from just before a fresh interpreter is started to its first "
        "result, checked against eager (interpreter, imports, loading, sha256 checks of the artifact, "
        "compilation; not shutdown); methods alternate round by round. In the steady state every method "
        "serves in its own process, all alive at once, and the stream goes to them in chunks of "
        f"{CHUNK} requests in rotating order, so load from elsewhere hits them alike. torch.compile runs "
        "with its default options; the artifacts are built with Inductor freezing, as their profiles say. "
        "Hand bucketing pads to the buckets listed per model, eager or with one static-shape torch.compile "
        "graph per bucket compiled before traffic.",
        "",
        f"![cold start]({COLD_CHART})",
        "",
        f"![steady state]({STEADY_CHART})",
        "",
        "## Summary",
        "",
        "| model | cold: precompile | cold: eager | cold: torch.compile (cold / warm / Mega-Cache) | "
        "p50: eager | p50: torch.compile | p50: buckets+compile | p50: precompile planned |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, case in results["cases"].items():
        c, st = case["cold_start"], case["steady"]
        lines.append(
            f"| {name} | {c['precompile']['median']:.2f} s | {c['eager']['median']:.2f} s | "
            f"{c['torch.compile cold']['median']:.1f} / {c['torch.compile warm cache']['median']:.1f} / "
            f"{c['torch.compile Mega-Cache']['median']:.1f} s | "
            f"{st['eager']['p50_ms']:.2f} ms | {st['compile']['p50_ms']:.2f} ms | "
            f"{st['buckets-compile']['p50_ms']:.2f} ms | {st['precompile-planned']['p50_ms']:.2f} ms |"
        )
    lines += ["", "## What the numbers say (computed from this run)", ""]
    for name, case in results["cases"].items():
        lines += [f"**{name}**", ""] + [f"- {f}" for f in findings(case)] + [""]
    for name, case in results["cases"].items():
        lines += ["", f"## {name}: {case['description']}", "", f"Profile: `{case['profile']}`.", ""]
        lines += _cold_table(case)
        lines += [""] + _steady_table(case)
        lines += [""] + _overhead_lines(case)
        lines += [""] + _build_table(case)
    return "\n".join(lines) + "\n"


def findings(case: dict[str, Any]) -> list[str]:
    """Plain statements of where the artifact wins and where it loses, each from the tables below."""
    cold, st = case["cold_start"], case["steady"]
    ours = cold["precompile"]["median"]
    floor = cold["import torch"]["median"]
    out = [
        f"Cold start: precompile {ours:.2f} s, {ours - floor:+.2f} s over `import torch`; eager "
        f"{cold['eager']['median']:.2f} s; torch.compile {cold['torch.compile cold']['median'] / ours:.0f}× slower cold, "
        f"{cold['torch.compile warm cache']['median'] / ours:.1f}× with a warm cache, "
        f"{cold['torch.compile Mega-Cache']['median'] / ours:.1f}× with Mega-Cache."
    ]
    if cold["eager"]["median"] < ours:
        out.append(f"Where we lose: eager reaches its first result {ours - cold['eager']['median']:.2f} s sooner.")
    planned, dynamic = st["precompile-planned"], st["precompile-dynamic"]
    inexact = "" if case["exact_padding"] else " (inexact)"

    def name(m: str) -> str:
        return m + inexact if m.startswith("buckets") else m

    out.append(
        f"Steady state, precompile planned: p50 {planned['p50_ms']:.2f} ms, p99 {planned['p99_ms']:.2f} ms, "
        f"{planned['requests_per_s']:.0f} req/s; against the dynamic-only plan "
        f"{dynamic['mean_ms'] / planned['mean_ms']:.2f}× on mean latency (>1: the plan pays)."
    )
    for metric, label in (("p50_ms", "p50"), ("p99_ms", "p99"), ("mean_ms", "mean")):
        better = [m for m, r in st.items() if not m.startswith("precompile") and r[metric] < planned[metric]]
        if better:
            out.append(
                f"Where we lose on {label}: "
                + ", ".join(f"{name(m)} {st[m][metric]:.2f} ms ({1 - st[m][metric] / planned[metric]:.0%} lower)" for m in better)
                + f" against {planned[metric]:.2f} ms."
            )
    stalls = {m: [t for t in r["latency_ms"] if t > 1000] for m, r in st.items()}
    if any(stalls.values()):
        out.append(
            "Stalls in the timed stream, after warm-up (requests over 1 s; for torch.compile, recompiles): "
            + ", ".join(f"{m} {len(t)} costing {sum(t) / 1000:.0f} s" for m, t in stalls.items() if t)
            + "."
        )
    lighter = [m for m, r in st.items() if not m.startswith("precompile") and r["peak_rss_mb"] < planned["peak_rss_mb"]]
    if lighter:
        listed = ", ".join(f"{name(m)} {st[m]['peak_rss_mb']:.0f} MB" for m in lighter)
        out.append(f"Where we lose on memory: {listed} against {planned['peak_rss_mb']:.0f} MB peak RSS.")
    build = case["builds"]["planned"]
    out.append(
        f"The price: building the planned artifact took {build['wall_s']:.0f} s "
        f"({sum(v['compile_s'] or 0 for v in build['variants']):.0f} s of compilation over {len(build['variants'])} variants), "
        f"once, offline; torch.compile pays {cold['torch.compile cold']['median'] - floor:.0f} s in every process "
        f"that starts with an empty cache, and its server took {st['compile']['ready_s']:.0f} s to warm up here even with a warm one."
    )
    return out


def _cold_table(case: dict[str, Any]) -> list[str]:
    cold = case["cold_start"]
    floor = cold["import torch"]["median"]
    shape = " ".join(f"{d}={n}" for d, n in case["cold_shape"].items())
    lines = [
        f"### Cold start: fresh process to first correct result ({shape})",
        "",
        "Seconds; median of the runs and their range. The marks are medians from process start.",
        "",
        "| method | median | min–max | over `import torch` | torch imported | model ready | correct (error) |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, r in cold.items():
        marks = r["marks"]
        ready = marks.get("model ready")
        over = "floor" if label == "import torch" else f"+{r['median'] - floor:.2f}"
        ready_text = "–" if ready is None else f"{ready:.2f}"
        correct = "yes" if r["correct"] else "NO"
        lines.append(
            f"| {label} | {r['median']:.2f} | {r['min']:.2f}–{r['max']:.2f} | {over} | "
            f"{marks['import torch']:.2f} | {ready_text} | {correct} ({_err(r['max_error'])}) |"
        )
    return lines


def _steady_table(case: dict[str, Any]) -> list[str]:
    n = len(case["requests"])
    exact = "exact (masked padding)" if case["exact_padding"] else "NOT exact: zero borders change a convnet's output"
    buckets = "; ".join(f"{d} {b}" for d, b in case["buckets"].items())
    lines = [
        f"### Steady state: {n} requests",
        "",
        f"Milliseconds per request. Hand buckets: {buckets} ({exact}). Ready: seconds from the start of "
        "setup (load or compile) to the end of warm-up. Peak RSS includes any compilation in the process. "
        "Error: max |out − eager| / max |eager| on the first requests.",
        "",
        "| method | p50 ms | p99 ms | max ms | mean ms | req/s | peak RSS MB | ready s | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for method, r in case["steady"].items():
        lines.append(
            f"| {method} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {max(r['latency_ms']):.0f} | {r['mean_ms']:.2f} | {r['requests_per_s']:.1f} | "
            f"{r['peak_rss_mb']:.0f} | {r['ready_s']:.1f} | {_err(r['max_error'])} |"
        )
    planned = case["steady"]["precompile-planned"].get("calls_per_variant")
    if planned:
        lines += ["", "Planned artifact, calls per variant: " + ", ".join(f"{v} {c}" for v, c in planned.items()) + "."]
    return lines


def _overhead_lines(case: dict[str, Any]) -> list[str]:
    o = case["overhead"]
    shape = " ".join(f"{d}={n}" for d, n in o["shape"].items())
    return [
        f"### Loader overhead ({shape}, variant {o['variant']})",
        "",
        f"Guards + dispatch (`model.select`): {o['select_us']:.1f} µs. A whole call through the loader "
        f"{o['loader_us']:.1f} µs against the raw AOTInductor runner {o['raw_us']:.1f} µs: "
        f"{o['overhead_us']:+.1f} µs ({100 * o['overhead_us'] / o['raw_us']:+.1f}%, within noise when small).",
    ]


def _build_table(case: dict[str, Any]) -> list[str]:
    lines = [
        "### Build",
        "",
        "| artifact | variants (compile s each, in parallel on all cores) | build wall s | unpacked MB | packed MB |",
        "|---|---|---|---|---|",
    ]
    for name, b in case["builds"].items():
        variants = ", ".join(f"{v['id']} {v['compile_s']:.0f}" for v in b["variants"])
        lines.append(f"| {name} | {variants} | {b['wall_s']:.0f} | {_mb(b['unpacked_bytes'])} | {_mb(b.get('packed_bytes'))} |")
    return lines


# --- charts ----------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def cold_chart(results: dict[str, Any], path: Path) -> Path:
    """Per model, a bar per method (median, whiskers min–max), the `import torch` floor as a line."""
    plt = _pyplot()
    cases = results["cases"]
    fig, axes = plt.subplots(len(cases), 1, figsize=(9, 2.6 * len(cases) + 0.6), squeeze=False)
    for ax, (name, case) in zip(axes[:, 0], cases.items()):
        cold = case["cold_start"]
        labels = [k for k in cold if k != "import torch"]
        med = [cold[k]["median"] for k in labels]
        err = [[cold[k]["median"] - cold[k]["min"] for k in labels], [cold[k]["max"] - cold[k]["median"] for k in labels]]
        colors = ["tab:green" if k == "precompile" else "tab:gray" if k == "eager" else "tab:orange" for k in labels]
        ax.barh(labels, med, xerr=err, color=colors, capsize=3)
        floor = cold["import torch"]["median"]
        ax.axvline(floor, color="black", linestyle="--", linewidth=1)
        ax.text(floor, len(labels) - 0.4, f" import torch {floor:.1f} s", fontsize=8, va="bottom")
        for y, value in enumerate(med):
            ax.text(value, y, f" {value:.1f} s", va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set_title(f"{name}: fresh process to first correct result", fontsize=10)
        ax.set_xlabel("seconds")
        ax.set_xlim(0, max(med + [cold[k]["max"] for k in labels]) * 1.18)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def by_work(work: list[int], latency: list[float], bins: int = 8) -> list[tuple[float, float]]:
    """Median latency per log-spaced bin of request size: (bin's geometric centre, median ms)."""
    lo, hi = min(work), max(work)
    if lo == hi:
        return [(lo, statistics.median(latency))]
    edges = [lo * (hi / lo) ** (i / bins) for i in range(bins + 1)]
    out = []
    for a, b in zip(edges, edges[1:]):
        inside = [t for w, t in zip(work, latency) if a <= w < b or (b == hi and w == hi)]
        if inside:
            out.append((math.sqrt(a * b), statistics.median(inside)))
    return out


def steady_chart(results: dict[str, Any], path: Path) -> Path:
    """Per model, median latency against request size for each method (log-log)."""
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda y, _: f"{y:g}")
    sparse = FuncFormatter(lambda y, _: f"{y:g}" if f"{y:g}"[0] in "25" else "")  # minor ticks: 2 and 5 only
    cases = results["cases"]
    fig, axes = plt.subplots(1, len(cases), figsize=(5.2 * len(cases), 4.2), squeeze=False)
    styles = {
        "eager": ("tab:gray", "-"),
        "compile": ("tab:orange", "-"),
        "buckets-eager": ("tab:gray", ":"),
        "buckets-compile": ("tab:orange", ":"),
        "precompile-dynamic": ("tab:green", "--"),
        "precompile-planned": ("tab:green", "-"),
    }
    for ax, (name, case) in zip(axes[0], cases.items()):
        for method, r in case["steady"].items():
            points = by_work(case["work"], r["latency_ms"])
            color, style = styles.get(method, (None, "-"))
            ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", markersize=3, color=color, label=method)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(plain)
        lo, hi = ax.get_ylim()
        ax.yaxis.set_minor_formatter(plain if hi / lo < 10 else sparse)
        ax.set_xlabel(f"request size: {case['work_unit']}")
        ax.set_ylabel("median ms per request")
        ax.set_title(f"{name}: steady-state latency by shape", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python -m bench.report RESULTS.json")
    path = Path(argv[0])
    for written in write_all(json.loads(path.read_text(encoding="utf-8")), path.parent):
        print(written)


if __name__ == "__main__":
    main(sys.argv[1:])
