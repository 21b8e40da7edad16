"""The byte tokenizer's round trip and a local Hugging Face tokenizer directory, never downloaded."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.envs.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    TokenizerError,
    TokenizerNotFound,
    load_tokenizer,
)

BYTES = ByteTokenizer()


@given(st.text())
def test_bytes_decode_inverts_encode_for_any_text(text):
    ids = BYTES.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert BYTES.decode(ids) == text


@given(st.lists(st.one_of(st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=3))))
def test_bytes_decode_never_raises_on_any_ids(ids):
    assert isinstance(BYTES.decode(ids), str)


def test_bytes_decode_drops_special_ids_and_replaces_what_is_not_a_byte():
    hello = BYTES.encode("hi")
    assert BYTES.decode([BYTES.bos_id, *hello, BYTES.eos_id, BYTES.pad_id]) == "hi"
    assert BYTES.decode([*hello, 9999, -1]) == "hi\ufffd\ufffd"
    assert BYTES.decode([0xE2, 0x82]) == "\ufffd"  # a multi-byte character cut short


def test_bytes_encodes_a_lone_surrogate_as_the_replacement_character():
    assert BYTES.decode(BYTES.encode("a\ud800b")) == "a\ufffdb"


def test_byte_tokenizer_shape_and_fingerprint_are_fixed():
    assert (BYTES.vocab_size, BYTES.pad_id, BYTES.bos_id, BYTES.eos_id) == (259, 256, 257, 258)
    assert isinstance(BYTES, Tokenizer)
    assert load_tokenizer("bytes").fingerprint() == BYTES.fingerprint()
    assert len(BYTES.fingerprint()) == 64


def test_a_missing_directory_is_a_specific_error_that_names_the_fix(tmp_path):
    with pytest.raises(TokenizerNotFound, match="never downloads"):
        load_tokenizer(str(tmp_path / "absent"))
    with pytest.raises(TokenizerNotFound, match="never downloads"):
        load_tokenizer("Qwen/Qwen2-0.5B")  # a hub id is not fetched
    with pytest.raises(TokenizerNotFound):
        load_tokenizer("")


def test_an_empty_directory_says_what_file_it_needs(tmp_path):
    with pytest.raises(TokenizerError, match="save_pretrained"):
        load_tokenizer(str(tmp_path))


def _save_word_tokenizer(directory, with_config=True):
    """A tiny word-level tokenizer built here with `tokenizers` (nothing downloaded)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, "def": 3, "f": 4, "return": 5, "x": 6, "+": 7}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if not with_config:
        raw.save(str(directory / "tokenizer.json"))
        return
    fast = PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.save_pretrained(str(directory))


def test_a_local_hugging_face_tokenizer_loads_behind_the_protocol(tmp_path):
    _save_word_tokenizer(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizer)
    assert isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.pad_id, tok.eos_id, tok.bos_id) == (8, 0, 1, 1)
    ids = tok.encode("return x + x")
    assert ids == [5, 6, 7, 6]
    assert tok.decode([*ids, tok.eos_id]).split() == ["return", "x", "+", "x"]
    assert tok.decode([5, 99, -3]).count("\ufffd") == 2
    assert tok.fingerprint() != BYTES.fingerprint()
    assert load_tokenizer(str(tmp_path)).fingerprint() == tok.fingerprint()


def test_a_tokenizer_json_without_an_eos_token_is_refused(tmp_path):
    _save_word_tokenizer(tmp_path, with_config=False)
    with pytest.raises(TokenizerError, match="no EOS token"):
        load_tokenizer(str(tmp_path))
