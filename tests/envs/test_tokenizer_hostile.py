"""A hostile tokenizer directory: every bad file is one TokenizerError naming it, nothing in the
directory runs, nothing prompts or reaches the network, nothing hangs or reads without bound."""

from __future__ import annotations

import errno
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from shoal.envs.tokenizer import (
    MAX_CONFIG_BYTES,
    MAX_TOKENIZER_BYTES,
    HFTokenizer,
    TokenizerError,
    TokenizerNotFound,
    load_tokenizer,
)
from tests.support.strategies import json_values

VOCAB = {"<pad>": 0, "<eos>": 1, "<unk>": 2, "def": 3, "x": 4, "a": 5}
CONFIG = {"eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}
EVIL_CODE = (
    "from pathlib import Path\n"
    "Path(__file__).with_name('MARKER').write_text('ran')\n"
    "from transformers import PreTrainedTokenizerFast\n"
    "class EvilTok(PreTrainedTokenizerFast):\n"
    "    pass\n"
)
HYPOTHESIS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)  # each example rewrites the same file in tmp_path


def _tokenizer_json(vocab: dict[str, int] = VOCAB, pre_tokenizer: Any = None) -> dict[str, Any]:
    """A WordLevel tokenizer.json written by hand: nothing is trained or downloaded."""
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": pre_tokenizer or {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }


