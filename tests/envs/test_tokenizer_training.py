"""The BPE the LM pipeline learns from a task suite: any text round-trips, digits stay single
tokens (held-out constants are writable), training is deterministic, bad sizes are refused."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from shoal.envs.tokenizer import TokenizerError, load_tokenizer
from shoal.envs.tokenizer_training import MIN_VOCAB, train_bpe

CORPUS = [
    f"def f(xs):\n    # return xs with {k} added to each item; f([1, 2])=[{k + 1}, {k + 2}]\n"
    f"    return [v + {k} for v in xs]\n"
    for k in range(10, 40)
]


@pytest.fixture(scope="module")
def learnt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_bpe(CORPUS, tmp_path_factory.mktemp("bpe") / "tok", 400)


def test_the_learnt_tokens_shorten_the_suite_and_digits_stay_single(learnt):
    tok = load_tokenizer(str(learnt))
    assert MIN_VOCAB < tok.vocab_size <= 400
    assert {tok.pad_id, tok.bos_id, tok.eos_id} == {0, 1, 2}
    text = CORPUS[3]
    ids = tok.encode(text)
    assert len(ids) < len(text.encode()) / 2
    pieces = [tok.decode([i]) for i in ids]
    assert all(not any(c.isdigit() for c in p) or p.strip().isdigit() for p in pieces)
    assert all(len(p.strip()) <= 1 for p in pieces if p.strip().isdigit())


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=200))
def test_any_text_round_trips_through_the_learnt_tokenizer(learnt, text):
    tok = load_tokenizer(str(learnt))
    assert tok.decode(tok.encode(text)) == text


def files_digest(directory: Path) -> str:
    return hashlib.sha256(
        b"".join(p.name.encode() + p.read_bytes() for p in sorted(directory.iterdir()))
    ).hexdigest()


def test_training_is_deterministic(tmp_path):
    first = train_bpe(CORPUS, tmp_path / "a", 400)
    second = train_bpe(CORPUS, tmp_path / "b", 400)
    assert files_digest(first) == files_digest(second)
    assert load_tokenizer(str(first)).fingerprint() == load_tokenizer(str(second)).fingerprint()


@pytest.mark.parametrize("size", [0, MIN_VOCAB - 1, True, 1 << 40])
def test_a_vocabulary_that_cannot_hold_the_bytes_is_refused(tmp_path, size):
    with pytest.raises(TokenizerError, match="BPE vocabulary"):
        train_bpe(CORPUS, tmp_path / "tok", size)
    assert not (tmp_path / "tok").exists()
