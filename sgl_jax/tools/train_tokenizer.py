"""Train the bundled byte-level BPE tokenizer on ``sgl_jax/assets/corpus.txt``.

The result is a Hugging Face ``tokenizer.json`` with exactly :data:`VOCAB_SIZE` entries:
256 byte symbols, BPE merges learned from the corpus, and the ChatML special tokens appended
last (as Qwen does, so they have the highest ids). Byte-level pre-tokenization plus the
ByteLevel decoder, with no normalizer, make ``decode(encode(s)) == s`` for every UTF-8 string:
any byte sequence is expressible with the 256 byte symbols.

Training is deterministic: the corpus is fed in a fixed order, the byte alphabet is fixed, and
the trainer breaks count ties by pair ids, so the same corpus always yields the same file.

    python -m sgl_jax.tools.train_tokenizer OUT_DIR [--corpus PATH]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets"
CORPUS_PATH = ASSETS_DIR / "corpus.txt"

VOCAB_SIZE = 512  # total, special tokens included
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)


def _corpus_lines(corpus_path: str | os.PathLike[str]) -> list[str]:
    # Paragraph-sized pieces keep the trainer's word counts independent of how it might split
    # one huge string; the order is the file's order.
    text = Path(corpus_path).read_text(encoding="utf-8")
    return [line for line in text.splitlines(keepends=True) if line]


def train_tokenizer(corpus_path: str | os.PathLike[str] = CORPUS_PATH) -> Tokenizer:
    """A byte-level BPE of exactly VOCAB_SIZE tokens; the special tokens take the last ids."""
    tokenizer = Tokenizer(models.BPE())
    # add_prefix_space=False: a leading space is never invented, so round trips are exact.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_corpus_lines(corpus_path), trainer=trainer)
    base = tokenizer.get_vocab_size(with_added_tokens=False)
    if base != VOCAB_SIZE - len(SPECIAL_TOKENS):
        raise RuntimeError(
            f"BPE training produced {base} tokens, wanted {VOCAB_SIZE - len(SPECIAL_TOKENS)}: "
            "the corpus is too small for that many merges"
        )
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    assert tokenizer.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    return tokenizer


def special_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """Ids of the three ChatML special tokens."""
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    missing = [tok for tok, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"tokenizer lacks special tokens {missing}")
    return {tok: int(i) for tok, i in ids.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="directory to write tokenizer.json into")
    parser.add_argument("--corpus", default=str(CORPUS_PATH), help="UTF-8 training text")
    args = parser.parse_args(argv)
    tokenizer = train_tokenizer(args.corpus)
    os.makedirs(args.out_dir, exist_ok=True)
    out = os.path.join(args.out_dir, "tokenizer.json")
    tokenizer.save(out)
    print(
        f"wrote {out}: vocab {tokenizer.get_vocab_size()}, specials {special_token_ids(tokenizer)}"
    )


if __name__ == "__main__":
    main()
