"""refuse_rollback under concurrency: check and record are one step, and a conflict is an error.

Before, ``check`` ran before the load and ``record`` after, nothing held between, and ``record``
returned silently on a conflict: two concurrent loads of two different builds of version 5 were both
served. Now a load holds the name's lock from the check until its version is recorded.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import loader
from loader import UntrustedArtifactError
from loader.artifact import manifest_digest, read_manifest_with_bytes
from loader.trust import VersionLedger


def build_of(classifier_artifact: Path, dst: Path, version: int, created: str = "2030-01-01T00:00:00+00:00") -> Path:
    shutil.copytree(classifier_artifact, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest.update(version=version, created=created)
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return dst


def digest_of(folder: Path) -> str:
    return manifest_digest(read_manifest_with_bytes(folder)[1])


def race_threads(paths: list[Path], state: Path) -> dict[Path, object]:
    """Load every path at once from its own thread; each result is the model or the exception."""
    barrier = threading.Barrier(len(paths))
    results: dict[Path, object] = {}

    def one(path: Path) -> None:
        barrier.wait()
        try:
            results[path] = loader.load(path, refuse_rollback=True, state_dir=state)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            results[path] = e

    threads = [threading.Thread(target=one, args=(p,)) for p in paths]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_two_builds_of_one_version_loaded_at_once_from_threads_one_is_refused(classifier_artifact, tmp_path):
    a = build_of(classifier_artifact, tmp_path / "a", 5, "2030-01-01T00:00:00+00:00")
    b = build_of(classifier_artifact, tmp_path / "b", 5, "2031-01-01T00:00:00+00:00")
    results = race_threads([a, b], tmp_path / "state")
    refused = [e for e in results.values() if isinstance(e, Exception)]
    assert len(refused) == 1, results
    assert isinstance(refused[0], UntrustedArtifactError)
    message = str(refused[0])
    assert "version 5 was already loaded on this host with other content" in message
    assert digest_of(a)[:16] in message and digest_of(b)[:16] in message


def test_a_newer_and_an_older_version_loaded_at_once_never_end_in_a_rollback(classifier_artifact, tmp_path):
    v3 = build_of(classifier_artifact, tmp_path / "v3", 3)
    v5 = build_of(classifier_artifact, tmp_path / "v5", 5)
    state = tmp_path / "state"
    for _ in range(3):
        results = race_threads([v5, v3], state)
        assert not isinstance(results[v5], Exception), results[v5]
        assert json.loads((state / "versions" / "tiny-classifier.json").read_text())["version"] == 5
    # Once 5 is recorded, 3 can only be refused.
    assert isinstance(race_threads([v3, v3], state)[v3], UntrustedArtifactError)


RACER = textwrap.dedent(
    """
    import os, sys, time
    import loader

    path, state, go = sys.argv[1:4]
    while not os.path.exists(go):
        time.sleep(0.001)
    try:
        loader.load(path, refuse_rollback=True, state_dir=state)
        print("loaded")
    except loader.UntrustedArtifactError as e:
        print("refused:", e)
    """
)


def test_two_builds_of_one_version_loaded_at_once_from_processes_one_is_refused(classifier_artifact, tmp_path):
    builds = [
        build_of(classifier_artifact, tmp_path / name, 7, f"20{30 + i}-01-01T00:00:00+00:00")
        for i, name in enumerate("ab")
    ]
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(b), str(tmp_path / "state"), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).parent.parent,
        )
        for b in builds
    ]
    time.sleep(4)  # both have imported torch and are polling
    go.touch()
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outputs]
    lines = sorted(out.strip().splitlines()[-1] for out, _ in outputs)
    assert lines[0] == "loaded"
    assert (
        lines[1].startswith("refused:") and "version 7 was already loaded on this host with other content" in lines[1]
    )


def test_a_conflicting_record_written_during_a_load_is_an_error_not_a_silent_no_op(classifier_artifact, tmp_path):
    v3 = build_of(classifier_artifact, tmp_path / "v3", 3)
    v5 = build_of(classifier_artifact, tmp_path / "v5", 5)
    ledger = VersionLedger(tmp_path / "state")
    m3, m5 = read_manifest_with_bytes(v3)[0], read_manifest_with_bytes(v5)[0]
    hold = ledger.hold(m3, digest_of(v3), str(v3))
    ledger._write(m5, digest_of(v5))  # a writer that did not take the lock (an older loader, say)
    with pytest.raises(UntrustedArtifactError, match="version 3 is older than version 5"):
        hold.record()
    assert ledger.seen("tiny-classifier") == (5, digest_of(v5))


def test_a_failed_load_releases_the_lock_and_records_nothing(classifier_artifact, tmp_path):
    broken = build_of(classifier_artifact, tmp_path / "broken", 4)
    (broken / "weights.safetensors").write_bytes(b"\0" * (broken / "weights.safetensors").stat().st_size)
    state = tmp_path / "state"
    with pytest.raises(loader.ArtifactError):
        loader.load(broken, refuse_rollback=True, state_dir=state)
    done = threading.Event()
    threading.Thread(
        target=lambda: (loader.load(classifier_artifact, refuse_rollback=True, state_dir=state), done.set())
    ).start()
    assert done.wait(30), "the failed load kept the ledger's lock"
    assert VersionLedger(state).seen("tiny-classifier")[0] == 1
