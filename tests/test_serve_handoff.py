"""precompile.serve.handoff: results of a batch reach the event loop awaiting them in one wake-up, not
one per call; cancelling an awaitable drops its queued call, and a call's error is raised where it is
awaited. On the session's tiny classifier through a real loader.Batcher."""

from __future__ import annotations

import asyncio

import pytest
import torch

import loader
from precompile.serve.handoff import loop_results
from tests.test_batch import WAIT, call_inputs


@pytest.fixture(scope="module")
def classifier(classifier_artifact):
    return loader.load(classifier_artifact)


def counting_wake_ups(loop: asyncio.AbstractEventLoop) -> list:
    """Every callback another thread hands ``loop`` (call_soon_threadsafe: a write to its self-pipe)."""
    handed, original = [], loop.call_soon_threadsafe

    def counted(callback, *args, **kwargs):
        handed.append(callback)
        return original(callback, *args, **kwargs)

    loop.call_soon_threadsafe = counted
    return handed


def test_a_batch_reaches_the_loop_in_one_wake_up(classifier):
    calls = [call_inputs(seed, seq=6) for seed in range(8)]

    async def main():
        wake_ups = counting_wake_ups(asyncio.get_running_loop())
        with loader.Batcher(classifier, max_batch=8, max_delay_ms=60_000, wait_alone=True) as batcher:
            waiting = [loop_results().wrap(batcher.submit(*args)) for args in calls]
            got = await asyncio.wait_for(asyncio.gather(*waiting), WAIT)
            assert batcher.stats()["batching"]["batch_sizes"] == {"8": 1}
        return got, wake_ups

    got, wake_ups = asyncio.run(main())
    for (outputs, _, _), args in zip(got, calls):
        torch.testing.assert_close(outputs, classifier(*args), rtol=1e-4, atol=1e-5)
    # One per future with asyncio.wrap_future; here the eight set in one burst wake the loop once,
    # however the loop and the worker share the GIL meanwhile (a busy machine gave eight before).
    assert len(wake_ups) == 1, wake_ups


def test_cancelling_drops_the_call_and_errors_are_raised_where_awaited(classifier):
    async def main():
        with loader.Batcher(classifier, max_batch=8, max_delay_ms=300, wait_alone=True) as batcher:
            stay, gone, spoiled = (call_inputs(seed, seq=5) for seed in range(3))
            waiting = [loop_results().wrap(batcher.submit(*args)) for args in (stay, gone, spoiled)]
            spoiled[0].fill_(99)  # spoilt after its guard passed: its batch fails, then it alone
            waiting[1].cancel()
            await asyncio.sleep(0)
            outputs = await asyncio.wait_for(waiting[0], WAIT)
            with pytest.raises(loader.GuardError, match="ids"):
                await asyncio.wait_for(waiting[2], WAIT)
            return outputs, batcher.stats()["batching"]

    (outputs, _, _), stats = asyncio.run(main())
    torch.testing.assert_close(outputs, classifier(*call_inputs(0, seq=5)), rtol=1e-4, atol=1e-5)
    assert stats["dropped_cancelled"] == 1
