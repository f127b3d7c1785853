"""`precompile serve REPO`: a repository of models, each in its versions, on a real uvicorn server on a
loopback port (the command as a process), built from the session's tiny artifacts (no compile here)."""

from __future__ import annotations

import shutil
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import torch
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

import loader
from loader import constants as C
from precompile.cli import main
from precompile.serve.repository import VersionPolicy, is_repository, scan

from .conftest import artifact_version, builds
from .test_remote import store_env  # noqa: F401 (a fixture)
from .test_serve_load import serve_command

CLASSIFIER, STRUCTURED = "tiny-classifier", "tiny-structured"


@pytest.fixture(scope="module")
def repo(classifier_versions, structured_artifact, tmp_path_factory) -> Path:
    """A repository of three models: the classifier as a model folder of versions 1-3 (folders named
    as `precompile push` names packs), the structured model as an artifact folder at the top, and a
    model folder holding a damaged pack."""
    root = tmp_path_factory.mktemp("repo") / "models"
    for n in (1, 2, 3):
        shutil.copytree(classifier_versions[n - 1], root / CLASSIFIER / str(n))
    shutil.copytree(structured_artifact, root / "structured")
    (root / "broken").mkdir()
    (root / "broken" / f"1{C.PACK_SUFFIX}").write_bytes(b"not a pack at all")
    return root


def classifier_body(seed: int = 0, batch: int = 2, seq: int = 10) -> tuple[dict, tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.bool)
    return {"inputs": {"ids": ids.tolist(), "mask": mask.tolist()}}, (ids, mask)


def structured_body(seed: int = 0) -> tuple[dict, torch.Tensor]:
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(seed))
    return {"inputs": {"x": x.tolist()}}, x


def v2_body(name: str, tensor: torch.Tensor, datatype: str) -> dict:
    return {"name": name, "shape": list(tensor.shape), "datatype": datatype, "data": tensor.reshape(-1).tolist()}


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


class Traffic:
    """A bounded client loop on one model: ``clients`` threads post /predict/{name} until stopped (at
    most ``limit`` requests each), recording every status, the versions that answered, and any answer
    that differs from eager's on the artifact at ``expected_from``."""

    def __init__(self, base: str, name: str, expected_from: Path, *, clients: int = 2, limit: int = 2000):
        self.base, self.name, self.limit = base, name, limit
        self.statuses: Counter[int] = Counter()
        self.versions: Counter[int] = Counter()
        self.wrong: list[str] = []
        model = loader.load(expected_from, warmup=False)
        self.bodies = []
        for seed in range(clients):
            payload, (ids, mask) = classifier_body(seed)
            self.bodies.append((payload, model(ids, mask)))
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def _run(self, i: int) -> None:
        payload, expected = self.bodies[i]
        with httpx.Client(base_url=self.base, timeout=30) as c:
            for _ in range(self.limit):
                if self._stop.is_set():
                    return
                response = c.post(f"/predict/{self.name}", json=payload)
                with self._lock:
                    self.statuses[response.status_code] += 1
                    if response.status_code == 200:
                        data = response.json()
                        self.versions[data["artifact"]["version"]] += 1
                        if not torch.allclose(torch.tensor(data["outputs"]), expected, atol=1e-5):
                            self.wrong.append(response.text[:200])

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)

    def served(self) -> int:
        with self._lock:
            return self.statuses[200]

    def wait_for(self, condition, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"gave up waiting; statuses {dict(self.statuses)}, versions {dict(self.versions)}")
            time.sleep(0.05)


# --- what a repository is ------------------------------------------------------------------------


def test_a_folder_that_is_not_an_artifact_is_a_repository(repo, classifier_artifact, tmp_path):
    assert is_repository(str(repo)) and is_repository("s3://bucket/models/")
    assert not is_repository(str(classifier_artifact)) and not is_repository(str(tmp_path / "nope"))
    assert not is_repository("s3://bucket/models/tiny-classifier/current")
    found = scan(str(repo))
    assert {n: sorted(v) for n, v in found.versions.items()} == {CLASSIFIER: [1, 2, 3], STRUCTURED: [1]}
    assert set(found.broken) == {"broken"} and "1.tar.zst" in found.broken["broken"]


