"""Speculative decoding (NGRAM drafts, TARGET_VERIFY steps), end to end through the Engine.

Greedy outputs, logprobs and routed-experts rows are checked against the float64 reference
(what the engine without speculation is checked against too); seeded sampling against an
engine without speculation (the same random draws must give the same tokens). Rejected drafts
must leave no trace: not in the rows (streamed or final), not in the prefix cache, and no KV
slot leaks. The pieces (the proposer, the acceptance rule, dropping a request's tail KV) are
checked on their own first.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from sgl_jax import Engine
from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.managers.req_memory import ReqMemory
from sgl_jax.srt.managers.schedule_batch import Req
from sgl_jax.srt.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from sgl_jax.srt.mem_cache.radix_cache import RadixCache
from sgl_jax.srt.sampling.sampling_params import SamplingParams
from sgl_jax.srt.server_args import ServerArgs
from sgl_jax.srt.speculative.ngram import NgramProposer
from sgl_jax.srt.speculative.verify import accepted_tokens
from sgl_jax.testing import TEST_MODEL_PATH, engine_args
from tests.engine_utils import (
    assert_no_leak,
    decoded_rows,
    expected_rows,
    prompt_ids,
    reference,
    reference_greedy,
)

CFG = ModelConfig.from_hf(TEST_MODEL_PATH)
L, K = CFG.num_hidden_layers, CFG.num_experts_per_tok
GREEDY = {"temperature": 0.0, "ignore_eos": True}
SETTINGS = dict(precompile_token_paddings=[16, 64], chunked_prefill_size=64,
                precompile_bs_paddings=[4, 8], enable_return_routed_experts=True)


# -- the pieces -------------------------------------------------------------------------------
def test_ngram_proposes_the_continuation_of_the_longest_earlier_match():
    p = NgramProposer(1, 4)
    # "7 8" occurred twice; the most recent occurrence is followed by 5 6.
    assert p.propose([7, 8, 1, 2, 7, 8, 5, 6, 9, 7, 8], 2) == [5, 6]
    # The longest suffix wins over a more recent shorter one: "3 7 8" -> 1.
    assert p.propose([3, 7, 8, 1, 4, 7, 8, 2, 3, 7, 8], 1) == [1]
    assert p.propose([3, 7, 8, 1, 4, 7, 8, 2, 3, 7, 8], 3) == [1, 4, 7]
    assert p.propose([1, 2, 3], 3) == []  # nothing recurs
    assert p.propose([5, 5], 3) == [5]  # only as many tokens as follow the match
    assert p.propose([1, 2, 1], 0) == []
    assert NgramProposer(2, 4).propose([9, 1, 5, 1], 2) == []  # a 1-token match is too short


def test_accepted_tokens_keeps_confirmed_drafts_and_the_target_token():
    assert accepted_tokens([], [4]) == [4]
    assert accepted_tokens([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted + bonus
    assert accepted_tokens([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # second draft rejected
    assert accepted_tokens([5, 6, 7], [1, 6, 7, 8]) == [1]
    with pytest.raises(ValueError):
        accepted_tokens([5], [5])


@pytest.mark.parametrize("page", [1, 4])
def test_shrink_kv_returns_the_pages_past_the_kept_positions(page):
    allocator = TokenToKVPoolAllocator(64, page_size=page)
    memory = ReqMemory(ReqToTokenPool(4, 64), allocator, RadixCache(allocator, page_size=page))
    req = Req("r", list(range(9)), SamplingParams(max_new_tokens=8), seed=0)
    assert memory.admit(req)
    memory.assign_kv(req, memory.alloc_kv(req, 9))
    req.kv_len = 9
    before = allocator.available_size()
    memory.shrink_kv(req, 6)  # positions 6..8 rejected
    assert req.kv_len == 6
    kept_pages = -(-6 // page)
    assert allocator.available_size() == before + (-(-9 // page) - kept_pages) * page
    # The request grows again from position 6, on its own last page first.
    slots = memory.alloc_kv(req, 4)
    memory.assign_kv(req, slots)
    if page > 1:
        assert slots[0] // page == memory.req_to_token_pool.req_to_token[req.req_pool_idx, 5] // page
    req.kv_len = 10
    memory.release(req, cache=False)
    assert allocator.available_size() == allocator.size


@pytest.mark.parametrize("page", [1, 4])
def test_held_kv_grows_past_a_step_in_flight_and_shrinks_to_its_successor(page):
    """The memory side of an overlapped verify step: a request holds 9 positions plus 2
    scratch ones of the step in flight; its successor's 4 positions are allocated past them,
    on the same page first; processing the step in flight keeps the successor's positions
    and scratch, and releasing the request gives every slot back."""
    allocator = TokenToKVPoolAllocator(64, page_size=page)
    memory = ReqMemory(ReqToTokenPool(4, 64), allocator, RadixCache(allocator, page_size=page))
    req = Req("r", list(range(5)), SamplingParams(max_new_tokens=20), seed=0)
    assert memory.admit(req)
    memory.assign_kv(req, memory.alloc_kv(req, 11))  # 9 positions + 2 scratch
    req.kv_len = 9
    table = memory.req_to_token_pool.req_to_token[req.req_pool_idx]
    slots = memory.extend_held_kv(req, 11, 4)
    np.testing.assert_array_equal(table[11:15], slots)
    if page > 1:
        assert slots[0] // page == table[10] // page  # the held last page continues
    assert len(set(table[:15].tolist())) == 15
    req.kv_len = 13  # the successor's 4 tokens counted at its launch
    before = allocator.available_size()
    # The step in flight kept 2 of its 4 positions: the successor starts 2 earlier.
    memory.shrink_kv(req, 11, held=15, reserve=2)
    assert req.kv_len == 11
    assert allocator.available_size() == before + (-(-15 // page) - -(-13 // page)) * page
    # The successor, processed with nothing after it, keeps 1 position and frees its scratch.
    memory.shrink_kv(req, 12, held=13)
    memory.release(req, cache=False)
    assert allocator.available_size() == allocator.size
    with pytest.raises(ValueError):
        memory.shrink_kv(req, 3, held=2)


@pytest.mark.parametrize("kwargs, message", [
    ({"speculative_algorithm": "NEXTN", "speculative_draft_model_path": "/tmp"}, "is for EAGLE"),
    ({"speculative_algorithm": "EAGLE", "model_path": "/tmp"}, "needs --speculative-draft"),
    ({"speculative_algorithm": "NGRAM", "speculative_eagle_topk": 2}, "chain"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_steps": 3,
      "speculative_num_draft_tokens": 8}, "a chain draft verifies"),
    ({"speculative_num_steps": 3}, "need --speculative-algorithm"),
    ({"speculative_algorithm": "NGRAM", "enable_dp_attention": True, "dp_size": 2,
      "ep_size": 2}, "DP attention"),
    ({"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 3,
      "speculative_ngram_max_match_window_size": 2}, "min <= max"),
])
def test_server_args_refuse_what_speculation_cannot_do(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**kwargs)


def test_server_args_defaults_and_overlap():
    args = ServerArgs(speculative_algorithm="NGRAM")
    assert (args.speculative_num_steps, args.speculative_eagle_topk,
            args.speculative_num_draft_tokens) == (3, 1, 4)
    assert args.disable_overlap_schedule  # NGRAM's drafts are proposed on the host
    # EAGLE / NEXTN verify steps read their inputs on the device: overlap stays on, except
    # where per_token expert records need each token's position at launch.
    assert not ServerArgs(speculative_algorithm="EAGLE").disable_overlap_schedule
    assert ServerArgs(speculative_algorithm="EAGLE",
                      expert_distribution_recorder_mode="per_token").disable_overlap_schedule


# -- end to end -------------------------------------------------------------------------------
def repetitive(seed: int) -> list[int]:
    """A prompt whose continuation NGRAM can guess: a random phrase said four times."""
    return prompt_ids(seed, 8) * 4


def write_random_draft(path: Path, seed: int = 0) -> str:
    """An EAGLE draft of the test model's shape with random weights (docs/speculative.md has
    the format): its drafts are mostly wrong, which must not change any output."""
    h, heads, kv_heads, hd, inter = (CFG.hidden_size, CFG.num_attention_heads,
                                     CFG.num_key_value_heads, CFG.head_dim, 96)
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    ones = lambda n: np.ones(n, np.float32)  # noqa: E731
    attn = "layers.0.self_attn."
    tensors = {
        "fc.weight": w(h, 2 * h), "norm.weight": ones(h),
        "layers.0.input_layernorm.weight": ones(h),
        "layers.0.post_attention_layernorm.weight": ones(h),
        attn + "q_proj.weight": w(heads * hd, h), attn + "k_proj.weight": w(kv_heads * hd, h),
        attn + "v_proj.weight": w(kv_heads * hd, h), attn + "o_proj.weight": w(h, heads * hd),
        attn + "q_norm.weight": ones(hd), attn + "k_norm.weight": ones(hd),
        "layers.0.mlp.gate_proj.weight": w(inter, h), "layers.0.mlp.up_proj.weight": w(inter, h),
        "layers.0.mlp.down_proj.weight": w(h, inter),
    }
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["SglJaxEagleDraft"], "model_type": "sgl_jax_eagle",
        "hidden_size": h, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": hd, "intermediate_size": inter, "rms_norm_eps": CFG.rms_norm_eps,
        "rope_theta": CFG.rope_theta, "vocab_size": CFG.vocab_size,
        "max_position_embeddings": 4096, "hidden_act": "silu", "torch_dtype": "float32"}))
    return str(path)


@pytest.fixture(scope="module", params=[("NGRAM", 1), ("NGRAM", 4), ("EAGLE", 4)],
                ids=lambda p: f"{p[0]}-page{p[1]}")
def engine(request, tmp_path_factory):
    algorithm, page = request.param
    extra = {}
    if algorithm == "EAGLE":
        extra["speculative_draft_model_path"] = write_random_draft(
            tmp_path_factory.mktemp("draft"))
        # Overlap off: these tests then cover device-input verify steps with nothing in
        # flight; the bundled-draft and NEXTN engines cover them overlapped.
        extra["disable_overlap_schedule"] = True
    eng = Engine(**engine_args(**SETTINGS), page_size=page, speculative_algorithm=algorithm,
                 speculative_num_steps=3, **extra)
    eng.drafts_guess = algorithm == "NGRAM"  # a random EAGLE draft is almost never right
    yield eng
    eng.shutdown()


@pytest.fixture(autouse=True)
def no_leaks(request):
    yield
    if "engine" in request.fixturenames:
        assert_no_leak(request.getfixturevalue("engine"))


def check_greedy(ids: list[int], out: dict, n: int) -> None:
    assert out["output_ids"] == reference_greedy(ids, n)
    assert out["meta_info"]["completion_tokens"] == n
    np.testing.assert_array_equal(decoded_rows(out, L, K), expected_rows(ids, out["output_ids"]))


def test_greedy_output_and_rows_equal_the_reference(engine):
    # One prompt of three prefill chunks (64 tokens each).
    prompts = [repetitive(i) for i in range(5)] + [prompt_ids(20 + i, 11 + 7 * i) for i in range(5)]
    prompts.append(prompt_ids(40, 150))
    lens = [40, 33, 1, 2, 57, 40, 5, 24, 61, 30, 20]
    compiles = engine.get_server_info()["num_compiles"]
    outs = engine.generate(input_ids=prompts,
                           sampling_params=[{**GREEDY, "max_new_tokens": n} for n in lens],
                           return_routed_experts=True)
    verify_steps = 0
    for ids, n, out in zip(prompts, lens, outs, strict=True):
        check_greedy(ids, out, n)
        ct = out["meta_info"]["spec_verify_ct"]
        assert 0 <= ct <= n - 1  # the first token comes from the prefill
        verify_steps += ct
    generated_by_verify = sum(lens) - len(lens)
    assert generated_by_verify > verify_steps or not engine.drafts_guess, "nothing accepted"
    info = engine.get_server_info()
    assert info["avg_spec_accept_length"] >= 1.0
    assert info["spec_overlapped_steps"] == 0  # these engines run without overlap
    assert info["num_compiles"] == compiles  # every verify shape was compiled at start-up


def test_logprobs_of_accepted_tokens_equal_the_reference(engine):
    ids = repetitive(7)
    out = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 24},
                          return_logprob=True, top_logprobs_num=2)
    assert out["meta_info"]["completion_tokens"] > out["meta_info"]["spec_verify_ct"] + 1 or \
        not engine.drafts_guess
    got = out["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in got] == out["output_ids"]
    logits = reference().forward(ids + out["output_ids"][:-1]).logits[len(ids) - 1 :]
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    want = logp[np.arange(len(out["output_ids"])), out["output_ids"]]
    np.testing.assert_allclose([v for v, _, _ in got], want, atol=1e-5)
    tops = out["meta_info"]["output_top_logprobs"]
    assert all(len(t) == 2 and t[0][1] == tok for t, tok in zip(tops, out["output_ids"],
                                                                 strict=True))


def test_stop_token_inside_accepted_drafts_ends_the_request_there(engine):
    ids = repetitive(3)
    full = reference_greedy(ids, 30)
    stop_at = next(i for i in range(8, 30) if full[i] not in full[:i])  # its first occurrence
    out = engine.generate(input_ids=ids, return_routed_experts=True, sampling_params={
        "temperature": 0.0, "max_new_tokens": 30, "stop_token_ids": [full[stop_at]]})
    assert out["output_ids"] == full[: stop_at + 1]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    np.testing.assert_array_equal(decoded_rows(out, L, K), expected_rows(ids, out["output_ids"]))


def test_streamed_rows_are_those_of_accepted_tokens(engine):
    ids = repetitive(11)
    chunks = list(engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 33},
                                  return_routed_experts=True, stream=True))
    output_ids = [t for c in chunks for t in c["output_ids"]]
    assert output_ids == reference_greedy(ids, 33)
    rows, start = [], 0
    for c in chunks:
        if c["meta_info"].get("routed_experts") is None:
            continue
        assert c["meta_info"]["routed_experts_start"] == start
        part = decoded_rows(c, L, K)
        rows.append(part)
        start += len(part)
    np.testing.assert_array_equal(np.concatenate(rows), expected_rows(ids, output_ids))
    assert chunks[-1]["meta_info"]["spec_verify_ct"] >= 1


def test_prefix_cache_holds_accepted_tokens_only(engine):
    engine.flush_cache()
    ids = repetitive(13)
    first = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 40},
                            return_routed_experts=True)
    check_greedy(ids, first, 40)
    # The whole sequence again: its cached prefix is what the first request kept.
    again = ids + first["output_ids"]
    second = engine.generate(input_ids=again, sampling_params={**GREEDY, "max_new_tokens": 8},
                             return_routed_experts=True)
    assert second["meta_info"]["cached_tokens"] >= len(again) - 8
    check_greedy(again, second, 8)


def test_abort_mid_stream_frees_everything(engine):
    ids = repetitive(17)
    stream = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 200},
                             return_routed_experts=True, stream=True)
    first = next(iter(stream))
    engine.abort_request(first["meta_info"]["id"])
    last = list(stream)[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    # no_leaks checks the memory after the test


@pytest.fixture(scope="module")
def plain_engine():
    eng = Engine(**engine_args(**SETTINGS))
    yield eng
    eng.shutdown()


def test_seeded_sampling_draws_the_tokens_it_draws_without_speculation(engine, plain_engine):
    prompts = [repetitive(30 + i) for i in range(6)]
    params = [{"temperature": t, "top_p": 0.9, "ignore_eos": True, "max_new_tokens": 32,
               "sampling_seed": 100 + i} for i, t in enumerate([0.3, 0.3, 0.7, 0.7, 1.0, 1.0])]
    spec = engine.generate(input_ids=prompts, sampling_params=params, return_routed_experts=True)
    plain = plain_engine.generate(input_ids=prompts, sampling_params=params,
                                  return_routed_experts=True)
    for ids, s, p in zip(prompts, spec, plain, strict=True):
        assert s["output_ids"] == p["output_ids"]
        np.testing.assert_array_equal(decoded_rows(s, L, K), expected_rows(ids, s["output_ids"]))
    assert sum(o["meta_info"]["completion_tokens"] - 1 - o["meta_info"]["spec_verify_ct"]
               for o in spec) > 0 or not engine.drafts_guess, "no draft was ever accepted"


def test_on_device_acceptance_counts_agree_with_the_host_rule():
    import jax.numpy as jnp

    from sgl_jax.srt.forward_batch_info import ForwardBatch, ForwardMode, make_padding_batch
    from sgl_jax.srt.speculative.eagle import accepted_counts

    rng = np.random.default_rng(0)
    for _ in range(20):
        lens = rng.integers(1, 5, size=rng.integers(1, 6))
        t_pad, b_pad = int(lens.sum()) + 3, len(lens) + 2
        drafts = [rng.integers(0, 3, n - 1).tolist() for n in lens]
        sampled = [rng.integers(0, 3, n).tolist() for n in lens]
        ids = np.zeros(t_pad, np.int32)
        ids[: lens.sum()] = np.concatenate([[9] + d for d in drafts])
        nxt = np.zeros(t_pad, np.int32)
        nxt[: lens.sum()] = np.concatenate(sampled)
        base = make_padding_batch(ForwardMode.TARGET_VERIFY, t_pad, b_pad, 16, b_pad)
        extend = np.zeros(b_pad, np.int32)
        extend[: len(lens)] = lens
        batch = ForwardBatch(**{**vars(base), "input_ids": jnp.asarray(ids),
                                "extend_lens": jnp.asarray(extend)})
        got = np.asarray(accepted_counts(batch, batch.token_to_req, jnp.asarray(nxt)))
        want = [len(accepted_tokens(d, s)) - 1 for d, s in zip(drafts, sampled, strict=True)]
        assert got[: len(lens)].tolist() == want


@pytest.fixture(scope="module", params=["NGRAM", "EAGLE"])
def small_pool(request, tmp_path_factory):
    extra = {}
    if request.param == "EAGLE":
        extra["speculative_draft_model_path"] = write_random_draft(
            tmp_path_factory.mktemp("draft"), seed=1)
    eng = Engine(**engine_args(**SETTINGS), page_size=4, max_total_tokens=256,
                 schedule_conservativeness=0.0, speculative_algorithm=request.param, **extra)
    yield eng
    assert_no_leak(eng)
    eng.shutdown()


def test_retraction_in_a_small_kv_pool(small_pool):
    before = small_pool.get_server_info()["num_retractions"]
    prompts = [repetitive(80 + i) + prompt_ids(90 + i, 5 * i) for i in range(4)]
    lens = [90, 80, 85, 75]
    outs = small_pool.generate(
        input_ids=prompts, sampling_params=[{**GREEDY, "max_new_tokens": n} for n in lens],
        return_routed_experts=True)
    assert small_pool.get_server_info()["num_retractions"] > before
    for ids, n, out in zip(prompts, lens, outs, strict=True):
        check_greedy(ids, out, n)


# -- the bundled model and its trained EAGLE draft ---------------------------------------------
@pytest.fixture(scope="module")
def bundled_eagle():
    eng = Engine(**{**engine_args(**SETTINGS), "model_path": None},
                 speculative_algorithm="EAGLE")  # the bundled draft by default
    yield eng
    assert_no_leak(eng)
    eng.shutdown()


def test_bundled_draft_drafts_what_the_reference_draft_drafts(bundled_eagle):
    """Greedy output equals the float64 reference, and each request takes exactly the verify
    steps a float64 simulation of the same 3-step chain (reference_eagle) takes: every draft
    the engine proposed was the reference draft's (a wrong draft would shift the counts)."""
    from sgl_jax.srt.configs.model_config import BUNDLED_EAGLE_DRAFT_PATH, BUNDLED_MODEL_PATH
    from sgl_jax.srt.tokenizer import Tokenizer
    from sgl_jax.tools.reference_eagle import EagleReference, accept_length

    target = reference(BUNDLED_MODEL_PATH)
    draft = EagleReference(BUNDLED_EAGLE_DRAFT_PATH, target)
    tokenizer = Tokenizer.from_pretrained(BUNDLED_MODEL_PATH)
    corpus = (Path(BUNDLED_MODEL_PATH).parent / "corpus.txt").read_text()
    texts = [corpus[i : i + 150] for i in (0, 3000, 7000)] + ["The lighthouse keeper"]
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    outs = bundled_eagle.generate(input_ids=prompts, sampling_params={**GREEDY,
                                                                     "max_new_tokens": 40})
    emitted = steps = 0
    for ids, out in zip(prompts, outs, strict=True):
        assert out["output_ids"] == reference_greedy(ids, 40, path=BUNDLED_MODEL_PATH)
        sim_emitted, sim_steps = accept_length(draft, ids, out["output_ids"], 3)
        assert out["meta_info"]["spec_verify_ct"] == sim_steps
        emitted, steps = emitted + sim_emitted, steps + sim_steps
    assert emitted / steps > 1.5, "the bundled draft accepts too little: retrain it?"
    # The checks above covered verify steps launched before their predecessor was processed.
    assert bundled_eagle.get_server_info()["spec_overlapped_steps"] > 0


