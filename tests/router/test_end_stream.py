"""``end_stream``: a front door's ``finally`` closes the backend's stream, whatever state its
cancellation left it in, and the request is aborted exactly once."""

from __future__ import annotations

import asyncio
import logging

from pdserve.router.backend import GenerationDelta, end_stream


def stream_with_a_slow_end(ends: list[str]):
    async def deltas():
        try:
            yield GenerationDelta([1])
            await asyncio.sleep(3600)  # the next delta never comes
            yield GenerationDelta([2], finish_reason="length")
        finally:
            await asyncio.sleep(0.05)  # the abort's calls to the workers
            ends.append("aborted")

    return deltas()


def test_a_stream_still_running_in_a_cancelled_task_ends_by_itself(caplog):
    """The gRPC door awaits each delta through wait_for, which runs ``__anext__`` in a task of
    its own; cancelled twice (a deadline, then the server stopping) it returns while that task
    still runs the stream's end. Closing the stream then raised 'already running' (logged as
    an error); now it is left to end by itself, and the abort happens once."""
    async def main() -> list[str]:
        ends: list[str] = []
        deltas = stream_with_a_slow_end(ends)
        assert (await deltas.__anext__()).token_ids == [1]
        inner = asyncio.ensure_future(deltas.__anext__())
        await asyncio.sleep(0.01)
        inner.cancel()
        await asyncio.sleep(0.01)  # the stream's end is running in that task now
        await end_stream(deltas)
        await asyncio.gather(inner, return_exceptions=True)
        return ends

    with caplog.at_level(logging.ERROR):
        assert asyncio.run(main()) == ["aborted"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_stream_closed_before_its_last_delta_is_aborted_once_and_after_it_never():
    async def main(read_all: bool) -> list[str]:
        ends: list[str] = []

        async def deltas():
            try:
                yield GenerationDelta([1])
                yield GenerationDelta([2], finish_reason="length")
                ends.append("finished")
            finally:
                if not ends:
                    ends.append("aborted")

        stream = deltas()
        await stream.__anext__()
        if read_all:
            async for _ in stream:
                pass
        await end_stream(stream)
        await end_stream(stream)  # (twice: still once)
        return ends

    assert asyncio.run(main(False)) == ["aborted"]
    assert asyncio.run(main(True)) == ["finished"]
