"""The pure parts of a link: credit accounting and the handshake's proofs."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.runtime import auth
from shoal.runtime.credit import ReceiveCredit, SendCredit
from shoal.runtime.errors import AuthenticationFailed, LinkClosed, MailboxFull, MalformedFrame


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 64),
    st.integers(1, 1 << 20),
    st.lists(st.integers(0, 1 << 18), max_size=300),
)
def test_credit_is_neither_lost_nor_invented(frames: int, nbytes: int, sizes: list[int]) -> None:
    """Simulate a sender and receiver: whatever is in flight never exceeds the window (plus
    the one frame that may overdraw bytes), and a stalled sender always gets a grant back."""
    send, receive = SendCredit(frames, nbytes), ReceiveCredit(frames, nbytes)
    in_flight: list[int] = []
    ungranted = [0, 0]
    for size in sizes:
        if not send.available:
            # the sender is stalled: everything in flight is consumed, and a grant must follow
            granted = False
            while in_flight:
                grant = receive.consumed(in_flight.pop(0))
                ungranted[0] += 1
                if grant is not None:
                    send.grant(*grant)
                    ungranted = [ungranted[0] - grant[0], 0]
                    granted = True
            assert granted
            assert send.available
        send.take_nowait(size)
        receive.received(size)  # a conforming sender never trips the receiver's check
        in_flight.append(size)
        assert len(in_flight) <= frames
        assert sum(in_flight) - size < nbytes
        assert send.frames + len(in_flight) + ungranted[0] == frames


def test_take_nowait_refuses_when_spent_and_take_waits_for_a_grant() -> None:
    async def main() -> None:
        credit = SendCredit(1, 100)
        credit.take_nowait(10)
        with pytest.raises(MailboxFull, match="credit window"):
            credit.take_nowait(10)
        waiter = asyncio.create_task(credit.take(10))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        credit.grant(1, 10)
        await asyncio.wait_for(waiter, 1)
        credit.close(LinkClosed("gone"))
        with pytest.raises(LinkClosed, match="gone"):
            await credit.take(1)

    asyncio.run(main())


nonces = st.binary(min_size=auth.NONCE_BYTES, max_size=auth.NONCE_BYTES)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1), st.binary(min_size=1), nonces, nonces)
def test_a_proof_only_verifies_with_the_same_token_and_nonces(
    token: bytes, other: bytes, first: bytes, second: bytes
) -> None:
    proof = auth.proof(token, b"client", first, second)
    auth.verify(token, b"client", first, second, proof)
    if other != token:
        with pytest.raises(AuthenticationFailed, match="different cluster token"):
            auth.verify(other, b"client", first, second, proof)
    if first != second:
        with pytest.raises(AuthenticationFailed):
            auth.verify(token, b"client", second, first, proof)
    with pytest.raises(AuthenticationFailed):
        auth.verify(token, b"server", first, second, proof)
    with pytest.raises(AuthenticationFailed, match="no token proof"):
        auth.verify(token, b"client", first, second, None)


def test_receiver_refuses_requests_beyond_the_window() -> None:
    receive = ReceiveCredit(2, 1000)
    receive.received(10)
    receive.received(10)
    with pytest.raises(MalformedFrame, match="beyond the credit window"):
        receive.received(10)
    assert receive.consumed(10) == (1, 10)
    receive.received(10)
