"""IncrementalDecoder: streamed pieces add up to the full decode; stop strings trim exactly.

Everything runs against the real bundled byte-level BPE tokenizer.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from sgl_jax.srt.managers.incremental_detokenizer import IncrementalDecoder
from sgl_jax.srt.tokenizer import Tokenizer

MODEL_DIR = Path(__file__).resolve().parents[1] / "sgl_jax" / "assets" / "tiny-qwen3-moe"
FFFD = "\ufffd"

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "café naïve résumé Ångström Żółć",
    "世界你好，静かにしてください。안녕하세요",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷 end",
    "😀😀😀世世世ééé",
    "mixed: 1+1=2 <tag> {json: [1, 2]} é😀世\n\n  spaces  ",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_pretrained(str(MODEL_DIR))


def _byte_symbols() -> dict[int, str]:
    """Byte-level BPE's byte -> symbol map: printable Latin-1 bytes stand for themselves,
    the other bytes are shifted to code points from 256 up, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    symbols = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + shifted)
            shifted += 1
    return symbols


@pytest.fixture(scope="module")
def byte_ids(tok: Tokenizer) -> dict[int, int]:
    ids = {b: tok.token_to_id(s) for b, s in _byte_symbols().items()}
    assert None not in ids.values()
    return ids  # type: ignore[return-value]


def _stream(
    decoder: IncrementalDecoder, ids: Sequence[int], rng: random.Random, max_chunk: int = 4
) -> list[str]:
    pieces = []
    i = 0
    while i < len(ids):
        k = rng.randint(1, max_chunk)
        pieces.append(decoder.push(ids[i : i + k]))
        i += k
    pieces.append(decoder.finish())
    return pieces


# ---- bytes -> text ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_random_ids_concatenate_to_full_decode(tok: Tokenizer, byte_ids: dict, seed: int) -> None:
    rng = random.Random(seed)
    high_bytes = [byte_ids[b] for b in range(0x80, 0x100)]  # continuation and lead bytes
    for _ in range(300):
        skip = rng.random() < 0.5
        pool = high_bytes if rng.random() < 0.5 else range(tok.vocab_size)
        ids = [rng.choice(pool) for _ in range(rng.randint(0, 50))]
        prompt_tail = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 6))]
        decoder = IncrementalDecoder(tok, prompt_tail, skip_special_tokens=skip)
        pieces = _stream(decoder, ids, rng, max_chunk=rng.choice([1, 2, 4, 40]))
        expected = tok.decode(ids, skip_special_tokens=skip)
        assert "".join(pieces) == expected, (ids, prompt_tail, skip, pieces)
        assert decoder.text == expected
        assert decoder.stopped_by is None


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("max_chunk", [1, 2, 3, 4])
def test_valid_text_streams_without_replacement_chars(
    tok: Tokenizer, text: str, max_chunk: int
) -> None:
    ids = tok.encode(text)
    pieces = _stream(IncrementalDecoder(tok), ids, random.Random(max_chunk), max_chunk)
    assert "".join(pieces) == text
    assert not any(FFFD in p for p in pieces)


@pytest.mark.parametrize("text", TEXTS)
def test_text_is_emitted_as_soon_as_it_is_final(tok: Tokenizer, text: str) -> None:
    # After every token, everything up to the last complete character has been emitted.
    ids = tok.encode(text)
    decoder = IncrementalDecoder(tok)
    for n in range(1, len(ids) + 1):
        decoder.push(ids[n - 1 : n])
        full = tok.decode(ids[:n])
        assert full.startswith(decoder.text)
        assert decoder.text == full.rstrip(FFFD)
    assert decoder.finish() == ""


def test_character_split_over_pushes(tok: Tokenizer, byte_ids: dict) -> None:
    ids = [byte_ids[b] for b in "a世😀".encode()]  # one token per byte: 1 + 3 + 4
    decoder = IncrementalDecoder(tok)
    assert [decoder.push([i]) for i in ids] == ["a", "", "", "世", "", "", "", "😀"]
    # A big push ending inside a character emits everything before that character.
    decoder = IncrementalDecoder(tok)
    assert decoder.push(ids[:6]) == "a世"
    assert decoder.push(ids[6:]) == "😀"


