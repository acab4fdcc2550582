"""The class of each op of a compiled step (``classify``).

Classes, from each op's source stack (the ``StackFrames`` XLA keeps: file and function,
innermost first), its ``op_name`` metadata and its opcode (``CLASSES`` in this order):
``expert_matmuls`` (grouped / dense expert matmuls: the gmm kernels (``MATMUL_KERNELS``), dots
in ``layers/moe/`` expert code, ``ragged_dot``), ``moe_dispatch`` (the rest of the expert
code: sorting assignments by expert, gathers, the weighted combine), ``router``
(``layers/moe/router.py``, routing),
``attention`` (the attention backend, the kernel's metadata, rotary embedding (not where the
token matmul kernel rotates q and k after their projections: ``projections``); not its
projections), ``kv_cache_write`` (``write_kv``: the step's new K/V into the cache),
``projections`` (every other dot: q/k/v/o, dense MLP, the LM head; the token matmul
kernel, ``PROJECTION_KERNELS``), ``sampler``
(``layers/sampler.py``, logprobs), ``sampler_full_sort`` (``breakdown``), ``collectives``
(all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute, and XLA:TPU's
collective fusions: a reduce-scatter's pieces), ``copies`` (copy,
copy-start, transpose and fusions of only those: layout changes and prefetches without a
model source, e.g. a weight re-laid out for a kernel every step) and ``other``
(norms, embedding lookup, the batch's metadata, elementwise glue).
"""

from __future__ import annotations

from sgl_jax.tools.aot.hlo.parse import Instr, Module

CLASSES = ("expert_matmuls", "moe_dispatch", "router", "attention", "kv_cache_write",
           "projections", "sampler", "sampler_full_sort", "collectives", "copies", "other")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
               "ragged-all-to-all", "collective-permute", "collective-broadcast")
COPIES = {"copy", "copy-start", "transpose"}
# (file path fragment or None, function name or None) -> class, first match wins, checked
# for each frame from the innermost outward.
FRAME_RULES: tuple[tuple[str | None, str | None, str], ...] = (
    (None, "full_sort", "sampler"),  # inside the fallback branch; its excess is split off
    (None, "write_kv", "kv_cache_write"),
    ("/layers/sampler.py", None, "sampler"),
    ("/layers/logprobs.py", None, "sampler"),
    ("/layers/moe/router.py", None, "router"),
    ("/layers/moe/routing.py", None, "router"),
    ("/layers/moe/ragged.py", None, "experts"),
    ("/layers/moe/dense.py", None, "experts"),
    ("/layers/moe/experts.py", None, "experts"),
    ("/layers/moe/dispatch.py", None, "moe_dispatch"),
    ("/layers/moe/ep_moe.py", None, "moe_dispatch"),
    ("/layers/attention/", None, "attention"),
    ("/ragged_paged_attention/", None, "attention"),
    ("/layers/rotary.py", None, "attention"),
    ("/layers/norm_rope.py", None, "attention"),  # q/k norm and rotary, one kernel
    ("/layers/norm.py", None, "other"),
    ("/forward_batch_info.py", None, "other"),
)
FALLBACK_FUNCTIONS = ("full_sort",)
# Pallas kernels of the gmm backend that are grouped matmuls (``jit(name)`` in their op
# name): Megablox's ``gmm``, gate + up + activation, and down with the per-token combine
# (whose adds into the sums are counted with its matmul).
MATMUL_KERNELS = ("gmm", "gate_up_act", "down_and_combine")
PROJECTION_KERNELS = ("token_matmul",)  # layers/token_matmul.py: a prefill's q/k/v


def _has_dot(module: Module, ins: Instr) -> bool:
    if ins.opcode in ("dot", "convolution"):
        return True
    if ins.opcode == "custom-call":
        return _expert_kernel(ins) or _projection_kernel(ins)
    if ins.opcode == "fusion":
        return any(_has_dot(module, i) for c in ins.called
                   for i in module.computations.get(c, []))
    return False


