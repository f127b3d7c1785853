"""A bounded fuzz of a running server, per route and protocol: every answer a client's mistake can
get is a 4xx (or a gRPC status other than INTERNAL and UNKNOWN), never a 5xx, and the server never dies.

    python -m bench.fuzz [--requests 2000] [--seed 1] [--runtime torch native]

builds the tests' tiny classifier (versions 1-3: int64 ids with a value range, a bool mask) and
structured model (float32, three outputs) into bench/work/fuzz, serves them as a repository
(``precompile serve REPO --runtime R --versions latest:2 --grpc-port G --allow-repository-control``)
and sends each route ``--requests`` seeded requests, mostly well-formed, each field at times of
another type or value (junk versions and names in paths included):

    predict       POST /predict/{name}[/versions/{v}]        nested-list bodies
    v2-infer      POST /v2/models/{name}[/versions/{v}]/infer  JSON and binary tensors
    v2-metadata   GET  /v2/models/{name}[/versions/{v}][/ready]
    grpc-typed    ModelInfer, values in typed contents
    grpc-raw      ModelInfer, values in raw_input_contents (bool bytes other than 0/1 among them)
    control       the repository extension: index, load and unload (the structured model, junk names
                  and bodies), after the other routes

Prints a histogram of answers per route and writes bench/results/fuzz.json and fuzz.md. The suite
runs a fixed-seed slice of the same generators (tests/test_hardening.py, tests/test_serve_clients.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import signal
import struct
import subprocess
import sys
import time
import urllib.parse
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HUGE_EMPTY = [0, 2**31 - 1, 2**31 - 1]  # no values, and more than numpy can shape: refused by the codec
# Versions a client may write: served, unserved, and what str.isdigit() takes but a version is not.
VERSIONS = [
    "2",
    "3",
    "3",
    "1",
    "01",
    "0",
    "7",
    "-1",
    "+3",
    "\u00b2",
    "\uff11",
    "\u0661",
    "3.0",
    " 3",
    "9" * 30,
    "x",
    "",
]
NAMES = ["", "nope", "..", "tiny-classifier/..", "tiny\u00e9", "tiny-classifier\u0000", "TINY-CLASSIFIER"]
SERVER_ERROR_CODES = ("INTERNAL", "UNKNOWN", "DATA_LOSS", "UNIMPLEMENTED", "UNAVAILABLE")


DATATYPES = ["BOOL", "UINT8", "INT8", "INT16", "INT32", "INT64", "FP16", "BF16", "FP32", "FP64", "BYTES", "fp32", ""]
PACK = {"BOOL": "?", "INT64": "q", "FP32": "f"}


def junk(rng, depth: int = 0):
    """Any JSON value: null, booleans, integers (int64's edges and beyond), floats (NaN, ±Infinity,
    float32's edge), strings, lists and objects, nested."""
    kind = rng.randrange(8 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice([0, 1, -1, 7, 49, 50, 2**31, 2**63 - 1, -(2**63), 2**63, 2**70, rng.randint(-1000, 1000)])
    if kind == 3:
        return rng.choice(
            [0.0, 0.5, -1.5, 1e-45, 3.4e38, -3.4e38, 1e39, math.nan, math.inf, -math.inf, rng.uniform(-10, 10)]
        )
    if kind == 4:
        return rng.choice(["", "x", "ids", "mask", "FP32", "yes", "true", "1", "output", "hidden", "\u00e9\u0000"])
    if kind == 5:
        return []
    if kind == 6:
        return [junk(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {
        rng.choice(["name", "shape", "datatype", "data", "parameters", "binary_data_size", "binary_data", "k"]): junk(
            rng, depth + 1
        )
        for _ in range(rng.randrange(4))
    }


def values(rng, spec: dict, count: int) -> list:
    """``count`` values for an input: mostly valid for its datatype (and the classifier's ids range), at times not."""
    datatype, wild = spec["datatype"], rng.random() < 0.1
    if datatype == "BOOL":
        return (
            [rng.random() < 0.7 for _ in range(count)]
            if not wild
            else [rng.choice([0, 1, 2, None, "t"]) for _ in range(count)]
        )
    if datatype == "INT64":
        hi = spec["max"]
        return [rng.randint(0, hi) for _ in range(count)] if not wild else [junk(rng, 3) for _ in range(count)]
    edge = [3.4e38, -3.4e38, 1e30, 1e-40, 0.0, -0.0]
    return [rng.uniform(-4, 4) if not wild else rng.choice(edge + [math.nan, math.inf]) for _ in range(count)]


def binary_values(rng, spec: dict, vals: list) -> bytes:
    code = PACK[spec["datatype"]]
    try:
        return struct.pack(f"<{len(vals)}{code}", *vals)
    except (struct.error, TypeError):
        return bytes(
            rng.randrange(256) for _ in range(len(vals) * struct.calcsize(code))
        )  # raw bytes: NaN, 2 as BOOL...


def maybe(rng, p: float = 0.08) -> bool:
    return rng.random() < p


def v2_request(rng, model: dict) -> tuple[bytes, dict[str, str]]:
    """One infer request for ``model`` (its /v2 metadata, with each input's range): every field of the
    protocol's request schema, each at times of another JSON type or value."""
    batch, seq = rng.randint(1, 4), rng.randint(2, 12)
    items, chunks = [], []
    for spec in model["inputs"]:
        shape = [batch if s == -1 and i == 0 else (seq if s == -1 else s) for i, s in enumerate(spec["shape"])]
        if maybe(rng):
            shape = rng.choice(
                [
                    junk(rng),
                    [],
                    [batch],
                    shape + [1],
                    [-1, 2],
                    [2**40, 0],
                    [0] * len(shape),
                    [1] * 40,
                    [1.0, 8],
                    HUGE_EMPTY,
                ]
            )
        count = (
            math.prod(shape) if isinstance(shape, list) and all(type(s) is int and 0 <= s < 64 for s in shape) else 8
        )
        vals = values(rng, spec, count + (rng.choice([-1, 1]) if maybe(rng) else 0))
        item: dict = {"name": spec["name"], "shape": shape, "datatype": spec["datatype"]}
        if rng.random() < 0.4:
            raw = binary_values(rng, spec, vals)
            item["parameters"] = {
                "binary_data_size": len(raw) if not maybe(rng) else rng.choice([junk(rng), len(raw) + 1, -1, 0])
            }
            chunks.append(raw)
        else:
            item["data"] = vals if not maybe(rng) else rng.choice([junk(rng), [vals], [[v] for v in vals], vals[:1]])
            if maybe(rng):
                item["parameters"] = junk(rng)
        if maybe(rng):
            item["name"] = junk(rng)
        if maybe(rng):
            item["datatype"] = rng.choice(DATATYPES + [junk(rng)])
        for key in list(item):
            if maybe(rng, 0.03):
                del item[key]
        items.append(item)
    if maybe(rng):
        items = rng.choice([items[:-1], items + items[:1], items[::-1], items + [junk(rng)], [junk(rng)]])
    request: dict = {"inputs": items if not maybe(rng, 0.03) else junk(rng)}
    if rng.random() < 0.5:
        request["id"] = rng.choice([f"req-{rng.randrange(10**6)}", junk(rng)])
    if rng.random() < 0.4:
        request["parameters"] = rng.choice(
            [{"binary_data_output": rng.random() < 0.5}, {"binary_data_output": junk(rng)}, junk(rng), {}]
        )
    if rng.random() < 0.5:
        names = [o["name"] for o in model["outputs"]]
        outputs = []
        for _ in range(rng.randint(0, len(names))):
            output: dict = {"name": rng.choice(names) if not maybe(rng) else junk(rng)}
            if rng.random() < 0.6:
                output["parameters"] = rng.choice(
                    [{"binary_data": rng.random() < 0.5}, {"binary_data": junk(rng)}, junk(rng)]
                )
            outputs.append(output)
        request["outputs"] = outputs if not maybe(rng, 0.03) else junk(rng)
    if maybe(rng, 0.02):
        request = junk(rng)
    header = json.dumps(request).encode()
    if maybe(rng, 0.02):
        header = header[: rng.randrange(len(header) + 1)]
    body = header + b"".join(chunks)
    headers = {"Content-Type": "application/octet-stream" if chunks else "application/json"}
    if chunks or maybe(rng, 0.05):
        length = (
            len(header)
            if not maybe(rng)
            else rng.choice(["x", "-1", str(len(body) + 1), "0", "+3", "1_0", str(len(header) - 1)])
        )
        headers["Inference-Header-Content-Length"] = str(length)
    if maybe(rng, 0.03):
        body += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
    return body, headers


def predict_request(rng, model: dict) -> bytes:
    """One /predict body for ``model``: nested lists of its inputs' values, at times ragged, of the
    wrong kind, misnamed, missing or extra."""
    batch, seq = rng.randint(1, 4), rng.randint(2, 12)
    inputs: dict = {}
    for spec in model["inputs"]:
        width = seq if spec["shape"][1] == -1 else spec["shape"][1]
        rows = [values(rng, spec, width) for _ in range(batch)]
        if maybe(rng):
            rows = rng.choice([junk(rng), rows[0], [rows], rows + [rows[0][:-1]], [[r] for r in rows]])
        inputs[spec["name"] if not maybe(rng, 0.04) else rng.choice(["", "x2", "IDS"])] = rows
    if maybe(rng, 0.04):
        inputs[rng.choice(["extra", "ids", "x"])] = junk(rng)
    request: object = {"inputs": inputs}
    if maybe(rng, 0.04):
        request = rng.choice([junk(rng), {"inputs": inputs, "id": 1}, {"input": inputs}, {"inputs": junk(rng)}])
    return json.dumps(request).encode()


def version_path(rng, name: str) -> str:
    """``/{name}`` or ``/{name}/versions/{v}``, the name and version at times junk, percent-encoded."""
    if maybe(rng, 0.05):
        name = rng.choice(NAMES)
    path = "/" + urllib.parse.quote(name, safe="")
    if rng.random() < 0.3:
        path += "/versions/" + urllib.parse.quote(rng.choice(VERSIONS), safe="")
    return path


def grpc_request(rng, model: dict, *, raw: bool) -> Any:
    """One ModelInfer request for ``model`` (its /v2 metadata with ranges), values in raw contents or
    typed ones, each field at times wrong: names, datatypes, shapes (negative, huge, empty and huge),
    value counts, bytes (a BOOL byte of 2), the version, the outputs asked for."""
    from precompile.serve import predict_v2_pb2 as pb

    request = pb.ModelInferRequest(model_name=model["name"], id=f"r{rng.randrange(10**6)}")
    if rng.random() < 0.3:
        request.model_version = rng.choice(VERSIONS)
    if maybe(rng, 0.04):
        request.model_name = rng.choice(NAMES)
    batch, seq = rng.randint(1, 4), rng.randint(2, 12)
    specs = list(model["inputs"])
    if maybe(rng):
        specs = rng.choice([specs[:-1], specs + specs[:1], specs[::-1]])
    for spec in specs:
        shape = [batch if s == -1 and i == 0 else (seq if s == -1 else s) for i, s in enumerate(spec["shape"])]
        if maybe(rng):
            shape = rng.choice([[], [batch], shape + [1], [-1, 2], [2**40, 0], [0] * len(shape), [1] * 40, HUGE_EMPTY])
        count = math.prod(shape) if all(0 <= s < 64 for s in shape) else 8
        count = max(count + (rng.choice([-1, 1]) if maybe(rng) else 0), 0)
        datatype = spec["datatype"] if not maybe(rng) else rng.choice(DATATYPES)
        item = request.inputs.add(name=spec["name"] if not maybe(rng, 0.04) else rng.choice(NAMES), datatype=datatype)
        item.shape.extend(shape)
        vals = values(rng, spec, count)
        if raw:
            data = binary_values(rng, spec, vals)
            if spec["datatype"] == "BOOL" and data and maybe(rng, 0.2):
                data = bytes([rng.choice([2, 255])]) + data[1:]
            request.raw_input_contents.append(data if not maybe(rng, 0.05) else data[:-1])
        else:
            _typed_contents(rng, item, spec, vals)
    if maybe(rng, 0.03) and raw:
        request.raw_input_contents.append(b"\x00" * 8)  # one more entry than inputs
    if rng.random() < 0.3:
        for name in rng.sample([o["name"] for o in model["outputs"]] + ["nope"], k=rng.randint(1, 2)):
            request.outputs.add(name=name)
    return request


def _typed_contents(rng, item: Any, spec: dict, vals: list) -> None:
    """``vals`` into the typed field of the input's datatype (or, at times, another field), as far as
    protobuf takes them: a value a field cannot hold goes in as a valid one of that field."""
    field = {"BOOL": "bool_contents", "INT64": "int64_contents", "FP32": "fp32_contents"}[spec["datatype"]]
    if maybe(rng):
        field = rng.choice(["bool_contents", "int_contents", "int64_contents", "uint_contents", "fp32_contents"])
    target = getattr(item.contents, field)
    for v in vals:
        try:
            target.append(v)
        except (TypeError, ValueError):
            target.append({"bool_contents": True, "fp32_contents": 0.5}.get(field, 1))


def control_request(rng, name: str) -> tuple[str, str, bytes]:
    """(method, path, body) for the repository extension: the index (GET or POST, with junk bodies),
    load and unload of ``name`` or of junk names."""
    kind = rng.random()
    body = (
        b""
        if rng.random() < 0.5
        else json.dumps(junk(rng) if maybe(rng, 0.5) else {"ready": rng.random() < 0.5}).encode()
    )
    if maybe(rng, 0.05):
        body = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 16)))
    if kind < 0.4:
        return rng.choice(["GET", "POST"]), "/v2/repository/index", body
    target = name if rng.random() < 0.15 else rng.choice(NAMES + ["nope-" + str(rng.randrange(100))])
    action = rng.choice(["load", "unload", "reload", ""])
    return "POST", f"/v2/repository/models/{urllib.parse.quote(target, safe='')}/{action}", body


def model_description(get, name: str, ranges: dict[str, int]) -> dict:
    """The model's /v2 metadata (``get(path)``: the parsed JSON), each input with its value range's top."""
    model = get(f"/v2/models/{name}")
    for spec in model["inputs"]:
        spec["max"] = ranges.get(spec["name"], 0)
    return model


# --- sending -------------------------------------------------------------------------------------


class Tally:
    """Answers per route (HTTP status or gRPC code) and the ones that are the server's fault."""

    def __init__(self) -> None:
        self.codes: dict[str, Counter] = {}
        self.errors: list[str] = []

    def add(self, route: str, code: Any, bad: bool, what: Any) -> None:
        self.codes.setdefault(route, Counter())[str(code)] += 1
        if bad:
            self.errors.append(f"{route}: {str(what)[:300]} -> {code}")

    def merge(self, other: Tally) -> None:
        for route, codes in other.codes.items():
            self.codes.setdefault(route, Counter()).update(codes)
        self.errors += other.errors


def fuzz_http(base: str, models: list[dict], n: int, seed: int, tally: Tally) -> None:
    """``n`` requests on each HTTP route (predict, v2-infer, v2-metadata) over ``models``."""
    import httpx

    rng = random.Random(seed)
    with httpx.Client(base_url=base, timeout=30) as c:
        for route in ("predict", "v2-infer", "v2-metadata"):
            for _ in range(n):
                model = rng.choice(models)
                named = version_path(rng, model["name"])
                if route == "predict":
                    method, path = "POST", "/predict" + named
                    body, headers = predict_request(rng, model), {"Content-Type": "application/json"}
                elif route == "v2-infer":
                    method, path = "POST", f"/v2/models{named}/infer"
                    body, headers = v2_request(rng, model)
                else:
                    method, path = "GET", f"/v2/models{named}" + rng.choice(["", "/ready"])
                    body, headers = b"", {}
                try:
                    response = c.request(method, path, content=body, headers=headers)
                except httpx.TransportError as e:  # no answer at all is worse than a 5xx
                    tally.add(route, type(e).__name__, True, (path, body[:200]))
                    return
                tally.add(route, response.status_code, response.status_code >= 500, (path, body[:200], response.text))


def fuzz_grpc(target: str, models: list[dict], n: int, seed: int, tally: Tally) -> None:
    """``n`` ModelInfer requests with typed contents and ``n`` with raw ones, over ``models``."""
    import grpc

    from precompile.serve import predict_v2_pb2 as pb

    rng = random.Random(seed)
    with grpc.insecure_channel(target) as channel:
        infer = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        for route, raw in (("grpc-typed", False), ("grpc-raw", True)):
            for _ in range(n):
                request = grpc_request(rng, rng.choice(models), raw=raw)
                try:
                    infer(request, timeout=30)
                    code = "OK"
                except grpc.RpcError as e:
                    code = e.code().name
                    detail = e.details()
                else:
                    detail = ""
                tally.add(route, code, code in SERVER_ERROR_CODES, (str(request)[:200], detail))


def fuzz_control(base: str, name: str, n: int, seed: int, tally: Tally) -> None:
    """``n`` repository-extension requests (``name``: the model they may unload and load); ``name``
    is loaded again at the end."""
    import httpx

    rng = random.Random(seed)
    with httpx.Client(base_url=base, timeout=120) as c:
        for _ in range(n):
            method, path, body = control_request(rng, name)
            try:
                response = c.request(method, path, content=body)
            except httpx.TransportError as e:
                tally.add("control", type(e).__name__, True, (path, body[:100]))
                return
            tally.add("control", response.status_code, response.status_code >= 500, (path, body[:100], response.text))
        c.post(f"/v2/repository/models/{name}/load")


# --- a repository served -------------------------------------------------------------------------


def build_repository(work: Path) -> Path:
    """The tests' classifier as versions 1-3 and the structured model, as a repository under ``work``
    (each compiled once; the folder is kept between runs)."""
    import shutil

    from precompile.pipeline import build
    from tests.conftest import CLASSIFIER_PROFILE, STRUCTURED_PROFILE, artifact_version, write_profile

    repo = work / "repo"
    if (repo / "tiny-classifier" / "3" / "manifest.json").is_file():
        return repo
    classifier, structured = work / "classifier", work / "structured"
    for out, text in ((classifier, CLASSIFIER_PROFILE), (structured, STRUCTURED_PROFILE)):
        if not (out / "manifest.json").is_file():
            print(f"building {out.name} -> {out}", flush=True)
            build(write_profile(work / f"{out.name}-profile", text), out)
    staging = work / "repo.partial"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(classifier, staging / "tiny-classifier" / "1")
    for version in (2, 3):
        artifact_version(classifier, staging / "tiny-classifier" / str(version), version)
    shutil.copytree(structured, staging / "structured")
    staging.rename(repo)
    return repo


def serve(repo: Path, runtime: str, log: Path) -> tuple[subprocess.Popen, str, str]:
    """``precompile serve REPO`` on loopback ports, ready: (process, HTTP base URL, gRPC target)."""
    from bench.serve_load import Server, free_port, wait_ready
    from precompile.serve.server import serving_env

    http, grpc_port = free_port(), free_port()
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **serving_env(1)}
    command = [
        sys.executable, "-m", "precompile", "serve", str(repo), "--runtime", runtime, "--versions", "latest:2",
        "--port", str(http), "--grpc-port", str(grpc_port), "--allow-repository-control", "--log-level", "warning",
    ]  # fmt: skip
    with open(log, "wb") as out:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    wait_ready(Server("precompile", False, process, http, grpc_port, 1, log), timeout=300)
    return process, f"http://127.0.0.1:{http}", f"127.0.0.1:{grpc_port}"