def test_weight_update_then_outputs_are_the_new_models(small_pool, tmp_path):
    """After update_weights_from_disk the verify steps (and EAGLE's draft, through the
    target's embedding and LM head) run on the new weights: greedy output and rows are the
    new checkpoint's float64 reference; the drafts may get worse, the outputs cannot."""
    from sgl_jax.tools.make_random_model import write_random_model

    second = str(tmp_path / "second")
    write_random_model(second, "tiny", seed=5)
    result = small_pool.update_weights_from_disk(second)
    assert result["success"], result
    try:
        ids = repetitive(123)
        out = small_pool.generate(input_ids=ids, return_routed_experts=True,
                                  sampling_params={**GREEDY, "max_new_tokens": 30})
        assert out["output_ids"] == reference_greedy(ids, 30, path=second)
        np.testing.assert_array_equal(decoded_rows(out, L, K),
                                      expected_rows(ids, out["output_ids"], second))
    finally:
        assert small_pool.update_weights_from_disk(TEST_MODEL_PATH)["success"]



# -- NEXTN: the MTP layer of DeepSeek-V3 / GLM-4.5 checkpoints -----------------------------------
def test_overlapped_verify_steps_sample_stop_and_stream_as_without_speculation(bundled_eagle):
    """The bundled draft is often right, so overlapped verify steps start at every offset from
    their lower bound: seeded sampling, a stop token that lands inside an accepted run while
    the next step is in flight, and streamed rows are those of the bundled model without
    speculation."""
    from sgl_jax.srt.configs.model_config import BUNDLED_MODEL_PATH

    bundled = ModelConfig.from_hf(BUNDLED_MODEL_PATH)
    layers, top_k = bundled.num_hidden_layers, bundled.num_experts_per_tok
    plain = Engine(**{**engine_args(**SETTINGS), "model_path": None})
    try:
        prompts = [prompt_ids(80 + i, 20, vocab=500) for i in range(4)]
        sampled = [{"temperature": t, "top_p": 0.9, "max_new_tokens": 48, "ignore_eos": True,
                    "sampling_seed": 7 + i} for i, t in enumerate([0.3, 0.6, 0.9, 1.2])]
        want = plain.generate(input_ids=prompts, sampling_params=sampled)
        got = bundled_eagle.generate(input_ids=prompts, sampling_params=sampled)
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
        # More requests than run at once, some of several prompt chunks: admissions and
        # chunks come while verify steps are in flight; greedy and seeded, 1 to 69 tokens.
        rng = np.random.default_rng(0)
        queued = [prompt_ids(200 + i, int(rng.integers(5, 150))) for i in range(14)]
        mixed = [{"temperature": 0.8 * (i % 2), "sampling_seed": i, "ignore_eos": True,
                  "max_new_tokens": int(rng.integers(1, 70))} for i in range(14)]
        want = plain.generate(input_ids=queued, sampling_params=mixed, return_routed_experts=True)
        got = bundled_eagle.generate(input_ids=queued, sampling_params=mixed,
                                     return_routed_experts=True)
        for g, w in zip(got, want, strict=True):
            assert g["output_ids"] == w["output_ids"]
            assert g["meta_info"]["routed_experts"] == w["meta_info"]["routed_experts"]
        # A stop token from the middle of each greedy continuation.
        greedy = plain.generate(input_ids=prompts, sampling_params={**GREEDY,
                                                                  "max_new_tokens": 40})
        stops = [{"temperature": 0.0, "max_new_tokens": 40,
                  "stop_token_ids": [o["output_ids"][17]]} for o in greedy]
        want = plain.generate(input_ids=prompts, sampling_params=stops,
                              return_routed_experts=True)
        got = bundled_eagle.generate(input_ids=prompts, sampling_params=stops,
                                     return_routed_experts=True)
        for ids, g, w in zip(prompts, got, want, strict=True):
            assert g["output_ids"] == w["output_ids"]
            np.testing.assert_array_equal(decoded_rows(g, layers, top_k),
                                          expected_rows(ids, g["output_ids"], BUNDLED_MODEL_PATH))
        chunks = list(bundled_eagle.generate(input_ids=prompts[0], stream=True,
                                             return_routed_experts=True,
                                             sampling_params={**GREEDY, "max_new_tokens": 30}))
        output_ids = [t for c in chunks for t in c["output_ids"]]
        assert output_ids == greedy[0]["output_ids"][:30]
        rows = [decoded_rows(c, layers, top_k) for c in chunks
                if c["meta_info"].get("routed_experts") is not None]
        np.testing.assert_array_equal(
            np.concatenate(rows), expected_rows(prompts[0], output_ids, BUNDLED_MODEL_PATH))
    finally:
        plain.shutdown()
    assert bundled_eagle.get_server_info()["spec_overlapped_steps"] > 0


