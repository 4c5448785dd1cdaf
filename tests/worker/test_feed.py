"""The device feed: a dedicated device thread that takes the packer's batches itself.

What both batching loops rely on: batches run one at a time off the event
loop, the pick is as late as possible (what arrives during a batch joins the
next one), results are settled on the loop in order, what is held can be
listed at any instant, a failure of the device reaches the caller, and
cancelling leaves no thread behind.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from tokenq.shared.packer import Batch, Budget, Packer
from tokenq.worker.pipeline.feed import Aborted, DeviceFeed, Rules, monotonic_ms

pytestmark = pytest.mark.unit


def job(name: str, length: int = 10, priority: int = 0) -> Any:
    """What the feed reads of a pipeline job: its encoding's length, arrival and priority."""
    return SimpleNamespace(
        name=name, encoding=SimpleNamespace(length=length), arrived_ms=monotonic_ms(),
        request=SimpleNamespace(priority=priority),
    )


class Device:
    """An execute() that records what ran, on which thread, and can be held."""

    def __init__(self) -> None:
        self.ran: list[list[str]] = []
        self.threads: set[str] = set()
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()
        self.active = 0
        self.most_active = 0
        self._lock = threading.Lock()

    def __call__(self, batch: Batch[Any]) -> list[str]:
        with self._lock:
            self.active += 1
            self.most_active = max(self.most_active, self.active)
        self.threads.add(threading.current_thread().name)
        self.started.set()
        self.gate.wait(10)
        names = sorted(payload.name for payload in batch.payloads)
        self.ran.append(names)
        with self._lock:
            self.active -= 1
        return names


def feed_for(device: Device, *, rows: int = 64, linger_ms: float = 0.0,
             done: list[bool] | None = None) -> DeviceFeed[Any, list[str]]:
    state = done if done is not None else [False]
    return DeviceFeed(Packer(Budget(10_000, rows), linger_ms), device,
                      rules(flushing=lambda: state[0], finished=lambda: state[0]))


def rules(**calls: Any) -> Rules:
    """Rules whose questions are the given callables (the rest: the defaults)."""
    made = Rules()
    for name, call in calls.items():
        setattr(made, name, call)
    return made


def run(coroutine: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coroutine, 30))


def test_batches_run_one_at_a_time_on_the_device_thread_and_settle_in_order() -> None:
    async def main() -> None:
        device, done = Device(), [False]
        feed = feed_for(device, rows=2, done=done)
        settled: list[tuple[list[str], str]] = []

        async def settle(batch: Batch[Any], result: list[str]) -> None:
            settled.append((result, threading.current_thread().name))
            if sum(len(names) for names, _ in settled) == 6:
                done[0] = True
                feed.wake()

        feed.add([job(f"r{i}") for i in range(6)])
        await feed.run(settle)
        assert [names for names, _ in settled] == device.ran
        assert sorted(name for names in device.ran for name in names) == [
            f"r{i}" for i in range(6)
        ]
        assert all(len(names) <= 2 for names in device.ran)
        assert device.threads == {"tokenq-device"}
        assert {thread for _, thread in settled} == {threading.current_thread().name}
        assert device.most_active == 1

    run(main())


def test_what_arrives_during_a_batch_joins_the_next_one() -> None:
    """The pick is as late as possible: at the instant the device frees."""

    async def main() -> None:
        device, done = Device(), [False]
        feed = feed_for(device, done=done)
        device.gate.clear()

        async def settle(batch: Batch[Any], result: list[str]) -> None:
            if len(device.ran) == 2:
                done[0] = True
                feed.wake()

        feed.add([job("first")])
        running = asyncio.ensure_future(feed.run(settle))
        await asyncio.to_thread(device.started.wait, 5)
        feed.add([job(f"later{i}") for i in range(5)])
        assert sorted(p.name for p in feed.held()) == ["first", *(f"later{i}" for i in range(5))]
        device.gate.set()
        await running
        assert device.ran == [["first"], [f"later{i}" for i in range(5)]]

    run(main())


