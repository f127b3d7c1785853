"""Cold start of the torch-free loader beside today's loader (and ONNX Runtime, given the ONNX file of
the same model and the bench extra): fresh process to first correct result, and peak RSS; and the
same for the server on each runtime (process start to the first 200 of POST /v2/models/NAME/infer).

    python -m bench.coldstart_native ARTIFACT[=ONNX] [ARTIFACT[=ONNX] ...] [--rounds 5]
        [--dims batch=4,seq=77] [--no-server] [--open eager|background|lazy] [--per-call N] [-o OUT.json]

    # MiniLM and a convnet as the bench builds them (python -m bench --keep KEEP: KEEP/CASE/planned is the
    # artifact, KEEP/CASE/model.onnx the same model for ONNX Runtime, which needs the bench extra):
    python -m bench.coldstart_native KEEP/minilm/planned=KEEP/minilm/model.onnx \\
        KEEP/resnet50/planned=KEEP/resnet50/model.onnx --rounds 10 -o coldstart_native.json
    # and MiniLM standalone (precompile build profiles/bench/minilm_standalone.yaml -o KEEP/minilm/standalone)
    # beside the same dynamic-only build on torch's libraries (KEEP/minilm/dynamic):
    python -m bench.coldstart_native KEEP/minilm/standalone=KEEP/minilm/model.onnx \\
        KEEP/minilm/dynamic=KEEP/minilm/model.onnx --rounds 10 --no-server --per-call 50 -o coldstart_standalone.json

Methods, alternated round by round so a neighbour's load slows them alike:

    native        python, numpy, ``loader.load_native`` (torch's libraries, never ``import torch``; for a
                  standalone artifact, ``compile: {standalone: true}``, not even those: its own shim)
    loader        python, ``import torch``, ``loader.load`` (what serving does today)
    onnxruntime   python, numpy, ``onnxruntime`` on the ONNX file (skipped without one or without the package)
    serve-native  ``precompile serve ARTIFACT --runtime native``: start to the first 200 on /v2 infer
    serve-torch   ``precompile serve ARTIFACT --runtime torch``, the same (both skipped with --no-server)

ARTIFACT is a folder or a pack (``precompile pack``; the first round unpacks it into the cache, later
rounds load the verified entry). ``--open`` is the loaders' ``open`` (default: theirs, background:
the first variant opened before ``load()`` returns, the others after).

Each child (``--child METHOD``) imports only what its method needs, loads, runs one call on inputs
made from the manifest (a fixed seed; each dim at ``--dims`` or the first variant's hint), and prints
the wall-clock time of its result and its peak RSS (``ru_maxrss``) before it saves the outputs; the
time counted is from just before the parent starts the process, interpreter start-up and imports
included. A server is started on a free loopback port and sent the same call (binary tensors) until
it answers 200; its peak RSS is the kernel's high-water mark (``VmHWM``) read then. The parent checks
each result against the torch loader's: bit-identical for the torch-free path (within 1e-5 relative
on a standalone artifact, whose exp is its shim's), within 1e-3 relative
for ONNX Runtime, within 1e-4 for the servers (they size their thread pools from the CPUs the
process gets, which may sum in another order). Figures mean something only on a quiet machine; the
script prints them, it never asserts on them.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from loader.threads import wait_env

METHODS = ("native", "loader", "onnxruntime", "serve-native", "serve-torch")
ROOT = Path(__file__).resolve().parent.parent
PER_CALL_ENV = "BENCH_PER_CALL"  # set for a child: a steady pass of that many calls per block
SERVER_DEADLINE = 300.0  # seconds a server may take to answer its first call


def read_manifest(artifact: Path):
    """The manifest of an artifact folder or of a pack (``precompile pack``: its head)."""
    from loader.artifact import read_manifest as read_folder
    from loader.stores.pack import read_head

    return read_head(artifact).manifest if Path(artifact).is_file() else read_folder(artifact)


def make_case(artifact: Path, dims: dict[str, int], out: Path) -> dict[str, int]:
    """Write the inputs of one call (numpy, seeded) to ``out`` (.npz); return the dim sizes used."""
    import numpy as np

    manifest = read_manifest(artifact)
    sizes = {**manifest.variants[0].hint, **{d: n for d, n in dims.items() if d in manifest.dims}}
    rng = np.random.default_rng(0)
    arrays = {}
    for spec in manifest.inputs:
        shape = [sizes[s] if isinstance(s, str) else s for s in spec.shape]
        if spec.dtype == "bool":
            arrays[spec.name] = np.ones(shape, dtype=bool)
        elif spec.dtype.startswith(("int", "uint")):
            lo, hi = (spec.range.min, spec.range.max) if spec.range is not None else (0, 9)
            arrays[spec.name] = rng.integers(lo, hi + 1, shape, dtype=spec.dtype)
        else:
            arrays[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
    np.savez(out, **arrays)
    return sizes


def child(method: str, artifact: str, case: str, out: str, onnx: str | None, open_mode: str | None) -> None:
    """One cold start; everything imported here is part of what is timed."""
    import numpy as np

    feeds = dict(np.load(case))
    options = {"open": open_mode} if open_mode else {}
    per_call = int(os.environ.get(PER_CALL_ENV) or 0)
    if per_call:  # a steady pass, not a cold start: one thread, time.process_time per call
        options["threads"] = 1
    if method == "native":
        import loader

        model = loader.load_native(artifact, **options)
        args = [feeds[n] for n in model.input_names]
    elif method == "loader":
        import torch

        import loader

        model = loader.load(artifact, **options)
        args = [torch.from_numpy(feeds[n]) for n in model.input_names]
    if method in ("native", "loader"):
        result = model(*args)
        if per_call:
            print(json.dumps({"per_call_ms": _per_call_ms(lambda: model(*args), per_call)}), flush=True)
            return
    else:
        from bench.peers import open_engine

        run, _ = open_engine("onnxruntime", onnx, len(os.sched_getaffinity(0)))
        result = run(feeds)[0]
    done = time.time()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    maps = Path("/proc/self/maps").read_text()
    report = {
        "done": done,
        "rss_mb": usage.ru_maxrss / 1024,
        "cpu_s": usage.ru_utime + usage.ru_stime,  # every thread's, to the first result
        "libtorch": "libtorch_cpu" in maps,
    }
    print(json.dumps(report), flush=True)
    first = _first(result)
    np.save(out, first.numpy() if hasattr(first, "numpy") and not isinstance(first, np.ndarray) else np.asarray(first))


def _per_call_ms(call, calls: int) -> float:
    """CPU milliseconds per call (``time.process_time``: every thread's, so a neighbour's load
    slows it less than wall-clock time), the least of 5 blocks of ``calls``, after 5 warm calls."""
    for _ in range(5):
        call()
    blocks = []
    for _ in range(5):
        began = time.process_time()
        for _ in range(calls):
            call()
        blocks.append((time.process_time() - began) / calls * 1e3)
    return min(blocks)


def _first(result):
    """The first array of forward()'s structure."""
    while isinstance(result, (tuple, list, dict)):
        result = next(iter(result.values())) if isinstance(result, dict) else result[0]
    return result


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env.update(wait_env({}))  # what precompile serve runs with, for every method alike
    return env


