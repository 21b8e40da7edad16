"""The weights of a `save_pretrained` directory, read one tensor at a time, so a rank that builds
a causal LM unit by unit (learner/materialize.py) never holds more of the file than one unit.

The directory is outside input: only safetensors are read (a pickled `.bin` can run code), the
shard index is bounded in size and checked in shape before it is trusted, every file it names
must be a plain name inside the directory, and every tensor is checked against the parameter
it fills (its name, its shape, a floating-point dtype) before it is copied, each with a
`PolicyError` that names the file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from shoal.learner.errors import PolicyError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_INDEX_BYTES = 16 * 2**20
"""A shard index maps tensor names to file names: a 100B model's has a few thousand entries
(well under 1 MiB); 16 MiB bounds what a hostile one makes shoal parse."""
MAX_NAME_CHARS = 512


class LMWeights:
    """Tensor name -> the safetensors file in `directory` that holds it."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        index = directory / INDEX_FILE
        if index.is_file():
            self.files = _from_index(index)
        elif (directory / SINGLE_FILE).is_file():
            single = directory / SINGLE_FILE
            self.files = dict.fromkeys(_keys(single), single)
        else:
            raise PolicyError(
                f"{str(directory)!r} has no {SINGLE_FILE} or {INDEX_FILE}: shoal loads an LM's "
                "weights from safetensors only (save it with save_pretrained(..., "
                "safe_serialization=True))"
            )

    def check_names(self, expected: set[str]) -> None:
        """Refuse files that lack a parameter of the LM or hold tensors it has no place for
        (another architecture or size): nothing is left at a random value or silently dropped."""
        missing, extra = sorted(expected - self.files.keys()), sorted(self.files.keys() - expected)
        if missing or extra:
            raise PolicyError(
                f"the weights in {str(self.directory)!r} do not fit the LM its config.json "
                f"describes: missing {_few(missing)}, unexpected {_few(extra)}"
            )

    def read(self, name: str, shape: torch.Size) -> torch.Tensor:
        """Tensor `name` as float32, checked to have `shape`."""
        from safetensors import SafetensorError, safe_open

        path = self.files[name]
        try:
            with safe_open(str(path), framework="pt") as handle:
                tensor = handle.get_tensor(name)
        except (OSError, SafetensorError) as exc:
            raise PolicyError(f"cannot read {name!r} from {str(path)!r}: {exc}") from exc
        if tensor.shape != shape or not tensor.is_floating_point():
            raise PolicyError(
                f"{name!r} in {str(path)!r} is {tensor.dtype} {list(tensor.shape)}; the LM "
                f"needs a floating-point tensor of shape {list(shape)}"
            )
        return tensor.float()


def _from_index(index: Path) -> dict[str, Path]:
    if index.stat().st_size > MAX_INDEX_BYTES:
        raise PolicyError(f"{str(index)!r} is over {MAX_INDEX_BYTES // 2**20} MiB: not an index")
    try:
        data = json.loads(index.read_bytes())
    except (ValueError, RecursionError) as exc:
        raise PolicyError(f"{str(index)!r} is not JSON: {exc}") from exc
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, Mapping):
        raise PolicyError(f"{str(index)!r} has no weight_map object of tensor name -> file")
    files: dict[str, Path] = {}
    for name, file in weight_map.items():
        if not isinstance(file, str) or not _plain_file_name(file) or len(name) > MAX_NAME_CHARS:
            raise PolicyError(
                f"{str(index)!r} maps {name[:60]!r} to {str(file)[:60]!r}: every entry must "
                "name a .safetensors file in the same directory"
            )
        files[name] = index.parent / file
    for path in set(files.values()):
        if not path.is_file():
            raise PolicyError(f"{str(index)!r} names {path.name!r}, which is not in the directory")
    return files


def _plain_file_name(file: str) -> bool:
    return file.endswith(".safetensors") and Path(file).name == file and file not in (".", "..")


def _keys(path: Path) -> list[str]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            return list(handle.keys())
    except (OSError, SafetensorError) as exc:
        raise PolicyError(f"cannot read the safetensors header of {str(path)!r}: {exc}") from exc


def _few(names: list[str]) -> str:
    if not names:
        return "none"
    shown = ", ".join(repr(n[:80]) for n in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")
