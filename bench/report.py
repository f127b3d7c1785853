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

from .peers import LABELS, TOLERANCE
from .peers import METHODS as PEERS
from .steady import CHUNK

COLD_CHART = "coldstart.png"
STEADY_CHART = "steady.png"
# Cold-start bar colours by the method label's start; the steady chart uses the same per engine.
COLD_COLORS = (
    ("precompile", "tab:green"),
    ("eager", "tab:gray"),
    ("torch.compile", "tab:orange"),
    ("ONNX", "tab:blue"),
    ("OpenVINO", "tab:purple"),
)


def write_all(results: dict[str, Any], out: Path) -> list[Path]:
    """Write results.json, README.md and the charts into ``out``; return the files written."""
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "results.json"
    json_path.write_text(json.dumps(results, indent=1), encoding="utf-8")
    charts = [cold_chart(results, out / COLD_CHART), steady_chart(results, out / STEADY_CHART)]
    md = out / "README.md"
    md.write_text(markdown(results) + others(out), encoding="utf-8")
    return [json_path, md, *charts]


# Benchmarks with their own command and page in the results folder (kept when ``python -m bench`` runs).
OTHER_PAGES = {
    "precision.md": "bf16 and int8 variants against eager, ONNX Runtime and OpenVINO (`python -m bench.precision`)",
    "serve_load.md": "serving under concurrency, with and without dynamic batching (`python -m bench.serve_load`)",
    "fleet.md": "sharded and Ray builds, object-store transfers and cold start from S3 (`python -m bench.fleet`)",
}


def others(out: Path) -> str:
    """Links to the other benchmark pages present in ``out``."""
    present = [(name, what) for name, what in OTHER_PAGES.items() if (out / name).is_file()]
    if not present:
        return ""
    return "\n## Other benchmarks\n\n" + "".join(f"- [{name}]({name}): {what}\n" for name, what in present)


# --- Markdown --------------------------------------------------------------------------------------


def _mb(n: int | None) -> str:
    return "–" if n is None else f"{n / 2**20:.1f}"


def _err(e: float | None) -> str:
    return "–" if e is None else f"{e:.0e}"


def ran(methods: dict[str, Any]) -> dict[str, Any]:
    """The methods that produced numbers (a peer whose ONNX export or start failed holds ``failed``)."""
    return {m: r for m, r in methods.items() if "failed" not in r}


def label(method: str, r: dict[str, Any]) -> str:
    """A steady-state method as the prose names it; a peer with its engine's precision when not f32."""
    name = LABELS.get(method, method)
    return f"{name} ({r['precision']})" if r.get("precision") not in (None, "f32") else name


def weighted_mean(requests: list[dict[str, int]], latency: list[float]) -> float:
    """Per request shape the median ms, weighted by how often the traffic sends that shape: the mean
    a server of this traffic sees, without one slow outlier weighing on it."""
    by_shape: dict[tuple, list[float]] = {}
    for sizes, ms in zip(requests, latency):
        by_shape.setdefault(tuple(sorted(sizes.items())), []).append(ms)
    return sum(len(v) * statistics.median(v) for v in by_shape.values()) / len(latency)


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    s = results["sizes"]
    v = m["versions"]
    lines = [
        "# Benchmark results" + (" (quick smoke run: not for reading)" if results["mode"] == "quick" else ""),
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads), {m['memory_gb']} GB, "
        f"{m['platform']}, CPU capability {m['cpu_capability']}. "
        f"torch {v['torch']}, transformers {v.get('transformers', '–')}, onnxruntime {v.get('onnxruntime', '–')}, "
        f"openvino {v.get('openvino', '–')}, Python {v['python']}. Run {m['date']}, "
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
        "The peers: each model is exported once, before any timing, by `torch.onnx.export(model, args, "
        "dynamo=True, dynamic_shapes=...)` with one dynamic dim per profile dim (the ONNX inputs carry the "
        "profile's dim names), as our build happens before its cold start. ONNX Runtime runs that file on its CPU "
        "execution provider with every graph optimization (ORT_ENABLE_ALL) and as many intra-op threads as "
        'torch uses; OpenVINO reads the same file (`Core.read_model`, then `compile_model(model, "CPU", '
        "config)`) once with its defaults (its own precision, bf16 on a CPU with AMX or AVX-512 BF16, and "
        "its own thread count) and once with `INFERENCE_PRECISION_HINT: f32`. Their cold start is the "
        "interpreter, the engine's import, reading the inputs, reading and optimizing (ORT) or converting "
        "and compiling (OpenVINO) the ONNX file, and the first call; torch is not imported before the first "
        f"result. A bf16 result is called correct within {TOLERANCE['bf16']:g} of eager relative to the output's "
        f"scale, f32 within {TOLERANCE['f32']:g}. Error columns: max |out − eager| on the first requests of the "
        "stream (abs) and the same over max |eager| (rel.).",
        "",
        f"![cold start]({COLD_CHART})",
        "",
        f"![steady state]({STEADY_CHART})",
        "",
        "## Summary",
        "",
        "| model | cold: precompile | cold: eager | cold: torch.compile (cold / warm / Mega-Cache) | "
        f"cold: {' / '.join(LABELS[p] for p in PEERS)} | "
        "p50: eager | p50: torch.compile | p50: buckets+compile | p50: precompile planned | "
        f"p50: {' / '.join(LABELS[p] for p in PEERS)} |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, case in results["cases"].items():
        c, st = case["cold_start"], case["steady"]
        lines.append(
            f"| {name} | {c['precompile']['median']:.2f} s | {c['eager']['median']:.2f} s | "
            f"{c['torch.compile cold']['median']:.1f} / {c['torch.compile warm cache']['median']:.1f} / "
            f"{c['torch.compile Mega-Cache']['median']:.1f} s | "
            + " / ".join(_figure(c.get(LABELS[p]), "median", "{:.2f}") for p in PEERS)
            + " s | "
            f"{st['eager']['p50_ms']:.2f} ms | {st['compile']['p50_ms']:.2f} ms | "
            f"{st['buckets-compile']['p50_ms']:.2f} ms | {st['precompile-planned']['p50_ms']:.2f} ms | "
            + " / ".join(_figure(st.get(p), "p50_ms", "{:.2f}") for p in PEERS)
            + " ms |"
        )
    lines += ["", "## Where we win and where we lose", ""]
    for name, case in results["cases"].items():
        lines += _peers_section(name, case) + [""]
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