@pytest.mark.parametrize(
    "text, versions, chosen",
    [
        ("latest:1", [3, 1, 2], [3]),
        ("latest:2", [3, 1, 2], [2, 3]),
        ("latest:5", [1, 2], [1, 2]),
        ("1,3", [1, 2, 3], [1, 3]),
        ("2, 9", [1, 2, 3], [2]),
    ],
)
def test_the_version_policy_picks_the_newest_or_the_listed(text, versions, chosen):
    assert VersionPolicy.parse(text).select(versions) == chosen


def test_the_repository_settings_travel_to_the_workers(repo, monkeypatch):
    """Workers read the config back from the environment: the repository settings come with it."""
    from precompile.serve.config import ServeConfig

    config = ServeConfig(str(repo), repository=True, versions="1,3", allow_repository_control=False, watch=True)
    monkeypatch.setenv(*next(iter(config.to_env().items())))
    assert ServeConfig.from_env() == config


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--versions", "latest:0"], "--versions latest:0: latest:N needs a whole number N >= 1"),
        (["--versions", "newest"], "--versions newest: expected latest:N or versions such as 3,5"),
        (["--allow-reload"], "--allow-reload and --record apply to one artifact"),
        (["--workers", "2", "--allow-repository-control"], "a load or unload reaches one worker only"),
    ],
)
def test_serve_refuses_a_bad_repository_option(repo, args, message):
    result = invoke("serve", str(repo), *args)
    assert result.exit_code in (1, 2) and message in result.output and "Traceback" not in result.output


def test_repository_options_are_refused_for_one_artifact(classifier_artifact):
    result = invoke("serve", str(classifier_artifact), "--allow-repository-control")
    assert result.exit_code == 2 and "apply to a repository" in result.output


def test_an_empty_repository_is_refused_before_starting(tmp_path):
    result = invoke("serve", str(tmp_path))
    assert result.exit_code == 1 and "no models found" in result.output and "Traceback" not in result.output


def test_one_artifact_is_served_as_before_and_by_its_name(classifier_artifact):
    """`precompile serve ARTIFACT` keeps its routes; /predict/{name} takes its name, and the repository
    extension is refused: there is no repository."""
    from loader import Live
    from precompile.serve.app import create_app
    from precompile.serve.config import ServeConfig

    from .test_serve import AppClient

    app = create_app(ServeConfig(str(classifier_artifact)), live=Live(classifier_artifact))
    payload, _ = classifier_body()
    with AppClient(app) as c:
        assert c.get("/readyz").json() == {"status": "ready", "name": CLASSIFIER, "version": 1}
        assert c.post("/predict", json=payload).status_code == 200
        assert c.post(f"/predict/{CLASSIFIER}", json=payload).status_code == 200
        assert c.post(f"/predict/{CLASSIFIER}/versions/1", json=payload).status_code == 200
        response = c.post("/predict/other", json=payload)
        assert response.status_code == 404 and response.json()["detail"] == (
            f"unknown model 'other' (this server serves '{CLASSIFIER}')"
        )
        assert c.get(f"/v2/models/{CLASSIFIER}/versions/2/ready").status_code == 404
        response = c.get("/v2/repository/index")
        assert response.status_code == 403 and "serves one artifact" in response.json()["error"]
        assert "/predict/{name}" in c.get("/openapi.json").json()["paths"]


# --- serving -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def grpc_port() -> int:
    from .test_serve_load import free_port

    return free_port()


@pytest.fixture(scope="module")
@builds
def served(repo, grpc_port):
    """`precompile serve REPO` with the defaults (latest:1, no repository control), and --grpc-port."""
    with serve_command(repo, "--grpc-port", str(grpc_port)) as port:
        yield f"http://127.0.0.1:{port}"


