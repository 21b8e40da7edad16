"""The shard index of a save_pretrained directory is outside input: whatever bytes it holds,
reading it gives a mapping into the directory's own .safetensors files or one PolicyError."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from shoal.learner.errors import PolicyError
from shoal.learner.models.lm_files import INDEX_FILE, LMWeights

NAMES = st.sampled_from(["a.safetensors", "b.safetensors", "../a.safetensors", "/a.safetensors",
                         "a.bin", "", ".", "sub/a.safetensors", "missing.safetensors"])  # fmt: skip
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8) | NAMES,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def read(content: bytes) -> dict[str, Path] | None:
    """The index's mapping (file names only) when `content` is accepted, else None."""
    with tempfile.TemporaryDirectory(prefix="shoal-lm-files-") as name:
        directory = Path(name)
        save_file({"w": torch.zeros(2)}, str(directory / "a.safetensors"))
        (directory / INDEX_FILE).write_bytes(content)
        try:
            weights = LMWeights(directory)
        except PolicyError:
            return None
        assert all(path.parent == directory and path.is_file() for path in weights.files.values())
        return {tensor: Path(path.name) for tensor, path in weights.files.items()}


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=256))
def test_any_bytes_are_an_index_or_one_policy_error(content: bytes) -> None:
    read(content)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.text(max_size=12), NAMES | JSON, max_size=5), st.booleans())
def test_a_weight_map_is_accepted_only_when_every_entry_is_a_file_of_the_directory(
    weight_map: dict[str, object], wrapped: bool
) -> None:
    document = {"weight_map": weight_map} if wrapped else weight_map
    files = read(json.dumps(document).encode())
    if files is None:
        return
    assert wrapped
    assert files == {tensor: Path("a.safetensors") for tensor in weight_map}
