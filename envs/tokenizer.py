"""Tokenizers for text environments: bytes that need nothing, or one saved in a local directory.

`load_tokenizer("bytes")` is the 259-id byte tokenizer (UTF-8 bytes 0..255, then PAD, BOS, EOS);
any other spec must be a local directory holding a Hugging Face tokenizer (`tokenizer.json`,
optionally with `tokenizer_config.json`), read with `local_files_only` — shoal never downloads.
`decode` never raises: an id that is not a byte (a special id is dropped, an unknown one becomes
U+FFFD) and bytes that are not UTF-8 turn into U+FFFD. `fingerprint()` is the sha256 of what
defines the tokenizer, so an environment or stage hash changes whenever the tokenizer does.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from shoal.envs.errors import EnvError
from shoal.errors import ConfigError

__all__ = [
    "BYTES",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "TokenizerError",
    "TokenizerNotFound",
    "load_tokenizer",
]

BYTES = "bytes"
REPLACEMENT = "\ufffd"
_REPLACEMENT_BYTES = REPLACEMENT.encode()
_SURROGATE = re.compile("[\ud800-\udfff]")


class TokenizerError(EnvError, ConfigError):
    """A tokenizer directory that cannot be used; the message says what is missing."""


class TokenizerNotFound(TokenizerError):
    """The spec is neither "bytes" nor an existing local directory (shoal never downloads)."""


@runtime_checkable
class Tokenizer(Protocol):
    """What text environments, generation and the pipeline need of a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def bos_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[Any]) -> str: ...

    def fingerprint(self) -> str: ...


def _as_id(value: Any) -> int | None:
    """`value` as a Python int, or None when it is not an integer at all."""
    if isinstance(value, bool):
        return None
    try:
        as_int = int(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return as_int if as_int == value else None


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then PAD=256, BOS=257, EOS=258: a vocabulary of 259.

    Lossless for every str that is valid Unicode: `decode(encode(s)) == s`. A lone surrogate
    (not encodable as UTF-8) is encoded as U+FFFD."""

    vocab_size = 259
    pad_id = 256
    bos_id = 257
    eos_id = 258

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"encode takes a str, got {type(text).__name__}")
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:
            data = _SURROGATE.sub(REPLACEMENT, text).encode("utf-8")
        return list(data)

    def decode(self, ids: Iterable[Any]) -> str:
        out = bytearray()
        for value in ids:
            token = _as_id(value)
            if token is not None and 0 <= token < 256:
                out.append(token)
            elif token not in (self.pad_id, self.bos_id, self.eos_id):
                out += _REPLACEMENT_BYTES
        return out.decode("utf-8", "replace")

    def fingerprint(self) -> str:
        spec = {"kind": BYTES, "vocab": self.vocab_size, "special": [256, 257, 258]}
        return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()

    def __repr__(self) -> str:
        return "<ByteTokenizer vocab=259>"


class HFTokenizer:
    """A Hugging Face fast tokenizer read from a local directory, behind the `Tokenizer` protocol.

    It must define an EOS token (generation stops on it); PAD falls back to EOS and BOS to EOS
    where the directory defines none, as most causal-LM tokenizers do."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._hf = _load_hf(directory)
        eos = self._hf.eos_token_id
        if eos is None:
            raise TokenizerError(
                f"the tokenizer in {directory} defines no EOS token: set eos_token in its "
                "tokenizer_config.json (generation needs one to stop)"
            )
        self.eos_id = int(eos)
        self.pad_id = int(self._hf.pad_token_id if self._hf.pad_token_id is not None else eos)
        self.bos_id = int(self._hf.bos_token_id if self._hf.bos_token_id is not None else eos)
        self.vocab_size = len(self._hf)
        self._special = set(self._hf.all_special_ids)
        self._fingerprint = _hf_fingerprint(self._hf, self.pad_id, self.bos_id, self.eos_id)

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"encode takes a str, got {type(text).__name__}")
        return list(self._hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Iterable[Any]) -> str:
        pieces: list[str] = []
        run: list[int] = []
        for value in ids:
            token = _as_id(value)
            if token is not None and 0 <= token < self.vocab_size:
                if token not in self._special:
                    run.append(token)
                continue
            pieces.append(self._decode_run(run))
            pieces.append(REPLACEMENT)
            run = []
        pieces.append(self._decode_run(run))
        return "".join(pieces)

    def _decode_run(self, run: list[int]) -> str:
        return str(self._hf.decode(run, skip_special_tokens=True)) if run else ""

    def fingerprint(self) -> str:
        return self._fingerprint

    def __repr__(self) -> str:
        return f"<HFTokenizer {self.directory} vocab={self.vocab_size}>"


def _load_hf(directory: Path) -> Any:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    has_config = (directory / "tokenizer_config.json").is_file()
    if not has_config and not (directory / "tokenizer.json").is_file():
        raise TokenizerError(
            f"{directory} holds no tokenizer.json or tokenizer_config.json: save one there with "
            "tokenizer.save_pretrained(DIR)"
        )
    try:
        if has_config:
            return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        return PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
    except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"cannot load the tokenizer in {directory}: {exc}") from exc


def _hf_fingerprint(hf: Any, pad: int, bos: int, eos: int) -> str:
    backend = getattr(hf, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(hf.get_vocab(), sort_keys=True)
    digest = hashlib.sha256(body.encode())
    digest.update(json.dumps({"pad": pad, "bos": bos, "eos": eos, "n": len(hf)}).encode())
    return digest.hexdigest()


def load_tokenizer(spec: str) -> Tokenizer:
    """ "bytes", or the path of a local directory holding a Hugging Face tokenizer."""
    if not isinstance(spec, str) or not spec:
        raise TokenizerNotFound(f"tokenizer {spec!r}: use 'bytes' or a local directory")
    if spec == BYTES:
        return ByteTokenizer()
    directory = Path(spec).expanduser()
    if not directory.is_dir():
        raise TokenizerNotFound(
            f"tokenizer {spec!r} is neither 'bytes' nor a local directory; shoal never downloads "
            "tokenizers: save one with tokenizer.save_pretrained(DIR) and pass DIR"
        )
    return HFTokenizer(directory)