def test_every_model_is_served_by_name_with_the_outputs_of_eager(served, repo, structured_artifact):
    payload, (ids, mask) = classifier_body(1, batch=3, seq=17)
    expected = loader.load(repo / CLASSIFIER / "3", warmup=False)(ids, mask)
    with httpx.Client(base_url=served, timeout=30) as c:
        response = c.post(f"/predict/{CLASSIFIER}", json=payload)
        assert response.status_code == 200, response.text
        assert response.json()["artifact"] == {"name": CLASSIFIER, "version": 3}
        assert torch.allclose(torch.tensor(response.json()["outputs"]), expected, atol=1e-5)

        body = {"inputs": [v2_body("ids", ids, "INT64"), v2_body("mask", mask, "BOOL")]}
        for url in (f"/v2/models/{CLASSIFIER}/infer", f"/v2/models/{CLASSIFIER}/versions/3/infer"):
            response = c.post(url, json=body)
            assert response.status_code == 200, response.text
            out = response.json()
            assert out["model_name"] == CLASSIFIER and out["model_version"] == "3"
            got = torch.tensor(out["outputs"][0]["data"]).reshape(out["outputs"][0]["shape"])
            assert torch.allclose(got, expected, atol=1e-5)

        s_payload, x = structured_body()
        response = c.post(f"/predict/{STRUCTURED}", json=s_payload)
        assert response.status_code == 200, response.text
        assert response.json()["artifact"]["name"] == STRUCTURED
        eager = loader.load(structured_artifact, warmup=False)(x)
        assert torch.allclose(torch.tensor(response.json()["outputs"]["hidden"]), eager["hidden"], atol=1e-5)

        assert c.get(f"/v2/models/{STRUCTURED}").json()["inputs"] == [
            {"name": "x", "datatype": "FP32", "shape": [-1, 8]}
        ]
        assert c.get(f"/v2/models/{CLASSIFIER}/versions/3").json()["versions"] == ["3"]


def test_an_unknown_model_or_version_is_404_and_saying_so(served):
    payload, _ = classifier_body()
    with httpx.Client(base_url=served, timeout=30) as c:
        response = c.post("/predict/nope", json=payload)
        assert response.status_code == 404
        assert response.json()["detail"] == f"unknown model 'nope' (this server serves: {CLASSIFIER}, {STRUCTURED})"
        response = c.post(f"/v2/models/{CLASSIFIER}/versions/1/infer", json={"inputs": []})
        assert response.status_code == 404
        assert response.json()["error"] == f"model '{CLASSIFIER}' has no version '1' served (served: 3)"
        assert c.get(f"/v2/models/{CLASSIFIER}/versions/x/ready").status_code == 400  # malformed, not unknown
        response = c.post("/predict", json=payload)  # several models: the name is not optional
        assert response.status_code == 422 and "POST /predict/{name}" in response.json()["detail"]


def test_readiness_is_per_model_and_a_broken_one_takes_none_down(served):
    with httpx.Client(base_url=served, timeout=30) as c:
        ready = c.get("/readyz")
        assert ready.status_code == 200
        models = ready.json()["models"]
        assert models["ready"] == [CLASSIFIER, STRUCTURED] and models["loading"] == []
        assert list(models["failed"]) == ["broken"] and "1.tar.zst" in models["failed"]["broken"]
        assert c.get(f"/v2/models/{CLASSIFIER}/ready").json() == {"name": CLASSIFIER, "ready": True}
        broken = c.get("/v2/models/broken/ready")
        assert broken.status_code == 503 and "model 'broken' is unavailable" in broken.json()["error"]
        assert c.get("/v2/health/ready").status_code == 200