def test_invalid_bytes_are_emitted_once_final(tok: Tokenizer, byte_ids: dict) -> None:
    cont, lead3 = byte_ids[0x80], byte_ids[0xE4]
    decoder = IncrementalDecoder(tok)
    assert decoder.push([cont]) == ""  # held: the decoder cannot tell garbage from a prefix
    # A second lone continuation byte proves the first one is garbage.
    assert decoder.push([cont]) == FFFD
    assert decoder.push([byte_ids[ord("x")]]) == FFFD + "x"
    # An incomplete character cut short by an ASCII byte is final too.
    assert decoder.push([lead3, byte_ids[0xB8], byte_ids[ord("y")]]) == FFFD + "y"
    # An incomplete character at the very end is flushed by finish().
    assert decoder.push([lead3]) == ""
    assert decoder.finish() == FFFD
    assert decoder.text == FFFD + FFFD + "x" + FFFD + "y" + FFFD
    all_ids = [cont, cont, byte_ids[ord("x")], lead3, byte_ids[0xB8], byte_ids[ord("y")], lead3]
    assert decoder.text == tok.decode(all_ids)


def test_long_garbage_run_is_not_held_forever(tok: Tokenizer, byte_ids: dict) -> None:
    decoder = IncrementalDecoder(tok)
    emitted = "".join(decoder.push([byte_ids[0x80]]) for _ in range(100))
    assert emitted == FFFD * 99  # only the last byte is still undecided
    assert decoder.finish() == FFFD


def test_prompt_tail_is_context_only(tok: Tokenizer, byte_ids: dict) -> None:
    prompt = tok.encode("<|im_start|>user\n世界<|im_end|>\n<|im_start|>assistant\n")
    output = tok.encode("Hello 😀 there")
    for skip in (True, False):
        decoder = IncrementalDecoder(tok, prompt[-5:], skip_special_tokens=skip)
        pieces = _stream(decoder, output, random.Random(0), 1)
        assert "".join(pieces) == "Hello 😀 there"
    # A prompt ending inside a character does not glue its bytes to the output's.
    lead, cont = byte_ids[0xE4], byte_ids[0xB8]
    decoder = IncrementalDecoder(tok, [byte_ids[ord("a")], lead])
    assert decoder.push([cont, byte_ids[0x96]]) + decoder.finish() == tok.decode(
        [cont, byte_ids[0x96]]
    )


def test_skip_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("hi<|im_end|>there<|endoftext|>")
    kept = IncrementalDecoder(tok, skip_special_tokens=False)
    assert "".join(_stream(kept, ids, random.Random(1), 1)) == "hi<|im_end|>there<|endoftext|>"
    skipped = IncrementalDecoder(tok, skip_special_tokens=True)
    assert "".join(_stream(skipped, ids, random.Random(1), 1)) == "hithere"


class _RecordingTokenizer(Tokenizer):
    """The real tokenizer, recording how many ids each decode call sees."""

    def __init__(self, inner: Tokenizer) -> None:
        self.__dict__.update(inner.__dict__)
        self.decode_lengths: list[int] = []

    def decode(self, ids, skip_special_tokens: bool = True) -> str:  # type: ignore[override]
        ids = list(ids)
        self.decode_lengths.append(len(ids))
        return super().decode(ids, skip_special_tokens)


def test_work_per_push_is_bounded(tok: Tokenizer) -> None:
    recording = _RecordingTokenizer(tok)
    ids = tok.encode("世界 café 😀 " * 400)
    assert len(ids) > 4000
    decoder = IncrementalDecoder(recording)
    pieces = [decoder.push([i]) for i in ids]
    pieces.append(decoder.finish())
    assert "".join(pieces) == "世界 café 😀 " * 400
    # Windows stay a few tokens long however long the output grows.
    assert max(recording.decode_lengths) <= 12
    assert len(recording.decode_lengths) <= 4 * len(ids)


def test_push_after_finish_is_an_error(tok: Tokenizer) -> None:
    decoder = IncrementalDecoder(tok)
    assert decoder.push(tok.encode("a")) == "a"
    assert decoder.finish() == ""
    assert decoder.finish() == ""
    with pytest.raises(RuntimeError):
        decoder.push([1])


# ---- stop strings ---------------------------------------------------------------------------


def _run(tok: Tokenizer, text: str, stop: Sequence[str], max_chunk: int = 1, seed: int = 0):
    decoder = IncrementalDecoder(tok, stop=stop)
    pieces = _stream(decoder, tok.encode(text), random.Random(seed), max_chunk)
    assert "".join(pieces) == decoder.text
    return decoder, pieces


