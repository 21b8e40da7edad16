"""Errors of the environment ecosystem; each message names the fix (the closest id, the newest version)."""

from shoal.errors import ShoalError


class EnvError(ShoalError):
    """Root of the errors raised by shoal.envs."""


class UnknownEnvironment(EnvError):
    """No environment is registered under this id; the message names the closest ids."""


class DeprecatedEnvironment(EnvError):
    """The id names an outdated version; the message names the newest one."""


class InvalidAction(EnvError):
    """An action is outside the environment's action space."""


class InvalidEnvironmentId(EnvError):
    """The text is not an environment id at all; the message shows the accepted forms."""


class RegistrationError(EnvError):
    """An environment cannot be registered as asked (id taken, bad time limit)."""


class SandboxError(EnvError):
    """The sandbox itself failed or was misused (not the episode's code); the message says how."""


class ResultChannelViolation(EnvError):
    """An episode's result channel holds something the harness never writes: its program wrote
    there. The episode fails with this message as its reason; nothing else is affected."""