def test_the_repository_extension_is_off_unless_enabled(served):
    with httpx.Client(base_url=served, timeout=30) as c:
        for method, url in (
            ("GET", "/v2/repository/index"),
            ("POST", "/v2/repository/index"),
            ("POST", f"/v2/repository/models/{CLASSIFIER}/unload"),
            ("POST", f"/v2/repository/models/{CLASSIFIER}/load"),
        ):
            response = c.request(method, url)
            assert response.status_code == 403 and "--allow-repository-control" in response.json()["error"]
        assert c.post("/v1/reload").status_code == 403
        assert c.get(f"/v2/models/{CLASSIFIER}/ready").status_code == 200  # nothing was unloaded


def test_metrics_carry_the_model_label(served):
    payload, _ = classifier_body()
    with httpx.Client(base_url=served, timeout=30) as c:
        before = samples(c.get("/metrics").text)
        assert c.post(f"/predict/{CLASSIFIER}", json=payload).status_code == 200
        assert c.post(f"/predict/{STRUCTURED}", json={"inputs": {"x": [[1.0]]}}).status_code == 422
        assert c.post("/predict/nope", json=payload).status_code == 404
        after = samples(c.get("/metrics").text)

    def delta(key):
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta(("precompile_requests_total", (("code", "200"), ("model", CLASSIFIER)))) == 1
    assert delta(("precompile_requests_total", (("code", "422"), ("model", STRUCTURED)))) == 1
    assert delta(("precompile_requests_total", (("code", "404"), ("model", "")))) == 1  # not the client's name
    assert after[("precompile_reloads_total", (("model", CLASSIFIER), ("result", "ok")))] == 1
    info = [k for k in after if k[0] == "precompile_artifact_info"]
    assert sorted(dict(k[1])["name"] for k in info) == [CLASSIFIER, STRUCTURED]


def test_several_workers_each_serve_the_repository(repo):
    """--workers 2: the workers serve every model, counted under its label (summed across them)."""
    with serve_command(repo, "--workers", "2") as port, httpx.Client(base_url=f"http://127.0.0.1:{port}") as c:
        deadline = time.monotonic() + 60  # this connection's worker may start after the one that said ready
        while c.get("/readyz", timeout=30).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        for _ in range(4):
            assert c.post(f"/predict/{CLASSIFIER}", json=classifier_body()[0], timeout=30).status_code == 200
            assert c.post(f"/predict/{STRUCTURED}", json=structured_body()[0], timeout=30).status_code == 200
        counts = samples(c.get("/metrics").text)
    for name in (CLASSIFIER, STRUCTURED):
        assert counts[("precompile_requests_total", (("code", "200"), ("model", name)))] == 4


# --- versions, trust, control --------------------------------------------------------------------


def test_listed_versions_and_the_trust_options_apply_to_every_version(repo, signing_keys, tmp_path):
    """--versions latest:2 with --trusted-key: version 2 is signed and serves, version 3 is not and is
    UNAVAILABLE with the reason; a request naming no version gets the newest ready one."""
    from precompile.ship.sign import sign

    root = tmp_path / "signed"
    for n in (1, 2, 3):
        shutil.copytree(repo / CLASSIFIER / str(n), root / CLASSIFIER / str(n))
    sign(root / CLASSIFIER / "2", signing_keys[0])
    options = ("--versions", "latest:2", "--trusted-key", str(signing_keys[1]), "--allow-repository-control")
    with serve_command(root, *options) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
        index = c.get("/v2/repository/index").json()
        assert [(r["name"], r["version"], r["state"]) for r in index] == [
            (CLASSIFIER, "2", "READY"),
            (CLASSIFIER, "3", "UNAVAILABLE"),
        ]
        assert "not signed" in index[1]["reason"]
        assert c.post("/v2/repository/index", json={"ready": True}).json() == [index[0]]
        response = c.post("/predict", json=classifier_body()[0])  # one model: the name is optional
        assert response.status_code == 200 and response.json()["artifact"]["version"] == 2
        assert c.get(f"/v2/models/{CLASSIFIER}/versions/3/ready").status_code == 503
        # A load retries the failed version, and it fails the same way: the policy holds for every load.
        response = c.post(f"/v2/repository/models/{CLASSIFIER}/load")
        assert response.status_code == 200  # version 2 is ready
        assert c.get("/v2/repository/index").json()[1]["state"] == "UNAVAILABLE"


