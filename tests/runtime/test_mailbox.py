"""Mailbox bounds, FIFO order, back-pressure and close; the dead-letter office."""

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.errors import ConfigError
from shoal.runtime.errors import MailboxFull
from shoal.runtime.loop import run
from shoal.runtime.mailbox import DeadLetters, Mailbox, MailboxClosed


def drain(box: Mailbox[int]) -> list[int]:
    out = []
    while (item := box.get_nowait()) is not None:
        out.append(item)
    return out


@pytest.mark.parametrize("size", [0, -1, 1.5, "8", True, None])
def test_bad_capacity_names_the_key(size):
    with pytest.raises(ConfigError, match="mailbox_size"):
        Mailbox(size)


@given(capacity=st.integers(1, 50), ops=st.lists(st.booleans(), max_size=200))
def test_never_exceeds_capacity_and_keeps_fifo(capacity, ops):
    """Random puts (True) and gets (False): length stays bounded and order is first in, first out."""
    box: Mailbox[int] = Mailbox(capacity)
    model: list[int] = []
    next_item = 0
    for is_put in ops:
        if is_put:
            if len(model) < capacity:
                box.put_nowait(next_item)
                model.append(next_item)
            else:
                with pytest.raises(MailboxFull):
                    box.put_nowait(next_item)
                assert not box.offer(next_item)
            next_item += 1
        else:
            expected = model.pop(0) if model else None
            assert box.get_nowait() == expected
        assert len(box) == len(model) <= capacity
    assert drain(box) == model


def test_put_waits_for_room_and_nowait_does_not_overtake():
    async def body():
        box: Mailbox[str] = Mailbox(1)
        box.put_nowait("a")
        waiting = asyncio.ensure_future(box.put("b"))
        await asyncio.sleep(0)
        assert not waiting.done()
        assert box.get_nowait() == "a"
        # room now exists, but the waiting sender is first in line
        with pytest.raises(MailboxFull):
            box.put_nowait("c")
        await waiting
        assert drain(box) == ["b"]

    run(body())


def test_waiting_senders_are_served_in_arrival_order():
    async def body():
        box: Mailbox[int] = Mailbox(2)
        box.put_nowait(0)
        box.put_nowait(1)
        senders = [asyncio.ensure_future(box.put(i)) for i in range(2, 8)]
        await asyncio.sleep(0)
        got = []
        while len(got) < 8:
            item = box.get_nowait()
            if item is None:
                await asyncio.sleep(0)
                continue
            got.append(item)
        await asyncio.gather(*senders)
        assert got == list(range(8))

    run(body())


def test_cancelled_sender_passes_its_wakeup_on():
    async def body():
        box: Mailbox[int] = Mailbox(1)
        box.put_nowait(0)
        first = asyncio.ensure_future(box.put(1))
        second = asyncio.ensure_future(box.put(2))
        await asyncio.sleep(0)
        assert box.get_nowait() == 0  # wakes `first`
        first.cancel()
        await asyncio.sleep(0)
        await asyncio.wait_for(second, 5)
        assert first.cancelled()
        assert drain(box) == [2]

    run(body())


def test_close_fails_waiting_senders_and_returns_leftovers():
    async def body():
        box: Mailbox[int] = Mailbox(1)
        box.put_nowait(1)
        waiting = asyncio.ensure_future(box.put(2))
        await asyncio.sleep(0)
        assert box.close() == [1]
        with pytest.raises(MailboxClosed):
            await waiting
        with pytest.raises(MailboxClosed):
            box.put_nowait(3)
        with pytest.raises(MailboxClosed):
            await box.wait_nonempty()
        assert box.closed
        with pytest.raises(MailboxClosed):
            box.offer(4)

    run(body())


def test_consumer_wakes_when_a_message_arrives():
    async def body():
        box: Mailbox[int] = Mailbox(4)
        consumer = asyncio.ensure_future(box.wait_nonempty())
        await asyncio.sleep(0)
        assert not consumer.done()
        box.put_nowait(7)
        await asyncio.wait_for(consumer, 5)
        assert box.get_nowait() == 7

    run(body())


@settings(max_examples=30, deadline=None)
@given(
    capacity=st.integers(1, 4),
    per_sender=st.lists(st.integers(0, 12), min_size=1, max_size=4),
)
def test_concurrent_senders_keep_their_own_order(capacity, per_sender):
    """Several tasks `put` while one consumer drains: nothing lost, each sender's order kept."""

    async def body():
        box: Mailbox[tuple[int, int]] = Mailbox(capacity)

        async def send(sender: int, count: int) -> None:
            for seq in range(count):
                await box.put((sender, seq))

        senders = [asyncio.ensure_future(send(i, n)) for i, n in enumerate(per_sender)]
        got: list[tuple[int, int]] = []
        while len(got) < sum(per_sender):
            item = box.get_nowait()
            if item is None:
                await box.wait_nonempty()
                continue
            got.append(item)
        await asyncio.gather(*senders)
        for sender, count in enumerate(per_sender):
            assert [seq for s, seq in got if s == sender] == list(range(count))

    run(body())


def test_dead_letters_count_all_and_keep_recent():
    letters = DeadLetters(keep=2)
    for i in range(5):
        letters.record("a", f"m{i}", "actor stopped")
    assert letters.total == 5
    assert [d.method for d in letters] == ["m3", "m4"]
    with pytest.raises(ConfigError, match="dead_letter_records"):
        DeadLetters(keep=-1)
    none_kept = DeadLetters(keep=0)
    none_kept.record("a", "m", "r")
    assert none_kept.total == 1
    assert list(none_kept) == []


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(1, 3),
    background=st.lists(st.booleans(), min_size=1, max_size=30),
    consumer_yields=st.lists(st.booleans(), min_size=1, max_size=30),
)
def test_sends_from_different_tasks_keep_their_causal_order(capacity, background, consumer_yields):
    """Each send starts once the previous one is in the mailbox or waiting in line, some from
    their own task: the consumer sees them in exactly that order."""

    async def body():
        box: Mailbox[int] = Mailbox(capacity)
        got: list[int] = []
        total = len(background)

        async def consume() -> None:
            step = 0
            while len(got) < total:
                item = box.get_nowait()
                if item is None:
                    await box.wait_nonempty()
                    continue
                got.append(item)
                if consumer_yields[step % len(consumer_yields)]:
                    await asyncio.sleep(0)
                step += 1

        consumer = asyncio.ensure_future(consume())
        senders = []
        for i, in_own_task in enumerate(background):
            if in_own_task:
                senders.append(asyncio.ensure_future(box.put(i)))
                await asyncio.sleep(0)  # it is now in the mailbox or in line
            else:
                await box.put(i)
        await asyncio.gather(*senders)
        await consumer
        assert got == list(range(total))

    run(body())