def _write(directory: Path, tokenizer: Any = None, config: Any = CONFIG) -> Path:
    """A tokenizer directory: a value is written as JSON, bytes as they are, None not at all."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, value in (
        ("tokenizer.json", _tokenizer_json() if tokenizer is None else tokenizer),
        ("tokenizer_config.json", config),
    ):
        if value is None:
            continue
        data = value if isinstance(value, bytes) else json.dumps(value).encode()
        (directory / name).write_bytes(data)
    return directory


def test_a_clean_directory_loads(tmp_path):
    tok = load_tokenizer(str(_write(tmp_path)))
    assert (tok.vocab_size, tok.eos_id, tok.pad_id) == (6, 1, 0)
    assert tok.encode("def x") == [3, 4]


# --- code in the directory never runs, nothing prompts, nothing goes online -----------------


@pytest.mark.parametrize(
    "auto_map",
    [
        {"AutoTokenizer": [None, "tokenization_evil.EvilTok"]},
        {"AutoTokenizer": ["tokenization_evil.EvilTok", "tokenization_evil.EvilTok"]},
        {"AutoTokenizer": [None, "someorg/somerepo--tokenization_evil.EvilTok"]},
        "anything",
    ],
)
def test_a_config_asking_for_custom_code_is_refused_and_never_runs(
    tmp_path, monkeypatch, capsys, auto_map
):
    directory = _write(tmp_path / "tok", config={**CONFIG, "auto_map": auto_map})
    (directory / "tokenization_evil.py").write_text(EVIL_CODE)
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n" * 10))  # a prompt would be answered yes
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json sets auto_map"):
        load_tokenizer(str(directory))
    assert not (directory / "MARKER").exists()
    assert "custom code" not in capsys.readouterr().out
    assert sys.stdin.read() == "y\n" * 10  # nothing was asked


def test_a_model_config_json_with_auto_map_is_never_read(tmp_path, monkeypatch, capsys):
    directory = _write(tmp_path / "tok")
    (directory / "config.json").write_text(
        json.dumps(
            {
                "model_type": "evil",
                "auto_map": {"AutoTokenizer": [None, "tokenization_evil.EvilTok"]},
            }
        )
    )
    (directory / "tokenization_evil.py").write_text(EVIL_CODE)
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))
    tok = load_tokenizer(str(directory))
    assert tok.encode("def x") == [3, 4]
    assert not (directory / "MARKER").exists()
    assert "custom code" not in capsys.readouterr().out


def test_tokenizer_file_in_the_config_never_points_outside_the_directory(tmp_path):
    plain = load_tokenizer(str(_write(tmp_path / "plain")))
    elsewhere = _write(tmp_path / "elsewhere", config={**CONFIG, "tokenizer_file": "/etc/passwd"})
    assert load_tokenizer(str(elsewhere)).fingerprint() == plain.fingerprint()
    (elsewhere / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match=r"holds no tokenizer\.json"):
        load_tokenizer(str(elsewhere))


# --- malformed files: one error naming the file ------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        b'{"version": "1.0", "model": ',
        b"[" * 100_000,
        b"{" * 100_000,
        b"[1, 2, 3]",
        b"",
        b"\xff\xfe not utf-8",
        b'{"version": "1.0", "model": {"type": "NoSuchModel"}}',
    ],
)
def test_a_malformed_tokenizer_json_names_the_file(tmp_path, data):
    directory = _write(tmp_path, tokenizer=data)
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        load_tokenizer(str(directory))


@pytest.mark.parametrize(
    ("config", "why"),
    [
        (b"[1,2,3]", "not an object"),
        (b'{"a":' + b"[" * 100_000, "not valid JSON"),
        (b'{"eos_token": ', "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b'{"eos_token": 5}', "eos_token must be"),
        (b'{"eos_token": {"content": ["<eos>"]}}', "eos_token must be"),
        (b'{"pad_token": ""}', "pad_token must be"),
        (b'{"eos_token": "' + b"e" * 5000 + b'"}', "eos_token must be"),
    ],
)
def test_a_malformed_tokenizer_config_names_the_file_and_key(tmp_path, config, why):
    directory = _write(tmp_path, config=config)
    with pytest.raises(TokenizerError, match=rf"tokenizer_config\.json.*{why}"):
        load_tokenizer(str(directory))


def test_an_added_token_object_names_a_special_token(tmp_path):
    config = {"eos_token": {"content": "<eos>", "special": True, "__type": "AddedToken"}}
    assert load_tokenizer(str(_write(tmp_path, config=config))).eos_id == 1


@HYPOTHESIS
@given(st.binary(max_size=300))
def test_any_bytes_as_tokenizer_json_are_one_error(tmp_path, data):
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        load_tokenizer(str(_write(tmp_path, tokenizer=data)))


@HYPOTHESIS
@given(st.binary(max_size=300))
def test_any_bytes_as_tokenizer_config_load_or_are_one_error(tmp_path, data):
    _loads_or_names(_write(tmp_path, config=data), "tokenizer_config.json")


JSON = json_values(max_text=8, max_leaves=12)
SPECIAL = st.sampled_from(
    ["bos_token", "eos_token", "unk_token", "pad_token", "mask_token", "auto_map"]
)


@HYPOTHESIS
@given(
    JSON
    | st.dictionaries(
        SPECIAL, JSON | st.text(max_size=6) | st.sampled_from(list(VOCAB)), max_size=5
    )
)
def test_any_json_config_loads_or_is_one_error(tmp_path, config):
    _loads_or_names(_write(tmp_path, config=config), "tokenizer_config.json")


def _loads_or_names(directory: Path, name: str) -> None:
    """A load either gives a working tokenizer or one TokenizerError naming `name` (or, for a
    config that names no EOS token, saying so)."""
    try:
        tok = load_tokenizer(str(directory))
    except TokenizerError as exc:
        error = str(exc)
    else:
        assert isinstance(tok, HFTokenizer)
        assert isinstance(tok.decode([*tok.encode("def x a"), tok.eos_id, 999, -1]), str)
        return
    assert name in error or "no EOS token" in error, error


# --- files that are not regular, too large, or cannot be read -----------------------------------


def test_a_fifo_a_device_or_a_directory_is_refused_without_reading(tmp_path):
    cases = {
        "fifo": lambda p: os.mkfifo(p),
        "zero": lambda p: p.symlink_to("/dev/zero"),
        "dir": Path.mkdir,
    }
    for label, make in cases.items():
        directory = _write(tmp_path / label)
        (directory / "tokenizer.json").unlink()
        make(directory / "tokenizer.json")
        with pytest.raises(TokenizerError, match=rf"{label}/tokenizer\.json is not a regular file"):
            load_tokenizer(str(directory))


def test_a_symlink_to_a_regular_file_is_followed(tmp_path):
    """The Hugging Face cache links each snapshot file to a blob outside the snapshot."""
    blob = tmp_path / "blobs" / "abc"
    blob.parent.mkdir()
    blob.write_text(json.dumps(_tokenizer_json()))
    directory = _write(tmp_path / "snapshot")
    (directory / "tokenizer.json").unlink()
    (directory / "tokenizer.json").symlink_to(blob)
    assert load_tokenizer(str(directory)).encode("x") == [4]


def test_a_symlink_loop_or_a_dangling_link_config_is_named_not_skipped(tmp_path):
    loop = _write(tmp_path / "loop", config=None)
    (loop / "tokenizer_config.json").symlink_to("tokenizer_config.json")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json.*symbolic-link loop"):
        load_tokenizer(str(loop))
    dangling = _write(tmp_path / "dangling", config=None)
    (dangling / "tokenizer_config.json").symlink_to(tmp_path / "absent.json")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json is a broken symbolic link"):
        load_tokenizer(str(dangling))


@pytest.mark.parametrize(
    ("name", "limit"),
    [("tokenizer.json", MAX_TOKENIZER_BYTES), ("tokenizer_config.json", MAX_CONFIG_BYTES)],
)
def test_a_file_over_the_bound_is_refused_before_it_is_read(tmp_path, name, limit):
    directory = _write(tmp_path)
    with open(directory / name, "r+b") as handle:
        handle.truncate(limit + 1)  # sparse: no disk space, and reading it would be refused anyway
    with pytest.raises(TokenizerError, match=rf"{name} is larger than {limit >> 20} MiB"):
        load_tokenizer(str(directory))


def test_a_vocabulary_outside_the_model_limits_is_refused_naming_the_file(tmp_path, monkeypatch):
    from shoal.envs import tokenizer
    from shoal.learner.models.config import LIMITS

    assert LIMITS["vocab_size"] == tokenizer.VOCAB_LIMITS  # one bound for tokenizers and models
    monkeypatch.setattr(tokenizer, "VOCAB_LIMITS", (2, 5))
    with pytest.raises(TokenizerError, match=r"tokenizer\.json defines 6 tokens, .* 2 to 5"):
        load_tokenizer(str(_write(tmp_path / "big")))
    single = _write(tmp_path / "single", tokenizer=_tokenizer_json({"<unk>": 0}), config={})
    with pytest.raises(TokenizerError, match=r"tokenizer\.json defines 1 tokens"):
        load_tokenizer(str(single))


def test_an_unreadable_file_says_to_grant_read_permission(tmp_path, monkeypatch):
    directory = _write(tmp_path)
    target = str(directory / "tokenizer.json")
    real_open = os.open

    def deny(path: Any, *args: Any, **kwargs: Any) -> int:
        if os.fspath(path) == target:
            raise PermissionError(errno.EACCES, "Permission denied", target)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", deny)  # as root, chmod would not deny it
    with pytest.raises(
        TokenizerError, match=r"tokenizer\.json: Permission denied; give this user read"
    ):
        load_tokenizer(str(directory))


def test_an_unusable_tokenizer_path_names_the_setting(tmp_path):
    with pytest.raises(TokenizerError, match=r"tokenizer setting .* File name too long; .*shorter"):
        load_tokenizer(str(tmp_path / ("x" * 300)))
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(TokenizerError, match=r"tokenizer setting .* symbolic-link loop"):
        load_tokenizer(str(tmp_path / "loop"))
    (tmp_path / "file.txt").write_text("")
    for spec in ("~no_such_user_here/tok", "a\0b", str(tmp_path / "file.txt" / "sub")):
        with pytest.raises(TokenizerNotFound, match="never downloads"):
            load_tokenizer(spec)


# --- a regex the engine gives up on -----------------------------------------------------------


def test_a_regex_over_its_backtracking_limit_is_one_error_not_a_panic(tmp_path):
    split = {
        "type": "Split",
        "pattern": {"Regex": "(\\S+\\s?)+[xyz]{9}"},
        "behavior": "Isolated",
        "invert": False,
    }
    tok = load_tokenizer(str(_write(tmp_path, tokenizer=_tokenizer_json(pre_tokenizer=split))))
    with pytest.raises(TokenizerError, match=r"failed on a text.*regular expression"):
        tok.encode("x" * 8 + "a" * 100)
    assert isinstance(tok.decode([3, 4, 5]), str)