def test_unloading_and_loading_under_traffic_loses_no_request_to_the_others(repo):
    with (
        serve_command(repo, "--allow-repository-control") as port,
        httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c,
    ):
        base = f"http://127.0.0.1:{port}"
        with Traffic(base, CLASSIFIER, repo / CLASSIFIER / "3") as traffic:
            traffic.wait_for(lambda: traffic.served() >= 10)
            for _ in range(2):
                assert c.post(f"/v2/repository/models/{STRUCTURED}/unload").status_code == 200
                assert c.post(f"/predict/{STRUCTURED}", json=structured_body()[0]).status_code == 404
                row = [r for r in c.get("/v2/repository/index").json() if r["name"] == STRUCTURED]
                assert row == [{"name": STRUCTURED, "state": "UNAVAILABLE", "reason": "unloaded"}]
                assert c.post(f"/v2/repository/models/{STRUCTURED}/load").status_code == 200
                assert c.post(f"/predict/{STRUCTURED}", json=structured_body()[0]).status_code == 200
            seen = traffic.served()
            traffic.wait_for(lambda: traffic.served() >= seen + 10)
        assert set(traffic.statuses) == {200} and traffic.wrong == [], traffic.statuses
        response = c.post("/v2/repository/models/nope/load")
        assert response.status_code == 404 and "no model 'nope' in the repository" in response.json()["error"]
        response = c.post("/v2/repository/models/broken/load")
        assert response.status_code == 400 and "failed to load 'broken'" in response.json()["error"]
        response = c.post(f"/v2/repository/models/{CLASSIFIER}/load", json={"parameters": {"file:x": "/etc"}})
        assert response.status_code == 400 and "take no parameters" in response.json()["error"]
        assert c.post("/v2/repository/models/nope/unload").status_code == 404


def test_watch_serves_a_new_version_and_drops_the_old_under_traffic(repo, tmp_path):
    root = tmp_path / "models"
    shutil.copytree(repo / CLASSIFIER / "3", root / CLASSIFIER / "3")
    with serve_command(root, "--watch", "--watch-interval", "0.2") as port:
        base = f"http://127.0.0.1:{port}"
        with Traffic(base, CLASSIFIER, root / CLASSIFIER / "3") as traffic:
            traffic.wait_for(lambda: traffic.served() >= 10)
            artifact_version(root / CLASSIFIER / "3", root / CLASSIFIER / ".4.tmp", 4)
            (root / CLASSIFIER / ".4.tmp").rename(root / CLASSIFIER / "4")
            traffic.wait_for(lambda: traffic.versions[4] >= 10)
            # A model that appears is served too.
            shutil.copytree(repo / "structured", root / ".structured.tmp")
            (root / ".structured.tmp").rename(root / "structured")
            with httpx.Client(base_url=base, timeout=30) as c:
                traffic.wait_for(lambda: c.get(f"/v2/models/{STRUCTURED}/ready").status_code == 200)
                assert c.get(f"/v2/models/{CLASSIFIER}/versions/3/ready").status_code == 404  # dropped
        assert set(traffic.statuses) == {200} and traffic.wrong == [], traffic.statuses
        assert set(traffic.versions) == {3, 4}


def test_the_repository_is_confined_to_its_folder(repo, classifier_artifact, tmp_path):
    """A link in REPO to an artifact outside it is refused, as /v1/reload refuses one outside
    --reload-root; the other models serve on."""
    root = tmp_path / "models"
    shutil.copytree(repo / "structured", root / "structured")
    (root / "outside").symlink_to(classifier_artifact)
    found = scan(str(root))
    assert list(found.versions) == [STRUCTURED]
    assert "not under the repository" in found.broken["outside"]


