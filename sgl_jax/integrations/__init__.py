"""Adapters that let other frameworks drive the engine.

``import sgl_jax`` never imports a framework. ``sgl_jax.integrations.tunix``'s row helpers
(``align_routed_experts``, ``to_maxtext_forced_routed_experts``: numpy only) work without one;
its ``SglJaxRollout`` (which names the missing extra) and the ``tunix_*`` submodules need the
``tunix`` extra (``pip install 'sgl_jax[tunix]'``).
"""
