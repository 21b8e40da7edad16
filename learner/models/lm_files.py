"""The weights of a `save_pretrained` directory, checked from the safetensors headers alone, then
read by torch.distributed.checkpoint's `HuggingFaceStorageReader` into the LM as it is held: a
sharded rank reads only its own rows of each tensor, not the model.

The directory is outside input. Only safetensors are read (a pickled `.bin` can run code), at
most MAX_FILES of them; each header is parsed by the safetensors library, which bounds it; a
tensor name may appear in one file only; a file carrying DCP's own sharding metadata is refused
(the reader would trust offsets in it); and every tensor must match a parameter of the LM by
name and shape, with a floating-point dtype, before a byte of data is read. Each refusal is a
`PolicyError` naming the file.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from shoal.learner.errors import PolicyError

SUFFIX = ".safetensors"
MAX_FILES = 4096
"""A 100B-parameter model ships as tens of files; a directory of more is not a model."""
DCP_METADATA_KEY = "DCP_SHARDING_INFO"
"""What DCP's HuggingFaceStorageWriter writes into a sharded save's headers."""
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})


class LMWeights:
    """Every tensor of the directory's safetensors files: name -> (file, shape)."""

    def __init__(self, directory: Path, aside: frozenset[str] = frozenset()) -> None:
        """`aside`: file names that hold no LM tensors (the value head's); their headers are
        checked all the same, since the reader parses every safetensors file it finds."""
        self.directory = directory
        files = sorted(p for p in directory.iterdir() if p.name.endswith(SUFFIX) and p.is_file())
        if all(file.name in aside for file in files):
            raise PolicyError(
                f"{str(directory)!r} has no {SUFFIX} file: shoal loads an LM's weights from "
                "safetensors only (save it with save_pretrained(..., safe_serialization=True))"
            )
        if len(files) > MAX_FILES:
            raise PolicyError(
                f"{str(directory)!r} holds {len(files)} {SUFFIX} files, over {MAX_FILES}"
            )
        self.tensors: dict[str, tuple[Path, tuple[int, ...]]] = {}
        for file in files:
            tensors = _header(file)
            if file.name in aside:
                continue
            for name, shape in tensors.items():
                if name in self.tensors:
                    raise PolicyError(
                        f"{name[:80]!r} is in both {self.tensors[name][0].name!r} and "
                        f"{file.name!r} in {str(directory)!r}: keep one copy"
                    )
                self.tensors[name] = (file, shape)

    def check(self, lm: nn.Module) -> None:
        """Refuse files that lack a parameter of `lm`, hold tensors it has no place for, or
        hold one of another shape (another architecture or size): nothing is left at a random
        value or silently dropped."""
        expected = {name: tuple(p.shape) for name, p in lm.named_parameters()}
        missing = sorted(expected.keys() - self.tensors.keys())
        extra = sorted(self.tensors.keys() - expected.keys())
        if missing or extra:
            raise PolicyError(
                f"the weights in {str(self.directory)!r} do not fit the LM its config.json "
                f"describes: missing {_few(missing)}, unexpected {_few(extra)}"
            )
        for name, shape in expected.items():
            file, found = self.tensors[name]
            if found != shape:
                raise PolicyError(
                    f"{name!r} in {str(file)!r} has shape {list(found)}; the LM its config.json "
                    f"describes needs {list(shape)}"
                )

    def load_into(self, lm: nn.Module) -> None:
        """Copy the files into `lm`'s parameters where they are held (each rank of a sharded LM
        reads its own rows; a collective when the LM is sharded or replicated)."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        state = {name: param.detach() for name, param in lm.named_parameters()}
        reader = dcp.HuggingFaceStorageReader(str(self.directory))
        try:
            dcp.load(state, storage_reader=reader, no_dist=not dist.is_initialized())
        except (CheckpointException, OSError, RuntimeError, ValueError) as exc:
            raise PolicyError(
                f"cannot read the LM's weights from {str(self.directory)!r}: {exc}"
            ) from exc


def _header(file: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from `file`'s header (checked: float dtypes, no DCP offsets)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            if DCP_METADATA_KEY in (handle.metadata() or {}):
                raise PolicyError(
                    f"{str(file)!r} is one shard of a DCP HuggingFace save ({DCP_METADATA_KEY} in "
                    "its header): consolidate it into whole tensors first"
                )
            tensors = {}
            for name in handle.keys():  # noqa: SIM118 - a safe_open handle is no dict
                part = handle.get_slice(name)
                if part.get_dtype() not in FLOAT_DTYPES:
                    raise PolicyError(
                        f"{name[:80]!r} in {str(file)!r} is {part.get_dtype()}: an LM's weights "
                        f"are floating point ({', '.join(sorted(FLOAT_DTYPES))})"
                    )
                tensors[name] = tuple(int(d) for d in part.get_shape())
            return tensors
    except (OSError, SafetensorError) as exc:
        raise PolicyError(f"cannot read the safetensors header of {str(file)!r}: {exc}") from exc


def _few(names: list[str]) -> str:
    if not names:
        return "none"
    shown = ", ".join(repr(n[:80]) for n in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")