def test_requests_that_fill_the_context_draft_past_it_safely():
    """A request may end exactly at the context length: its last verify steps' draft chain
    writes scratch positions past it (the host rows and the device page table have room for
    them; the scheduler used to crash there). Output and rows equal the reference."""
    from sgl_jax.srt.configs.model_config import BUNDLED_MODEL_PATH

    bundled = ModelConfig.from_hf(BUNDLED_MODEL_PATH)
    eng = Engine(**{**engine_args(**SETTINGS), "model_path": None, "context_length": 128},
                 speculative_algorithm="EAGLE")
    try:
        for n in (100, 118, 124):
            ids = prompt_ids(n, n)
            out = eng.generate(input_ids=ids, return_routed_experts=True,
                               sampling_params={**GREEDY, "max_new_tokens": 128 - n})
            assert out["output_ids"] == reference_greedy(ids, 128 - n, path=BUNDLED_MODEL_PATH)
            np.testing.assert_array_equal(
                decoded_rows(out, bundled.num_hidden_layers, bundled.num_experts_per_tok),
                expected_rows(ids, out["output_ids"], BUNDLED_MODEL_PATH))
        assert_no_leak(eng)
    finally:
        eng.shutdown()


@pytest.fixture(scope="module", params=["tiny-deepseek-v3", "tiny-glm4-moe"])
def nextn_engine(request, tmp_path_factory):
    from sgl_jax.tools.make_random_model import write_random_model

    path = str(tmp_path_factory.mktemp("mtp") / request.param)
    write_random_model(path, request.param, seed=0)  # with one MTP layer
    eng = Engine(**engine_args(**{**SETTINGS, "model_path": path}), page_size=4,
                 speculative_algorithm="NEXTN")
    eng.path = path
    yield eng
    assert_no_leak(eng)
    eng.shutdown()