def test_held_counts_what_ran_but_is_not_settled_yet() -> None:
    async def main() -> None:
        device, done = Device(), [False]
        feed = feed_for(device, done=done)
        seen: list[list[str]] = []
        release = asyncio.Event()

        async def settle(batch: Batch[Any], result: list[str]) -> None:
            seen.append(sorted(p.name for p in feed.held()))
            await release.wait()
            done[0] = True
            feed.wake()

        feed.add([job("a"), job("b")])
        running = asyncio.ensure_future(feed.run(settle))
        while not seen:
            await asyncio.sleep(0.01)
        release.set()
        await running
        assert seen == [["a", "b"]]  # not buffered, not running: settling, still held
        assert feed.held() == []

    run(main())


def test_an_unsealed_batch_lingers_and_a_wake_ends_it_early() -> None:
    async def main() -> None:
        device, done = Device(), [False]
        feed = feed_for(device, linger_ms=300.0, done=done)
        times: list[float] = []

        async def settle(batch: Batch[Any], result: list[str]) -> None:
            times.append(time.monotonic())
            if len(times) == 2:
                done[0] = True
                feed.wake()

        started = time.monotonic()
        feed.add([job("lone")])
        running = asyncio.ensure_future(feed.run(settle))
        while not times:
            await asyncio.sleep(0.01)
        assert times[0] - started >= 0.29  # it waited for company
        feed.add([job("second")])
        await asyncio.sleep(0.05)
        done[0] = True  # flushing: the lingering batch goes at once
        feed.wake()
        await running
        assert times[1] - times[0] < 0.25
        assert device.ran == [["lone"], ["second"]]

    run(main())


class Custom(BaseException):
    """A BaseException that is no Exception, as a plugin may raise."""


@pytest.mark.parametrize(("raised", "expected", "match"), [
    (RuntimeError("device lost"), RuntimeError, "device lost"),
    (asyncio.CancelledError("plugin"), Aborted, "stopped on CancelledError: plugin"),
    (Custom("custom"), Aborted, "stopped on Custom: custom"),
    (KeyboardInterrupt(), Aborted, "stopped on KeyboardInterrupt"),
])
def test_a_device_failure_reaches_the_caller_and_its_batch_stays_held(
    raised: BaseException, expected: type[Exception], match: str,
) -> None:
    async def main() -> None:
        def broken(batch: Batch[Any]) -> None:
            raise raised

        feed: DeviceFeed[Any, None] = DeviceFeed(
            Packer(Budget(100, 8)), broken, Rules())

        async def settle(batch: Batch[Any], result: None) -> None:
            raise AssertionError("nothing ran")

        feed.add([job("x")])
        with pytest.raises(expected, match=match) as caught:
            await feed.run(settle)  # an ordinary error, never a cancel or an interpreter exit
        if expected is Aborted:
            assert caught.value.__cause__ is raised
        assert [payload.name for payload in feed.held()] == ["x"]  # for whoever answers it

    run(main())
    assert not [t for t in threading.enumerate() if t.name == "tokenq-device"]


def test_cancelling_stops_the_thread_after_its_batch_and_drops_the_result() -> None:
    async def main() -> None:
        device = Device()
        device.gate.clear()
        feed = feed_for(device)
        settled: list[Any] = []

        async def settle(batch: Batch[Any], result: list[str]) -> None:
            settled.append(result)

        feed.add([job("a")])
        running = asyncio.ensure_future(feed.run(settle))
        await asyncio.to_thread(device.started.wait, 5)
        feed.add([job("b")])
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        device.gate.set()
        for _ in range(200):
            if not [t for t in threading.enumerate() if t.name == "tokenq-device"]:
                break
            await asyncio.sleep(0.01)
        assert settled == []
        assert device.ran == [["a"]]  # "b" was never started
        # "a" ran but was never settled, so it is still held: whoever cancelled
        # can answer it (the batcher fails what is held, so no caller hangs).
        assert sorted(p.name for p in feed.held()) == ["a", "b"]

    run(main())
    assert not [t for t in threading.enumerate() if t.name == "tokenq-device"]


