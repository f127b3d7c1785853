"""Precision variants against eager and the CPU peers: MiniLM (real weights) and ResNet-50.

    .venv/bin/python -m bench.precision [--models minilm resnet50] [--seconds 1.0] [--out bench/results/precision.json]
    .venv/bin/python -m bench.precision --isa [--models minilm resnet50] [--out bench/results/isa.json]

For each model: builds ``profiles/bench/<model>_precision.yaml`` (fp32, bf16 and int8 under the
accuracy gate; MiniLM's calibration inputs are real sentences: minilm_calibration.jsonl, written by
``--write-calibration``), exports the ONNX
file the peers serve, then times on a fixed set of shapes, one method after another per shape:
fp32 eager (torch.no_grad), each precision the artifact kept (``loader.load(precision=...)``), ONNX
Runtime, OpenVINO with its defaults (bf16 on this CPU) and OpenVINO f32. Prints and writes the
median ms per shape, their sum, and each method's accuracy against fp32 eager (smallest cosine
similarity of output rows on the calibration inputs: for MiniLM, sentence embeddings).

Needs the bench extra (make venv-bench). Run it on a quiet machine: about 15 minutes on 2 cores.

``--isa``: what portable code costs, per call. Builds ``profiles/bench/<model>.yaml`` (fp32) with
``cpu: {isa: [native, x86-64-v3, x86-64-v4]}`` (the levels this host runs) and times, per shape, the
native variants against each level's (``loader.load(cpu_isa=...)``): AVX2 against AVX-512 on one
CPU, and both against the build host's own code. ``--models quick`` is the smoke run (a tiny model).

``--int8-options``: what each int8 static option gives, in accuracy only (deterministic: it needs no
quiet machine, and compiles nothing). Per option of ``INT8_OPTIONS``, the model is quantized by the
build's own PT2E code (``precompile.stages.quantize.static_int8``) on calibration inputs drawn as the
build draws them, and run in eager (the quantize/dequantize graph Inductor lowers to oneDNN's int8
kernels); the table is its cosine against fp32 eager on held-out inputs (other seeds, the same traffic
shapes): the smallest over rows (what the gate checks), the 5th percentile, the mean, and the mean
relative error of the output rows. Two options are also compiled as the build compiles them
(Inductor's int8 lowering) and measured the same way, with their distance to the eager q/dq graph.
ResNet-50: about 10 minutes on 2 cores.

``--bf16-static``: where a static bf16 ResNet-50 call spends its time, against OpenVINO's. Compiles
the model for one image size (``--size``, default 1×128²) in bf16 and fp32 as the build does
(``stages.compile.compile_package``, freezing), then per method: the median ms per call, the CPU ms
per call, and for one call the oneDNN primitives that run (kernel, count, reorders), their summed
time and what is left outside them (allocation, Inductor's own kernels, dispatch); for OpenVINO
(default and f32) its nodes per kind and their summed time (``PERF_COUNT``). About 5 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ROOT / "profiles" / "bench"
# The peers (bench.peers.open_engine's methods) by their names in the results.
PEER_LABELS = {"onnxruntime": "ONNX Runtime", "openvino": "OpenVINO default", "openvino-f32": "OpenVINO f32"}

SHAPES = {
    # The shapes the issue measured on (batch × tokens).
    "minilm": [
        {"batch": 1, "seq": 16},
        {"batch": 1, "seq": 64},
        {"batch": 4, "seq": 32},
        {"batch": 8, "seq": 128},
        {"batch": 2, "seq": 100},
    ],
    "resnet50": [
        {"batch": 1, "height": 128, "width": 128},
        {"batch": 2, "height": 96, "width": 96},
        {"batch": 1, "height": 64, "width": 112},
        {"batch": 2, "height": 128, "width": 80},
    ],
    # profiles/bench/quick.yaml: the smoke run of --isa.
    "quick": [{"batch": 1, "seq": 16}, {"batch": 2, "seq": 9}],
}

SENTENCES = [
    "A man is playing a guitar on the stage while the crowd sings along with him.",
    "The new phone has a better camera, but its battery does not last as long as the old one.",
    "Children were building a large sand castle near the water before the tide came in.",
    "Our quarterly revenue grew by twelve percent, driven mostly by subscriptions in Europe.",
    "She forgot her umbrella at the station and walked home through the heavy rain.",
    "The recipe calls for two cups of flour, a pinch of salt and three fresh eggs.",
    "Scientists observed a distant galaxy whose light left it more than ten billion years ago.",
    "Please reset your password using the link we sent to your email address yesterday.",
    "The train to the airport was delayed by forty minutes because of a signal failure.",
    "A small dog is chasing a red ball across the park while its owner watches.",
    "The committee will review every application and announce the results next month.",
    "Heavy snowfall closed the mountain pass, and drivers were told to take the coast road.",
    "He spent the weekend repairing the old bicycle he found in his grandfather's garage.",
    "The museum's new exhibition shows paintings that have never been displayed in public before.",
    "Customers complained that the checkout page froze whenever they applied a discount code.",
    "Two women are sitting at a cafe table, talking and drinking coffee in the afternoon sun.",
]


def write_minilm_calibration(path: Path) -> None:
    """Real sentences as calibration inputs: each alone, and groups of four cut to the shortest."""
    import sys

    from transformers import AutoTokenizer

    sys.path.insert(0, str(PROFILES))
    import models  # profiles/bench/models.py

    tokenizer = AutoTokenizer.from_pretrained(models.minilm_path(), local_files_only=True)
    rows = [tokenizer(s)["input_ids"] for s in SENTENCES]
    with path.open("w", encoding="utf-8") as f:
        for ids in rows:
            f.write(json.dumps({"input_ids": [ids], "attention_mask": [[1] * len(ids)]}) + "\n")
        for k in range(0, len(rows), 4):
            group = rows[k : k + 4]
            n = min(len(r) for r in group)
            f.write(json.dumps({"input_ids": [r[:n] for r in group], "attention_mask": [[1] * n] * len(group)}) + "\n")


def median_ms(fn: Callable[[], Any], seconds: float) -> float:
    fn()
    fn()
    start = time.perf_counter()
    fn()
    once = time.perf_counter() - start
    times = []
    for _ in range(max(5, min(500, int(seconds / max(once, 1e-6))))):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().reshape(-1, a.shape[-1]), b.double().reshape(-1, b.shape[-1])
    return float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min())


def run_model(name: str, work: Path, seconds: float, log: Callable[[str], None]) -> dict[str, Any]:
    """Build ``name``'s precision profile in ``work``, then its methods' accuracy and times (the module docstring)."""
    from precompile.calibration import calibration_inputs
    from precompile.pipeline import build
    from precompile.traffic import read_distribution

    folder = work / name
    shutil.copytree(PROFILES, folder, ignore=shutil.ignore_patterns("__pycache__"))
    profile_path = folder / f"{name}_precision.yaml"
    start = time.perf_counter()
    result = build(profile_path, folder / "artifact")
    build_s = time.perf_counter() - start
    log(f"{name}: built in {build_s:.0f} s: {', '.join(v.id for v in result.manifest.variants)}")
    loaded, methods, engines, threads = compared_methods(name, result, profile_path, log)
    eager = methods["eager fp32"]

    samples = [args for _, args in calibration_inputs(loaded, read_distribution(loaded))]
    accuracy = {}
    for label, fn in methods.items():
        accuracy[label] = min(cosine(fn(args), eager(args)) for args in samples)

    rows = time_shapes(loaded.profile, SHAPES[name], methods, seconds, log)
    totals = {label: sum(r[label] for r in rows) for label in methods}
    gate = list(result.manifest.check.precision)
    return {
        "model": name,
        "build_seconds": build_s,
        "variants": [v.id for v in result.manifest.variants],
        "gate": gate,
        "shapes": rows,
        "total_ms": totals,
        "min_cosine_vs_eager": accuracy,
        "calibration_samples": len(samples),
        "engines": engines,
        "threads": threads,
    }


def compared_methods(
    name: str, result: Any, profile_path: Path, log: Callable[[str], None]
) -> tuple[Any, dict[str, Callable[[tuple], torch.Tensor]], dict[str, Any], int]:
    """What a bench compares for one built profile: fp32 eager (``"eager fp32"``), the artifact per
    precision it kept, and the peers on the model's ONNX export (written beside the profile). Returns
    the loaded profile, the methods, what each peer engine says about itself, and torch's threads."""
    from precompile.profile import load_profile
    from precompile.stages.resolve import resolve_model

    from .onnx_export import export_onnx

    loaded = load_profile(profile_path)
    model = resolve_model(loaded)
    onnx = export_onnx(model, loaded.profile, profile_path.parent / "model.onnx")
    threads = torch.get_num_threads()

    def eager(args: tuple) -> torch.Tensor:
        with torch.no_grad():
            return model(*args)

    methods: dict[str, Callable[[tuple], torch.Tensor]] = {"eager fp32": eager, **artifact_methods(result)}
    engines: dict[str, Any] = {}
    if "path" in onnx:
        peers, engines = peer_methods(onnx["path"], list(loaded.profile.inputs), threads)
        methods.update(peers)
    else:
        log(f"{name}: ONNX export failed, peers skipped: {onnx['failed']}")
    return loaded, methods, engines, threads