def test_nextn_output_rows_and_drafts_equal_the_reference(nextn_engine):
    """MLA (DeepSeek-V3) and GQA (GLM-4.5) targets with their MTP layer as the draft: output
    and rows are the float64 reference's, and every request takes the verify steps a float64
    simulation of the MTP chain (reference_nextn) takes."""
    from sgl_jax.tools.reference_eagle import accept_length
    from sgl_jax.tools.reference_nextn import NextnReference

    path = nextn_engine.path
    cfg = ModelConfig.from_hf(path)
    draft = NextnReference(reference(path))
    prompts = [repetitive(60 + i) for i in range(2)] + [prompt_ids(70, 90)]
    outs = nextn_engine.generate(input_ids=prompts, return_routed_experts=True,
                                 sampling_params={**GREEDY, "max_new_tokens": 24})
    for ids, out in zip(prompts, outs, strict=True):
        assert out["output_ids"] == reference_greedy(ids, 24, path=path)
        np.testing.assert_array_equal(
            decoded_rows(out, cfg.num_hidden_layers, cfg.num_experts_per_tok),
            expected_rows(ids, out["output_ids"], path))
        assert out["meta_info"]["spec_verify_ct"] == accept_length(draft, ids,
                                                                   out["output_ids"], 3)[1]
    assert nextn_engine.get_server_info()["spec_overlapped_steps"] > 0


