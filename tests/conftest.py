from __future__ import annotations

import os

# Tests run on the CPU; a persistent compilation cache makes repeated engine start-ups cheap.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
