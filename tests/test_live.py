"""loader.Live: one artifact served, new versions swapped in whole or not at all."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

import loader
from loader import ArtifactError, Live, LoaderError, SwapError
from loader.serving.live import resolve_pointer


def inputs(batch=2, seq=10, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50, (batch, seq), generator=gen), torch.ones(batch, seq, dtype=torch.bool)


def wait_for(condition, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_serves_like_the_model_it_loaded(classifier_versions):
    live = Live(classifier_versions[0])
    assert live.ready and live.serving.version == 1
    assert torch.equal(live(*inputs()), loader.load(classifier_versions[0])(*inputs()))


def test_empty_until_swapped(classifier_versions):
    live = Live()
    assert not live.ready and live.current is None
    with pytest.raises(LoaderError, match="no artifact loaded yet"):
        live(*inputs())
    live.swap(classifier_versions[1])
    assert live.serving.version == 2


def test_swap_replaces_the_model_and_old_references_keep_working(classifier_versions):
    live = Live(classifier_versions[0])
    held = live.model  # what a call in flight holds
    new = live.swap(classifier_versions[1])
    assert new.version == 2 and live.model is new.model and live.model is not held
    assert torch.equal(held(*inputs()), live(*inputs()))  # the old one still runs to completion
    assert live.status()["last_attempt"]["ok"] is True


def test_a_broken_version_leaves_the_old_one_serving(classifier_versions, tmp_path):
    live = Live(classifier_versions[0])
    broken = tmp_path / "broken"
    shutil.copytree(classifier_versions[1], broken)
    data = bytearray((broken / "weights.safetensors").read_bytes())
    data[-5] ^= 0x40
    (broken / "weights.safetensors").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="weights.safetensors does not match its sha256"):
        live.swap(broken)
    assert live.serving.version == 1
    attempt = live.status()["last_attempt"]
    assert attempt["ok"] is False and "does not match its sha256" in attempt["error"]
    assert live(*inputs()).shape == (2, 3)


def test_a_missing_path_leaves_the_old_one_serving(classifier_versions, tmp_path):
    live = Live(classifier_versions[0])
    with pytest.raises(ArtifactError, match="no such artifact"):
        live.swap(tmp_path / "nope")
    assert live.serving.version == 1


def test_rollback_is_refused_unless_allowed(classifier_versions):
    live = Live(classifier_versions[2])
    with pytest.raises(SwapError, match="version 1 is older than the serving version 3") as refused:
        live.swap(classifier_versions[0])
    assert "serve with --allow-rollback (Live(..., allow_rollback=True) or swap(..., allow_rollback=True))" in str(
        refused.value
    )
    assert live.serving.version == 3
    assert live.swap(classifier_versions[0], allow_rollback=True).version == 1


def test_another_model_is_refused(classifier_versions, structured_artifact):
    live = Live(classifier_versions[0])
    with pytest.raises(SwapError, match="'tiny-structured' cannot replace 'tiny-classifier'"):
        live.swap(structured_artifact)
    assert live.serving.name == "tiny-classifier"


def test_changed_inputs_are_refused(classifier_versions, tmp_path):
    renamed = tmp_path / "renamed"
    shutil.copytree(classifier_versions[1], renamed)
    manifest = json.loads((renamed / "manifest.json").read_text())
    manifest["inputs"][1]["name"] = "attention_mask"
    (renamed / "manifest.json").write_text(json.dumps(manifest))
    live = Live(classifier_versions[0])
    with pytest.raises(
        SwapError, match=r"inputs \(ids: int64\[batch, seq\], attention_mask: bool\[batch, seq\]\) differ"
    ):
        live.swap(renamed)


def test_a_failing_check_refuses_the_version(classifier_versions):
    def check(model):
        if model.manifest.version == 2:
            raise ValueError("golden outputs differ")

    live = Live(classifier_versions[0], check=check)
    with pytest.raises(SwapError, match="refused by the check: ValueError: golden outputs differ"):
        live.swap(classifier_versions[1])
    assert live.swap(classifier_versions[2]).version == 3


def test_swap_warms_up_before_serving(classifier_versions, monkeypatch):
    warmed = []
    original = loader.CompiledModel.warmup
    monkeypatch.setattr(loader.CompiledModel, "warmup", lambda self: (warmed.append(self), original(self)))
    live = Live(classifier_versions[0])
    assert warmed == [live.model]
    assert live.stats()["shapes"] == []  # warm-up calls are not traffic


def test_stats_keep_the_shapes_of_every_version(classifier_versions):
    live = Live(classifier_versions[0])
    live(*inputs(2, 10))
    live(*inputs(2, 10))
    live.swap(classifier_versions[1])
    live(*inputs(2, 10))
    live(*inputs(3, 5))
    assert live.stats()["shapes"] == [
        {"dims": {"batch": 2, "seq": 10}, "count": 3},
        {"dims": {"batch": 3, "seq": 5}, "count": 1},
    ]


def test_swap_in_background_returns_a_future(classifier_versions):
    live = Live(classifier_versions[0])
    assert live.swap_in_background(classifier_versions[1]).result(timeout=30).version == 2


def test_pointer_file_and_link_resolve_to_the_folder(classifier_versions, tmp_path):
    pointer = tmp_path / "current"
    pointer.write_text(os.path.relpath(classifier_versions[1], tmp_path) + "\n")
    assert resolve_pointer(pointer) == classifier_versions[1].resolve()
    link = tmp_path / "link"
    link.symlink_to(classifier_versions[2])
    assert resolve_pointer(link) == classifier_versions[2].resolve()
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(LoaderError, match="the pointer file is empty"):
        resolve_pointer(empty)


def replace_link(link: Path, target: Path) -> None:
    """What a deploy step does: a new link beside the old one, renamed over it (atomic)."""
    tmp = link.with_name(link.name + ".new")
    tmp.symlink_to(target)
    os.replace(tmp, link)


def test_watch_follows_a_replaced_link_and_skips_a_broken_version(classifier_versions, tmp_path):
    current = tmp_path / "current"
    current.symlink_to(classifier_versions[0])
    live = Live(current)
    live.watch(interval=0.05)
    try:
        replace_link(current, classifier_versions[1])
        assert wait_for(lambda: live.serving.version == 2)
        replace_link(current, tmp_path / "missing")  # a bad deploy: the old version serves on
        time.sleep(0.3)
        assert live.serving.version == 2
        replace_link(current, classifier_versions[3])
        assert wait_for(lambda: live.serving.version == 4)
    finally:
        live.close()


def test_watch_reports_why_a_version_was_refused(classifier_versions, tmp_path):
    current = tmp_path / "current"
    current.write_text(str(classifier_versions[2]))
    live = Live(current)
    live.watch(interval=0.05)
    try:
        tmp = tmp_path / "current.new"
        tmp.write_text(str(classifier_versions[0]))
        os.replace(tmp, current)
        assert wait_for(lambda: live.last_attempt is not None and not live.last_attempt.ok)
        assert "older than the serving version 3" in live.last_attempt.error
        assert live.serving.version == 3
    finally:
        live.close()


def test_a_link_to_a_pack_serves_the_pack(classifier_pack, tmp_path):
    link = tmp_path / "current"
    link.symlink_to(classifier_pack)
    live = Live(link, cache_dir=tmp_path / "cache")
    assert live.serving.path == classifier_pack.resolve()
    assert live(*inputs()).shape == (2, 3)


SECRET = "hunter2-do-not-leak"


@pytest.mark.parametrize(
    "content",
    [SECRET + "\n", b"\x89PNG\r\n" + SECRET.encode(), "../" + SECRET],
    ids=["text", "binary", "relative-path"],
)
def test_a_file_that_is_no_pointer_is_never_quoted(classifier_versions, tmp_path, content):
    """A path naming some other file (a secret, a config): the error names the file, not its content."""
    path = tmp_path / "secret.txt"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(LoaderError) as info:
        resolve_pointer(path)
    assert SECRET not in str(info.value)
    assert str(info.value) == (
        f"{path}: not an artifact folder, a pack, or a pointer file naming an existing one "
        "(a pointer file holds one line: the artifact's path, relative to the file)"
    )
    live = Live(classifier_versions[0])
    with pytest.raises(LoaderError):
        live.swap(path)
    assert SECRET not in json.dumps(live.status())


def test_a_manifest_of_another_format_is_not_quoted(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "manifest.json").write_text(json.dumps({"format": SECRET, "name": SECRET}))
    with pytest.raises(ArtifactError) as info:
        loader.load(tmp_path / "a")
    assert SECRET not in str(info.value)


def test_the_digest_is_of_the_manifest_as_read(classifier_artifact, tmp_path):
    """A manifest without the optional keys (an older writer): written again by this loader it would
    gain them and hash differently; the digest reported is the one a signature covers."""
    from loader.artifact import manifest_digest, read_manifest_with_bytes

    manifest = json.loads((classifier_artifact / "manifest.json").read_text())
    folder = tmp_path / "a"
    shutil.copytree(classifier_artifact, folder)
    (folder / "manifest.json").write_text(
        json.dumps({k: v for k, v in manifest.items() if k not in ("check", "expires")})
    )
    parsed, raw = read_manifest_with_bytes(folder)
    assert manifest_digest(raw) != manifest_digest(parsed)
    live = Live(folder)
    assert live.serving.digest == live.model.digest == manifest_digest(raw)
    assert live.status()["serving"]["digest"] == manifest_digest(raw)


def test_stats_count_each_call_once(classifier_versions):
    live = Live(classifier_versions[0])
    for seq in (5, 6, 7):
        live(*inputs(2, seq))
    stats = live.stats()
    assert stats["calls"] == 3
    assert stats["variants"]["dynamic"] == {
        "calls": 3,
        "pieces": 3,
        "seconds": pytest.approx(stats["variants"]["dynamic"]["seconds"]),
        "precision": "fp32",
    }
    assert Live().stats()["calls"] == 0


def test_a_version_takes_traffic_only_with_every_variant_open(tagger_build):
    """load() opens the first variant and the others in the background (loader.opening); Live waits
    for them: after a swap no call waits for a variant to open."""
    live = Live(tagger_build.path)
    model = live.model
    assert len(model.variants) == 4
    assert all(model.is_open(v.id) for v in model.variants)


def test_a_variant_that_cannot_open_refuses_the_version(tagger_build, tmp_path):
    """A package that fails its hash when the background opener reaches it: the swap is refused and
    the old version serves on, as when every package was hashed in load()."""
    live = Live(tagger_build.path)
    broken = tmp_path / "broken"
    shutil.copytree(tagger_build.path, broken)
    last = live.model.variants[-1]
    package = broken / last.file
    data = bytearray(package.read_bytes())
    data[len(data) // 2] ^= 0x40
    package.write_bytes(bytes(data))
    with pytest.raises(SwapError, match=f"variant '{last.id}' cannot be opened: .*does not match its sha256"):
        live.swap(broken)
    assert live.serving.path == tagger_build.path
    ids, mask = torch.randint(0, 50, (1, 16)), torch.ones(1, 16, dtype=torch.bool)
    assert torch.equal(live(ids, mask)[0], loader.load(tagger_build.path)(ids, mask)[0])