def artifact_methods(result: Any) -> dict[str, Callable[[tuple], torch.Tensor]]:
    """The built artifact loaded once per precision it kept, and once more as ``loader.load`` serves
    it by default when it holds more than one: each a method to time and to compare."""
    import loader

    methods: dict[str, Callable[[tuple], torch.Tensor]] = {}
    for precision in ("fp32", "bf16", "int8"):
        if any(v.precision == precision for v in result.manifest.variants):
            compiled = loader.load(result.path, precision=precision)
            methods[f"precompile {precision}"] = lambda args, m=compiled: m(*args)
    if len({v.precision for v in result.manifest.variants}) > 1:  # what loader.load serves by default
        compiled = loader.load(result.path)
        methods["precompile auto"] = lambda args, m=compiled: m(*args)
    return methods


def peer_methods(
    onnx_path: str, names: list[str], threads: int
) -> tuple[dict[str, Callable[[tuple], torch.Tensor]], dict[str, Any]]:
    """The CPU peers on the exported ONNX file (ONNX Runtime, OpenVINO default and f32), each a
    method taking the profile's inputs in order, and what each engine says about itself."""
    from .peers import open_engine

    methods: dict[str, Callable[[tuple], torch.Tensor]] = {}
    engines: dict[str, Any] = {}
    for method, label in PEER_LABELS.items():
        run, facts = open_engine(method, onnx_path, threads)
        engines[label] = facts
        methods[peer_label(method, facts)] = lambda args, r=run: torch.from_numpy(
            r({n: t.numpy() for n, t in zip(names, args)})[0]
        )
    return methods, engines


