"""Framework adapters are optional: ``import sgl_jax`` never imports them, and an adapter whose
framework is missing says which extra to install (sgl_jax/integrations/)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest


def test_importing_sgl_jax_imports_no_framework():
    code = ("import sys, sgl_jax, sgl_jax.integrations; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'tunix'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]"


@pytest.mark.skipif(importlib.util.find_spec("tunix") is not None,
                    reason="tunix is installed here (tests/tunix test the adapter)")
def test_the_tunix_adapter_without_tunix_names_the_extra():
    with pytest.raises(ImportError, match=r"pip install 'sgl_jax\[tunix\]'"):
        import sgl_jax.integrations.tunix  # noqa: F401
