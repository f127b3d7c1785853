"""The KServe runtime (precompile/integrations/kserve.py): kserve's own ModelServer, started here on
loopback ports as a process (`python -m precompile.integrations.kserve`, as the ClusterServingRuntime
runs it), called with tritonclient (HTTP, gRPC) and kserve's own clients; and deploy/kserve/*.yaml
validated against the CRDs' schemas (no Kubernetes here)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import loader

from .isolation import blocked_env
from .ray_cluster import free_port, stop_group, wait_http_ready

if importlib.util.find_spec("kserve") is None:
    pytest.skip("kserve is not installed (pip install -e '.[dev]')", allow_module_level=True)
# Not imported here: kserve's V2 messages and tritonclient's are the same protobuf package (`inference`),
# which one process's descriptor pool holds once; kserve's own clients run in a process of their own.
httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kserve"
NAME = "tiny-classifier"


class KServeRuntime:
    """``python -m precompile.integrations.kserve`` on free loopback ports, in a process group of its own."""

    def __init__(self, model_dir: Path, log: Path, *extra: str, env: dict[str, str] | None = None):
        self.http, self.grpc = free_port(), free_port()
        self.log_path = log
        self.log = open(log, "wb")
        args = [
            sys.executable,
            "-m",
            "precompile.integrations.kserve",
            f"--model_name={NAME}",
            f"--model_dir={model_dir}",
            f"--http_port={self.http}",
            f"--grpc_port={self.grpc}",
            *extra,
        ]
        self.process = subprocess.Popen(
            args, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )

    def wait_ready(self, timeout: float = 90) -> None:
        url = f"http://127.0.0.1:{self.http}/v2/models/{NAME}/ready"
        wait_http_ready(url, self.process, self.log_path, "the KServe runtime", timeout=timeout)

    def stop(self) -> None:
        stop_group(self.process, grace=10)
        self.log.close()


@pytest.fixture(scope="module")
def mounted(classifier_artifact, tmp_path_factory) -> Path:
    """The artifact where KServe's storage initializer (or a pvc:// mount) puts it: /mnt/models."""
    mnt = tmp_path_factory.mktemp("mnt") / "models"
    shutil.copytree(classifier_artifact, mnt)
    return mnt


@pytest.fixture(scope="module")
def runtime(mounted, tmp_path_factory):
    server = KServeRuntime(mounted, tmp_path_factory.mktemp("kserve") / "server.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def reference(classifier_artifact):
    return loader.load(classifier_artifact)


def call(seed: int, batch: int = 2, seq: int = 12) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 50, (batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), dtype=bool)
    mask[:, seq - 2 :] = False
    return ids, mask


