"""loader.Batcher on the session artifacts: concurrent callers get their own results, batches form,
one bad call fails alone, the queue has a limit. Threads are bounded in count and every wait in time."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import loader
from loader.serving.batch_plan import BatchPlan, batch_plan, padded_size

WAIT = 30.0  # seconds any result may take


def call_inputs(seed: int, seq: int, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (batch, seq), generator=g)
    mask = torch.rand(batch, seq, generator=g) < 0.8
    return ids, mask


@pytest.fixture(scope="module")
def classifier(classifier_artifact):
    return loader.load(classifier_artifact)


def run_together(batcher: loader.Batcher, calls: list[tuple]) -> list:
    """Submit every call from its own thread at the same moment; return each caller's outputs."""
    start = threading.Barrier(len(calls))

    def one(args):
        start.wait(timeout=WAIT)
        return batcher.submit(*args).result(timeout=WAIT)[0]

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(one, calls))


def test_concurrent_callers_get_their_own_results_from_batches(classifier):
    calls = [call_inputs(seed, seq=10) for seed in range(8)]
    expected = [classifier(*args) for args in calls]
    classifier.reset_stats()
    with loader.Batcher(classifier, max_batch=8, max_delay_ms=200, wait_alone=True) as batcher:
        got = run_together(batcher, calls)
        stats = batcher.stats()
    for out, want in zip(got, expected):
        assert out.shape == want.shape
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    batching = stats["batching"]
    assert batching["requests"] == 8
    assert batching["batches"] < 8  # some calls ran together
    assert sum(int(size) * n for size, n in batching["batch_sizes"].items()) == 8
    # The model counted the batches that ran (what the next build should compile for)...
    assert stats["calls"] == batching["batches"]
    assert any(s["dims"]["batch"] > 1 for s in stats["shapes"])
    # ...and the batcher the requests.
    assert batching["request_shapes"] == [{"dims": {"batch": 1, "seq": 10}, "count": 8}]
    assert batching["queue_wait_ms"]["count"] == 8


def test_a_call_refused_by_the_guards_fails_alone(classifier):
    good = [call_inputs(seed, seq=6) for seed in range(3)]
    bad_ids = torch.full((1, 6), 99)  # outside the ids range [0, 49]
    with loader.Batcher(classifier, max_delay_ms=200, wait_alone=True) as batcher:
        futures = [batcher.submit(*args) for args in good]
        with pytest.raises(loader.GuardError, match="ids"):
            batcher.submit(bad_ids, torch.ones(1, 6, dtype=torch.bool))
        for future, args in zip(futures, good):
            torch.testing.assert_close(future.result(timeout=WAIT)[0], classifier(*args), rtol=1e-4, atol=1e-5)


def test_a_failing_batch_is_retried_call_by_call(classifier):
    calls = [call_inputs(seed, seq=5) for seed in range(4)]
    expected = [classifier(*args) for args in calls]
    with loader.Batcher(classifier, max_delay_ms=300, wait_alone=True) as batcher:
        futures = [batcher.submit(*args) for args in calls]
        calls[1][0].fill_(99)  # the caller spoils its input after the guard passed it: the batch fails
        results = []
        for future in futures:
            try:
                results.append(future.result(timeout=WAIT)[0])
            except loader.GuardError as e:
                results.append(e)
        stats = batcher.stats()["batching"]
    assert isinstance(results[1], loader.GuardError) and "ids" in str(results[1])
    for i in (0, 2, 3):
        torch.testing.assert_close(results[i], expected[i], rtol=1e-4, atol=1e-5)
    assert stats["retried_batches"] == 1


def test_a_full_queue_refuses_with_batcher_full(classifier):
    with loader.Batcher(classifier, max_batch=8, max_delay_ms=500, max_queue=2, wait_alone=True) as batcher:
        futures = [batcher.submit(*call_inputs(seed, seq=4)) for seed in range(2)]
        with pytest.raises(loader.BatcherFull, match="queue is full"):
            batcher.submit(*call_inputs(9, seq=4))
        for future in futures:
            future.result(timeout=WAIT)
        assert batcher.stats()["batching"]["refused_queue_full"] == 1


