"""The envelope kinds are names in the code but letters on the wire; a peer running older code
reads the letters, so they must never change."""

from shoal.runtime import envelope


def test_envelope_kinds_keep_their_wire_letters() -> None:
    kinds = (
        envelope.TELL,
        envelope.ASK,
        envelope.REPLY,
        envelope.FAIL,
        envelope.CREDIT,
        envelope.ERROR,
    )
    assert kinds == ("t", "a", "r", "f", "c", "e")
