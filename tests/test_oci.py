"""OCI artifacts (loader/stores/oci.py, precompile/ship/oci.py) against a real registry on loopback: Debian's
`docker-registry` (tests/oci_registry.py), started and stopped here, storing blobs in a tmp folder."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import loader
from loader import ArtifactError, LoaderError
from loader import constants as C
from loader.stores import remote
from loader.stores.oci import parse_reference
from precompile.cli import main
from precompile.ship.oci import push
from precompile.ship.sign import keygen, sign

from .conftest import artifact_version
from .oci_registry import LocalRegistry, binary

if binary() is None:
    pytest.skip(
        "docker-registry is not installed (apt-get install docker-registry; .ci/run does)", allow_module_level=True
    )


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    with LocalRegistry(tmp_path_factory.mktemp("registry")) as running:
        yield running


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv(C.CACHE_ENV, str(folder))
    return folder


def inputs():
    torch.manual_seed(0)
    return torch.randint(0, 50, (2, 16)), torch.ones(2, 16, dtype=torch.bool)


def test_a_pushed_artifact_loads_from_its_reference_with_the_same_answers(registry, classifier_artifact, cache):
    pushed = push(classifier_artifact, f"oci://{registry.address}/models/classifier:1")
    assert pushed.reference == f"oci://{registry.address}/models/classifier:1"
    model = loader.load(pushed.reference)
    expected = loader.load(classifier_artifact)(*inputs())
    torch.testing.assert_close(model(*inputs()), expected, rtol=0, atol=0)
    # By digest too: the reference a deploy pins.
    pinned = loader.load(f"oci://{registry.address}/models/classifier@{pushed.digest}")
    torch.testing.assert_close(pinned(*inputs()), expected, rtol=0, atol=0)


def test_the_manifest_is_an_oci_artifact_of_its_own_type_one_layer_per_file(registry, classifier_artifact):
    pushed = push(classifier_artifact, f"oci://{registry.address}/models/layout:1")
    data = registry.blob_path(pushed.digest).read_bytes()  # manifests are blobs in the registry's storage
    document = json.loads(data)
    assert document["artifactType"] == C.OCI_ARTIFACT_TYPE
    assert document["mediaType"] == C.OCI_MANIFEST_MEDIA_TYPE
    assert document["config"]["mediaType"] == C.OCI_EMPTY_MEDIA_TYPE
    titles = [layer["annotations"][C.OCI_TITLE_ANNOTATION] for layer in document["layers"]]
    manifest = loader.parse_manifest((classifier_artifact / C.MANIFEST_FILE).read_bytes())
    assert titles == [C.MANIFEST_FILE, *sorted(manifest.files)]
    weights = next(
        layer for layer in document["layers"] if layer["annotations"][C.OCI_TITLE_ANNOTATION] == C.WEIGHTS_FILE
    )
    assert weights["digest"] == f"sha256:{manifest.files[C.WEIGHTS_FILE].sha256}"
    assert weights["mediaType"] == C.OCI_LAYER_MEDIA_TYPES[C.WEIGHTS_FILE]


def test_a_second_version_with_the_same_weights_uploads_and_stores_no_new_weight_blob(
    registry, classifier_artifact, tmp_path
):
    push(classifier_artifact, f"oci://{registry.address}/models/shared:1")
    before = registry.stored_blobs()
    v2 = artifact_version(classifier_artifact, tmp_path / "v2", 2)
    pushed = push(v2, f"oci://{registry.address}/models/shared:2")
    after = registry.stored_blobs()
    manifest_size = (v2 / C.MANIFEST_FILE).stat().st_size
    assert pushed.uploaded == manifest_size  # only the new manifest.json: weights and packages were there
    weights = (v2 / C.WEIGHTS_FILE).stat().st_size
    assert pushed.reused >= weights
    added = {d: n for d, n in after.items() if d not in before}
    new_manifest = "sha256:" + hashlib.sha256((v2 / C.MANIFEST_FILE).read_bytes()).hexdigest()
    assert set(added) == {new_manifest, pushed.digest}  # the new manifest.json and the new OCI manifest
    manifest = loader.parse_manifest((v2 / C.MANIFEST_FILE).read_bytes())
    for rel, entry in manifest.files.items():  # the weights and the packages: stored once for both versions
        assert after[f"sha256:{entry.sha256}"] == entry.size, rel


def test_pushing_the_same_artifact_again_uploads_nothing(registry, classifier_artifact):
    push(classifier_artifact, f"oci://{registry.address}/models/again:1")
    again = push(classifier_artifact, f"oci://{registry.address}/models/again:1")
    assert again.uploaded == 0


def test_the_cli_pushes_and_pulls_the_same_reference(registry, classifier_artifact, tmp_path):
    reference = f"oci://{registry.address}/models/cli:7"
    result = CliRunner().invoke(main, ["push", str(classifier_artifact), reference], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"{reference}@sha256:")
    out = tmp_path / "pulled"
    result = CliRunner().invoke(main, ["pull", reference, "-o", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert result.output == f"{out} (version 1)\n"
    assert _files(out) == _files(classifier_artifact, only=_listed(classifier_artifact))


def test_oras_pulls_the_artifact_folder_back(registry, classifier_artifact, tmp_path):
    oras = pytest.importorskip("oras.client")
    push(classifier_artifact, f"oci://{registry.address}/models/oras:1")
    client = oras.OrasClient(hostname=registry.address, insecure=True)
    client.pull(target=f"{registry.address}/models/oras:1", outdir=str(tmp_path / "oras"))
    assert _files(tmp_path / "oras") == _files(classifier_artifact, only=_listed(classifier_artifact))
    assert loader.load(tmp_path / "oras").name == "tiny-classifier"


def test_a_signed_artifact_carries_its_signature_and_is_checked_before_its_weights(
    registry, classifier_artifact, signing_keys, tmp_path, cache
):
    signed = artifact_version(classifier_artifact, tmp_path / "signed", 3)
    sign(signed, signing_keys[0])
    reference = f"oci://{registry.address}/models/signed:3"
    push(signed, reference)
    assert loader.load(reference, trusted_keys=[signing_keys[1]]).name == "tiny-classifier"
    _, other_public, _ = keygen(tmp_path / "other")
    fresh = tmp_path / "fresh-cache"
    with pytest.raises(loader.UntrustedArtifactError):
        loader.load(reference, trusted_keys=[other_public], cache_dir=fresh)
    assert not (fresh / C.CACHE_ENTRIES_DIR).exists()  # refused on its head: no blob was downloaded


def test_a_blob_changed_in_the_registry_is_refused_at_load(registry, classifier_artifact, tmp_path, cache):
    v5 = artifact_version(classifier_artifact, tmp_path / "v5", 5)
    (v5 / C.WEIGHTS_FILE).chmod(0o644)
    data = bytearray((v5 / C.WEIGHTS_FILE).read_bytes())
    data[-1] ^= 0xFF  # weights of their own, so that tampering with them leaves the other tests' blobs alone
    (v5 / C.WEIGHTS_FILE).write_bytes(bytes(data))
    manifest = json.loads((v5 / C.MANIFEST_FILE).read_text())
    manifest["files"][C.WEIGHTS_FILE]["sha256"] = hashlib.sha256(data).hexdigest()
    (v5 / C.MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    reference = f"oci://{registry.address}/models/tampered:5"
    push(v5, reference)
    blob = registry.blob_path(f"sha256:{manifest['files'][C.WEIGHTS_FILE]['sha256']}")
    stored = bytearray(blob.read_bytes())
    stored[100] ^= 0x01
    blob.write_bytes(bytes(stored))
    with pytest.raises(ArtifactError, match=r"weights\.safetensors: the registry's blob does not hash to its digest"):
        loader.load(reference)
    assert not any((cache / C.CACHE_ENTRIES_DIR).iterdir())  # no entry was made of it
    result = CliRunner().invoke(main, ["pull", reference, "-o", str(tmp_path / "out")], catch_exceptions=False)
    assert result.exit_code == 1
    assert "does not hash to its digest" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_a_missing_tag_is_one_clear_line(registry, classifier_artifact):
    push(classifier_artifact, f"oci://{registry.address}/models/tags:1")
    with pytest.raises(ArtifactError, match=r"no such tag or manifest in 127\.0\.0\.1:\d+/models/tags$"):
        loader.load(f"oci://{registry.address}/models/tags:9")
    result = CliRunner().invoke(main, ["pull", f"oci://{registry.address}/models/tags:9"], catch_exceptions=False)
    assert result.exit_code == 1
    assert result.output.count("\n") == 1 and "no such tag or manifest" in result.output


@pytest.mark.parametrize(
    ("reference", "says"),
    [
        ("oci://registry.example.com/models/x", "no tag"),
        ("oci:///models/x:1", "no registry host"),
        ("oci://registry.example.com/Models/x:1", "not a valid repository name"),
        ("oci://registry.example.com/models/x@sha256:abc", "not a sha256 digest"),
        ("oci://registry.example.com/models/x:bad tag", "not a valid tag"),
    ],
)
def test_a_bad_reference_says_what_is_wrong(reference, says):
    with pytest.raises(LoaderError, match=says):
        parse_reference(reference)


def test_a_registry_that_is_down_is_named(tmp_path):
    with pytest.raises(ArtifactError, match=r"127\.0\.0\.1:9 unreachable .*; is it up\?"):
        loader.load("oci://127.0.0.1:9/models/x:1", cache_dir=tmp_path)


def test_something_else_under_the_reference_is_not_taken_for_an_artifact(registry, tmp_path):
    import urllib.request

    config = b'{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}'
    base = f"http://{registry.address}/v2/images/busybox"
    from loader.stores.oci import Registry

    client = Registry(parse_reference(f"oci://{registry.address}/images/busybox:1"))
    digest = "sha256:" + hashlib.sha256(config).hexdigest()
    client.upload_blob(digest, len(config), config)
    image = {
        "schemaVersion": 2,
        "mediaType": C.OCI_MANIFEST_MEDIA_TYPE,
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": digest, "size": len(config)},
        "layers": [],
    }
    request = urllib.request.Request(
        f"{base}/manifests/1",
        data=json.dumps(image).encode(),
        method="PUT",
        headers={"Content-Type": C.OCI_MANIFEST_MEDIA_TYPE},
    )
    urllib.request.urlopen(request).close()
    with pytest.raises(ArtifactError, match="not a precompile artifact"):
        loader.load(f"oci://{registry.address}/images/busybox:1", cache_dir=tmp_path)


def _listed(artifact: Path) -> set[str]:
    manifest = loader.parse_manifest((artifact / C.MANIFEST_FILE).read_bytes())
    return {C.MANIFEST_FILE, C.SIGNATURE_FILE, *manifest.files}


def _files(root: Path, only: set[str] | None = None) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and (only is None or p.relative_to(root).as_posix() in only)
    }


def test_a_server_watching_a_tag_follows_it_when_it_moves(registry, classifier_artifact, tmp_path, cache):
    tag = f"oci://{registry.address}/models/watched:current"
    push(classifier_artifact, tag)
    live = loader.Live(tag)
    assert live.serving.version == 1
    first = remote.identity(tag)
    push(artifact_version(classifier_artifact, tmp_path / "v6", 6), tag)  # the deploy: re-tag
    assert remote.identity(tag) != first
    live.watch(interval=0.05)
    try:
        deadline = time.monotonic() + 60
        while live.serving.version != 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert live.serving.version == 6
    finally:
        live.close()
