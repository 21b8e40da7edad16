"""A save_pretrained directory's safetensors are outside input: whatever bytes a file holds,
reading the directory gives its tensors' names and shapes or one PolicyError, and a valid
header is read back exactly."""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from shoal.learner.errors import PolicyError
from shoal.learner.models import lm_files
from shoal.learner.models.lm_files import LMWeights

SHAPES = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


def read(files: dict[str, bytes]) -> dict[str, tuple[int, ...]] | None:
    """The tensors' shapes when the directory holding `files` is accepted, else None."""
    with tempfile.TemporaryDirectory(prefix="shoal-lm-files-") as name:
        directory = Path(name)
        for file, content in files.items():
            (directory / file).write_bytes(content)
        try:
            weights = LMWeights(directory)
        except PolicyError:
            return None
        return {tensor: shape for tensor, (_, shape) in weights.tensors.items()}


def header(entries: dict[str, object]) -> bytes:
    text = json.dumps(entries).encode()
    return struct.pack("<Q", len(text)) + text


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=256))
def test_any_bytes_are_a_file_of_tensors_or_one_policy_error(content: bytes) -> None:
    read({"model.safetensors": content})


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.text(min_size=1, max_size=8),
        st.fixed_dictionaries(
            {"dtype": st.sampled_from(["F32", "BF16", "I64", "U8", "XX", 3]),
             "shape": SHAPES | st.just([-1]) | st.just("2"),
             "data_offsets": st.lists(st.integers(-2, 64), min_size=2, max_size=2)}
        ),
        max_size=4,
    )
)  # fmt: skip
def test_a_header_is_accepted_only_with_float_tensors_whose_bytes_are_there(
    entries: dict[str, dict[str, object]],
) -> None:
    body = bytes(256)
    shapes = read({"model.safetensors": header(entries) + body})
    if shapes is None:
        return
    assert shapes.keys() == entries.keys()
    for name, shape in shapes.items():
        assert entries[name]["dtype"] in ("F32", "BF16")
        assert list(shape) == entries[name]["shape"]


@settings(max_examples=50, deadline=None)
@given(st.dictionaries(st.sampled_from(["a", "b", "c.d"]), SHAPES, min_size=1))
def test_tensors_saved_by_safetensors_are_read_back_by_name_and_shape(
    shapes: dict[str, tuple[int, ...]],
) -> None:
    with tempfile.TemporaryDirectory() as name:
        save_file({k: torch.zeros(v) for k, v in shapes.items()}, f"{name}/x.safetensors")
        weights = LMWeights(Path(name))
        assert {k: s for k, (_, s) in weights.tensors.items()} == shapes


def test_a_directory_of_too_many_files_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lm_files, "MAX_FILES", 2)
    for index in range(3):
        save_file({f"t{index}": torch.zeros(1)}, str(tmp_path / f"m{index}.safetensors"))
    with pytest.raises(PolicyError, match=r"holds 3 \.safetensors files, over 2"):
        LMWeights(tmp_path)
