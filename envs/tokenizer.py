"""Tokenizers for text environments: bytes that need nothing, or one saved in a local directory.

`load_tokenizer("bytes")` is the 259-id byte tokenizer (UTF-8 bytes 0..255, then PAD, BOS, EOS);
any other spec must be a local directory holding a Hugging Face tokenizer (`tokenizer.json`,
optionally with `tokenizer_config.json` for its special tokens). shoal reads those two files
itself, bounded in size, and builds the tokenizer from them: nothing is downloaded, no code from
the directory runs (a config with `auto_map` is refused) and a bad file is one `TokenizerError`
naming it.
`decode` never raises: an id that is not a byte (a special id is dropped, an unknown one becomes
U+FFFD) and bytes that are not UTF-8 turn into U+FFFD. `fingerprint()` is the sha256 of what
defines the tokenizer, so an environment or stage hash changes whenever the tokenizer does.
"""

from __future__ import annotations

import hashlib
import json
import re
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from shoal.envs.errors import EnvError
from shoal.errors import ConfigError
from shoal.files import READ_FIXES, FileMissing, UnreadableFile, read_limited

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
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
MAX_TOKENIZER_BYTES = 64 << 20
"""Largest tokenizer.json read. Qwen2's (151,646 tokens and their merges) is about 7 MiB, so
real tokenizers with vocabularies several times larger fit; a hostile file at the bound still
loads in about 20 s and 1.7 GiB (measured with a 3.3M-token WordLevel vocabulary)."""
MAX_CONFIG_BYTES = 4 << 20
"""Largest tokenizer_config.json read: Qwen2's, chat template included, is about 7 KiB."""
SPECIAL_KEYS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip
"""The tokenizer_config.json keys read; the others do not change how text is encoded."""
_RESAVE = "save the tokenizer again with tokenizer.save_pretrained(DIR)"
VOCAB_LIMITS = (2, 1 << 22)
"""The vocabulary sizes a tokenizer may have: the bounds of a causal LM's `model.vocab_size`
too (learner/models/config.py takes them from here)."""


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
        with _rust_errors(
            f"the tokenizer in {self.directory} failed on a text; a regular expression in its "
            f"{TOKENIZER_FILE} may backtrack too much (simplify it)"
        ):
            ids = self._hf.encode(text, add_special_tokens=False)
        return list(ids)

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
        """The run's text, or U+FFFD where the Rust decoder fails (decode never raises)."""
        try:
            return str(self._hf.decode(run, skip_special_tokens=True)) if run else ""
        except BaseException as exc:
            if not _is_rust_failure(exc):
                raise
            return REPLACEMENT

    def fingerprint(self) -> str:
        return self._fingerprint

    def __repr__(self) -> str:
        return f"<HFTokenizer {self.directory} vocab={self.vocab_size}>"


def _load_hf(directory: Path) -> Any:
    """The directory's tokenizer.json wrapped with the special tokens its tokenizer_config.json
    names. Only these two files are opened, by shoal itself, so nothing in the directory (an
    `auto_map`, a `.py` file, a `tokenizer_file` pointing elsewhere) can run code, reach the
    network or make transformers prompt; transformers only wraps the object built here."""
    config = _read_config(directory / CONFIG_FILE)
    backend = _read_backend(directory / TOKENIZER_FILE)
    from transformers import PreTrainedTokenizerFast

    with _rust_errors(f"cannot load the tokenizer in {directory}"):
        hf = PreTrainedTokenizerFast(
            tokenizer_object=backend, **_special_tokens(directory / CONFIG_FILE, config)
        )
    _check_vocab(directory / TOKENIZER_FILE, len(hf))
    return hf


def _read_config(path: Path) -> dict[str, Any]:
    """tokenizer_config.json as a dict ({} when there is none); one asking for code is refused."""
    data = _read_bounded(path, MAX_CONFIG_BYTES)
    if data is None:
        return {}
    try:
        config = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise TokenizerError(f"{path} is not valid JSON ({exc}): {_RESAVE}") from exc
    if not isinstance(config, dict):
        raise TokenizerError(
            f"{path} holds a JSON {type(config).__name__}, not an object: {_RESAVE}"
        )
    if "auto_map" in config:
        raise TokenizerError(
            f"{path} sets auto_map, which asks to run Python code from the tokenizer directory; "
            "shoal never runs it: remove auto_map and keep a tokenizer.json that a plain fast "
            "tokenizer reads"
        )
    return config


def _special_tokens(path: Path, config: dict[str, Any]) -> dict[str, str | None]:
    """The special tokens the config names, each as its text: a str, an AddedToken's JSON
    ({"content": ...}) or null; any other key of the config does not change encoding."""
    tokens: dict[str, str | None] = {}
    for key in SPECIAL_KEYS:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if value is not None and not (isinstance(value, str) and 0 < len(value) <= 1024):
            raise TokenizerError(
                f"{path}: {key} must be a token's text (1 to 1024 characters), an "
                f'object with such a "content", or null; got {_preview(value)}'
            )
        if key in config:
            tokens[key] = value
    return tokens


