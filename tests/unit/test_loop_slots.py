"""The async handlers' slots on a worker's event loop (errands.worker.runners.LoopSlots):
at most ``size`` jobs begin at once, the others wait in order with urgent ones (rescued
jobs) first, and a wait that is cancelled takes no slot, also when the cancel lands as
the slot is handed to it."""

from __future__ import annotations

import asyncio

from errands.worker.runners import LoopSlots


def test_jobs_beyond_the_slots_wait_in_order_with_urgent_ones_first() -> None:
    async def scenario() -> list[str]:
        slots = LoopSlots(1)
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
        slots = LoopSlots(1)
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