def _kernel_call(ins: Instr, kernels: tuple[str, ...]) -> bool:
    """A custom call made by one of the jitted kernel functions named ``kernels``."""
    return ins.opcode == "custom-call" and any(f"jit({k})" in ins.op_name for k in kernels)


def _expert_kernel(ins: Instr) -> bool:
    """A custom call that is a grouped expert matmul: ``ragged_dot`` or a gmm kernel."""
    return (ins.opcode == "custom-call"
            and ("ragged-dot" in ins.name or "ragged_dot" in ins.op_name)
            or _kernel_call(ins, MATMUL_KERNELS))


def _projection_kernel(ins: Instr) -> bool:
    """A custom call that is a projection's matmul kernel (``PROJECTION_KERNELS``)."""
    return _kernel_call(ins, PROJECTION_KERNELS)


def _frame_chain(module: Module, ins: Instr) -> list[tuple[str, str]]:
    """The op's stack (innermost first): its own frame, or for a fusion without one the frame
    of the fused instruction that has one (its root first)."""
    if ins.frame is not None:
        return module.frames.get(ins.frame, [])
    if ins.opcode == "fusion":
        body = [i for c in ins.called for i in module.computations.get(c, [])]
        for i in sorted(body, key=lambda i: not i.root):
            if i.frame is not None:
                return module.frames.get(i.frame, [])
    return []


def classify(module: Module, ins: Instr, default: str = "other") -> str:
    op = ins.opcode.removesuffix("-start")
    if op in COLLECTIVES or (op == "fusion" and '"collective_algorithm_config"' in ins.attrs):
        return "collectives"  # (XLA:TPU's collective fusions: a reduce-scatter's pieces)
    name = ins.op_name
    if "ragged_paged_attention" in name:
        return "attention"
    dot = _has_dot(module, ins)
    if _expert_kernel(ins) or "ragged_dot" in name:
        return "expert_matmuls"
    if _projection_kernel(ins):
        return "projections"
    for file, function in _frame_chain(module, ins):
        for frag, fn, cls in FRAME_RULES:
            if (frag is None or frag in file) and (fn is None or fn == function.split(".")[-1]):
                if cls == "experts":
                    return "expert_matmuls" if dot else "moe_dispatch"
                if cls == "attention" and dot and "/ragged_paged_attention/" not in file:
                    continue  # a projection called from the attention module
                return cls
    if dot:
        return "projections"
    if default != "other":  # inside a loop or branch of a known class (the sampler's)
        return default
    if ins.opcode in COPIES or _is_layout_fusion(module, ins):
        return "copies"
    return default


_LAYOUT = {"parameter", "bitcast", "copy", "transpose", "reshape", "tuple", "get-tuple-element"}


def _is_layout_fusion(module: Module, ins: Instr) -> bool:
    """A fusion that only moves data to another layout (``copy_bitcast_fusion``, ...)."""
    if ins.opcode != "fusion":
        return False
    body = [i for c in ins.called for i in module.computations.get(c, [])]
    return bool(body) and all(i.opcode in _LAYOUT for i in body)


def in_fallback(module: Module, computation: str, seen: set[str] | None = None) -> bool:
    """Whether a computation (or a loop or call in it) holds ops of the sampler's sort
    fallback."""
    seen = seen if seen is not None else set()
    if computation in seen:
        return False
    seen.add(computation)
    for ins in module.computations.get(computation, []):
        if any(fn.split(".")[-1] in FALLBACK_FUNCTIONS for _, fn in _frame_chain(module, ins)):
            return True
        # Not into a nested conditional: a branch that holds the fallback's own cond (the
        # sampler's sampled_rows) is not the fallback.
        if ins.opcode not in ("fusion", "conditional") and any(
                in_fallback(module, c, seen) for c in ins.called):
            return True
    return False