def _read_backend(path: Path) -> Any:
    """tokenizer.json as a `tokenizers.Tokenizer`, its size and vocabulary bounded."""
    data = _read_bounded(path, MAX_TOKENIZER_BYTES)
    if data is None:
        raise TokenizerError(
            f"{path.parent} holds no {path.name}: save the tokenizer there with "
            "tokenizer.save_pretrained(DIR) (shoal reads a fast tokenizer's tokenizer.json, "
            "not vocab files or a tokenizer.model)"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TokenizerError(f"{path} is not UTF-8 text: {_RESAVE}") from exc
    from tokenizers import Tokenizer as RustTokenizer

    with _rust_errors(f"{path} is not a tokenizer the tokenizers library reads"):
        backend = RustTokenizer.from_str(text)
    _check_vocab(path, backend.get_vocab_size(with_added_tokens=True))
    return backend


def _check_vocab(path: Path, size: int) -> None:
    """Refuse a vocabulary no causal-LM policy could be built for, here, where the message can
    name the file, rather than later as an invalid model.vocab_size the user never set."""
    low, high = VOCAB_LIMITS
    if not low <= size <= high:
        raise TokenizerError(
            f"{path} defines {size} tokens, but a policy's vocabulary must have {low} to {high}: "
            "use a tokenizer with a vocabulary in that range"
        )


def _read_bounded(path: Path, limit: int) -> bytes | None:
    """The bytes of a regular file of at most `limit` bytes (`read_limited`: never a FIFO or a
    device, never more than the bound), or None when there is none."""
    try:
        return read_limited(path, limit)
    except FileMissing:
        return None
    except UnreadableFile as exc:
        raise TokenizerError(f"{exc}: {_RESAVE}") from None


@contextmanager
def _rust_errors(what: str) -> Iterator[None]:
    """Turn what the tokenizers library raises into one TokenizerError starting with `what`."""
    try:
        yield
    except TokenizerError:
        raise
    except BaseException as exc:
        if not _is_rust_failure(exc):
            raise
        raise TokenizerError(f"{what}: {_preview(str(exc))}") from exc


def _is_rust_failure(exc: BaseException) -> bool:
    """True for a failure of the tokenizers library's Rust code: it raises a bare Exception, or a
    pyo3 PanicException (a BaseException, so `except Exception` misses it: a regex over its
    backtracking limit panics), whose class no module exports; KeyboardInterrupt is not one."""
    return isinstance(exc, Exception) or type(exc).__name__ == "PanicException"


def _preview(value: Any) -> str:
    """`value` for a message, cut short: a hostile file or path may be megabytes long."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= 200 else f"{text[:200]}..."


def _hf_fingerprint(hf: Any, pad: int, bos: int, eos: int) -> str:
    """The backend's whole serialization (model, normalizer, pre-tokenizer, decoder) and the ids
    shoal uses, so any change to how text is tokenized changes the hash."""
    digest = hashlib.sha256(hf.backend_tokenizer.to_str().encode())
    digest.update(json.dumps({"pad": pad, "bos": bos, "eos": eos, "n": len(hf)}).encode())
    return digest.hexdigest()


def load_tokenizer(spec: str) -> Tokenizer:
    """ "bytes", or the path of a local directory holding a Hugging Face tokenizer."""
    if not isinstance(spec, str) or not spec:
        raise TokenizerNotFound(f"tokenizer {spec!r}: use 'bytes' or a local directory")
    if spec == BYTES:
        return ByteTokenizer()
    return HFTokenizer(_directory(spec))


def _directory(spec: str) -> Path:
    """The existing local directory `spec` names; an error that names the tokenizer setting when
    it is none (a hub id is not fetched) or cannot be read."""
    try:
        directory = Path(spec).expanduser()
        is_dir = stat.S_ISDIR(directory.stat().st_mode)
    except (FileNotFoundError, NotADirectoryError, RuntimeError, ValueError):
        is_dir = False  # RuntimeError: an unknown ~user; ValueError: a NUL byte
    except OSError as exc:
        fix = READ_FIXES.get(exc.errno or 0, "check the path")
        raise TokenizerError(
            f"the tokenizer setting {_preview(spec)!r} cannot be read: {exc.strerror}; {fix}"
        ) from exc
    if not is_dir:
        raise TokenizerNotFound(
            f"tokenizer {_preview(spec)!r} is neither 'bytes' nor a local directory; shoal never "
            "downloads tokenizers: save one with tokenizer.save_pretrained(DIR) and pass DIR"
        )
    return directory
