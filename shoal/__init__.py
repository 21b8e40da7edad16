"""shoal: asynchronous reinforcement-learning training on a cluster.

The root folders install as sub-packages (`shoal.runtime`, `shoal.raft`, ...); this package
itself holds only the face of the system: the CLI, configuration and the version.
"""

from shoal.version import __version__

__all__ = ["__version__"]