def describe(base: str) -> list[dict]:
    """The served models' /v2 metadata, with the classifier's ids range."""
    import httpx

    with httpx.Client(base_url=base, timeout=30) as c:
        get = lambda path: c.get(path).json()  # noqa: E731
        return [model_description(get, "tiny-classifier", {"ids": 49}), model_description(get, "tiny-structured", {})]


def run(repo: Path, runtime: str, n: int, seed: int, log: Path) -> dict[str, Any]:
    """Every route fuzzed ``n`` times on one server of ``runtime``: the tally, whether it lived on."""
    process, base, target = serve(repo, runtime, log)
    tally = Tally()
    start = time.monotonic()
    try:
        models = describe(base)
        fuzz_http(base, models, n, seed, tally)
        fuzz_grpc(target, models, n, seed + 1, tally)
        fuzz_control(base, "tiny-structured", n, seed + 2, tally)
        alive = process.poll() is None
        if alive:
            import httpx

            with httpx.Client(base_url=base, timeout=60) as c:
                ready = c.get("/v2/models/tiny-structured/ready").status_code == 200
                ready = ready and c.get("/v2/models/tiny-classifier/ready").status_code == 200
        else:
            ready = False
    finally:
        elapsed = time.monotonic() - start
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    log_text = log.read_text(errors="replace")
    return {
        "runtime": runtime,
        "requests": sum(sum(c.values()) for c in tally.codes.values()),
        "seconds": round(elapsed, 1),
        "codes": {route: dict(sorted(codes.items())) for route, codes in tally.codes.items()},
        "server_errors": tally.errors[:20],
        "alive": alive,
        "ready_after": ready,
        "exit_code": process.returncode,
        "tracebacks_logged": log_text.count("Traceback"),
    }


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def markdown(results: list[dict], n: int, seed: int) -> str:
    lines = [
        "# Fuzz: client mistakes per route and protocol",
        "",
        f"`python -m bench.fuzz --requests {n} --seed {seed}`: {n} seeded requests per route, on a repository "
        "server of each runtime (the tests' classifier, versions 2 and 3 served, and structured model; "
        "`--versions latest:2 --grpc-port G --allow-repository-control`). "
        f"Host: {cpu_name()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the end.",
        "",
        "| runtime | route | answers | 5xx / INTERNAL |",
        "|---|---|---|---|",
    ]
    for r in results:
        for route, codes in r["codes"].items():
            bad = sum(v for k, v in codes.items() if k.isdigit() and int(k) >= 500 or k in SERVER_ERROR_CODES)
            shown = ", ".join(f"{k}: {v}" for k, v in codes.items())
            lines.append(f"| {r['runtime']} | {route} | {shown} | {bad} |")
    lines.append("")
    for r in results:
        lines.append(
            f"- {r['runtime']}: {r['requests']} requests in {r['seconds']} s; alive after: {r['alive']}, models ready "
            f"after: {r['ready_after']}, exit code on SIGTERM: {r['exit_code']}, tracebacks in the log: "
            f"{r['tracebacks_logged']}, server errors: {len(r['server_errors'])}"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests per route (default 2000)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--runtime", nargs="+", default=["torch", "native"], choices=["torch", "native"])
    parser.add_argument("--work", type=Path, default=ROOT / "bench" / "work" / "fuzz")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    repo = build_repository(args.work)
    results = []
    for runtime in args.runtime:
        result = run(repo, runtime, args.requests, args.seed, args.work / f"serve-{runtime}.log")
        print(json.dumps(result, indent=1), flush=True)
        results.append(result)
    (args.out / "fuzz.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "fuzz.md").write_text(markdown(results, args.requests, args.seed))
    print(markdown(results, args.requests, args.seed))
    if any(r["server_errors"] or not r["alive"] for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
