"""Hypothesis strategies the parsers' tests share."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st


def json_values(max_text: int = 8, max_leaves: int = 12) -> st.SearchStrategy[Any]:
    """Any JSON-like value (what a parser of outside bytes may be handed once they decode):
    null, booleans, integers, floats (NaN and infinities too), short strings, and lists and
    objects of them nested a few levels."""
    return st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=max_text),
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=max_leaves,
    )
