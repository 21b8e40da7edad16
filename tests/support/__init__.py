"""Helpers shared by tests of several packages (fixtures that start real processes)."""