def _figure(r: dict[str, Any] | None, key: str, form: str) -> str:
    """One number of a method's results; "failed" or "–" where it has none."""
    if r is None:
        return "–"
    return "failed" if "failed" in r else form.format(r[key])


def versus(model: str, ours: float, theirs: float, peer: str) -> str:
    """One sentence: which of precompile and ``peer`` is faster on ``model``, and by how much."""
    if theirs < ours:
        return f"{peer} is {ours / theirs:.2f}× faster than precompile on {model}"
    return f"precompile is {theirs / ours:.2f}× faster than {peer} on {model}"


def peer_sentences(name: str, case: dict[str, Any]) -> list[str]:
    """Per peer, who wins on the traffic-weighted mean, with the p50 beside it; or why it did not run."""
    st = case["steady"]
    ours = st["precompile-planned"]
    ours_mean = weighted_mean(case["requests"], ours["latency_ms"])
    out = []
    for method in PEERS:
        r = st.get(method)
        if r is None:
            continue
        if "failed" in r:
            out.append(f"{LABELS[method]} did not run on {name}: {r['failed']}")
            continue
        mean = weighted_mean(case["requests"], r["latency_ms"])
        out.append(
            versus(name, ours_mean, mean, label(method, r))
            + f" (traffic-weighted mean {mean:.2f} ms against our {ours_mean:.2f}; p50 {r['p50_ms']:.2f} against "
            f"{ours['p50_ms']:.2f} ms; max abs error vs eager {_err(r['max_abs_error'])} against our {_err(ours['max_abs_error'])})"
        )
    return out


def _speed(ours: float, theirs: float) -> str:
    return (
        "–" if theirs == ours else f"{ours / theirs:.2f}× faster" if theirs < ours else f"{theirs / ours:.2f}× slower"
    )


def _peers_section(name: str, case: dict[str, Any]) -> list[str]:
    """Every steady-state method against the planned artifact, and a sentence per peer."""
    st = case["steady"]
    ours_mean = weighted_mean(case["requests"], st["precompile-planned"]["latency_ms"])
    sentences = [f"- {s}." for s in peer_sentences(name, case)]
    lines = [
        f"**{name}**",
        "",
        *([*sentences, ""] if sentences else []),
        "| method | p50 ms | traffic-weighted mean ms | vs precompile planned (weighted mean) | max abs error vs eager | rel. error |",
        "|---|---|---|---|---|---|",
    ]
    for method, r in st.items():
        if "failed" in r:
            lines.append(_failed_row(LABELS.get(method, method), r, 6))
            continue
        mean = weighted_mean(case["requests"], r["latency_ms"])
        lines.append(
            f"| {label(method, r)} | {r['p50_ms']:.2f} | {mean:.2f} | {_speed(ours_mean, mean)} | "
            f"{_err(r.get('max_abs_error'))} | {_err(r['max_error'])} |"
        )
    return lines


