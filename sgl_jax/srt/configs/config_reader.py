"""Typed reads of a checkpoint's ``config.json``: errors name the file and the field.

``ModelConfig.from_dict`` (``model_config.py``) and the family readers (``families.py``) read
every field through :class:`ConfigReader`, so a malformed value fails at load time with a
message that names it, never deep inside the model.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from sgl_jax.srt.bounded_text import bound_message, short_repr

INT_MAX = 2**31 - 1  # integer fields: sizes and counts index int32 arrays
MAX_CONFIG_BYTES = 16 * 2**20  # config.json files are a few KB


def read_config_json(path: str) -> Any:
    """The parsed ``config.json`` of a checkpoint directory (any JSON value: ``from_dict``
    checks it is an object). Errors name the file and never quote its contents."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"{path} has no config.json; it is not a Hugging Face checkpoint")
    try:
        size = os.path.getsize(config_file)
        if size > MAX_CONFIG_BYTES:
            raise ValueError(f"{config_file} is {size} bytes; a config.json of more than "
                             f"{MAX_CONFIG_BYTES} bytes is not a model config")
        with open(config_file, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ValueError(f"cannot read {config_file}: {e.strerror or e}") from e
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{config_file} is not UTF-8 text (byte {e.start}); "
                         "a config.json is UTF-8 JSON") from e
    try:
        return json.loads(text)
    except ValueError as e:  # json.JSONDecodeError, or an integer of too many digits
        where = (f" at line {e.lineno} column {e.colno}"
                 if isinstance(e, json.JSONDecodeError) else "")
        reason = e.msg if isinstance(e, json.JSONDecodeError) else bound_message(str(e), 120)
        raise ValueError(f"{config_file} is not valid JSON{where}: {reason}") from e


def json_kind(value: Any) -> str:
    kinds = {list: "list", str: "string", bool: "boolean", int: "number", float: "number",
             type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


class ConfigReader:
    """Typed reads of config.json fields, with errors that name the file and the field.

    Values are taken as JSON gives them: an integer field must be a JSON integer (not a
    string, a boolean or a float) within its bounds, a float field a finite number, a boolean
    field true or false. A field set to null counts as absent (its default, or an error if it
    has none)."""

    def __init__(self, hf: dict[str, Any], model_path: str, prefix: str = "") -> None:
        self.hf, self.model_path, self.prefix = hf, model_path, prefix  # prefix: "parent."

    def where(self, key: str) -> str:
        return f"{self.model_path}/config.json: {self.prefix}{key}"

    def get(self, key: str, default: Any = None) -> Any:
        value = self.hf.get(key)
        return default if value is None else value

    def need(self, key: str) -> Any:
        if self.hf.get(key) is None:
            raise ValueError(f"{self.model_path}/config.json lacks the field "
                             f"{self.prefix + key!r}")
        return self.hf[key]

    def int(self, key: str, default: int | None = None, lo: int = 1, hi: int = INT_MAX) -> int:
        value = self.need(key) if default is None else self.get(key, default)
        return self.check_int(key, value, lo, hi)

    def check_int(self, key: str, value: Any, lo: int = 1, hi: int = INT_MAX) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{self.where(key)} is {short_repr(value)}; it must be an integer")
        if not lo <= value <= hi:
            raise ValueError(f"{self.where(key)} is {short_repr(value)}; it must be in "
                             f"[{lo}, {hi}]")
        return value

    def int_list(self, key: str, lo: int = 0, hi: int = INT_MAX) -> list[int]:
        value = self.get(key, [])
        if not isinstance(value, list):
            raise ValueError(f"{self.where(key)} is {short_repr(value)}; it must be a list of "
                             "integers")
        return [self.check_int(key, v, lo, hi) for v in value]

    def float(self, key: str, default: float | None = None, positive: bool = True) -> float:
        value = self.need(key) if default is None else self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
                value) or (positive and value <= 0):
            kind = "a positive number" if positive else "a finite number"
            raise ValueError(f"{self.where(key)} is {short_repr(value)}; it must be {kind}")
        return float(value)

    def bool(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise ValueError(f"{self.where(key)} is {short_repr(value)}; it must be true or "
                             "false")
        return value

    def str(self, key: str, default: str) -> str:
        value = self.get(key, default)
        if not isinstance(value, str):
            raise ValueError(f"{self.where(key)} is {short_repr(value)}; it must be a string")
        return value

    def sub(self, key: str) -> ConfigReader | None:
        """A nested object (``rope_scaling``), read with the same checks; None if absent."""
        value = self.get(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError(f"{self.where(key)} is {short_repr(value)}; it must be an object")
        return ConfigReader(value, self.model_path, f"{self.prefix}{key}.")

    def rope_type(self) -> str | None:
        """``rope_scaling``'s type: None without one, "" if it names none."""
        scaling = self.rope()
        if scaling is None:
            return None
        return scaling.str("rope_type", scaling.str("type", ""))

    def default_rope_only(self) -> None:
        kind = self.rope_type()
        if kind not in (None, "default"):
            raise ValueError(f"rope_scaling type {short_repr(kind)} is not supported for this "
                             "architecture")



    def rope(self) -> ConfigReader | None:
        """The RoPE settings: ``rope_scaling`` (transformers 4 and the released configs) or
        ``rope_parameters`` (what transformers 5 writes, theta included); None if neither."""
        for key in ("rope_scaling", "rope_parameters"):
            section = self.sub(key)
            if section is not None and section.hf:
                return section
        return None

    def rope_theta(self, default: float) -> float:
        """``rope_theta`` at the top level, else in ``rope_parameters`` (transformers 5)."""
        if self.get("rope_theta") is not None:
            return self.float("rope_theta")
        params = self.sub("rope_parameters")
        if params is not None and params.get("rope_theta") is not None:
            return params.float("rope_theta")
        return default