def expected(model, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    return model(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()


def triton_inputs(module, ids, mask):
    inputs = [module.InferInput("ids", list(ids.shape), "INT64"), module.InferInput("mask", list(mask.shape), "BOOL")]
    inputs[0].set_data_from_numpy(ids)
    inputs[1].set_data_from_numpy(mask)
    return inputs


def test_metadata_names_the_artifacts_inputs(runtime):
    with urllib.request.urlopen(f"http://127.0.0.1:{runtime.http}/v2/models/{NAME}") as r:
        meta = json.loads(r.read())
    assert meta["name"] == NAME
    assert meta["inputs"] == [
        {"name": "ids", "datatype": "INT64", "shape": [-1, -1]},
        {"name": "mask", "datatype": "BOOL", "shape": [-1, -1]},
    ]


def test_tritonclient_http_gets_the_loaders_answers(runtime, reference):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{runtime.http}")
    for seed, (batch, seq) in enumerate([(1, 2), (2, 12), (8, 48), (3, 17)]):
        ids, mask = call(seed, batch, seq)
        result = client.infer(NAME, triton_inputs(httpclient, ids, mask))
        np.testing.assert_allclose(result.as_numpy("output"), expected(reference, ids, mask), rtol=1e-5, atol=1e-6)


def test_tritonclient_grpc_gets_the_loaders_answers(runtime, reference):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{runtime.grpc}")
    assert client.is_model_ready(NAME)
    for seed, (batch, seq) in enumerate([(1, 5), (4, 30)]):
        ids, mask = call(seed, batch, seq)
        result = client.infer(NAME, triton_inputs(grpcclient, ids, mask))
        np.testing.assert_allclose(result.as_numpy("output"), expected(reference, ids, mask), rtol=1e-5, atol=1e-6)


KSERVE_CLIENTS = """
import asyncio, json, sys
import numpy as np
import kserve

http, grpc_port, name = sys.argv[1], sys.argv[2], sys.argv[3]
ids, mask = np.load(sys.argv[4]), np.load(sys.argv[5])


def request():
    inputs = [kserve.InferInput("ids", list(ids.shape), "INT64"), kserve.InferInput("mask", list(mask.shape), "BOOL")]
    inputs[0].set_data_from_numpy(ids, binary_data=False)
    inputs[1].set_data_from_numpy(mask, binary_data=False)
    return kserve.InferRequest(model_name=name, infer_inputs=inputs)


async def both():
    rest = kserve.InferenceRESTClient(kserve.RESTConfig(protocol="v2"))
    grpc = kserve.InferenceGRPCClient(f"127.0.0.1:{grpc_port}")
    try:
        by_rest = await rest.infer(f"http://127.0.0.1:{http}", request(), model_name=name)
        by_grpc = await grpc.infer(request())
    finally:
        await rest.close()
        await grpc.close()
    return [r.outputs[0].as_numpy().tolist() for r in (by_rest, by_grpc)]


print(json.dumps(asyncio.run(both())))
"""


def test_kserves_own_clients_get_the_loaders_answers(runtime, reference, tmp_path):
    ids, mask = call(7, 2, 9)
    np.save(tmp_path / "ids.npy", ids)
    np.save(tmp_path / "mask.npy", mask)
    args = [str(runtime.http), str(runtime.grpc), NAME, str(tmp_path / "ids.npy"), str(tmp_path / "mask.npy")]
    done = subprocess.run([sys.executable, "-c", KSERVE_CLIENTS, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    by_rest, by_grpc = json.loads(done.stdout.strip().splitlines()[-1])
    want = expected(reference, ids, mask)
    for answer in (by_rest, by_grpc):
        np.testing.assert_allclose(np.array(answer, dtype=np.float32), want, rtol=1e-5, atol=1e-6)


def test_concurrent_clients_each_get_their_own_answer(runtime, reference):
    calls = [call(100 + i, 1 + i % 3, 8) for i in range(16)]

    def one(pair):
        client = httpclient.InferenceServerClient(f"127.0.0.1:{runtime.http}")
        return client.infer(NAME, triton_inputs(httpclient, *pair)).as_numpy("output")

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(one, calls))
    for pair, answer in zip(calls, answers):
        np.testing.assert_allclose(answer, expected(reference, *pair), rtol=1e-5, atol=1e-6)


def test_a_bad_shape_is_http_400_with_the_guards_words(runtime):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{runtime.http}")
    ids, _ = call(1, 2, 12)
    _, mask = call(1, 2, 10)
    with pytest.raises(InferenceServerException) as refused:
        client.infer(NAME, triton_inputs(httpclient, ids, mask))
    assert refused.value.status() == "400"
    assert "inputs sharing a dim must agree" in refused.value.message()
    ids, mask = call(1, 2, 49)  # seq beyond the artifact's 48
    with pytest.raises(InferenceServerException) as refused:
        client.infer(NAME, triton_inputs(httpclient, ids, mask))
    assert refused.value.status() == "400"


def test_a_bad_shape_is_grpc_invalid_argument(runtime):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{runtime.grpc}")
    ids, mask = call(2, 9, 12)  # batch beyond the artifact's 8
    with pytest.raises(InferenceServerException) as refused:
        client.infer(NAME, triton_inputs(grpcclient, ids, mask))
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"


def test_a_wrong_dtype_is_refused_not_a_server_error(runtime):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{runtime.http}")
    ids, mask = call(3)
    inputs = [
        httpclient.InferInput("ids", list(ids.shape), "FP32"),
        httpclient.InferInput("mask", list(mask.shape), "BOOL"),
    ]
    inputs[0].set_data_from_numpy(ids.astype(np.float32))
    inputs[1].set_data_from_numpy(mask)
    with pytest.raises(InferenceServerException) as refused:
        client.infer(NAME, inputs)
    assert refused.value.status() == "400"


def test_a_pack_from_the_storage_initializer_serves_on_the_torch_free_loader(classifier_pack, reference, tmp_path):
    """In an install without the build side (the kserve extra alone: what the runtime's image holds)."""
    mnt = tmp_path / "mnt" / "models"  # an s3://.../1.tar.zst storage URI: the one file in /mnt/models
    mnt.mkdir(parents=True)
    shutil.copy(classifier_pack, mnt / "1.tar.zst")
    # kserve brings pyyaml, pydantic and click itself; the rest of the build side must not be needed.
    env = blocked_env(
        tmp_path / "site", ("rich", "ruamel", "safetensors"), allowed=("precompile.integrations", "precompile.version")
    )
    server = KServeRuntime(mnt, tmp_path / "native.log", "--runtime=native", env=env)
    try:
        server.wait_ready()
        ids, mask = call(11, 2, 20)
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http}")
        result = client.infer(NAME, triton_inputs(httpclient, ids, mask))
        np.testing.assert_allclose(result.as_numpy("output"), expected(reference, ids, mask), rtol=1e-5, atol=1e-6)
    finally:
        server.stop()


def test_a_missing_artifact_is_one_line_and_exit_1(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "README").write_text("not a model\n")
    done = subprocess.run(
        [sys.executable, "-m", "precompile.integrations.kserve", f"--model_dir={tmp_path / 'models'}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("precompile kserve runtime: ")
    assert "neither an artifact folder (manifest.json) nor a folder of one pack" in done.stderr


# --- the YAML, against the CRDs' OpenAPI schemas (deploy/kserve/schema, scripts/trim-kserve-crds) ---


def schema(kind: str) -> dict:
    return json.loads((DEPLOY / "schema" / f"{kind}.json").read_text())


def documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


@pytest.mark.parametrize(
    ("file", "kind"),
    [
        ("clusterservingruntime.yaml", "clusterservingruntime"),
        ("inferenceservice.yaml", "inferenceservice"),
        ("inferenceservice-modelcar.yaml", "inferenceservice"),
    ],
)
def test_the_yaml_is_valid_against_the_crd_schema(file, kind):
    import jsonschema

    for document in documents(file):
        jsonschema.validate(document, schema(kind))


def test_the_schema_check_would_catch_a_mistake():
    import jsonschema

    runtime = documents("clusterservingruntime.yaml")[0]
    runtime["spec"]["supportedModelFormats"][0]["autoselect"] = True  # the field is autoSelect
    with pytest.raises(jsonschema.ValidationError, match="autoselect"):
        jsonschema.validate(runtime, schema("clusterservingruntime"))
    isvc = documents("inferenceservice.yaml")[0]
    isvc["spec"]["predictor"]["minReplicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(isvc, schema("inferenceservice"))


def test_the_runtime_runs_this_module_with_kserves_ports_and_model_dir():
    runtime = documents("clusterservingruntime.yaml")[0]
    container = runtime["spec"]["containers"][0]
    assert container["command"][-1] == "precompile.integrations.kserve"
    assert "--model_dir=/mnt/models" in container["args"]
    assert {f["name"] for f in runtime["spec"]["supportedModelFormats"]} == {"precompile"}
    isvc = documents("inferenceservice.yaml")[0]
    assert isvc["spec"]["predictor"]["model"]["modelFormat"]["name"] == "precompile"