def test_weight_updates_reach_the_mtp_draft(nextn_engine, tmp_path):
    """The MTP layer's tensors in a weight update update the NEXTN draft (they were logged and
    skipped, and such an update counted 0 parameters): the update counts the draft's
    parameter, and every request takes the verify steps the float64 simulation of the new
    layer takes. (A random MTP layer is almost never right, old or new, so the verify counts
    alone cannot tell the two layers apart; the parameter count does.)"""
    from safetensors.numpy import load_file

    from sgl_jax.tools.reference_eagle import accept_length
    from sgl_jax.tools.reference_nextn import NextnReference

    path = nextn_engine.path
    cfg = ModelConfig.from_hf(path)
    tensors = load_file(f"{path}/model.safetensors")
    name = f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight"
    old = tensors[name]
    new = np.random.default_rng(3).standard_normal(old.shape).astype(old.dtype) * old.std() * 4
    changed = tmp_path / "changed"
    changed.mkdir()
    for f in Path(path).iterdir():
        if f.name != "model.safetensors":
            (changed / f.name).write_bytes(f.read_bytes())
    save_file({**tensors, name: new}, str(changed / "model.safetensors"))
    after = NextnReference(reference(str(changed)))
    prompts = [repetitive(60 + i) for i in range(2)] + [prompt_ids(70, 90)]
    out = nextn_engine.update_weights_from_arrays({name: new})
    try:
        assert out["num_parameters"] == 1
        outs = nextn_engine.generate(input_ids=prompts,
                                     sampling_params={**GREEDY, "max_new_tokens": 24})
        for ids, o in zip(prompts, outs, strict=True):
            assert o["output_ids"] == reference_greedy(ids, 24, path=path)  # target unchanged
            assert o["meta_info"]["spec_verify_ct"] == accept_length(
                after, ids, o["output_ids"], 3)[1]
    finally:
        nextn_engine.update_weights_from_arrays({name: old})  # the module's engine as it was


