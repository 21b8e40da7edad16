"""shoal's actor runtime: actors with bounded mailboxes, supervision, and refs local or remote."""

from shoal.runtime.actor import DEFAULT_MAILBOX_SIZE, Actor, ActorContext
from shoal.runtime.local_ref import LocalActorRef
from shoal.runtime.loop import new_event_loop, run, uses_uvloop
from shoal.runtime.mailbox import DeadLetter, DeadLetters
from shoal.runtime.ref import DEFAULT_ASK_TIMEOUT, ActorRef
from shoal.runtime.supervision import FailureRecord, Strategy, SupervisorSpec
from shoal.runtime.system import ActorSystem, split_path

__all__ = [
    "DEFAULT_ASK_TIMEOUT",
    "DEFAULT_MAILBOX_SIZE",
    "Actor",
    "ActorContext",
    "ActorRef",
    "ActorSystem",
    "DeadLetter",
    "DeadLetters",
    "FailureRecord",
    "LocalActorRef",
    "Strategy",
    "SupervisorSpec",
    "new_event_loop",
    "run",
    "split_path",
    "uses_uvloop",
]
