from __future__ import annotations

import os

import pytest

# Tests run on the CPU; a persistent compilation cache makes repeated engine start-ups cheap.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The reference forward multiplies tiny matrices: BLAS threads only add overhead there.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def pytest_configure(config) -> None:
    # The exactness tests' checkpoint (sgl_jax/testing.py): written once, before any test
    # module reads its config.json at import time.
    from sgl_jax.testing import ensure_test_model

    ensure_test_model()


@pytest.fixture(scope="session")
def second_ckpt(tmp_path_factory) -> str:
    """A second tiny checkpoint with the bundled model's shapes (other weights): the target of
    weight-update tests."""
    from sgl_jax.tools.make_random_model import write_random_model

    path = str(tmp_path_factory.mktemp("second_ckpt"))
    write_random_model(path, "tiny", seed=1)
    return path
