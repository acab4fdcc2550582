"""A Hugging Face fast tokenizer (``tokenizer.json``) plus its chat template, without transformers.

``Tokenizer.from_pretrained(model_dir)`` reads the same files ``AutoTokenizer`` would:

- ``tokenizer.json`` (required): the ``tokenizers`` pipeline, added tokens included.
- ``tokenizer_config.json`` (optional): special tokens, ``add_bos_token``, ``model_max_length``
  and the Jinja ``chat_template`` (also read from ``chat_template.jinja`` when present).
- ``generation_config.json`` (optional): extra end-of-sequence ids (``eos_token_id``).

``clean_up_tokenization_spaces`` is deliberately ignored: it would make ``decode`` of a
sequence differ from the concatenation of the decodes of its pieces, which streaming relies on.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

NO_CHAT_TEMPLATE_MSG = "the model has no chat template; use /v1/completions or pass a prompt"

# transformers writes this sentinel when a tokenizer has no length limit.
_UNLIMITED_LENGTH = 10**12


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """A special token as written by transformers: a string or a serialized AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _pick_chat_template(value: Any) -> str | None:
    # transformers also stores several named templates as [{"name": ..., "template": ...}].
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        template = named.get("default")
        return template if isinstance(template, str) else None
    return None


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Like transformers' filter: non-ASCII characters stay readable in the prompt.
    return json.dumps(
        value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _message_text(content: Any, index: int) -> str | None:
    """A message's content as one string: OpenAI text parts are joined without a separator."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"messages[{index}].content must be a string or a list of content parts")
    texts = []
    for part in content:
        if not isinstance(part, Mapping):
            raise ValueError(f"messages[{index}].content parts must be objects with a 'type'")
        part_type = part.get("type")
        if part_type != "text":
            raise ValueError(
                f"messages[{index}]: content part type {part_type!r} is not supported (only 'text')"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"messages[{index}]: a 'text' content part needs a string 'text'")
        texts.append(text)
    return "".join(texts)


class Tokenizer:
    """Encode / decode with a ``tokenizers.Tokenizer`` and render the model's chat template."""

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        config: Mapping[str, Any] | None = None,
        generation_config: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> None:
        config = dict(config or {})
        generation_config = dict(generation_config or {})
        self._tok = tokenizer
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)

        self.bos_token: str | None = _token_content(config.get("bos_token"))
        self.eos_token: str | None = _token_content(config.get("eos_token"))
        self.pad_token: str | None = _token_content(config.get("pad_token"))
        self.bos_token_id: int | None = self._known_id(self.bos_token)
        self.pad_token_id: int | None = self._known_id(self.pad_token)

        # eos_token_ids: the tokenizer's eos first, then generation_config's, without repeats.
        eos_ids: list[int] = []
        config_eos = self._known_id(self.eos_token)
        if config_eos is not None:
            eos_ids.append(config_eos)
        for i in _as_id_list(generation_config.get("eos_token_id")):
            if i not in eos_ids:
                eos_ids.append(i)
        self.eos_token_ids: tuple[int, ...] = tuple(eos_ids)
        self.eos_token_id: int | None = eos_ids[0] if eos_ids else None
        if self.eos_token is None and self.eos_token_id is not None:
            self.eos_token = tokenizer.id_to_token(self.eos_token_id)

        self.add_bos_token: bool = bool(config.get("add_bos_token", False))
        max_len = config.get("model_max_length")
        self.model_max_length: int | None = (
            int(max_len)
            if isinstance(max_len, int | float) and 0 < max_len < _UNLIMITED_LENGTH
            else None
        )

        special = {i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special}
        special.update(i for i in (self.bos_token_id, self.pad_token_id) if i is not None)
        special.update(self.eos_token_ids)
        self.all_special_ids: set[int] = special

        self.chat_template: str | None = (
            chat_template
            if chat_template is not None
            else _pick_chat_template(config.get("chat_template"))
        )
        self._compiled_template: jinja2.Template | None = None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> Tokenizer:
        path = os.fspath(path)
        if os.path.isfile(path) and os.path.basename(path) == "tokenizer.json":
            path = os.path.dirname(path) or "."
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise ValueError(
                f"no tokenizer found: expected a Hugging Face fast-tokenizer file at "
                f"{tokenizer_file} (sgl_jax reads tokenizer.json, not slow/sentencepiece files)"
            )
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        generation_config = _read_json(os.path.join(path, "generation_config.json"))
        template = None
        template_file = os.path.join(path, "chat_template.jinja")
        if _pick_chat_template(config.get("chat_template")) is None and os.path.isfile(
            template_file
        ):
            with open(template_file, encoding="utf-8") as f:
                template = f.read()
        return cls(_HFTokenizer.from_file(tokenizer_file), config, generation_config, template)

    # ---- ids <-> text ----------------------------------------------------------------------

    def _known_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def _with_bos(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        # tokenizer.json's post-processor usually adds the BOS itself; only a config that asks
        # for one the post-processor does not add gets it prepended here (never twice).
        if (
            add_special_tokens
            and self.add_bos_token
            and self.bos_token_id is not None
            and (not ids or ids[0] != self.bos_token_id)
        ):
            return [self.bos_token_id, *ids]
        return ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return self._with_bos(ids, add_special_tokens)

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [self._with_bos(e.ids, add_special_tokens) for e in encodings]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        # Ids outside the vocabulary (a model whose embedding is padded past the tokenizer)
        # decode to nothing, as in the tokenizers library.
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def backend_json(self) -> str:
        """The ``tokenizers`` pipeline as its ``tokenizer.json`` text (for llguidance)."""
        return self._tok.to_str()

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        return [self._tok.id_to_token(i) for i in ids]

    def __len__(self) -> int:
        return self.vocab_size

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The longest token's text in UTF-8 bytes: an upper bound on how much text one token
        covers (byte-level and metaspace vocabularies spell a byte or a space with a longer
        character, so this only overestimates). A text of B bytes is at least B / this many
        tokens, which bounds a prompt's length before it is tokenized."""
        vocab = self._tok.get_vocab(with_added_tokens=True)
        return max((len(token.encode("utf-8")) for token in vocab), default=1) or 1

    # ---- chat ------------------------------------------------------------------------------

    def _template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise ValueError(NO_CHAT_TEMPLATE_MSG)
        if self._compiled_template is None:
            # The same environment transformers uses, so templates written for it render
            # identically: sandboxed, trim/lstrip blocks, loop controls, its helper functions.
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            try:
                self._compiled_template = env.from_string(self.chat_template)
            except jinja2.exceptions.TemplateError as e:
                raise ValueError(f"the model's chat template does not compile: {e}") from e
        return self._compiled_template

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[Any] | None = None,
        **kwargs: Any,
    ) -> str:
        """Renders ``messages`` into a prompt string (no tokenization).

        ``content`` may be a string, None, or a list of OpenAI ``{"type": "text"}`` parts, which
        are joined into one string. Errors (other part types, a template's
        ``raise_exception``) are ValueErrors, i.e. client errors.
        """
        template = self._template()
        normalized = []
        for index, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise ValueError(f"messages[{index}] must be an object")
            item = dict(message)  # never mutate the caller's messages
            if "content" in item:
                item["content"] = _message_text(item["content"], index)
            normalized.append(item)
        variables = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            **kwargs,
            "messages": normalized,
            "add_generation_prompt": add_generation_prompt,
            "tools": tools,
        }
        try:
            return template.render(**variables)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template error: {e}") from e
