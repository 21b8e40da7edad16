"""Environments from outside shoal, seen by every process of a run.

A learner, its rollout workers and the node daemons are separate processes: an environment
registered by a user's script in one of them is unknown in the others. So `shoal.envs` imports,
once and in every process, the modules named in `SHOAL_ENV_MODULES` (comma-separated) and the
`shoal.envs` entry points of installed packages; each registers its environments on import (an
entry point may also name a function, which is called with no arguments).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from collections.abc import Mapping

from shoal.envs.errors import EnvError

ENTRY_POINT_GROUP = "shoal.envs"
MODULES_VARIABLE = "SHOAL_ENV_MODULES"


class PluginError(EnvError):
    """An environment module or entry point could not be loaded; the message names it."""


def load_plugins(environ: Mapping[str, str] = os.environ) -> list[str]:
    """Import every plugin; returns what was loaded, in order."""
    loaded = []
    for name in (part.strip() for part in environ.get(MODULES_VARIABLE, "").split(",")):
        if not name:
            continue
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise PluginError(
                f"{MODULES_VARIABLE} names {name!r}, which cannot be imported ({exc}): "
                "fix the name or put its folder on PYTHONPATH"
            ) from exc
        loaded.append(name)
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            target = entry.load()
            if callable(target):
                target()
        except Exception as exc:
            raise PluginError(
                f"the {ENTRY_POINT_GROUP} entry point {entry.name!r} ({entry.value}) failed to "
                f"load: {type(exc).__name__}: {exc}"
            ) from exc
        loaded.append(entry.value)
    return loaded
