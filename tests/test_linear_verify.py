"""A speculative verify step through a Gated DeltaNet layer (layers/linear_attention/verify.py):
each row's tables end as decoding its accepted inputs one by one leaves them, whatever the
drafts after them; each token's output is the one-token step's; rows of other slots, padding
rows and padded tokens change nothing of the real rows. Checked against ``gated_delta.decode``
run on the accepted inputs alone and against the float64 reference
(``tools/reference_gated_delta``) over the whole sequence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax.srt.layers.linear_attention import gated_delta
from sgl_jax.srt.layers.linear_attention.verify import PendingStates, commit, verify_forward
from sgl_jax.tools.reference_gated_delta import gated_delta_layer
from tests.test_gated_delta import DIMS, HIDDEN, K, params, rel, tokens, weights

WIDTH = 4  # a row's last token and 3 drafts at most
decode = jax.jit(gated_delta.decode, static_argnums=1)


def test_verify_keeps_the_accepted_positions_states():
    w = weights(3)
    p = params(w)
    slots_total = 6
    history = [tokens(i, 9 + 4 * i) for i in range(3)]  # what each request saw before
    # The tables: rows 4, 1 and 3 hold the three requests' states after their history.
    tables = gated_delta.zero_states(DIMS, slots_total, K)  # (conv parts, recurrent)
    slots = [4, 1, 3]
    for s, h in zip(slots, history, strict=True):  # one token at a time: one compile
        state = gated_delta.zero_states(DIMS, 1, K)
        for tok in h:
            state = decode(p, DIMS, jnp.asarray(tok[None], jnp.float32), *state)[1:]
        tables = jax.tree.map(lambda t, v, s=s: t.at[s].set(v[0]), tables, state)
    lens = [4, 2, 1, 0]  # the last row is padding (the scratch row 5)
    new = [tokens(10 + i, n) for i, n in enumerate(lens[:3])]
    x = np.concatenate(new + [np.zeros((3, HIDDEN))])  # 3 padded tokens after the real ones
    starts = np.cumsum([0] + lens[:-1])
    y, pending = jax.jit(verify_forward, static_argnums=(1, 7))(
        p, DIMS, jnp.asarray(x, jnp.float32), jnp.asarray(starts, jnp.int32),
        jnp.asarray(lens, jnp.int32), jnp.asarray(slots + [5], jnp.int32), tables, WIDTH)
    assert isinstance(pending, PendingStates)
    accepted = [2, 0, 0, 0]  # row 0 keeps 3 inputs, rows 1 and 2 their first one only
    new_tables = jax.jit(commit)(pending, jnp.asarray(accepted, jnp.int32))
    assert jax.tree.structure(new_tables) == jax.tree.structure(tables)

    def row(tree, s: int) -> tuple[np.ndarray, np.ndarray]:
        """A slot's (conv [C, K-1] with its parts concatenated, recurrent) of ``tree``."""
        conv, rec = tree
        return np.concatenate([np.asarray(c[s]) for c in conv]), np.asarray(rec[s])

    np.testing.assert_array_equal(np.asarray(y)[sum(lens):], 0)  # padded tokens
    for b, (s, h) in enumerate(zip(slots, history, strict=True)):
        kept = new[b][: accepted[b] + 1]
        state = jax.tree.map(lambda t, s=s: t[s][None], tables)
        for j in range(len(new[b])):  # the one-token step over every input of the row
            out, *stepped = decode(p, DIMS, jnp.asarray(new[b][j][None], jnp.float32), *state)
            assert rel(y[starts[b] + j], out[0]) < 1e-5
            if j < len(kept):
                state = tuple(stepped)
        (conv_new, rec_new), (conv_want, rec_want) = row(new_tables, s), row(state, 0)
        assert rel(conv_new, conv_want) < 1e-5 and rel(rec_new, rec_want) < 1e-5
        # and the float64 reference over the history and the kept inputs
        ref_y, ref_conv, ref_state = gated_delta_layer(np.concatenate([h, kept]), w)
        assert rel(rec_new, ref_state) < 2e-5 and rel(conv_new, ref_conv) < 2e-5
        assert rel(y[starts[b]: starts[b] + len(kept)], ref_y[len(h):]) < 2e-5
    for s in (0, 2):  # slots of no row in the step: untouched
        for got, was in zip(row(new_tables, s), row(tables, s), strict=True):
            np.testing.assert_array_equal(got, was)


def test_commit_leaves_kv_arrays_alone():
    kv = jnp.ones((3, 2))
    assert commit(kv, jnp.zeros(1, jnp.int32)) is kv