def test_stop_spanning_pushes(tok: Tokenizer) -> None:
    decoder, pieces = _run(tok, "Hello world, again", ["world"])
    assert decoder.text == "Hello "
    assert decoder.stopped_by == "world"
    assert not any("w" in p for p in pieces)  # no piece leaked a part of the stop string


def test_stop_at_the_very_start(tok: Tokenizer) -> None:
    decoder, pieces = _run(tok, "STOP here", ["STOP"])
    assert decoder.text == "" and pieces == [""] * len(pieces)
    assert decoder.stopped_by == "STOP"


def test_stop_nothing_emitted_after_match(tok: Tokenizer) -> None:
    decoder = IncrementalDecoder(tok, stop=["##"])
    assert decoder.push(tok.encode("a##")) == "a"
    assert decoder.stopped_by == "##"
    assert decoder.push(tok.encode("more text")) == ""
    assert decoder.finish() == ""
    assert decoder.text == "a"


def test_overlapping_stops(tok: Tokenizer) -> None:
    # "ab" completes before "abc" could: it wins, trimming at the same start.
    decoder, _ = _run(tok, "xxabcdef", ["abc", "ab"])
    assert (decoder.text, decoder.stopped_by) == ("xx", "ab")
    # A stop whose prefix repeats: "aab" inside "aaab" starts at index 1.
    decoder, pieces = _run(tok, "xaaab tail", ["aab"])
    assert (decoder.text, decoder.stopped_by) == ("xa", "aab")
    # Two stops ending together: the one starting first trims more.
    decoder, _ = _run(tok, "hello", ["lo", "llo"])
    assert (decoder.text, decoder.stopped_by) == ("he", "llo")


def test_stop_never_appearing_flushes_held_text(tok: Tokenizer) -> None:
    decoder = IncrementalDecoder(tok, stop=["abc", "xyz"])
    assert decoder.push(tok.encode("hello ab")) == "hello "
    assert decoder.push(tok.encode("x")) == "ab"  # "x" may still start "xyz"
    assert decoder.finish() == "x"
    assert decoder.text == "hello abx"
    assert decoder.stopped_by is None


def test_stop_with_multibyte_characters(tok: Tokenizer) -> None:
    decoder, pieces = _run(tok, "你好世界。再见", ["世界"])
    assert (decoder.text, decoder.stopped_by) == ("你好", "世界")
    assert not any(FFFD in p for p in pieces)


def test_stop_on_special_token_text(tok: Tokenizer) -> None:
    ids = tok.encode("answer<|im_end|>junk")
    kept = IncrementalDecoder(tok, skip_special_tokens=False, stop=["<|im_end|>"])
    _stream(kept, ids, random.Random(0), 1)
    assert (kept.text, kept.stopped_by) == ("answer", "<|im_end|>")
    skipped = IncrementalDecoder(tok, skip_special_tokens=True, stop=["<|im_end|>"])
    _stream(skipped, ids, random.Random(0), 1)
    assert (skipped.text, skipped.stopped_by) == ("answerjunk", None)


def test_empty_stop_strings_are_ignored(tok: Tokenizer) -> None:
    decoder, _ = _run(tok, "abc", ["", "zz"])
    assert (decoder.text, decoder.stopped_by) == ("abc", None)


def _expected_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """Trim at the stop that completes first (then the one starting first)."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < (best[0] + len(best[1]), best[0])):
            best = (i, s)
    return (text, None) if best is None else (text[: best[0]], best[1])


@pytest.mark.parametrize("seed", range(4))
def test_stops_property(tok: Tokenizer, seed: int) -> None:
    # Over a tiny alphabet stops match often and overlap; the result must not depend on how
    # the ids are chunked, and no piece may ever contain the start of the matched stop.
    rng = random.Random(100 + seed)
    alphabet = ["a", "b", "c", " ", "é", "世"]
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
            for _ in range(rng.randint(1, 3))
        ]
        expected_text, expected_stop = _expected_stop(text, stops)
        decoder, pieces = _run(tok, text, stops, rng.randint(1, 4), rng.randrange(10**6))
        assert (decoder.text, decoder.stopped_by) == (expected_text, expected_stop), (
            text,
            stops,
        )
        emitted = ""
        for piece in pieces:
            emitted += piece
            assert expected_text.startswith(emitted)
