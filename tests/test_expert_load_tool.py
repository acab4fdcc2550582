"""python -m sgl_jax.tools.expert_load: dump reading (stat / per_pass / per_token), the per-device
load and imbalance arithmetic, the pictures (skipped without matplotlib) and its errors."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np
import pytest

from sgl_jax.tools import expert_load as el

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# 3 decoder layers (layer 0 dense), 4 experts, top-2.
COUNTS = np.array([[0, 0, 0, 0], [6, 2, 1, 1], [1, 1, 4, 4]], np.int64)


# ---- arithmetic (numpy only) ----------------------------------------------------------------


def test_device_load_and_imbalance_exact():
    contiguous = el.contiguous_table(4, 2)
    assert contiguous.tolist() == [[0, 1], [2, 3]]
    load = el.device_load(COUNTS, contiguous)
    assert load.tolist() == [[0, 0], [8, 2], [2, 8]]
    assert el.device_load(COUNTS[1], [[0, 2], [1, 3]]).tolist() == [7, 3]
    assert el.imbalance([8, 2]) == pytest.approx(1.6)
    assert el.imbalance([5, 5]) == 1.0
    assert el.imbalance([0, 0]) == 1.0
    assert el.imbalance([4, 0, 0, 0]) == 4.0

    p = el.placement_load(COUNTS, [1, 2], contiguous, "contiguous")
    assert p.total.tolist() == [10, 10] and p.imbalance == 1.0  # even in total ...
    assert p.mean_layer_imbalance == pytest.approx(1.6)  # ... but not per layer
    assert p.max_layer_imbalance == pytest.approx(1.6)
    # per-layer tables: {layer: table, "default": table}
    per_layer = {"default": contiguous, 1: np.array([[0, 3], [1, 2]]),
                 2: np.array([[0, 2], [1, 3]])}
    q = el.placement_load(COUNTS, [1, 2], per_layer, "mine")
    assert q.per_layer.tolist() == [[7, 3], [5, 5]]
    assert q.imbalance == pytest.approx(12 / 10)
    assert q.mean_layer_imbalance == pytest.approx((1.4 + 1.0) / 2)


def test_device_load_rejects_a_bad_mapping():
    with pytest.raises(ValueError, match="exactly once"):
        el.device_load(COUNTS, [[0, 1], [1, 3]])
    with pytest.raises(ValueError, match="does not divide"):
        el.contiguous_table(4, 3)


def test_balanced_placements():
    load = el.ExpertLoad(counts=COUNTS, moe_layers=[1, 2], mode="stat", num_experts_per_tok=2)
    assert load.expert_totals().tolist() == [7, 3, 5, 5]
    places = el.placements_for(load, 2, None, "both")
    assert [p.name for p in places] == ["contiguous", "balanced (totals)", "balanced per layer"]
    # totals [7, 3, 5, 5]: 7 -> dev 0, 5 -> dev 1, 5 -> dev 1, 3 -> dev 0: [[0, 1], [2, 3]]
    assert places[1].total.tolist() == [10, 10]
    assert places[2].mean_layer_imbalance == pytest.approx((1.4 + 1.0) / 2)
    assert places[2].max_layer_imbalance < places[0].max_layer_imbalance
    assert [p.name for p in el.placements_for(load, 2, None, True)] == ["contiguous", "balanced"]
    assert el.placements_for(load, None, None, False) == []
    with pytest.raises(ValueError, match="--ep-size"):
        el.placements_for(load, None, None, True)
    mapped = el.placements_for(load, None, json.dumps([[0, 2], [1, 3]]), False)
    assert mapped[1].total.tolist() == [12, 8] and mapped[1].name == "mapping"
    with pytest.raises(ValueError, match="ep-size"):
        el.placements_for(load, 4, "[[0, 2], [1, 3]]", False)


def test_token_share():
    share = el.token_share(COUNTS, 2)
    assert np.isnan(share[0]).all()
    assert share[1].tolist() == [1.2, 0.4, 0.2, 0.2] and share[2].sum() == pytest.approx(2)
    assert el.token_share(COUNTS)[1].sum() == pytest.approx(1)


# ---- reading the three dump modes -------------------------------------------------------------


def _meta(**kw):
    return {"num_experts": np.int64(4), "num_experts_per_tok": np.int64(2),
            "moe_layers": np.array([1, 2]), "architecture": np.array("Qwen3MoeForCausalLM"),
            **kw}


def test_read_stat(tmp_path):
    path = tmp_path / "stat.npz"
    np.savez(path, mode="stat", counts=COUNTS, num_tokens=np.int64(5), **_meta())
    load = el.load_dump(str(path))
    assert load.mode == "stat" and load.counts.tolist() == COUNTS.tolist()
    assert load.moe_layers == [1, 2] and load.num_experts == 4
    assert load.num_experts_per_tok == 2 and load.num_tokens == 5
    assert load.architecture == "Qwen3MoeForCausalLM"


def test_read_stat_with_moe_rows_only_and_no_metadata(tmp_path):
    path = tmp_path / "moe_rows.npz"  # rows = the MoE layers only
    np.savez(path, mode="stat", counts=COUNTS[1:], moe_layers=np.array([1, 2]))
    load = el.load_dump(str(path))
    assert load.counts.tolist() == COUNTS.tolist() and load.moe_layers == [1, 2]
    bare = tmp_path / "bare.npz"  # no mode, no metadata: recognised by its arrays
    np.savez(bare, counts=COUNTS)
    load = el.load_dump(str(bare))
    assert load.mode == "stat" and load.moe_layers == [1, 2]
    assert load.num_experts_per_tok is None


def test_read_the_recorders_layout(tmp_path):
    """The recorder keeps rows of the MoE layers only, with num_hidden_layers beside them."""
    meta = _meta(num_hidden_layers=np.int64(4), moe_layers=np.array([0, 2]),
                 recording=np.array(False), buffer_size=np.int64(1000), dropped=np.int64(3))
    rows = np.array([[6, 2, 1, 1], [1, 1, 4, 4]], np.int64)
    path = tmp_path / "recorder_stat.npz"
    np.savez(path, mode="stat", counts=rows, num_tokens=np.int64(5), **meta)
    load = el.load_dump(str(path))
    assert load.counts.shape == (4, 4) and load.moe_layers == [0, 2]
    assert load.counts[[0, 2]].tolist() == rows.tolist() and not load.counts[[1, 3]].any()
    assert load.extra["dropped"] == 3
    passes = tmp_path / "recorder_per_pass.npz"
    np.savez(passes, mode="per_pass", counts=np.stack([rows, rows]),
             forward_mode=np.array([0, 1], np.int8), num_tokens=np.array([3, 2]), **meta)
    assert el.load_dump(str(passes)).counts[[0, 2]].tolist() == (2 * rows).tolist()
    empty = tmp_path / "recorder_empty.npz"  # recording started, nothing ran yet
    np.savez(empty, mode="per_pass", counts=np.zeros((0, 2, 4), np.int64),
             forward_mode=np.zeros(0, np.int8), num_tokens=np.zeros(0, np.int64), **meta)
    load = el.load_dump(str(empty))
    assert load.counts.shape == (4, 4) and not load.counts.any() and load.num_tokens == 0
    # trailing dense layers: num_hidden_layers says where the MoE rows go
    np.savez(path, mode="stat", counts=rows, **{**meta, "moe_layers": np.array([0, 1])})
    load = el.load_dump(str(path))
    assert load.counts.shape == (4, 4) and load.counts[:2].tolist() == rows.tolist()
    np.savez(path, mode="stat", counts=rows, **{**meta, "moe_layers": np.array([0, 1, 2])})
    with pytest.raises(ValueError, match="every decoder layer or exactly the MoE layers"):
        el.load_dump(str(path))


def test_read_per_pass(tmp_path):
    passes = np.stack([COUNTS, 2 * COUNTS, np.zeros_like(COUNTS)])
    path = tmp_path / "per_pass.npz"
    np.savez(path, mode="per_pass", counts=passes, forward_mode=np.array([1, 2, 2]),
             num_tokens=np.array([5, 10, 0]), **_meta())
    load = el.load_dump(str(path))
    assert load.mode == "per_pass" and load.counts.tolist() == (3 * COUNTS).tolist()
    assert load.num_tokens == 15 and load.extra["num_passes"] == 3


@pytest.mark.parametrize("dtype", [np.int32, np.int16])
def test_read_per_token(tmp_path, dtype):
    # 5 tokens, 3 layers (layer 0 dense: -1), top-2; bincount must give COUNTS
    layer1 = [[0, 1], [0, 1], [0, 2], [0, 3], [0, 0]]  # 0:6 1:2 2:1 3:1
    layer2 = [[2, 3], [2, 3], [2, 3], [2, 3], [0, 1]]  # 0:1 1:1 2:4 3:4
    ids = np.stack([np.full((5, 2), -1), layer1, layer2], axis=1).astype(dtype)
    assert ids.shape == (5, 3, 2)
    path = tmp_path / "per_token.npz"
    np.savez(path, mode="per_token", topk_ids=ids, rid=np.array(["a", "a", "a", "b", "b"]),
             position=np.array([0, 1, 2, 0, 1]), **_meta())
    load = el.load_dump(str(path))
    assert load.mode == "per_token" and load.counts.tolist() == COUNTS.tolist()
    assert load.num_tokens == 5 and load.moe_layers == [1, 2]
    # without metadata: E from the ids, k from the shape, MoE layers from the -1 rows
    bare = tmp_path / "bare_tokens.npz"
    np.savez(bare, topk_ids=ids)
    load = el.load_dump(str(bare))
    assert load.counts.tolist() == COUNTS.tolist() and load.moe_layers == [1, 2]
    assert load.num_experts_per_tok == 2


def test_bad_files(tmp_path):
    text = tmp_path / "not.npz"
    text.write_text("hello")
    with pytest.raises(ValueError, match="not a readable .npz"):
        el.load_dump(str(text))
    npy = tmp_path / "one.npy"
    np.save(npy, COUNTS)
    with pytest.raises(ValueError, match="single .npy"):
        el.load_dump(str(npy))
    other = tmp_path / "other.npz"
    np.savez(other, weights=np.zeros(3))
    with pytest.raises(ValueError, match="not an expert distribution dump"):
        el.load_dump(str(other))
    mode = tmp_path / "mode.npz"
    np.savez(mode, mode="sometimes", counts=COUNTS)
    with pytest.raises(ValueError, match="unknown dump mode"):
        el.load_dump(str(mode))
    shape = tmp_path / "shape.npz"
    np.savez(shape, mode="per_pass", counts=COUNTS)
    with pytest.raises(ValueError, match=r"\[passes, layers, num_experts\]"):
        el.load_dump(str(shape))
    with pytest.raises(FileNotFoundError):
        el.load_dump(str(tmp_path / "missing.npz"))
    # the CLI: exit status 2 and the reason, no traceback
    assert el.main([str(other), "--out", str(tmp_path / "x.png")]) == 2
    assert not (tmp_path / "x.png").exists()


# ---- without matplotlib -------------------------------------------------------------------------


def test_clear_error_without_matplotlib(tmp_path, monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(el.PlotUnavailableError, match=r'pip install "sgl_jax\[plot\]"'):
        el.render_expert_load_png(COUNTS, [1, 2], "t")
    assert issubclass(el.PlotUnavailableError, ImportError)
    path = tmp_path / "stat.npz"
    np.savez(path, mode="stat", counts=COUNTS, **_meta())
    out = tmp_path / "load.png"
    assert el.main([str(path), "--out", str(out), "--ep-size", "2", "--balanced"]) == 3
    captured = capsys.readouterr()
    assert 'pip install "sgl_jax[plot]"' in captured.err
    assert "max/mean" in captured.out  # the figures are still printed
    assert not out.exists()


def test_importing_sgl_jax_does_not_import_matplotlib():
    code = ("import sys; import sgl_jax, sgl_jax.tools.expert_load; "
            "assert 'matplotlib' not in sys.modules; "
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


# ---- pictures -----------------------------------------------------------------------------------


def _read_png(data: bytes):
    plt = pytest.importorskip("matplotlib.pyplot")
    assert data[:8] == PNG_SIGNATURE
    return plt.imread(io.BytesIO(data), format="png")


def test_render_expert_load_png():
    pytest.importorskip("matplotlib")
    png = el.render_expert_load_png(COUNTS, [1, 2], "three layers", num_experts_per_tok=2)
    img = _read_png(png)
    assert img.shape[:2] == (600, 1000)  # figsize (10, 6) at dpi 100
    # rows of the MoE layers only, and an unknown k, draw too
    img = _read_png(el.render_expert_load_png(COUNTS[1:], [1, 2], "moe rows", num_layers=4))
    assert img.shape[:2] == (600, 1000)


def test_render_from_threads():
    """The server draws in worker threads: no pyplot state, so concurrent calls are safe."""
    pytest.importorskip("matplotlib")
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        pngs = list(pool.map(lambda i: el.render_expert_load_png(COUNTS * (i + 1), [1, 2],
                                                                   f"t{i}", 2), range(4)))
    assert all(p[:8] == PNG_SIGNATURE for p in pngs) and len(set(pngs)) == 4


@pytest.mark.parametrize("extra", [[], ["--ep-size", "2", "--balanced"],
                                   ["--ep-size", "2", "--balanced", "both"],
                                   ["--mapping", "[[0, 3], [1, 2]]"]])
def test_cli_writes_a_png(tmp_path, extra):
    pytest.importorskip("matplotlib")
    path = tmp_path / "stat.npz"
    np.savez(path, mode="stat", counts=COUNTS, num_tokens=np.int64(5), **_meta())
    out = tmp_path / "load.png"
    assert el.main([str(path), "--out", str(out), *extra]) == 0
    img = _read_png(out.read_bytes())
    assert img.shape[:2] == ((1150, 1000) if extra else (600, 1000))


def test_cli_subprocess_prints_the_imbalance_and_saves_the_mapping(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "pass.npz"
    np.savez(path, mode="per_pass", counts=COUNTS[None], num_tokens=np.array([5]), **_meta())
    out, saved = tmp_path / "load.png", tmp_path / "mapping.json"
    res = subprocess.run(
        [sys.executable, "-m", "sgl_jax.tools.expert_load", str(path), "--out", str(out),
         "--ep-size", "2", "--balanced", "per-layer", "--save-mapping", str(saved)],
        capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "contiguous: tokens per device [10, 10], max/mean 1.000" in res.stdout
    assert "(per layer: mean 1.600, worst 1.600)" in res.stdout
    assert "balanced per layer:" in res.stdout
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    mapping = json.loads(saved.read_text())
    assert mapping["default"] == [[0, 1], [2, 3]] and set(mapping) == {"default", "1", "2"}