def start(
    method: str, artifact: Path, case: Path, out: Path, onnx: str | None, open_mode: str | None, per_call: int = 0
) -> dict:
    if method.startswith("serve-"):
        return serve_once(method.removeprefix("serve-"), artifact, case, out)
    env = child_env()
    if per_call:
        env[PER_CALL_ENV] = str(per_call)
    command = [
        sys.executable,
        "-m",
        "bench.coldstart_native",
        "--child",
        method,
        str(artifact),
        str(case),
        str(out),
        onnx or "",
        open_mode or "",
    ]
    began = time.time()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{method} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    if per_call:
        return report
    return {
        "seconds": report["done"] - began,
        "rss_mb": report["rss_mb"],
        **{k: report[k] for k in ("cpu_s", "libtorch")},
    }


def infer_request(artifact: Path, case: Path) -> tuple[str, bytes, dict[str, str]]:
    """The /v2 infer call of ``case``'s inputs, in binary, its first output asked for in binary."""
    import numpy as np

    from precompile.serve.oip import DATATYPES, HEADER_LENGTH

    manifest = read_manifest(artifact)
    feeds = dict(np.load(case))
    inputs, chunks = [], []
    for spec in manifest.inputs:
        raw = np.ascontiguousarray(feeds[spec.name]).astype(feeds[spec.name].dtype.newbyteorder("<")).tobytes()
        shape = list(feeds[spec.name].shape)
        inputs.append(
            {
                "name": spec.name,
                "shape": shape,
                "datatype": DATATYPES[spec.dtype],
                "parameters": {"binary_data_size": len(raw)},
            }
        )
        chunks.append(raw)
    header = json.dumps({"inputs": inputs, "parameters": {"binary_data_output": True}}).encode()
    return f"/v2/models/{manifest.name}/infer", header + b"".join(chunks), {HEADER_LENGTH: str(len(header))}