def _chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square value exceeded with probability ~0.001 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def test_sampled_tokens_follow_the_target_distribution(engine):
    """A statistical check on a small vocabulary (top_k 4): the pair of tokens after the
    first, given the first, is distributed as the float64 reference says, whether drafts were
    accepted or rejected (the second token of the pair can be an accepted draft)."""
    if engine.drafts_guess is False:
        pytest.skip("a random EAGLE draft is almost never accepted: NGRAM runs it")
    ids = repetitive(77)
    n = 400
    params = [{"temperature": 1.0, "top_k": 4, "ignore_eos": True, "max_new_tokens": 3,
               "sampling_seed": 1000 + i} for i in range(n)]
    outs = engine.generate(input_ids=[ids] * n, sampling_params=params)
    seqs = [tuple(o["output_ids"]) for o in outs]
    first = max(set(s[0] for s in seqs), key=lambda t: sum(s[0] == t for s in seqs))
    pairs = [s[1:] for s in seqs if s[0] == first]

    def top4(logits: np.ndarray) -> dict[int, float]:
        top = np.argsort(-logits)[:4]
        p = np.exp(logits[top] - logits[top].max())
        return dict(zip(top.tolist(), (p / p.sum()).tolist(), strict=True))

    ref = reference()
    second = top4(ref.forward(ids + [first]).logits[-1])
    want = {(a, b): pa * pb for a, pa in second.items()
            for b, pb in top4(ref.forward(ids + [first, a]).logits[-1]).items()}
    assert set(pairs) <= set(want)
    observed = np.array([pairs.count(c) for c in want], float)
    expected = np.array(list(want.values())) * len(pairs)
    keep = expected >= 5  # cells too rare for the test are pooled
    observed = np.append(observed[keep], observed[~keep].sum())
    expected = np.append(expected[keep], expected[~keep].sum())
    stat = float(((observed - expected) ** 2 / np.maximum(expected, 1e-9)).sum())
    assert len(pairs) >= 60 and stat < _chi_square_critical(len(observed) - 1), (stat, pairs)
