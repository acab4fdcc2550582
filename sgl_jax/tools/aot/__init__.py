"""TPU ahead-of-time cost and memory report of the engine's step, on a machine without a TPU.

    python -m sgl_jax.tools.aot_report --model-config qwen3-30b-a3b --topology v6e:2x2 \\
        --tp-size 4 --decode-bs 64 256 --prefill-tokens 2048 --prefill-requests 8 \\
        --context-len 4096 [--json]

libtpu (``pip install "sgl_jax[tpu]"``) provides compile-only TPU devices for a named topology
(``jax.experimental.topologies``); the CPU stays JAX's default backend. The model runner is
built in abstract mode (no weights: parameters, KV cache and buffers are sharded
``jax.ShapeDtypeStruct``), and for every bucket the very step the engine serves
(``ModelRunner.lower_bucket``) is compiled by XLA:TPU. ``--model-config`` needs only a
``config.json`` (a checkpoint directory, the file itself, or a bundled name:
``qwen3-30b-a3b``, ``qwen3-235b-a22b``, ``deepseek-v3``, ``glm-4.5-air``, ``mixtral-8x7b``,
``qwen2-57b-a14b``). Multi-head latent attention (DeepSeek-V3) compiles with the ``native``
attention backend (the Pallas kernel cannot read its latent cache; asking for pallas is a
usage error).

Buckets: decode at each ``--decode-bs`` with every request at ``--context-len`` positions of
context; prefill of ``--prefill-tokens`` tokens split evenly over ``--prefill-requests`` new
requests (no cached prefix), compiled with the rows the engine uses for that token bucket.

What is reported, per bucket (``--json``: one list, one object per bucket):

- ``compiled_flops`` / ``bytes_accessed``: the compiled program's cost, summed over all devices
  = ``xla_*`` + ``kernel_*``. ``xla_*`` is XLA's ``cost_analysis()``, which on JAX 0.10.2 /
  libtpu is PER DEVICE (a matmul sharded 4 ways reports 1/4 of the FLOPs; checked), so it is
  multiplied by the device count. XLA cannot see inside a Pallas kernel (it counts 0 FLOPs and
  ~0 bytes for the ragged paged attention custom call), so ``kernel_*`` adds each kernel call's
  work analytically: ``4 * (heads / tp) * head_dim * sum(q_len * kv_len)`` FLOPs and one read of
  each sequence's K/V plus the queries and outputs (a lower bound: the kernel re-reads K/V per
  query block in prefill). With the ``native`` backend, XLA's own count of its attention loop
  (one compiled call alone at the bucket's shape, ``native_attention_xla_*``) is taken out per
  layer and the analytic cost put in. MLA: ``attention_flops_per_pair`` FLOPs per pair and head,
  and one read of the replicated latent rows. Two more properties of XLA's count: a ``while``
  loop's body is counted once whatever its trip count (the ``native`` attention backend's block
  loop is thus nearly invisible), and a ``cond`` counts its most expensive branch (the sampler's
  full-vocabulary sort fallback, which runs only when some row's top-k/top-p support is not
  inside the 1024 most probable ids, is counted in every bucket; ``--sampler-breakdown``
  compiles the sampler alone and reports its share and ``roofline_ms_without_sampler``). With
  the ragged expert backend and ``ep_size > 1``, XLA counts every ``ragged_dot`` at its static
  size, all ``T * k`` token-expert rows on every device of the "expert" axis, though only the
  device's own share is in its groups: ``ragged_static_excess_flops`` is that excess
  (``(ep - 1)`` times the ideal expert FLOPs) and ``flops_ratio_local_rows`` the ratio without
  it. With gmm the static size is one pass window, 1.25 times the device's share padded to
  the row tile (``gmm.pass_rows``, ``gmm.row_tile``; the excess is then a quarter of the ideal
  expert FLOPs).
- ``ideal_flops``: from the config, ``2 * active_params * tokens + 2 * hidden * vocab *
  sampled + attention`` (sampled: one row per request, one per token in a verify step);
  active parameters per token and layer are the attention projections
  (``attention_params``: GQA q/k/v/o; MLA q_a/q_b or q_proj, kv_a_proj_with_mqa, kv_b_proj,
  which also accounts for the absorbed matmuls, and o_proj) plus, in a MoE layer, the router
  (``hidden * experts``), the top-k experts' three matrices (``k * 3 * hidden *
  moe_intermediate``), the shared experts (``3 * hidden * shared width``) and Qwen2-MoE's
  shared-expert gate, in a dense layer the MLP (``3 * hidden * intermediate``); the LM head
  counts once per sampled row; attention over the actual context is ``heads *
  attention_flops_per_pair * sum(q_len * kv_len)`` per layer (GQA ``4 * head_dim`` per pair;
  MLA ``2 * (kv_lora + qk_rope) + 2 * kv_lora``; decode: one query per request over
  ``context_len`` positions; prefill: causal, ``n * (n + 1) / 2`` per request of ``n``
  tokens). ``flops_ratio = compiled / ideal``: above 1
  by work replicated over devices (attention, router and LM head on every device of the
  "expert" axis; the sampler on all), padded rows, the sampler and the static ragged_dot count.
- ``peak_hbm_bytes_per_device``: from ``memory_analysis()`` (per device): arguments (parameters
  + KV cache + buffers) + outputs not aliased to donated arguments + temporaries + program code.
  Parameters and KV cache per device are broken out from the shardings.
- ``roofline_ms``: ``max(flops / peak FLOP/s, bytes / HBM bandwidth)`` per device, with the
  chip's published bf16 peak and HBM bandwidth (communication over ICI is not modelled);
  ``tokens_per_s = tokens / roofline``.

``--dp-size D`` (= ``--ep-size``) compiles the step of data-parallel attention
(``enable_dp_attention``): ``--decode-bs`` and the prefill are GLOBAL, their requests dealt
round robin over the D ranks, each rank padded to the busiest one (``dp_buckets``); each
device holds and attends for its rank's requests only (the KV cache per device is 1 / D of
the total; the analytic attention is the busiest rank's, summed with ``rank_load``);
``max_requests_fit`` is the largest global batch at ``--context-len`` whose KV fits next to
the parameters. Every bucket also reports the bytes a device sends over the interconnect:
the MoE dispatch per layer from the formula (``dispatch_bytes_per_moe_layer``) and from the
compiled HLO's collectives (``collective_bytes``), and all of the step's collectives.

``--verify-tokens K`` (speculative decoding; not with ``--dp-size``, which the engine does not
combine with speculation yet) adds after each decode bucket the TARGET_VERIFY step of the same
requests: K tokens each (the last token and K - 1 drafts, the engine's
``--speculative-num-draft-tokens``) over ``context_len - K`` cached positions, logits and
sampling at every token, compiled by a runner built with ``--speculative-algorithm`` (NGRAM
by default: the target's step only; EAGLE with ``--speculative-draft-model-path``, or NEXTN
with the model's MTP layer: the draft's extend and chain are compiled into the step).
Each verify record carries ``bytes_vs_decode``, ``flops_vs_decode``, ``roofline_vs_decode``
and the same per verified token (``bytes_per_token_vs_decode``, ...).

``--breakdown`` splits each bucket's XLA count over op classes (expert matmuls, MoE
dispatch, router, attention, KV write, projections, sampler, the sampler's sort fallback,
collectives, copies, other), summing exactly to XLA's total (``hlo.breakdown``; the attention
kernel's analytic work is listed next to them). ``--extend-tokens N ...`` adds, per N, an
extend bucket of one request appending N tokens to a cached context (last token at
``--context-len`` positions), compiled at the engine's token bucket for N.

A layout that cannot hold parameters + KV cache in HBM (per device) exits with code 2 and says
what to change (MLA: its latent KV cache is replicated, tp does not split it); a compiled
peak above HBM is flagged (``peak_exceeds_hbm``, a warning). ``--scale-from-layers A B``
compiles truncated models and extrapolates every compiled figure linearly to the model's depth
(for deep models, whose full compile takes long): A and B layers of the model's majority kind,
plus one dense layer before A MoE layers when the model has both kinds (DeepSeek-V3's first 3
layers are dense), solved for per-dense-layer and per-MoE-layer costs separately; the
per-device parameter and KV figures are always the full model's.

Modules (``sgl_jax/tools/aot/``; ``sgl_jax/tools/aot_report.py`` is the command's entry point):

- ``cli``: the command line (argparse), printing the table or JSON, the exit codes.
- ``report``: one report, end to end: devices, the abstract runner, every bucket compiled at
  every depth, a record per bucket.
- ``topology``: compile-only TPU devices, the chip's published figures, the mesh order.
- ``model``: ``--model-config`` to a config, the attention backend, the abstract ModelRunner.
- ``buckets``: the steps compiled (decode, verify, prefill, extend; with DP attention).
- ``compile_step``: the engine's step lowered and compiled per bucket (cost and memory
  analysis: ``Compiled``), and the native attention call and the sampler alone.
- ``depth``: ``--scale-from-layers``: truncated models, extrapolation to full depth.
- ``accounting``: FLOPs and bytes from the config (ideal FLOPs from the active parameters,
  the attention kernel's work, KV bytes, dispatch bytes, a grouped matmul's static excess).
- ``memory_fit``: whether parameters and KV cache fit in HBM; the largest batch that does.
- ``roofline``: a bucket's record (compiled vs ideal, peak HBM, roofline time, tokens/s);
  verify against decode.
- ``tables``: the text output (table, notes, per-class breakdown).
- ``hlo/``: reading the compiled HLO: ``parse`` (instructions, source stacks, sizes),
  ``op_costs`` and ``op_classes`` (one op's FLOPs and bytes, and its class), ``breakdown``
  (the classes summing to XLA's total, ``--breakdown``) and ``collectives`` (the bytes a
  device sends over the interconnect).
"""
