from __future__ import annotations

import os

# Tests run on the CPU; a persistent compilation cache makes repeated engine start-ups cheap.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The reference forward multiplies tiny matrices: BLAS threads only add overhead there.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
