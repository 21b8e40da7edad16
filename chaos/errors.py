"""The chaos package's errors, all under `shoal.errors.ShoalError` so the CLI prints one line."""

from shoal.errors import ShoalError


class ChaosError(ShoalError):
    """Something in a chaos run went wrong; the message says what and what to do."""


class HistoryError(ChaosError):
    """A recorded history is malformed (e.g. completes before it was invoked, unknown kind)."""


class ScenarioError(ChaosError):
    """A scenario file is invalid: the message names the field, the value and what is valid."""


class ProxyError(ChaosError):
    """The fault proxy was given a bad fault setting or could not bind."""


class FaultError(ChaosError):
    """A fault could not be injected or healed (no such process, not root for a mount, ...)."""


class FaultUnsupported(FaultError):
    """This machine cannot make the fault at all (a kernel without netem, a cluster whose nodes
    share one network): the run reports it as unsupported rather than pretending it happened."""
