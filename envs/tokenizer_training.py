"""A byte-level BPE tokenizer trained on a task suite's own text, saved as a local tokenizer
directory that `load_tokenizer` reads like any other.

Why: a byte tokenizer spends one position per character, so CodeGen-v1's prompt and reference
take about 97 positions; a BPE learnt from the synthesised train split takes about 45 for the
same text, and an SFT step's cost follows the positions, which is what lets a few-million-
parameter model fit the CPU recipe (docs/pipeline.md). Digits stay one token each: values the
generator holds out (held-out tasks ask for constants no train task has) must be writable from
the digits every train task used, not from merged tokens only the train values formed. The byte
alphabet is in the vocabulary from the start, so any text, a perturbed or hostile prompt
included, still encodes.

Training is deterministic for the same texts in the same order (the pipeline passes the train
split as stage 1 wrote it), and the directory's sha256 is recorded like every stage output.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from shoal.envs.tokenizer import TokenizerError

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
MIN_VOCAB = 256 + 3
"""The byte alphabet and the three special tokens: a smaller vocabulary could not encode text."""
MAX_VOCAB = 1 << 17


def train_bpe(texts: Iterable[str], directory: Path, vocab_size: int) -> Path:
    """Learn at most `vocab_size` tokens from `texts` and save them under `directory` (created)
    as tokenizer.json + tokenizer_config.json; returns the directory."""
    if isinstance(vocab_size, bool) or not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise TokenizerError(
            f"a BPE vocabulary of {vocab_size!r} is invalid: use {MIN_VOCAB} to {MAX_VOCAB}"
        )
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token=PAD, bos_token=BOS, eos_token=EOS
    )
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(directory))
    return directory