def test_an_artifact_unreadable_at_a_rescan_keeps_serving(repo, tmp_path):
    """A rescan (--watch) that finds a served artifact damaged or mid-copy leaves its version serving,
    as a failed swap does, instead of dropping the model."""
    from precompile.serve.config import ServeConfig
    from precompile.serve.repository import Repository

    root = tmp_path / "models"
    shutil.copytree(repo / "structured", root / "structured")
    repository = Repository(ServeConfig(str(root), repository=True))
    try:
        repository.sync()
        assert repository.lookup(STRUCTURED).live.ready
        (root / "structured" / C.MANIFEST_FILE).write_text("{half a manifest")
        repository.sync()
        assert repository.lookup(STRUCTURED).live.ready
        states = [(r["name"], r["state"]) for r in repository.index()]
        assert states == [("structured", "UNAVAILABLE"), (STRUCTURED, "READY")]  # the damage is reported
        shutil.rmtree(root / "structured")  # gone from REPO: no longer served
        repository.sync()
        assert repository.index() == []
    finally:
        repository.stop()


# --- shared memory ------------------------------------------------------------------------------


def test_models_from_packs_map_their_weights_from_the_cache_entry(
    classifier_pack, structured_artifact, tmp_path, monkeypatch
):
    """Served from packs, each model's weights are mapped from its read-only cache entry (so several
    processes share one copy in the page cache), not copied into the process."""
    from precompile.ship.pack import pack

    cache = tmp_path / "cache"
    monkeypatch.setenv("PRECOMPILE_CACHE", str(cache))
    root = tmp_path / "models"
    (root / CLASSIFIER).mkdir(parents=True)
    shutil.copy(classifier_pack, root / CLASSIFIER / f"1{C.PACK_SUFFIX}")
    pack(structured_artifact, root / f"structured{C.PACK_SUFFIX}")
    with serve_command(root) as port:
        pid = _listener_pid(port)
        mapped = {line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "/" in line}
    entries = cache.resolve() / "artifacts"
    folders = {e.name for e in entries.iterdir() if e.is_dir()}
    assert len(folders) == 2  # one read-only entry per model
    weights = sorted(entries.glob(f"*/{C.WEIGHTS_FILE}"))
    assert {w.parent.name for w in weights} == folders
    assert {str(w) for w in weights} <= mapped, sorted(m for m in mapped if str(cache) in m)


def _listener_pid(port: int) -> int:
    """The process listening on ``port`` (the server re-executes itself, keeping its pid)."""
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "0A":
            inode = fields[9]
    assert inode is not None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(Path(fd).readlink() == Path(f"socket:[{inode}]") for fd in (proc / "fd").iterdir()):
                return int(proc.name)
        except OSError:
            continue
    raise AssertionError(f"no process listens on {port}")


# --- a store prefix ------------------------------------------------------------------------------