def first_binary_output(body: bytes, header_length: int):
    """The first output of a binary infer response, as a numpy array."""
    import numpy as np

    from precompile.serve.oip import DATATYPES

    header = json.loads(body[:header_length])
    first = header["outputs"][0]
    dtype = {code: name for name, code in DATATYPES.items()}[first["datatype"]]
    size = first["parameters"]["binary_data_size"]
    data = body[header_length : header_length + size]
    return np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<")).astype(dtype).reshape(first["shape"])


def serve_once(runtime: str, artifact: Path, case: Path, out: Path) -> dict:
    """One server cold start: ``precompile serve --runtime RUNTIME`` to its first 200 on /v2 infer."""
    import numpy as np

    from bench.serve_load import free_port, stop_server
    from precompile.serve.oip import HEADER_LENGTH

    path, body, headers = infer_request(artifact, case)
    port = free_port()
    command = [sys.executable, "-m", "precompile", "serve", str(artifact), "--runtime", runtime]
    command += ["--port", str(port), "--log-level", "warning"]
    env = {k: v for k, v in child_env().items() if not k.startswith("OMP_")}  # the server sets its own
    log = out.with_suffix(".log")
    with open(log, "wb") as stderr:  # a file, not a pipe nobody reads while the server runs
        began = time.time()
        proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"serve-{runtime} exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            if time.time() - began > SERVER_DEADLINE:
                raise RuntimeError(f"serve-{runtime}: no 200 within {SERVER_DEADLINE:g} s")
            request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=SERVER_DEADLINE) as response:
                    answer, length = response.read(), int(response.headers[HEADER_LENGTH])
                break
            except urllib.error.HTTPError as e:
                if e.code != 503:  # 503 until the model is loaded; anything else is a wrong call
                    raise RuntimeError(f"serve-{runtime}: HTTP {e.code}: {e.read()[:500]!r}") from None
            except (urllib.error.URLError, ConnectionError):  # not listening yet
                pass
            time.sleep(0.01)
        done = time.time()
        rss_mb = _high_water_mb(proc.pid)
    finally:
        stop_server(proc)
    np.save(out, first_binary_output(answer, length))
    return {"seconds": done - began, "rss_mb": rss_mb}


def _high_water_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def onnxruntime_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("onnxruntime") is not None


