"""sgl_jax: a JAX serving engine for Mixture-of-Experts models that returns the routed experts."""

from __future__ import annotations

__version__ = "0.1.0"


def __getattr__(name: str):
    # Imported lazily: `import sgl_jax` must stay cheap for the tools and the CLI's --help.
    if name == "Engine":
        from sgl_jax.srt.entrypoints.engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["Engine"]