def test_a_caller_that_went_away_is_dropped(classifier):
    with loader.Batcher(classifier, max_batch=8, max_delay_ms=300, wait_alone=True) as batcher:
        stay = batcher.submit(*call_inputs(1, seq=4))
        gone = batcher.submit(*call_inputs(2, seq=4))
        assert gone.cancel()
        assert stay.result(timeout=WAIT)[0].shape[0] == 1
        stats = batcher.stats()["batching"]
    assert stats["dropped_cancelled"] == 1 and stats["batch_sizes"] == {"1": 1}


def test_calls_of_different_sequence_lengths_are_grouped_by_shape(classifier):
    calls = [call_inputs(seed, seq=8 if seed % 2 else 12) for seed in range(6)]
    expected = [classifier(*args) for args in calls]
    classifier.reset_stats()
    with loader.Batcher(classifier, max_delay_ms=200, wait_alone=True) as batcher:
        got = run_together(batcher, calls)
        stats = batcher.stats()
    for out, want in zip(got, expected):
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    ran = {(s["dims"]["batch"], s["dims"]["seq"]) for s in stats["shapes"]}
    assert {seq for _, seq in ran} == {8, 12}  # never a batch of mixed lengths
    assert sum(s["dims"]["batch"] * s["count"] for s in stats["shapes"]) == 6


def test_structured_outputs_are_cut_back_per_caller(tagger_build):
    tagger = loader.load(tagger_build.path)
    calls = []
    for seed in range(4):
        ids, _ = call_inputs(seed, seq=16, batch=1 + seed % 2)
        calls.append((ids, torch.ones_like(ids, dtype=torch.bool)))
    expected = [tagger(*args) for args in calls]
    with loader.Batcher(tagger, max_delay_ms=200, wait_alone=True) as batcher:
        got = run_together(batcher, calls)
    for out, want in zip(got, expected):
        assert isinstance(out, type(want)) and len(out) == len(want)
        for o, w in zip(out, want):
            torch.testing.assert_close(o, w, rtol=1e-4, atol=1e-5)


def test_the_plan_knows_the_static_batch_sizes(tagger_build):
    tagger = loader.load(tagger_build.path)
    plan = batch_plan(tagger)
    statics = {(v.dims["seq"].min,): v.dims["batch"].min for v in tagger.variants if v.kind == "static"}
    assert plan.batch_dim == "batch"
    assert {key: sizes[0] for key, sizes in plan.statics.items()} == statics


def test_padding_aims_at_a_static_size_only_where_it_was_measured_to_pay():
    measured = BatchPlan("batch", statics={(): [1, 8]}, pad_to={(): {8: (2.0, 4.0)}})
    assert padded_size(measured, (), 8, 8) == 8
    assert padded_size(measured, (), 5, 8) == 8  # 2 ms static ≤ 4 ms × 5/8 on the dynamic variant
    assert padded_size(measured, (), 3, 8) == 3  # 2 ms > 4 ms × 3/8: run 3 rows on the dynamic one
    assert padded_size(measured, (), 5, 6) == 5  # never beyond the batch limit
    unmeasured = BatchPlan("batch", statics={(): [1, 8]})
    assert padded_size(unmeasured, (), 5, 8) == 5


def test_a_live_holder_is_batched_too(classifier_artifact):
    live = loader.Live(classifier_artifact)
    try:
        args = call_inputs(3, seq=7)
        with loader.Batcher(live, max_delay_ms=1) as batcher:
            outputs, variant, serving = batcher.call_detailed(*args)
        assert serving is live.serving and variant
        torch.testing.assert_close(outputs, live(*args), rtol=1e-4, atol=1e-5)
    finally:
        live.close()


