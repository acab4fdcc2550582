"""Tokenizer: the bundled byte-level BPE tokenizer and its ChatML template, read without transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sgl_jax.srt.tokenizer import NO_CHAT_TEMPLATE_MSG, Tokenizer

MODEL_DIR = Path(__file__).resolve().parents[1] / "sgl_jax" / "assets" / "tiny-qwen3-moe"

TEXTS = [
    "",
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  \n\ttabs and\nnewlines\n",
    "café naïve résumé Ångström Żółć",
    "世界你好，静かにしてください。안녕하세요",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "mixed: 1+1=2 <tag> {json: [1, 2]} é😀世",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_pretrained(str(MODEL_DIR))


def _copy_tokenizer(dst: Path, config: dict | None = None, generation: dict | None = None) -> Path:
    shutil.copy(MODEL_DIR / "tokenizer.json", dst / "tokenizer.json")
    if config is not None:
        (dst / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (dst / "generation_config.json").write_text(json.dumps(generation))
    return dst


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_encode_batch_matches_encode(tok: Tokenizer) -> None:
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]


def test_no_special_tokens_added(tok: Tokenizer) -> None:
    # The bundled tokenizer has no BOS: add_special_tokens changes nothing.
    assert tok.bos_token_id is None
    assert tok.encode("hi there", add_special_tokens=True) == tok.encode(
        "hi there", add_special_tokens=False
    )


def test_special_ids(tok: Tokenizer) -> None:
    assert tok.vocab_size == 512
    specials = {tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert None not in specials
    assert tok.all_special_ids == specials
    assert tok.pad_token_id == tok.token_to_id("<|endoftext|>")
    im_start, im_end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    # Special tokens are matched whole in text, and skipped (or kept) when decoding.
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == im_start and ids[-1] == im_end
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.id_to_token(im_end) == "<|im_end|>"
    assert tok.convert_ids_to_tokens([im_start, im_end]) == ["<|im_start|>", "<|im_end|>"]
    assert tok.id_to_token(10**6) is None


def test_eos_ids(tok: Tokenizer) -> None:
    im_end = tok.token_to_id("<|im_end|>")
    assert tok.eos_token_id == im_end
    assert tok.eos_token == "<|im_end|>"
    generation = json.loads((MODEL_DIR / "generation_config.json").read_text())
    extra = generation.get("eos_token_id")
    extra = extra if isinstance(extra, list) else [extra]
    assert tok.eos_token_ids[0] == im_end
    assert set(tok.eos_token_ids) == {im_end, *extra}
    assert len(set(tok.eos_token_ids)) == len(tok.eos_token_ids)


def test_eos_ids_merge_config_and_generation_config(tmp_path: Path) -> None:
    config = {"eos_token": {"content": "<|im_end|>", "special": True}, "pad_token": None}
    t = Tokenizer.from_pretrained(
        str(_copy_tokenizer(tmp_path, config, {"eos_token_id": [509, 511, 510]}))
    )
    assert t.eos_token_ids == (511, 509, 510)  # the tokenizer's own eos first, no repeats
    assert t.eos_token_id == 511
    assert t.pad_token_id is None


def test_add_bos_token_prepends_once(tmp_path: Path) -> None:
    config = {"bos_token": "<|endoftext|>", "add_bos_token": True}
    t = Tokenizer.from_pretrained(str(_copy_tokenizer(tmp_path, config)))
    bos = t.token_to_id("<|endoftext|>")
    assert t.bos_token_id == bos
    assert t.encode("hi")[0] == bos
    assert t.encode("<|endoftext|>hi").count(bos) == 1
    assert bos not in t.encode("hi", add_special_tokens=False)
    assert t.encode_batch(["hi"]) == [t.encode("hi")]


def test_chat_template_renders_chatml(tok: Tokenizer) -> None:
    assert tok.chat_template is not None
    messages = [{"role": "user", "content": "hi"}]
    assert (
        tok.apply_chat_template(messages)
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|im_start|>user\nhi<|im_end|>\n"
    )
    multi = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "世界"},
    ]
    assert tok.apply_chat_template(multi) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\n世界<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_template_content_parts(tok: Tokenizer) -> None:
    parts = [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]
    messages = [{"role": "user", "content": parts}]
    assert tok.apply_chat_template(messages) == tok.apply_chat_template(
        [{"role": "user", "content": "hello"}]
    )
    assert messages[0]["content"] is parts  # the caller's messages are not modified


@pytest.mark.parametrize(
    "content, needle",
    [
        ([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}], "image_url"),
        ([{"type": "input_audio", "input_audio": {}}], "input_audio"),
        ([{"type": "text"}], "text"),
        ([{"text": "no type"}], "None"),
        (42, "string"),
    ],
)
def test_chat_template_rejects_bad_content(tok: Tokenizer, content: object, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        tok.apply_chat_template([{"role": "user", "content": content}])


def test_missing_chat_template(tmp_path: Path) -> None:
    t = Tokenizer.from_pretrained(str(_copy_tokenizer(tmp_path)))
    assert t.chat_template is None
    with pytest.raises(ValueError) as info:
        t.apply_chat_template([{"role": "user", "content": "hi"}])
    assert str(info.value) == NO_CHAT_TEMPLATE_MSG
    # Without tokenizer_config.json there are no special-token names, but decoding works.
    assert t.decode(t.encode("hi 世界")) == "hi 世界"


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer.json") as info:
        Tokenizer.from_pretrained(str(tmp_path))
    assert str(tmp_path) in str(info.value)


def test_custom_template_variables_and_errors(tmp_path: Path) -> None:
    template = (
        "{{ bos_token }}|{{ eos_token }}|{{ tools | tojson }}|{{ extra }}|"
        "{% for m in messages %}{% if m['role'] == 'bad' %}"
        "{{ raise_exception('role bad is not allowed') }}{% endif %}"
        "[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}"
    )
    config = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "chat_template": template}
    t = Tokenizer.from_pretrained(str(_copy_tokenizer(tmp_path, config)))
    out = t.apply_chat_template(
        [{"role": "user", "content": "é"}], tools=[{"name": "f"}], extra="x"
    )
    assert out == '<|endoftext|>|<|im_end|>|[{"name": "f"}]|x|[user:é]>'
    with pytest.raises(ValueError, match="role bad is not allowed"):
        t.apply_chat_template([{"role": "bad", "content": "x"}])


def test_chat_template_is_sandboxed(tmp_path: Path) -> None:
    template = "{{ messages.__class__.__mro__ }}"
    t = Tokenizer.from_pretrained(str(_copy_tokenizer(tmp_path, {"chat_template": template})))
    with pytest.raises(ValueError):
        t.apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_jinja_file(tmp_path: Path) -> None:
    _copy_tokenizer(tmp_path, {"eos_token": "<|im_end|>"})
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    t = Tokenizer.from_pretrained(str(tmp_path))
    assert t.apply_chat_template([{"role": "user", "content": "ok"}]) == "ok"
