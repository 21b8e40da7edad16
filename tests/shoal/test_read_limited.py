"""`read_limited`, the one bounded read of a file from outside: a regular file's bytes up to the
bound, and for anything else (missing, a directory, a FIFO with no writer, too big) one
UnreadableFile, without blocking and without reading more than the bound."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.files import UnreadableFile, read_limited


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=64), st.integers(0, 80))
def test_a_regular_file_is_read_whole_within_the_bound_and_refused_over_it(
    tmp_path_factory: pytest.TempPathFactory, content: bytes, limit: int
) -> None:
    path = tmp_path_factory.mktemp("limited") / "f"
    path.write_bytes(content)
    if len(content) <= limit:
        assert read_limited(path, limit) == content
    else:
        with pytest.raises(UnreadableFile, match=r"is larger than .* refused unread"):
            read_limited(path, limit)


def test_a_symlink_to_a_regular_file_is_followed(tmp_path: Path) -> None:
    (tmp_path / "blob").write_bytes(b"{}")
    (tmp_path / "config.json").symlink_to(tmp_path / "blob")
    assert read_limited(tmp_path / "config.json", 10) == b"{}"


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda p: None, "does not exist"),  # FileMissing, an UnreadableFile
        (lambda p: p.mkdir(), "not a regular file"),
        (lambda p: os.mkfifo(p), "not a regular file"),  # no writer: an open would wait
        (lambda p: p.symlink_to("/dev/zero"), "not a regular file"),
        (lambda p: p.symlink_to(p), "symbolic-link loop"),
        (lambda p: p.symlink_to(p.parent / "gone"), "broken symbolic link"),
    ],
)
def test_anything_else_is_one_error_and_never_blocks(tmp_path: Path, make, said: str) -> None:
    path = tmp_path / "f"
    make(path)
    with pytest.raises(UnreadableFile, match=said):
        read_limited(path, 1024)