def peer_label(method: str, facts: dict[str, Any]) -> str:
    """A peer's label in the results: its name and the precision it chose, e.g. ``OpenVINO default (bf16)``."""
    return f"{PEER_LABELS[method]} ({facts['precision']})"


def time_shapes(
    profile: Any,
    shapes: list[dict[str, int]],
    methods: dict[str, Callable[[tuple], torch.Tensor]],
    seconds: float,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    """One row per shape: each method's median ms on the same inputs, one method after another."""
    from precompile.samples import make_inputs

    rows = []
    for i, sizes in enumerate(shapes):
        args = make_inputs(profile, sizes, seed=100 + i)
        row: dict[str, Any] = {"dims": sizes}
        for label, fn in methods.items():
            row[label] = median_ms(lambda: fn(args), seconds)
        rows.append(row)
        log(f"  {sizes}: " + "  ".join(f"{k} {v:.2f}" for k, v in row.items() if k != "dims"))
    return rows


def run_isa(name: str, work: Path, seconds: float, log: Callable[[str], None]) -> dict[str, Any]:
    """Build ``name``'s fp32 bench profile natively and for each x86-64 level this host runs, then time
    each per call on the model's shapes (``--isa`` in the module docstring)."""
    import yaml

    import loader
    from loader.host import cpu_features
    from loader.isa import LEVELS, missing_features
    from precompile.pipeline import build
    from precompile.profile import load_profile

    folder = work / f"{name}-isa"
    path = folder / f"{name}.yaml"
    levels = [isa for isa in LEVELS if not missing_features(isa, cpu_features())]
    artifact, build_s = folder / "artifact", None
    if (artifact / "manifest.json").is_file():  # --work kept it from an earlier run: time it again
        log(f"{name}: timing the artifact built earlier in {artifact}")
    else:
        shutil.copytree(PROFILES, folder, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
        raw = yaml.safe_load(path.read_text())
        raw["cpu"] = {"isa": ["native", *levels]}
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        start = time.perf_counter()
        result = build(path, artifact)
        build_s = time.perf_counter() - start
        log(f"{name}: built in {build_s:.0f} s: {', '.join(v.id for v in result.manifest.variants)}")
    if seconds <= 0:  # --build-only
        return {"model": name, "build_seconds": build_s}
    methods: dict[str, Callable[[tuple], torch.Tensor]] = {}
    for isa in ("native", *levels):
        compiled = loader.load(artifact, cpu_isa=isa)
        methods[f"precompile {isa}"] = lambda args, m=compiled: m(*args)
    profile = load_profile(path).profile
    rows = time_shapes(profile, SHAPES[name], methods, seconds, log)
    return {
        "model": name,
        "build_seconds": build_s,
        "variants": [v.id for v in compiled.manifest.variants],
        "shapes": rows,
        "total_ms": {label: sum(r[label] for r in rows) for label in methods},
        "threads": torch.get_num_threads(),
    }


# (label, quantization section over the schema's defaults, calibration samples, also compiled):
# "per-tensor weights" is a reference point the build does not offer (torchao's x86 recipe
# quantizes weights per output channel). A compiled row is the option as the build compiles it.
LAST_BLOCK = "classifier.resnet.encoder.stages.3.layers.2"  # ResNet-50's last bottleneck block: 3 of 54 layers
INT8_OPTIONS: list[tuple[str, dict[str, Any], int, bool]] = [
    ("default (per-channel weights, histogram)", {}, 16, True),
    ("per-tensor weights", {"weights": "per_tensor"}, 16, False),
    ("observer: minmax", {"observer": "minmax"}, 16, False),
    ("observer: percentile", {"observer": "percentile"}, 16, False),
    ("keep: [first]", {"keep": ["first"]}, 16, False),
    ("keep: [last]", {"keep": ["last"]}, 16, False),
    ("keep: [first, last]", {"keep": ["first", "last"]}, 16, False),
    ("keep: [first, last], 64 samples", {"keep": ["first", "last"]}, 64, False),
    ("64 samples", {}, 64, False),
    ("keep: [first, last], percentile", {"keep": ["first", "last"], "observer": "percentile"}, 16, False),
    ("keep: the last block", {"keep": [LAST_BLOCK]}, 16, False),
    ("keep: the last block, 64 samples", {"keep": [LAST_BLOCK]}, 64, True),
]


def run_int8_options(name: str, held_out: int, work: Path, log: Callable[[str], None]) -> dict[str, Any] | None:
    """``INT8_OPTIONS`` on ``name``'s precision profile: accuracy per option (the module docstring);
    the default once more as the build compiles it (into ``work``)."""
    import importlib
    import sys

    from precompile.calibration import calibration_inputs
    from precompile.options import unit_options
    from precompile.profile import load_profile
    from precompile.stages import quantize
    from precompile.stages.compile import compile_package
    from precompile.tracing import export_model
    from precompile.traffic import read_distribution

    loaded = load_profile(PROFILES / f"{name}_precision.yaml")
    profile, traffic = loaded.profile, read_distribution(loaded)
    sys.path.insert(0, str(PROFILES))
    module, factory = profile.model.factory.split(":")
    model = getattr(importlib.import_module(module), factory)()
    if quantize.int8_method(profile, model) != "static":
        log(f"  {name}: int8 is dynamic for it (no convolutions): no static options to compare")
        return None

    def draw(count: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
        changed = profile.model_copy(
            update={
                "check": profile.check.model_copy(update={"seed": seed}),
                "calibration": profile.calibration.model_copy(update={"samples": count}),
            }
        )
        return [args for _, args in calibration_inputs(loaded.model_copy(update={"profile": changed}), traffic)]

    calibration = draw(max(count for _, _, count, _ in INT8_OPTIONS), profile.check.seed)
    held = draw(held_out, profile.check.seed + 1000)
    with torch.no_grad():
        want = torch.cat([model(*args) for args in held]).double()
    hint = {d: s.max for d, s in profile.dims.items()}
    ranges = {d: (s.min, s.max) for d, s in profile.dims.items()}
    ep = export_model(model, profile, ranges, hint)
    rows = []
    for label, changes, count, compile_too in INT8_OPTIONS:
        changes = dict(changes)
        per_tensor = changes.pop("weights", None) == "per_tensor"
        spec = type(profile.quantization)(int8=profile.quantization.int8, **changes)  # not the profile's own
        if per_tensor:
            converted = _per_tensor_int8(ep.module(), spec, calibration[:count])
        else:
            converted = quantize.static_int8(ep.module(), spec, calibration[:count])
        with torch.no_grad():
            got = torch.cat([converted(*args) for args in held]).double()
        rows.append(_accuracy_row(label, count, want, got))
        log(_describe_row(rows[-1]))
        if compile_too:
            again = export_model(converted, profile, ranges, hint)
            package = compile_package(again, work / f"{name}-int8-{len(rows)}.pt2", unit_options({}, "int8"))
            compiled = torch._inductor.aoti_load_package(str(package.path))
            with torch.no_grad():
                lowered = torch.cat([compiled(*args) for args in held]).double()
            rows.append(_accuracy_row(f"{label}, compiled (Inductor)", count, want, lowered))
            rows[-1]["rel_err_vs_eager_qdq"] = float(((lowered - got).norm(dim=-1) / got.norm(dim=-1)).mean())
            log(_describe_row(rows[-1]) + f"  (vs the eager q/dq graph: {rows[-1]['rel_err_vs_eager_qdq']:.4f})")
    return {"model": name, "held_out_rows": int(want.shape[0]), "options": rows}


def _accuracy_row(label: str, samples: int, want: torch.Tensor, got: torch.Tensor) -> dict[str, Any]:
    """Output rows ``got`` against fp32 eager's ``want``: cosine (smallest, 5th percentile, mean), mean relative error."""
    cos = torch.nn.functional.cosine_similarity(want, got, dim=-1)
    return {
        "option": label,
        "samples": samples,
        "min": float(cos.min()),
        "p5": float(cos.quantile(0.05)),
        "mean": float(cos.mean()),
        "rel_err": float(((want - got).norm(dim=-1) / want.norm(dim=-1)).mean()),
    }


def _describe_row(row: dict[str, Any]) -> str:
    return (
        f"  {row['option']:<48} min {row['min']:.4f}  p5 {row['p5']:.4f}  mean {row['mean']:.5f}  "
        f"rel.err {row['rel_err']:.4f}"
    )


def _per_tensor_int8(graph: Any, spec: Any, samples: list[tuple[torch.Tensor, ...]]) -> Any:
    """``static_int8`` with one weight scale per tensor (MinMax): the reference point of INT8_OPTIONS."""
    import dataclasses

    from torchao.quantization.pt2e.observer import MinMaxObserver

    from precompile.stages import quantize

    quantizer = quantize.static_quantizer(spec, graph)
    config = quantizer.global_config
    weight = dataclasses.replace(
        config.weight,
        qscheme=torch.per_tensor_symmetric,
        ch_axis=None,
        observer_or_fake_quant_ctr=MinMaxObserver.with_args(eps=2**-12),
    )
    quantizer.set_global(dataclasses.replace(config, weight=weight))
    return quantize.static_int8(graph, spec, samples, quantizer=quantizer)


def run_bf16_static(work: Path, size: tuple[int, ...], seconds: float, log: Callable[[str], None]) -> dict[str, Any]:
    """ResNet-50 at one static ``size`` in bf16 and fp32 (compiled as the build does) against
    OpenVINO: time per call, and per call the primitives and the time inside them (the module docstring)."""
    import copy
    import resource

    import openvino as ov

    from precompile.options import unit_options
    from precompile.profile import load_profile
    from precompile.stages.compile import compile_package
    from precompile.stages.quantize import Bf16
    from precompile.stages.resolve import resolve_model
    from precompile.tracing import export_model

    from .onnx_export import export_onnx
    from .peers import OPENVINO_CONFIG

    loaded = load_profile(PROFILES / "resnet50_precision.yaml")
    profile, model = loaded.profile, resolve_model(loaded)
    dims = dict(zip(("batch", "height", "width"), (size[0], size[2], size[3])))
    x = torch.rand(*size, generator=torch.Generator().manual_seed(0)) * 2 - 1
    work.mkdir(parents=True, exist_ok=True)

    def cpu_ms(fn: Callable[[], Any], calls: int = 20) -> float:
        before = resource.getrusage(resource.RUSAGE_SELF)
        for _ in range(calls):
            fn()
        after = resource.getrusage(resource.RUSAGE_SELF)
        return 1000 * (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / calls

    rows = {}
    for precision in ("bf16", "fp32"):
        path = work / f"resnet50-{precision}-{'x'.join(map(str, size))}.pt2"
        if not path.exists():
            m = Bf16(copy.deepcopy(model).to(torch.bfloat16)).eval() if precision == "bf16" else model
            ep = export_model(m, profile, {d: (n, n) for d, n in dims.items()}, dims)
            compile_package(ep, path, unit_options({"freezing": True}, precision=precision))
        run = torch._inductor.aoti_load_package(str(path))
        wall = median_ms(lambda: run(x), seconds)
        primitives = _onednn_primitives(lambda: run(x), work / f"verbose-{precision}.txt")
        rows[f"precompile {precision} (static)"] = {"ms": wall, "cpu_ms": cpu_ms(lambda: run(x)), **primitives}
    onnx = export_onnx(model, profile, work / "model.onnx")
    core = ov.Core()
    for method, label in (("openvino", "OpenVINO default"), ("openvino-f32", "OpenVINO f32")):
        network = core.read_model(onnx["path"])
        network.reshape({network.inputs[0].get_any_name(): list(size)})
        compiled = core.compile_model(network, "CPU", {**OPENVINO_CONFIG[method], "PERF_COUNT": "YES"})
        request = compiled.create_infer_request()
        feed = {0: x.numpy()}
        wall = median_ms(lambda: request.infer(feed), seconds)
        request.infer(feed)
        nodes = [n for n in request.profiling_info if n.status == n.Status.EXECUTED]
        kinds: dict[str, int] = {}
        for n in nodes:
            key = f"{n.node_type} {n.exec_type}"
            kinds[key] = kinds.get(key, 0) + 1
        rows[f"{label} ({compiled.get_property('INFERENCE_PRECISION_HINT').get_type_name()})"] = {
            "ms": wall,
            "cpu_ms": cpu_ms(lambda: request.infer(feed)),
            "kinds": kinds,
            "inside_ms": sum(n.real_time.total_seconds() for n in nodes) * 1000,
        }
    for label, row in rows.items():
        log(
            f"  {label:<32} {row['ms']:7.2f} ms/call  cpu {row['cpu_ms']:6.2f} ms  inside kernels "
            f"{row['inside_ms']:6.2f} ms  {row['kinds']}"
        )
    return {"model": "resnet50", "size": list(size), "threads": torch.get_num_threads(), "methods": rows}


def _onednn_primitives(call: Callable[[], Any], log_path: Path) -> dict[str, Any]:
    """One ``call`` under oneDNN's verbose mode: the primitives per kind and kernel, and their summed ms."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    saved = os.dup(1)
    os.dup2(fd, 1)  # oneDNN prints with printf: only the file descriptor catches it
    try:
        with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
            call()
    finally:
        os.dup2(saved, 1)
        os.close(fd)
        os.close(saved)
    kinds: dict[str, int] = {}
    inside = 0.0
    for line in log_path.read_text().splitlines():
        fields = line.split(",")
        if line.startswith("onednn_verbose") and "exec" in fields and fields[fields.index("exec") + 1] == "cpu":
            i = fields.index("exec")
            key = f"{fields[i + 2]} {fields[i + 3]}"
            kinds[key] = kinds.get(key, 0) + 1
            inside += float(fields[-1])
    return {"kinds": kinds, "inside_ms": inside}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["minilm", "resnet50"], choices=sorted(SHAPES))
    parser.add_argument("--seconds", type=float, default=1.0, help="timing per method per shape")
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/precision.json (isa.json)")
    parser.add_argument("--isa", action="store_true", help="time the x86-64 levels' variants against native")
    parser.add_argument(
        "--work",
        type=Path,
        help="--isa, --bf16-static: build into (and time again from) this folder instead of a temporary one",
    )
    parser.add_argument("--build-only", action="store_true", help="--isa with --work: build, time nothing")
    parser.add_argument(
        "--int8-options", action="store_true", help="accuracy of each int8 static option (INT8_OPTIONS), no timing"
    )
    parser.add_argument("--held-out", type=int, default=64, help="--int8-options: held-out inputs per option")
    parser.add_argument(
        "--bf16-static", action="store_true", help="ResNet-50 bf16 at one static size: where a call's time goes"
    )
    parser.add_argument("--size", default="1x3x128x128", help="--bf16-static: the input's shape")
    parser.add_argument(
        "--write-calibration", action="store_true", help="rewrite profiles/bench/minilm_calibration.jsonl and stop"
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.write_calibration:
        write_minilm_calibration(PROFILES / "minilm_calibration.jsonl")
        return
    if args.int8_options:
        args.out = args.out or ROOT / "bench" / "results" / "int8_options.json"
        models = [m for m in args.models if (PROFILES / f"{m}_precision.yaml").exists()]
        results = []
        for name in models:
            print(f"{name}: int8 static options, cosine vs fp32 eager on {args.held_out} held-out inputs", flush=True)
            with tempfile.TemporaryDirectory(prefix="int8-options-") as tmp:
                results.append(run_int8_options(name, args.held_out, Path(tmp), lambda s: print(s, flush=True)))
        args.out.write_text(json.dumps({"results": [r for r in results if r]}, indent=2) + "\n")
        print(f"\nwrote {args.out}")
        return
    if args.bf16_static:
        args.out = args.out or ROOT / "bench" / "results" / "bf16_static.json"
        size = tuple(int(n) for n in args.size.split("x"))
        with tempfile.TemporaryDirectory(prefix="bf16-static-") as tmp:
            work = args.work or Path(tmp)
            result = run_bf16_static(work, size, args.seconds, lambda s: print(s, flush=True))
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.out}")
        return
    args.out = args.out or ROOT / "bench" / "results" / ("isa.json" if args.isa else "precision.json")
    if not args.isa and "quick" in args.models:
        parser.error("--models quick is the smoke run of --isa (it has no precision profile)")
    results = []
    if args.build_only and not (args.isa and args.work):
        parser.error("--build-only needs --isa and --work")
    with tempfile.TemporaryDirectory(prefix="precision-bench-") as tmp:
        for name in args.models:
            run = run_isa if args.isa else run_model
            work = args.work if args.isa and args.work else Path(tmp)
            results.append(run(name, work, 0.0 if args.build_only else args.seconds, lambda s: print(s, flush=True)))
    if args.build_only:
        return
    for r in results if args.isa else ():
        native = r["total_ms"]["precompile native"]
        print(f"\n{r['model']}: sum of median ms over {len(r['shapes'])} shapes")
        for label, total in r["total_ms"].items():
            print(f"  {label:<28} {total:8.1f} ms  {total / native:5.2f}× native")
    for r in () if args.isa else results:
        print(
            f"\n{r['model']}: sum of median ms over {len(r['shapes'])} shapes; min cosine vs fp32 eager on "
            f"{r['calibration_samples']} calibration inputs"
        )
        eager = r["total_ms"]["eager fp32"]
        for label, total in sorted(r["total_ms"].items(), key=lambda kv: kv[1]):
            print(
                f"  {label:<28} {total:8.1f} ms  {eager / total:5.2f}× eager   cosine {r['min_cosine_vs_eager'][label]:.4f}"
            )
    if args.out.exists():  # keep the other models' results from an earlier run
        earlier = json.loads(args.out.read_text()).get("results", [])
        results += [r for r in earlier if r["model"] not in args.models]
    args.out.write_text(
        json.dumps({"results": results, "cpu": torch.cpu.get_capabilities().get("cpu_name")}, indent=2) + "\n"
    )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
