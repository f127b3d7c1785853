"""Unloading frees: a version loaded and unloaded again and again through the repository's control
(``Repository.load`` / ``unload``, what ``POST /v2/repository/models/{name}/load`` and ``.../unload``
call) leaves nothing of it behind: its compiled libraries closed (counted in ``/proc/self/maps``),
its memory given back (RSS flat), its threads gone; on both runtimes."""

from __future__ import annotations

import gc
import shutil
import threading
from pathlib import Path

import pytest
import torch

import loader
from bench.unload import model_libraries, rss_mib
from precompile.serve.config import ServeConfig
from precompile.serve.repository import READY, Repository

CYCLES = 120
WARM_CYCLES = 10  # allocators and caches reach their steady size in the first cycles


@pytest.fixture(scope="module")
def repo(classifier_artifact, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("unload") / "models"
    shutil.copytree(classifier_artifact, root / "tiny-classifier" / "1")
    return root


@pytest.fixture
def frozen_heap():
    """What the session holds before the test, moved out of the collector's sight (``gc.freeze``):
    each cycle's ``gc.collect()`` then walks the cycle's own objects only, not the whole worker's heap
    (a second a cycle in a full suite's worker, a tenth in a fresh process). The model's objects are
    made after the freeze, so a cycle keeping one alive is still seen. What the test left is collected
    after it, so the next test's count of libraries starts without it."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
    gc.collect()


@pytest.mark.parametrize("runtime", ["torch", "native"])
def test_load_and_unload_cycles_leave_no_library_memory_or_thread(repo, runtime, frozen_heap):
    repository = Repository(ServeConfig(str(repo), repository=True, allow_repository_control=True, runtime=runtime))
    repository.start()
    repository.wait_loaded()
    threads_before = {t.ident for t in threading.enumerate()}
    libraries, rss = [], []
    try:
        for _ in range(CYCLES):
            repository.unload("tiny-classifier")
            gc.collect()
            libraries.append(len(model_libraries()))
            rss.append(rss_mib())
            repository.load("tiny-classifier")
        assert [r["state"] for r in repository.index()] == [READY]
    finally:
        repository.stop()
    # None of the cycles adds a library (one may linger for a cycle: it goes at the next dlclose once
    # the threads that called it have left the kernel). Before the fix: one more every cycle.
    assert max(libraries[WARM_CYCLES:]) <= libraries[WARM_CYCLES] + 1, libraries
    assert libraries[-1] <= libraries[WARM_CYCLES] + 1, libraries
    assert max(rss[WARM_CYCLES:]) <= rss[WARM_CYCLES] * 1.05, rss
    assert {t.ident for t in threading.enumerate()} <= threads_before | {threading.get_ident()}


def test_a_closed_model_closes_its_libraries(classifier_artifact):
    """``close()`` deletes the containers and closes the libraries, for a model loaded and called on a
    thread that has ended (a thread that called into a library keeps it mapped while it lives)."""
    # glibc keeps the process's first model library for good (loader.native.capi: the first to define a
    # unique symbol): a model held open beside the one under test makes sure that is not the one.
    primer = loader.load(classifier_artifact, open="eager")
    models = []

    def load_and_call() -> None:
        model = loader.load(classifier_artifact, open="eager")
        model(torch.zeros(2, 5, dtype=torch.int64), torch.ones(2, 5, dtype=torch.bool))
        models.append(model)

    try:
        start = model_libraries()
        worker = threading.Thread(target=load_and_call)
        worker.start()
        worker.join()
        own = model_libraries() - start
        assert own, "the load mapped no library of its own"
        models[0].close()
        # A library an earlier model left mapped (a thread that called it was still leaving the
        # kernel) may go at this dlclose as well: only the model's own are counted.
        assert not own & model_libraries(), (own, model_libraries())
        with pytest.raises(RuntimeError, match="the model was closed"):
            models[0](torch.zeros(2, 5, dtype=torch.int64), torch.ones(2, 5, dtype=torch.bool))
    finally:
        primer.close()
