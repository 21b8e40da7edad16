"""Errors of the actor runtime: one named exception per way a send, a call or a link fails."""

from shoal.errors import ShoalError


class ActorError(ShoalError):
    """Root of the errors a caller of an actor can see."""


class MailboxFull(ActorError):
    """`tell_nowait` found the mailbox (or the link's credit) exhausted; use `await tell` to wait."""


class ActorNotFound(ActorError):
    """No live actor has this name or path: it never existed or it has stopped."""


class AskTimeout(ActorError, TimeoutError):
    """An `ask` got no reply within its timeout; the request may or may not have been handled."""


class UnknownMethod(ActorError):
    """The actor has no public handler of that name."""


class RemoteError(ActorError):
    """The handler raised; carries the original exception's type name and message."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message


class ActorInterrupted(ActorError):
    """The actor was stopped or restarted while handling this call; it may have partly run."""


class InvalidActorName(ActorError):
    """An actor name is empty, reserved or has characters a path cannot carry."""


class InvalidActorPath(ActorError):
    """A path is neither a bare actor name nor `shoal://host:port/name`."""


class NameTaken(ActorError):
    """Another live actor in this system already has the name asked for."""


class SystemNotRunning(ActorError):
    """The actor system has not been started or is stopping; start it before spawning."""


class InvalidTimeout(ActorError, ValueError):
    """An ask timeout is not a positive, finite number of seconds."""


class NotAnActor(ActorError, TypeError):
    """`spawn` was given something that does not build an `Actor`."""


class Escalated(ActorError):
    """A child failed more often than its supervisor's restart intensity allows; the
    supervisor itself fails with this, chained to the child's last exception."""


class WireError(ShoalError):
    """Root of the errors about bytes on a link: the peer is misbehaving or incompatible."""


class MalformedFrame(WireError):
    """A frame could not be decoded; the link that sent it is closed."""


class UnknownMessageType(WireError):
    """A frame named a message or value type this process does not know."""


class FrameTooLarge(WireError):
    """A frame exceeds the link's maximum frame size."""


class AuthenticationFailed(WireError):
    """The peer did not prove it holds the cluster token."""


class LinkClosed(WireError):
    """The link to the peer is closed and could not be re-established in time."""
