"""What a verify step keeps.

A verify step feeds each request its last token followed by its draft tokens d_1..d_m and
samples a token at every position, each with the request's own sampler at the output index it
would have without speculation. Draft d_i is accepted when the target's token at the position
before it is d_i itself, for every i up to it; the target's token after the last accepted
draft is taken too. So every kept token is one the target sampled, from the logits of the
sequence as it would be without speculation: greedy output is the output without
speculation, and a seeded request draws the same tokens (exact-match verification; for a
deterministic draft such as NGRAM it accepts d_i with the target's probability of d_i, as
rejection sampling would).
"""

from __future__ import annotations

from collections.abc import Sequence


def accepted_tokens(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a request gains: the drafts the target confirmed, then its own next token.

    ``sampled[j]`` is the target's token after input position j (the last token, then each
    draft), so ``len(sampled) == len(drafts) + 1``.
    """
    if len(sampled) != len(drafts) + 1:
        raise ValueError(f"{len(sampled)} sampled tokens for {len(drafts)} drafts")
    j = 0
    while j < len(drafts) and drafts[j] == sampled[j]:
        j += 1
    return list(sampled[: j + 1])
