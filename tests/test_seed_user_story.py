"""The design's own example, run as a new user runs it (M17 item 4).

People copy SGLang-JAX's import line for the decoder of routed experts; it must keep working
here, from the codec that stays JAX-free. Then the user story: an Engine that returns routed
experts, one request asking, its rows decoded and reshaped to ``(-1, num_hidden_layers,
num_experts_per_tok)``, one row per token fed to the model, each equal to the independent
float64 reference forward (``sgl_jax.tools.reference_forward``).
"""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.layers.moe.routed_experts_capturer import extract_routed_experts_from_meta_info
from sgl_jax.srt.tokenizer import Tokenizer
from sgl_jax.testing import TEST_MODEL_PATH, engine_args
from tests.engine_utils import expected_rows


def test_import_line_is_the_jax_free_codec():
    from sgl_jax.srt import routed_experts_codec

    assert extract_routed_experts_from_meta_info is \
        routed_experts_codec.extract_routed_experts_from_meta_info
    # The codec itself never loads JAX (the detokenizer and clients import it).
    check = ("import sys; import sgl_jax.srt.routed_experts_codec; "
             "assert 'jax' not in sys.modules, 'the codec imported jax'")
    subprocess.run([sys.executable, "-c", check], check=True)


def test_user_story():
    from sgl_jax import Engine

    prompt = "The capital of France is"
    engine = Engine(enable_return_routed_experts=True, **engine_args())
    try:
        out = engine.generate(prompt=prompt, return_routed_experts=True, max_new_tokens=8)
    finally:
        engine.shutdown()
    cfg = ModelConfig.from_hf(TEST_MODEL_PATH)  # the numbers /get_model_info serves
    rows = extract_routed_experts_from_meta_info(out).reshape(
        -1, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    meta = out["meta_info"]
    assert rows.shape[0] == meta["prompt_tokens"] + meta["completion_tokens"] - 1
    ids = Tokenizer.from_pretrained(TEST_MODEL_PATH).encode(prompt)
    assert len(ids) == meta["prompt_tokens"]
    np.testing.assert_array_equal(rows, expected_rows(ids, out["output_ids"]))


def test_global_capturer_is_the_current_schedulers():
    """``get_global_experts_capturer()`` returns the capturer of the scheduler running in this
    thread; another thread, where no scheduler runs, gets a no-op capturer."""
    from sgl_jax.srt.layers.moe.routed_experts_capturer import (
        _RoutedExpertsCapturerNoop,
        _RoutedExpertsCapturerReal,
        get_global_experts_capturer,
    )
    from tests.test_scheduler_abort import SteppedScheduler

    stepped = SteppedScheduler()
    try:
        capturer = get_global_experts_capturer()
        assert isinstance(capturer, _RoutedExpertsCapturerReal)
        assert capturer.host_cache is stepped.scheduler.memory.routed_rows
        elsewhere = []
        thread = threading.Thread(target=lambda: elsewhere.append(get_global_experts_capturer()))
        thread.start()
        thread.join()
        assert isinstance(elsewhere[0], _RoutedExpertsCapturerNoop)
    finally:
        stepped.close()