def test_a_lone_caller_is_not_kept_waiting(classifier):
    """One client calling in a loop never waits for company: its calls run as they come."""
    with loader.Batcher(classifier, max_delay_ms=5000) as batcher:
        for seed in range(3):
            batcher(*call_inputs(seed, seq=4))
        waits = batcher.stats()["batching"]["queue_wait_ms"]
    assert waits["count"] == 3 and waits["max"] < 2500  # the 5 s delay never applied


def test_a_full_batch_runs_without_waiting_the_delay(classifier):
    """Once the queue holds max_batch rows of one shape, they run: the delay is for company only."""
    with loader.Batcher(classifier, max_batch=4, max_delay_ms=120_000, wait_alone=True) as batcher:
        futures = [batcher.submit(*call_inputs(seed, seq=6)) for seed in range(4)]
        for future in futures:
            future.result(timeout=WAIT)  # well before the two-minute delay
        assert batcher.stats()["batching"]["batch_sizes"] == {"4": 1}


def test_instances_run_a_batch_while_another_is_running(classifier):
    """With two instances, a second batch runs while the first is still held up; a lone batch gets
    every thread, one beside another batch its share."""
    teams, release = [], threading.Event()

    def team(size: int) -> bool:
        teams.append((threading.current_thread().name, size))
        if len(teams) == 1:
            release.wait(WAIT)  # the first worker is held here, its batch taken and counted as running
        return True

    with loader.Batcher(classifier, max_batch=1, instances=2, threads=2, team=team) as batcher:
        first = batcher.submit(*call_inputs(1, seq=4))
        while not teams:
            time.sleep(0.01)
        second = batcher.submit(*call_inputs(2, seq=4))
        try:
            torch.testing.assert_close(second.result(timeout=WAIT)[0], classifier(*call_inputs(2, seq=4)))
            assert not first.done()
        finally:
            release.set()
        torch.testing.assert_close(first.result(timeout=WAIT)[0], classifier(*call_inputs(1, seq=4)))
    (held, alone), (other, beside) = teams
    assert held != other and (alone, beside) == (2, 1)


def test_a_lone_caller_s_batches_go_to_the_worker_that_ran_the_last_one(classifier):
    """Last in, first out (as the server's execution instances): one client's calls keep one worker's
    OpenMP team awake instead of waking each worker's in turn."""
    ran = []

    def team(size: int) -> bool:
        ran.append(threading.current_thread().name)
        return True

    with loader.Batcher(classifier, max_batch=1, instances=3, threads=3, team=team) as batcher:
        for _ in range(6):
            batcher.submit(*call_inputs(1, seq=4)).result(timeout=WAIT)
        workers = {t.name for t in threading.enumerate() if t.name.startswith("precompile-batcher-")}
    assert len(workers) == 3 and len(set(ran)) == 1  # the team was set once, by the one worker


def test_on_each_warms_every_worker_at_every_team_size_before_its_next_batch(classifier):
    """A newly loaded model's warm-up runs in each worker thread, once per team size the worker runs
    batches with (oneDNN compiles per thread count, ideep plans per calling thread), before a batch."""
    events, lock = [], threading.Lock()
    sizes = threading.local()

    def team(size: int) -> bool:
        sizes.now = size
        return True

    def warm() -> None:
        classifier.warmup()
        with lock:
            events.append(("warm", threading.current_thread().name, sizes.now))

    with loader.Batcher(classifier, max_batch=1, instances=2, threads=2, team=team) as batcher:
        batcher.on_each(warm)
        deadline = time.monotonic() + WAIT
        while len(events) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        got = batcher.submit(*call_inputs(3, seq=4)).result(timeout=WAIT)[0]
    torch.testing.assert_close(got, classifier(*call_inputs(3, seq=4)))
    workers = {name for _, name, _ in events}
    assert len(workers) == 2 and all(name.startswith("precompile-batcher-") for name in workers)
    assert sorted((name, size) for _, name, size in events) == sorted((w, s) for w in workers for s in (1, 2))