def test_a_store_prefix_that_push_wrote_is_a_repository(
    classifier_artifact, structured_artifact, store_env, monkeypatch, tmp_path
):
    """`precompile push` of two models (the classifier in versions 1 and 2) to `rclone serve s3`, then
    `precompile serve s3://models/prod/`: both served, the classifier at its latest version, each from
    the store through the cache."""
    from loader.stores import remote
    from precompile.ship.remote import push

    from .test_remote import BUCKET, S3Server

    server = S3Server(store_env / "store")
    monkeypatch.setenv(remote.ENDPOINT_ENV, server.endpoint)
    store = f"s3://{BUCKET}/prod"
    try:
        push(classifier_artifact, store)
        push(artifact_version(classifier_artifact, tmp_path / "v2", 2), store)
        push(structured_artifact, store)
        with (
            serve_command(f"{store}/", "--allow-repository-control", "--watch", "--watch-interval", "0.2") as port,
            httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c,
        ):
            index = c.get("/v2/repository/index").json()
            assert [(r["name"], r["version"], r["state"]) for r in index] == [
                (CLASSIFIER, "2", "READY"),
                (STRUCTURED, "1", "READY"),
            ]
            payload, (ids, mask) = classifier_body(2)
            response = c.post(f"/predict/{CLASSIFIER}", json=payload)
            assert response.status_code == 200 and response.json()["artifact"]["version"] == 2
            expected = loader.load(classifier_artifact, warmup=False)(ids, mask)
            assert torch.allclose(torch.tensor(response.json()["outputs"]), expected, atol=1e-5)
            assert c.post(f"/predict/{STRUCTURED}", json=structured_body()[0]).status_code == 200
            metadata = c.get(f"/v2/models/{CLASSIFIER}").json()
            assert metadata["name"] == CLASSIFIER and metadata["versions"] == ["2"]

            # --watch: a damaged index leaves the model serving; a new version pushed is served.
            (server.root / BUCKET / "prod" / STRUCTURED / "index.json").write_text("{not json")
            push(artifact_version(classifier_artifact, tmp_path / "v3", 3), store)
            deadline = time.monotonic() + 60
            while c.get(f"/v2/models/{CLASSIFIER}/versions/3/ready").status_code != 200:
                assert time.monotonic() < deadline, c.get("/v2/repository/index").text
                time.sleep(0.1)
            assert c.post(f"/predict/{STRUCTURED}", json=structured_body()[0]).status_code == 200
            assert c.post(f"/predict/{CLASSIFIER}", json=payload).json()["artifact"]["version"] == 3
    finally:
        server.stop()


def test_grpc_serves_every_model_of_the_repository_by_name_and_version(served, grpc_port, repo, structured_artifact):
    """--grpc-port on a repository: ModelInfer finds each model (and version) where the HTTP routes do;
    an unknown one is NOT_FOUND, counted under model="" (a client cannot grow the label set)."""
    grpc_client = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    # The module's server: no other test calls it over gRPC, so the gRPC counts below are this test's.
    with grpc_client.InferenceServerClient(url=f"127.0.0.1:{grpc_port}") as c:
        _, (ids, mask) = classifier_body(2, batch=2, seq=9)
        inputs = [grpc_client.InferInput("ids", [2, 9], "INT64"), grpc_client.InferInput("mask", [2, 9], "BOOL")]
        inputs[0].set_data_from_numpy(ids.numpy())
        inputs[1].set_data_from_numpy(mask.numpy())
        expected = loader.load(repo / CLASSIFIER / "3", warmup=False)(ids, mask)
        for version in ("", "3"):
            result = c.infer(CLASSIFIER, inputs, model_version=version)
            assert result.get_response().model_version == "3"
            assert torch.allclose(
                torch.from_numpy(result.as_numpy(result.get_response().outputs[0].name)), expected, atol=1e-5
            )

        x = structured_body(3)[1]
        s_input = grpc_client.InferInput("x", list(x.shape), "FP32")
        s_input.set_data_from_numpy(x.numpy())
        result = c.infer(STRUCTURED, [s_input])
        eager = loader.load(structured_artifact, warmup=False)(x)
        assert torch.allclose(torch.from_numpy(result.as_numpy("hidden")), eager["hidden"], atol=1e-5)
        assert c.is_model_ready(STRUCTURED) and not c.is_model_ready("nope")

        for name, version in (("nope", ""), (CLASSIFIER, "1")):  # version 1 is not served (latest:1)
            with pytest.raises(InferenceServerException) as raised:
                c.infer(name, inputs, model_version=version)
            assert raised.value.status() == "StatusCode.NOT_FOUND", raised.value.message()
        text = httpx.get(f"{served}/metrics", timeout=30).text
    counted = samples(text)
    assert counted[("precompile_grpc_requests_total", (("code", "OK"), ("model", CLASSIFIER)))] == 2
    assert counted[("precompile_grpc_requests_total", (("code", "NOT_FOUND"), ("model", "")))] == 1
    assert counted[("precompile_grpc_requests_total", (("code", "NOT_FOUND"), ("model", CLASSIFIER)))] == 1
