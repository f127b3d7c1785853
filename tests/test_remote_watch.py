"""Deploys through a pointer object in a store: `precompile promote` writes `<url>/<name>/current`,
`Live.watch` / `precompile serve --watch` follow it. Against the real S3-compatible server of
tests/test_remote.py (`rclone serve s3` on loopback)."""

from __future__ import annotations

import threading

import pytest
import torch
from click.testing import CliRunner

import loader
from loader import ArtifactError, Live
from loader.stores import remote
from precompile.cli import main
from precompile.errors import PrecompileError
from precompile.ship.remote import promote, push

from .test_live import wait_for
from .test_remote import STORE, downloads, s3, store_env  # noqa: F401  (fixtures)

pytest.importorskip("s3fs")

NAME = "tiny-classifier"
MODEL = f"{STORE}/{NAME}"
POINTER = f"{MODEL}/current"


def inputs(batch=2, seq=10):
    return torch.randint(0, 50, (batch, seq)), torch.ones(batch, seq, dtype=torch.bool)


@pytest.fixture
def published(s3, classifier_versions):
    """Versions 1, 2 and 3 of the classifier pushed to the store, version 1 promoted."""
    urls = [push(v, STORE).url for v in classifier_versions[:3]]
    promote(MODEL, 1)
    return urls


def test_promote_writes_a_pointer_naming_the_pack(published, s3):
    pointer_url, pack_url = promote(MODEL, 2)
    assert (pointer_url, pack_url) == (POINTER, published[1])
    assert (s3.root / "models" / "prod" / NAME / "current").read_text() == "2.tar.zst\n"
    assert remote.resolve_pointer(POINTER).target == published[1]
    assert loader.Live(POINTER).serving.version == 2


def test_promote_refuses_a_version_never_published(published, s3):
    with pytest.raises(PrecompileError, match=r"no version 9 published \(published: 1, 2, 3\); push it first"):
        promote(MODEL, 9)
    assert remote.resolve_pointer(POINTER).target == published[0]  # the pointer did not move


def test_watch_follows_the_pointer_while_serving(published, downloads):
    live = Live(POINTER)
    assert live.serving.version == 1 and live.serving.path == published[0]
    errors: list[BaseException] = []
    stop = threading.Event()

    def call_all_along() -> None:
        ids, mask = inputs()
        while not stop.is_set():
            try:
                live(ids, mask)
            except BaseException as e:  # noqa: BLE001: the test fails on any
                errors.append(e)

    caller = threading.Thread(target=call_all_along)
    caller.start()
    try:
        live.watch(interval=0.05)
        assert wait_for(lambda: live.serving.version == 1 and len(downloads) == 1, timeout=2)  # looks download nothing
        promote(MODEL, 2)  # the deploy: one small write
        # last_attempt is recorded once the old version has drained, a moment after the swap itself
        assert wait_for(lambda: live.serving.version == 2 and live.last_attempt.version == 2)
        assert live.last_attempt.ok and live.last_attempt.path == published[1]
        stop.wait(0.5)  # more looks at an unchanged pointer: nothing loaded again
        # promote read version 2's head (one small read) before deploying; the server downloaded it once
        assert downloads == [published[0], published[1], published[1]]
    finally:
        stop.set()
        caller.join()
        live.close()
    assert errors == []


def test_a_pointer_to_a_missing_version_leaves_the_old_one_serving(published):
    live = Live(POINTER)
    live.watch(interval=0.05)
    try:
        fs, path = remote.filesystem(POINTER)
        fs.pipe_file(path, b"9.tar.zst\n")  # a hand-written pointer to a version never pushed
        missing = f"{MODEL}/9.tar.zst"
        assert wait_for(lambda: live.last_attempt is not None and live.last_attempt.path == missing)
        assert not live.last_attempt.ok and f"{missing}: no such object" in live.last_attempt.error
        assert live.serving.version == 1
        assert live(*inputs()).shape == (2, 3)
        promote(MODEL, 3)  # the next deploy is picked up as usual
        assert wait_for(lambda: live.serving.version == 3)
    finally:
        live.close()


def test_a_pointer_moved_back_is_a_rollback_the_server_refuses(published):
    promote(MODEL, 2)
    live = Live(POINTER)
    live.watch(interval=0.05)
    try:
        promote(MODEL, 1)
        assert wait_for(lambda: live.last_attempt.version == 1)
        assert not live.last_attempt.ok and "older than the serving version 2" in live.last_attempt.error
        assert live.serving.version == 2
    finally:
        live.close()


def test_a_pointer_naming_another_kind_of_store_is_refused(published):
    fs, path = remote.filesystem(POINTER)
    fs.pipe_file(path, b"file:///etc/passwd\n")
    with pytest.raises(ArtifactError, match=f"{POINTER}: not a pack nor a pointer naming one") as caught:
        Live(POINTER)
    assert "passwd" not in str(caught.value).split("naming one")[1]


def test_cli_promote(published):
    result = CliRunner().invoke(main, ["promote", MODEL, "--version", "3"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"{POINTER} -> {published[2]}"
    refused = CliRunner().invoke(main, ["promote", MODEL, "--version", "7"])
    assert refused.exit_code == 1 and "no version 7 published" in refused.output


def test_serve_watch_follows_a_remote_pointer(published):
    pytest.importorskip("fastapi")
    from precompile.cli.serve import _preflight
    from precompile.serve.app import create_app
    from precompile.serve.config import ServeConfig

    from .test_serve import AppClient

    manifest, runtime = _preflight(POINTER, None, (), "auto")  # the CLI's checks before the server starts
    assert manifest.version == 1 and runtime == "native"  # a CPU artifact: served without torch
    config = ServeConfig(POINTER, watch=True, watch_interval=0.05)
    with AppClient(create_app(config)) as client:
        assert wait_for(lambda: client.get("/readyz").status_code == 200)
        promote(MODEL, 2)
        assert wait_for(lambda: client.get("/v1/artifact").json()["version"] == 2)
        body = {"inputs": {"ids": [[1, 2, 3]], "mask": [[True, True, True]]}}
        reply = client.post("/predict", json=body).json()
        assert reply["artifact"]["version"] == 2