def test_a_stalled_loop_stalls_the_device_instead_of_piling_up_results() -> None:
    async def main() -> None:
        device, done = Device(), [False]
        feed: DeviceFeed[Any, list[str]] = DeviceFeed(
            Packer(Budget(10_000, 1)), device,
            rules(flushing=lambda: done[0], finished=lambda: done[0]), max_unsettled=2,
        )
        release = asyncio.Event()

        async def settle(batch: Batch[Any], result: list[str]) -> None:
            await release.wait()

        feed.add([job(f"r{i}") for i in range(6)])
        running = asyncio.ensure_future(feed.run(settle))
        await asyncio.sleep(0.3)
        assert len(device.ran) == 2  # two results waiting: the device waits too
        release.set()
        done[0] = True
        feed.wake()
        await running
        assert len(device.ran) == 6

    run(main())


def test_each_batch_teaches_the_packer_its_time() -> None:
    async def main() -> None:
        device, done = Device(), [False]
        feed = feed_for(device, rows=1, done=done)

        async def settle(batch: Batch[Any], result: list[str]) -> None:
            if len(device.ran) == 3:
                done[0] = True
                feed.wake()

        feed.add([job("a", 5), job("b", 50), job("c", 500)])
        await feed.run(settle)
        assert feed.packer.timer.batches == 3

    run(main())


def test_messages_sent_while_the_loop_is_busy_share_one_wake_up_and_keep_their_order() -> None:
    """The device thread wakes the loop only when no wake-up is on its way: batches taken
    and finished while the loop was held are read in one go, in the order sent, and each
    result comes after its batch's take (``on_take``: the buffer has room)."""

    async def main() -> None:
        device, done = Device(), [False]
        events: list[str] = []
        feed: DeviceFeed[Any, list[str]] = DeviceFeed(
            Packer(Budget(10_000, 1)), device, rules(
                flushing=lambda: done[0], finished=lambda: done[0],
                taken=lambda: events.append("take")),
        )
        loop = asyncio.get_running_loop()
        wakes = [0]
        plain = loop.call_soon_threadsafe

        def counting(callback: Any, *args: Any, **kwargs: Any) -> Any:
            wakes[0] += 1
            return plain(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]

        async def settle(batch: Batch[Any], result: list[str]) -> None:
            events.append(f"done {result[0]}")
            if len(events) == 2:
                time.sleep(0.3)  # the loop held: the device runs ahead meanwhile
            if sum(event.startswith("done") for event in events) == 12:
                done[0] = True
                feed.wake()

        feed.add([job(f"r{i:02d}") for i in range(12)])
        await feed.run(settle)
        taken = [event for event in events if event == "take"]
        finished = [event.split()[1] for event in events if event.startswith("done")]
        assert len(taken) == 12 and finished == [names[0] for names in device.ran]
        for i, name in enumerate(finished):  # the i-th result follows the i-th take
            assert events.index(f"done {name}") > [n for n, e in enumerate(events)
                                                   if e == "take"][i]
        assert wakes[0] < 24, "every take and result woke the loop on its own"

    run(main())


def test_no_batch_is_taken_while_may_take_says_no_and_one_is_once_woken() -> None:
    """The worker holds batches back while its unpublished answers fill the room."""

    async def main() -> None:
        device, room = Device(), [False]
        feed: DeviceFeed[Any, list[str]] = DeviceFeed(
            Packer(Budget(10_000, 64), 0.0), device,
            rules(flushing=lambda: True, may_take=lambda: room[0]))
        settled: list[list[str]] = []

        async def settle(batch: Batch[Any], result: list[str]) -> None:
            settled.append(result)

        task = asyncio.create_task(feed.run(settle))
        feed.add([job("a"), job("b")])
        await asyncio.sleep(0.3)
        assert device.ran == [] and len(feed.packer) == 2, "a batch was taken with no room"
        room[0] = True
        feed.wake()  # room made: the thread looks again
        while not settled:
            await asyncio.sleep(0.01)
        assert settled == [["a", "b"]] and len(feed.packer) == 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
