"""YaRN RoPE scaling as transformers defines it (``rope_scaling`` / ``rope_parameters``)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """YaRN context extension (DeepSeek-V3's and gpt-oss's ``rope_scaling``), as transformers
    defines it. ``truncate``: the correction range's bounds are rounded to whole dims (floor /
    ceil; transformers' default); gpt-oss sets it false and keeps them fractional."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True
    explicit_attention_factor: float | None = None  # the config's own ``attention_factor``

    @staticmethod
    def yarn_mscale(factor: float, mscale: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

    @property
    def attention_factor(self) -> float:
        """Multiplies cos and sin (transformers' YaRN ``attention_factor``)."""
        if self.explicit_attention_factor is not None:
            return self.explicit_attention_factor
        if self.mscale and self.mscale_all_dim:
            return self.yarn_mscale(self.factor, self.mscale) / self.yarn_mscale(
                self.factor, self.mscale_all_dim)
        return self.yarn_mscale(self.factor, 1.0)

    @property
    def softmax_mscale(self) -> float:
        """MLA multiplies its softmax scale by the square of this (DeepSeek-V3)."""
        return self.yarn_mscale(self.factor, self.mscale_all_dim) if self.mscale_all_dim else 1.0
