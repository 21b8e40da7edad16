"""The root of shoal's error hierarchy.

Every package defines its own errors under `ShoalError`, so the CLI and the admin API can
turn anything a user caused into one clear line instead of a traceback. This module imports
nothing, so any package may use it without breaking the downward import order.
"""


class ShoalError(Exception):
    """An error a user can cause or must act on; its message says what to do."""


class ConfigError(ShoalError):
    """A configuration value is invalid: the message names the key, the value and what is valid."""
