"""The tensors of a weight update by Hugging Face name, from what a trainer holds.

``Engine.update_weights_from_arrays`` takes ``{hf_name: array}``, or a nested structure
(an ``nnx.State``, e.g. ``nnx.state(model, nnx.Param)``, or nested dicts) together with
``names``: a function from a leaf's path (a tuple of its keys: strings and layer indices) to
its Hugging Face name (None: not sent), or a dict from the path, or from the path joined with
dots, to the name. The values must already have the Hugging Face shapes (``[out, in]``
linear weights, one tensor per expert); reshaping a model of another layout is the caller's
mapping (``integrations/tunix_qwen3.py`` does it for tunix's Qwen3). No JAX here: ``nnx``
variables are recognised by their ``get_value`` method.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

LeafPath = tuple[Any, ...]
Names = Callable[[LeafPath], str | None] | Mapping[Any, str]


def hf_named_arrays(arrays: Mapping[Any, Any], names: Names | None = None) -> dict[str, Any]:
    """``arrays`` as ``{hf_name: array}`` (a flat dict as it is when ``names`` is None).
    ValueError for a name given twice or a non-string name."""
    if not isinstance(arrays, Mapping):
        raise ValueError(f"arrays must be a dict of tensors by Hugging Face name or a nested "
                         f"state with names=, not {type(arrays).__name__}")
    if names is None:
        return dict(arrays)
    name_of = names if callable(names) else _lookup(names)
    out: dict[str, Any] = {}
    for path, leaf in _leaves(arrays, ()):
        name = name_of(path)
        if name is None:
            continue
        if not isinstance(name, str):
            raise ValueError(f"names gave {type(name).__name__} for {path}; Hugging Face "
                             "names are strings")
        if name in out:
            raise ValueError(f"names gives {name!r} to two leaves (one is {path})")
        out[name] = leaf
    return out


def _lookup(table: Mapping[Any, str]) -> Callable[[LeafPath], str | None]:
    def name_of(path: LeafPath) -> str | None:
        if path in table:
            return table[path]
        return table.get(".".join(str(p) for p in path))
    return name_of


def _leaves(tree: Any, path: LeafPath) -> Iterator[tuple[LeafPath, Any]]:
    if isinstance(tree, Mapping):
        for key, sub in tree.items():
            yield from _leaves(sub, (*path, key))
    elif hasattr(tree, "get_value"):  # an nnx.Variable
        yield path, tree.get_value()
    else:
        yield path, tree
