"""Shared fixtures: every test that starts processes or ports cleans them up, even on failure."""
