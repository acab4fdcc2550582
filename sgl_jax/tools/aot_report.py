"""TPU ahead-of-time cost and memory report of the engine's step, on a machine without a TPU.

    python -m sgl_jax.tools.aot_report --model-config qwen3-30b-a3b --topology v6e:2x2 \\
        --tp-size 4 --decode-bs 64 256 --prefill-tokens 2048 --prefill-requests 8 \\
        --context-len 4096 [--json]

The command's entry point. The report is the package ``sgl_jax.tools.aot`` (its docstring says
what is reported and which module does what; docs/aot_report.md how each figure is counted).
"""

import sys

from sgl_jax.tools.aot.cli import main

if __name__ == "__main__":
    sys.exit(main())
