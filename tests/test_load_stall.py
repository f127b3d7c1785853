"""A model loaded while others serve leaves them the CPUs (issue 38, part 3; the figures are
``python -m bench.load_stall``'s, bench/results/load-stall.md): a repository's later load runs at a
lower CPU priority, and the new model's execution instances warm their own threads at its hints
alone, the other shapes having been warmed once for the process by the load. The first scan, before
anything serves, warms every instance at every shape the load warmed."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest

import loader.warmup
from loader.dispatch import ServedModel
from precompile.serve.config import ServeConfig
from precompile.serve.repository import READY, Repository


@pytest.fixture(scope="module")
def repo(classifier_artifact, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("load-stall") / "models"
    shutil.copytree(classifier_artifact, root / "tiny-classifier" / "1")
    return root


@pytest.mark.parametrize("runtime", ["torch", "native"])
def test_a_load_while_others_serve_warms_instances_at_the_hints_alone(repo, runtime, monkeypatch):
    runs: list[tuple[str, tuple[int, ...], int, int]] = []  # (thread, first input's shape, nice value, model)
    run_variant = ServedModel.run_variant

    def recorded(self, variant_id, *args, **kwargs):
        thread = threading.current_thread().name
        if thread.startswith(("precompile-instance-", "precompile-load", "open-variants")):
            nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            runs.append((thread, tuple(args[0].shape), nice, id(self)))
        return run_variant(self, variant_id, *args, **kwargs)

    monkeypatch.setattr(ServedModel, "run_variant", recorded)
    # The default warm-up ("auto") runs the largest shape where its estimate from the hint's time fits
    # a budget: on a busy host a slow hint left it out. Every estimate fits here, so the load always
    # warms a shape beyond the hints, the premise of the test.
    monkeypatch.setattr(loader.warmup, "estimate_seconds", lambda *args, **kwargs: 0.0)
    config = ServeConfig(str(repo), repository=True, allow_repository_control=True, runtime=runtime)
    repository = Repository(config)
    repository.start()
    try:
        repository.wait_loaded()
        service = repository.lookup("tiny-classifier")
        model = service.live.model
        model.wait_opened()  # the load's warm-up of the other shapes, behind the hint's, is done
        hints = {tuple(model.example_inputs(v)[0].shape) for v in model.variants}
        warmed = {
            tuple(model.example_inputs(v, sizes)[0].shape) for v in model.variants for sizes in model.warmed[v.id]
        }
        assert warmed > hints, "the load warms more than the hints (the test needs a shape beyond them)"
        call = dict(zip(model.input_names, model.example_inputs(model.variants[0])))
        service.instances.submit(service.live.call_detailed, **call).result()  # each instance warm by now

        first_scan = {(t, shape) for t, shape, _, _ in runs if t.startswith("precompile-instance-")}
        assert {shape for _, shape in first_scan} == warmed  # before anything served: every warmed shape
        base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        assert {nice for t, _, nice, _ in runs if t.startswith("precompile-load")} == {base}

        runs.clear()
        repository.unload("tiny-classifier")
        repository.load("tiny-classifier")  # a later load: others may be serving
        assert [r["state"] for r in repository.index()] == [READY]
        service = repository.lookup("tiny-classifier")
        for _ in range(4):  # an instance warms before its first call; enough calls to reach each
            service.instances.submit(service.live.call_detailed, **call).result()
        # the new version's runs alone: the first version's other instance may still be warming
        new = id(service.live.model)
        instance_shapes = {shape for t, shape, _, m in runs if t.startswith("precompile-instance-") and m == new}
        load_runs = [(shape, nice) for t, shape, nice, m in runs if t.startswith("precompile-load") and m == new]
    finally:
        repository.stop()
    assert instance_shapes and instance_shapes <= hints, instance_shapes
    assert {shape for shape, _ in load_runs} == warmed  # the load itself still warms every shape
    assert all(nice > base for _, nice in load_runs) or os.name != "posix"  # ... at a lower priority