def findings(case: dict[str, Any]) -> list[str]:
    """Plain statements of where the artifact wins and where it loses, each from the tables below."""
    cold, st = case["cold_start"], ran(case["steady"])
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
                + ", ".join(
                    f"{name(m)} {st[m][metric]:.2f} ms ({1 - st[m][metric] / planned[metric]:.0%} lower)"
                    for m in better
                )
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
    for method, r in cold.items():
        if "failed" in r:
            lines.append(_failed_row(method, r, 7))
            continue
        marks = r["marks"]
        over = "floor" if method == "import torch" else f"{r['median'] - floor:+.2f}"
        correct = "yes" if r["correct"] else "NO"
        precision = "" if r.get("precision", "f32") == "f32" else f", {r['precision']}"
        lines.append(
            f"| {method} | {r['median']:.2f} | {r['min']:.2f}–{r['max']:.2f} | {over} | "
            f"{_mark(marks, 'import torch')} | {_mark(marks, 'model ready')} | {correct} ({_err(r['max_error'])}{precision}) |"
        )
    return lines


def _failed_row(method: str, r: dict[str, Any], columns: int) -> str:
    """A table row for a method that did not run: its name, then why, across the other columns."""
    return f"| {method} | failed: {r['failed']} |" + " |" * (columns - 2)


def _mark(marks: dict[str, float], name: str) -> str:
    """A mark's seconds, or – where the method has no such step (a peer never imports torch)."""
    return f"{marks[name]:.2f}" if name in marks else "–"


def _steady_table(case: dict[str, Any]) -> list[str]:
    n = len(case["requests"])
    exact = "exact (masked padding)" if case["exact_padding"] else "NOT exact: zero borders change a convnet's output"
    buckets = "; ".join(f"{d} {b}" for d, b in case["buckets"].items())
    lines = [
        f"### Steady state: {n} requests",
        "",
        f"Milliseconds per request. Hand buckets: {buckets} ({exact}). Ready: seconds from the start of "
        "setup (load or compile) to the end of warm-up. Peak RSS includes any compilation in the process. "
        "Weighted mean: per shape the median, weighted by how often the stream sends it. "
        "Errors against eager on the first requests: max |out − eager| (abs) and that over max |eager| (rel.).",
        "",
        "| method | p50 ms | p99 ms | max ms | mean ms | weighted mean ms | req/s | peak RSS MB | ready s | abs error | rel. error |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, r in case["steady"].items():
        if "failed" in r:
            lines.append(_failed_row(method, r, 11))
            continue
        lines.append(
            f"| {method} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {max(r['latency_ms']):.0f} | {r['mean_ms']:.2f} | "
            f"{weighted_mean(case['requests'], r['latency_ms']):.2f} | {r['requests_per_s']:.1f} | "
            f"{r['peak_rss_mb']:.0f} | {r['ready_s']:.1f} | {_err(r.get('max_abs_error'))} | {_err(r['max_error'])} |"
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
        lines.append(
            f"| {name} | {variants} | {b['wall_s']:.0f} | {_mb(b['unpacked_bytes'])} | {_mb(b.get('packed_bytes'))} |"
        )
    onnx = case.get("onnx")
    if onnx is not None:
        done = (
            f"failed: {onnx['failed']}"
            if "failed" in onnx
            else f"{_mb(onnx['bytes'])} MB, example sizes {onnx['example_sizes']}"
        )
        lines += ["", f"The peers' ONNX file (`torch.onnx.export`, dynamo=True): {onnx['seconds']:.0f} s, {done}."]
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
        cold = ran(case["cold_start"])
        labels = [k for k in cold if k != "import torch"]
        med = [cold[k]["median"] for k in labels]
        err = [
            [cold[k]["median"] - cold[k]["min"] for k in labels],
            [cold[k]["max"] - cold[k]["median"] for k in labels],
        ]
        colors = [next(c for start, c in COLD_COLORS if k.startswith(start)) for k in labels]
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
        "onnxruntime": ("tab:blue", "-"),
        "openvino": ("tab:purple", ":"),
        "openvino-f32": ("tab:purple", "-"),
    }
    for ax, (name, case) in zip(axes[0], cases.items()):
        for method, r in ran(case["steady"]).items():
            points = by_work(case["work"], r["latency_ms"])
            color, style = styles.get(method, (None, "-"))
            ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                style,
                marker="o",
                markersize=3,
                color=color,
                label=method,
            )
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