def measure(artifact: Path, onnx: str | None, opts: argparse.Namespace, dims: dict[str, int]) -> dict:
    """Every method's cold starts on one model, checked against the torch loader's result."""
    import numpy as np

    from loader.native import manifest_problem

    manifest = read_manifest(artifact)
    problem = manifest_problem(manifest)
    standalone = all(v.shim for v in manifest.variants if v.device == "cpu")
    methods = ["loader"] if problem else ["native", "loader"]
    skipped = {"native": f"the torch-free loader cannot serve it: {problem}"} if problem else {}
    if not onnx:
        skipped["onnxruntime"] = "no ONNX file given (ARTIFACT=ONNX)"
    elif not onnxruntime_available():
        skipped["onnxruntime"] = "onnxruntime is not installed (the bench extra: make venv-bench)"
    else:
        methods.append("onnxruntime")
    if opts.no_server:
        skipped["serve-native"] = skipped["serve-torch"] = "--no-server"
    else:
        methods += ["serve-torch"] if problem else ["serve-native", "serve-torch"]
        if problem:
            skipped["serve-native"] = skipped["native"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        case = folder / "case.npz"
        sizes = make_case(artifact, dims, case)
        runs: dict[str, list[dict]] = {m: [] for m in methods}
        results = {}
        for _ in range(opts.rounds):
            for method in methods:
                out = folder / f"{method}.npy"
                runs[method].append(start(method, artifact, case, out, onnx, opts.open))
                results[method] = np.load(out)
        steady = {
            m: start(m, artifact, case, folder / "steady.npy", onnx, opts.open, opts.per_call)["per_call_ms"]
            for m in ("native", "loader")
            if opts.per_call and m in methods
        }
    reference = results["loader"]
    scale = float(np.abs(reference).max()) or 1.0

    def within(method: str, rtol: float) -> bool:
        got = results[method]
        return bool(got.shape == reference.shape and np.abs(got - reference).max() / scale <= rtol)

    checks = {}
    if "native" in results:  # a standalone artifact's exp is its shim's, not SLEEF's: float tolerance
        checks["native"] = results["native"].dtype == reference.dtype and (
            within("native", 1e-5) if standalone else bool(np.array_equal(results["native"], reference))
        )
    if "onnxruntime" in results:
        checks["onnxruntime"] = within("onnxruntime", 1e-3)
    for method in ("serve-native", "serve-torch"):
        if method in results:
            checks[method] = within(method, 1e-4)
    return {
        "artifact": str(artifact),
        "standalone": standalone,
        "dims": sizes,
        "rounds": opts.rounds,
        "open": opts.open or "default",
        "methods": {
            m: {
                "cold_start_s": {
                    "median": statistics.median(r["seconds"] for r in rs),
                    "min": min(r["seconds"] for r in rs),
                },
                "peak_rss_mb": {
                    "median": statistics.median(r["rss_mb"] for r in rs),
                    "max": max(r["rss_mb"] for r in rs),
                },
                **(
                    {  # the loaders' and ONNX Runtime's children: CPU seconds to the first result
                        "cpu_s": {"median": statistics.median(r["cpu_s"] for r in rs)},
                        "libtorch_mapped": any(r["libtorch"] for r in rs),
                    }
                    if "cpu_s" in rs[0]
                    else {}
                ),
                **({"per_call_ms_1_thread": steady[m]} if m in steady else {}),
                "correct": checks.get(m, True),
                "bit_identical": bool(np.array_equal(results[m], reference)),
            }
            for m, rs in runs.items()
        },
        "skipped": skipped,
    }


def compile_checkout() -> None:
    """Write the bytecode of this checkout's ``loader`` and ``precompile`` into their ``__pycache__``,
    as installing a wheel does (pip compiles every module), so that no child compiles them from
    source: ONNX Runtime's and numpy's installed modules start compiled, and a checkout run with
    ``PYTHONDONTWRITEBYTECODE=1`` (never writing it) would pay 20-40 ms more per process
    (bench/results/coldstart_isa.md, 2026-12-07)."""
    for package in ("loader", "precompile"):
        compileall.compile_dir(ROOT / package, quiet=1)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:  # METHOD ARTIFACT CASE OUT ONNX-or-empty OPEN-or-empty: one cold start
        child(*argv[1:5], argv[5] or None, argv[6] or None)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", metavar="ARTIFACT[=ONNX]", help="an artifact, and the same model as ONNX")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--dims", default="", help="dim sizes of the call, e.g. batch=4,seq=77 (each model takes its own)"
    )
    parser.add_argument("--no-server", action="store_true", help="skip the servers' cold starts")
    parser.add_argument(
        "--per-call",
        type=int,
        default=0,
        metavar="N",
        help="also time the loaders' steady calls: one thread, CPU ms per call (least of 5 blocks of N)",
    )
    parser.add_argument(
        "--open",
        choices=("eager", "background", "lazy"),
        help="load(open=...) for the native and loader methods (default: the loaders' own, background)",
    )
    parser.add_argument("-o", "--output", type=Path, help="write the figures as JSON here too")
    opts = parser.parse_args(argv)
    compile_checkout()
    dims = {k: int(v) for k, v in (item.split("=", 1) for item in opts.dims.split(",") if item)}
    report = {"models": {}}
    for model in opts.models:
        artifact, _, onnx = model.partition("=")
        name = read_manifest(Path(artifact)).name
        report["models"][name] = measure(Path(artifact), onnx or None, opts, dims)
    text = json.dumps(report, indent=2)
    print(text)
    if opts.output:
        opts.output.write_text(text + "\n")
    wrong = [
        f"{name}: {m}" for name, r in report["models"].items() for m, f in r["methods"].items() if not f["correct"]
    ]
    if wrong:
        raise SystemExit(f"wrong results: {', '.join(wrong)}")


if __name__ == "__main__":
    main()
