"""Adapters that let other frameworks drive the engine.

Each submodule imports its framework on import, so ``import sgl_jax`` never needs them:
``sgl_jax.integrations.tunix`` needs the ``tunix`` extra (``pip install 'sgl_jax[tunix]'``).
"""
