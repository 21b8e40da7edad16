"""MuJoCo's engine warnings as log records, once each, instead of lines on stderr.

MuJoCo's C library prints a warning (a deprecated attribute in a model file, say) to stderr
every time a model compiles: one per environment copy made, so `shoal train gym:HalfCheetah-v5`
wrote it through its progress line for each copy its pre-flight check and its evaluation made.
MuJoCo's Python bindings take a callback for them; this one logs each distinct message once.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

_seen: set[str] = set()
_routed = False


def route_mujoco_warnings() -> None:
    """Send MuJoCo's warnings to the log from now on (idempotent; no-op without mujoco)."""
    global _routed
    if _routed:
        return
    try:
        import mujoco
    except ImportError:
        return
    mujoco.set_mju_user_warning(_log_once)
    _routed = True


def _log_once(message: str) -> None:
    if message in _seen:
        return
    _seen.add(message)
    log.info("mujoco: %s", message)
