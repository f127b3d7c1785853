"""The HTTP API fuzzed from its own OpenAPI schema with schemathesis: `precompile serve` as a process on
a loopback port, over a thousand generated requests (valid and schema-violating bodies for every
operation), no 5xx, and the server alive at the end. Bounded in requests and in time."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections import Counter

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from .conftest import builds
from .test_serve_load import ROOT, free_port, stop_server, wait_ready

# Generated requests per operation and mode ("shaped": positive bodies laid out as one rectangular call,
# see `shaped`); the GETs take no input, so a few requests each say it all.
EXAMPLES = {
    ("POST", "/predict", "positive"): 350,
    ("POST", "/predict", "negative"): 200,
    ("POST", "/predict", "shaped"): 200,
    ("POST", "/predict", "shaped, ids in range"): 200,
    ("POST", "/v1/reload", "positive"): 100,
    ("POST", "/v1/reload", "negative"): 100,
}
MIN_REQUESTS = 1000
DEADLINE = 80.0  # seconds of fuzzing at most; fewer requests than MIN_REQUESTS in that time fails the test


@pytest.fixture
@builds
def server(classifier_artifact, tmp_path):
    """`precompile serve` with reload on, confined to a root holding a copy of the classifier."""
    root = tmp_path / "root"
    shutil.copytree(classifier_artifact, root / "classifier")
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "precompile",
        "serve",
        str(root / "classifier"),
        "--port",
        str(port),
        "--allow-reload",
        "--reload-root",
        str(root),
        "--max-body-bytes",
        "65536",
        "--log-level",
        "error",
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    log = open(tmp_path / "server.log", "w+")
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base)
        yield process, base
    finally:
        stop_server(process, timeout=30)
        log.seek(0)
        print(log.read()[-4000:])
        log.close()


def test_schemathesis_finds_no_server_error_and_the_server_survives(server):
    process, base = server
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {(op.method.upper(), op.path) for op in operations} >= {("POST", "/predict"), ("POST", "/v1/reload")}

    codes: Counter = Counter()
    server_errors: list[str] = []
    deadline = time.monotonic() + DEADLINE
    session = requests.Session()

    for op in operations:
        for kind in ("positive", "negative", "shaped", "shaped, ids in range"):
            key = (op.method.upper(), op.path, kind)
            if key not in EXAMPLES and kind != "positive":
                continue
            mode = GenerationMode.NEGATIVE if kind == "negative" else GenerationMode.POSITIVE
            strategy = op.as_strategy(generation_mode=mode)
            if kind.startswith("shaped"):
                strategy = strategy.map(lambda case, in_range=kind.endswith("in range"): shaped(case, in_range))

            @given(case=strategy)
            @settings(
                max_examples=EXAMPLES.get(key, 3),
                deadline=None,
                database=None,
                derandomize=True,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            def send(case) -> None:
                if time.monotonic() > deadline:
                    return
                response = case.call(base_url=base, session=session, timeout=30)
                codes[(case.path, response.status_code)] += 1
                if response.status_code >= 500:
                    server_errors.append(
                        f"{case.method} {case.path} {case.body!r:.300} -> {response.status_code} {response.text[:300]}"
                    )

            send()

    total = sum(codes.values())
    print(f"schemathesis: {total} requests, by endpoint and status: {dict(sorted(codes.items()))}")
    assert process.poll() is None, "the server died"
    assert httpx.get(f"{base}/healthz", timeout=5).status_code == 200
    assert httpx.get(f"{base}/readyz", timeout=5).status_code == 200
    assert not server_errors, "\n".join(server_errors[:10])
    assert total >= MIN_REQUESTS, f"only {total} requests in {DEADLINE} s"
    assert codes[("/predict", 200)] >= 50 and codes[("/predict", 422)] >= 50  # the model ran, the guards refused


def shaped(case, in_range: bool):
    """The values schemathesis generated for a predict request, laid out as one rectangular call: JSON
    Schema cannot say "rectangular" or "same shape as the other input", so most raw bodies stop at the
    codec; these reach the guards (value ranges at int64's edges) and, ``in_range``, the model."""
    inputs = case.body.get("inputs") if isinstance(case.body, dict) else None
    if not isinstance(inputs, dict) or not isinstance(inputs.get("ids"), list) or not inputs["ids"]:
        return case
    rows = inputs["ids"]
    batch, seq = len(rows), max(2, len(rows[0]) if isinstance(rows[0], list) else 2)
    ids, mask = _leaves(rows) or [0], _leaves(inputs.get("mask")) or [True]
    if in_range:
        ids = [int(v) % 50 for v in ids]
    case.body = {
        "inputs": {
            "ids": [[ids[(r * seq + c) % len(ids)] for c in range(seq)] for r in range(batch)],
            "mask": [[mask[(r * seq + c) % len(mask)] for c in range(seq)] for r in range(batch)],
        }
    }
    return case


def _leaves(value) -> list:
    if isinstance(value, list):
        return [leaf for v in value for leaf in _leaves(v)]
    return [] if value is None else [value]
