"""The handlers' slots of a worker (errands.worker.runners.HandlerSlots):
at most ``size`` jobs begin at once, the others wait in order with urgent ones (rescued
jobs) first, and a wait that is cancelled takes no slot, also when the cancel lands as
the slot is handed to it. In a worker with both kinds of handler the sync ones' threads
wait in the same line as the async ones' tasks, a slot given back on any thread reaches
the next waiter of either kind, and a stop opens them all."""

from __future__ import annotations

import asyncio
import threading
import time

from errands.worker.runners import HandlerSlots


def test_jobs_beyond_the_slots_wait_in_order_with_urgent_ones_first() -> None:
    async def scenario() -> list[str]:
        slots = HandlerSlots(1)
        began: list[str] = []

        async def job(name: str, urgent: bool = False) -> None:
            await slots.take(urgent)
            began.append(name)

        await job("first")  # the one slot: taken at once
        waiting = [
            asyncio.create_task(job("fresh-1")),
            asyncio.create_task(job("fresh-2")),
            asyncio.create_task(job("rescued", urgent=True)),
        ]
        await asyncio.sleep(0)
        assert began == ["first"]  # no slot free: all three wait
        for _ in waiting:
            slots.give()
            await asyncio.sleep(0)
        await asyncio.gather(*waiting)
        return began

    assert asyncio.run(scenario()) == ["first", "rescued", "fresh-1", "fresh-2"]


def test_a_cancelled_wait_takes_no_slot_and_one_handed_over_as_it_was_cancelled_passes_on() -> None:
    async def scenario() -> tuple[int, list[str]]:
        slots = HandlerSlots(1)
        await slots.take()
        began: list[str] = []

        async def job(name: str) -> None:
            await slots.take()
            began.append(name)

        gone = asyncio.create_task(job("cancelled while waiting"))
        handed = asyncio.create_task(job("cancelled as handed its slot"))
        last = asyncio.create_task(job("next"))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        slots.give()  # to `handed`, whose cancel lands in the same loop turn
        handed.cancel()
        await asyncio.gather(gone, handed, return_exceptions=True)
        await asyncio.wait_for(last, 1)  # the slot went on to it
        slots.give()
        return slots.free, began

    free, began = asyncio.run(scenario())
    assert began == ["next"]
    assert free == 1  # every slot back: none lost, none given twice


def test_threads_and_tasks_wait_in_one_line_and_a_slot_given_on_any_thread_reaches_the_next() -> (
    None
):
    slots = HandlerSlots(1)
    began: list[str] = []
    lock = threading.Lock()

    def thread_job(name: str) -> None:
        assert slots.take_blocking()
        with lock:
            began.append(name)

    async def scenario() -> None:
        assert await slots.take()  # the one slot: held by a task
        first = threading.Thread(target=thread_job, args=("thread-1",))
        first.start()
        while not slots._waiting:  # (waiting in line)
            await asyncio.sleep(0.001)

        async def task_job(name: str) -> None:
            assert await slots.take()
            began.append(name)

        task = asyncio.create_task(task_job("task-2"))
        await asyncio.sleep(0.01)
        assert began == []  # no slot free: both wait
        slots.give()  # from the loop, to the thread waiting first
        first.join(2)
        assert began == ["thread-1"]
        # the thread's slot given back from another thread reaches the task on its loop
        await asyncio.to_thread(slots.give)
        await asyncio.wait_for(task, 2)
        assert began == ["thread-1", "task-2"]
        slots.give()

    asyncio.run(scenario())
    assert slots.free == 1  # every slot back: none lost, none given twice


def test_a_stop_opens_the_slots_every_waiter_goes_on_and_none_is_counted() -> None:
    slots = HandlerSlots(1)
    assert slots.take_blocking()
    results: list[bool] = []
    waiter = threading.Thread(target=lambda: results.append(slots.take_blocking(urgent=True)))
    waiter.start()
    while not slots._urgent:
        time.sleep(0.001)

    async def task_waits() -> bool:
        return await slots.take()

    async def scenario() -> bool:
        task = asyncio.create_task(task_waits())
        await asyncio.sleep(0.01)
        slots.open()  # as a stop does, from its own thread
        return await asyncio.wait_for(task, 2)

    assert asyncio.run(scenario()) is False  # went on without a slot
    waiter.join(2)
    assert results == [False]
    assert slots.take_blocking() is False  # a later wait returns at once
    slots.give()  # (a handler that held one ends): nothing counted
    assert slots.free == 0
