"""Tests for mha.viz: every function draws what it says into the Axes it returns."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: no window, no display needed

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from matplotlib.axes import Axes

from mha import viz
from mha.flash import tile_schedule

TOKENS = ["the", "cat", "eats", "fish"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _weights(*shape):
    g = torch.Generator().manual_seed(0)
    return torch.softmax(torch.randn(*shape, generator=g), dim=-1)


def test_viz_does_not_import_bench():
    # viz needs only the log-log fit (mha.fit), not the timing and profiling machinery of bench.
    code = "import sys, mha.viz; print('mha.bench' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert result.stdout.strip() == "False"


def _ticklabels(axis):
    return [t.get_text() for t in axis.get_ticklabels()]


# --------------------------------------------------------------------------------------- heatmap


def test_attention_heatmap_draws_the_weights_with_labels():
    w = _weights(4, 4)
    ax = viz.attention_heatmap(w, query_labels=TOKENS, key_labels=TOKENS, title="head 0")
    assert isinstance(ax, Axes)
    assert len(ax.images) == 1
    np.testing.assert_allclose(ax.images[0].get_array(), w.numpy(), rtol=1e-6)
    assert _ticklabels(ax.xaxis) == TOKENS and _ticklabels(ax.yaxis) == TOKENS
    assert ax.get_xlabel() == "key" and ax.get_ylabel() == "query" and ax.get_title() == "head 0"
    assert len(ax.figure.axes) == 2  # the axes and its colorbar
    assert len(ax.texts) == 0


def test_attention_heatmap_into_given_axes_with_annotations():
    fig, given = plt.subplots()
    w = _weights(1, 1, 3, 5)  # leading size-1 dims are dropped
    ax = viz.attention_heatmap(w, ax=given, annotate=True, colorbar=False)
    assert ax is given
    assert len(fig.axes) == 1
    assert len(ax.texts) == 15
    assert ax.texts[0].get_text() == f"{w[0, 0, 0, 0].item():.2f}"


def test_attention_heatmap_accepts_float16_and_numpy():
    for w in (_weights(3, 3).half(), _weights(3, 3).numpy()):
        ax = viz.attention_heatmap(w)
        assert ax.images[0].get_array().shape == (3, 3)


def test_attention_heatmap_bad_input():
    with pytest.raises(
        ValueError, match=r"weights must be 2-D \(L, S\) for one head, got shape \(2, 4, 4\)"
    ):
        viz.attention_heatmap(_weights(2, 4, 4))
    with pytest.raises(ValueError, match="query_labels has 3 labels but there are 4 queries"):
        viz.attention_heatmap(_weights(4, 4), query_labels=TOKENS[:3])
    with pytest.raises(TypeError, match="key_labels must be a sequence of labels, got the string"):
        viz.attention_heatmap(_weights(4, 4), key_labels="abcd")
    with pytest.raises(TypeError, match="ax must be a matplotlib Axes or None"):
        viz.attention_heatmap(_weights(4, 4), ax="left")


# ----------------------------------------------------------------------------------------- heads


def test_attention_heads_grid_shares_one_scale():
    w = _weights(6, 4, 4)
    axes = viz.attention_heads(w, query_labels=TOKENS, key_labels=TOKENS, ncols=4)
    assert isinstance(axes, np.ndarray) and axes.shape == (6,)
    assert all(isinstance(ax, Axes) and len(ax.images) == 1 for ax in axes)
    for h, ax in enumerate(axes):
        np.testing.assert_allclose(ax.images[0].get_array(), w[h].numpy(), rtol=1e-6)
        assert ax.get_title() == f"head {h}"
    for ax in axes:
        assert ax.images[0].get_clim() == (0.0, pytest.approx(w.max().item()))
    fig = axes[0].figure
    visible = [ax for ax in fig.axes if ax.get_visible() and ax.images]
    assert len(visible) == 6  # 2 x 4 grid: the two unused panels are hidden
    assert len(fig.axes) == 8 + 1  # grid panels + one shared colorbar
    assert axes[0].get_ylabel() == "query" and axes[1].get_ylabel() == ""


def test_attention_heads_into_given_axes():
    _, given = plt.subplots(1, 3)
    axes = viz.attention_heads(_weights(1, 3, 2, 5), axes=given, titles=["a", "b", "c"])
    assert list(axes) == list(given)
    assert [ax.get_title() for ax in axes] == ["a", "b", "c"]


def test_attention_heads_bad_input():
    with pytest.raises(ValueError, match=r"weights must be 3-D \(H, L, S\), got shape \(4, 4\)"):
        viz.attention_heads(_weights(4, 4))
    with pytest.raises(ValueError, match="axes must hold at least 3 matplotlib Axes"):
        _, two = plt.subplots(1, 2)
        viz.attention_heads(_weights(3, 4, 4), axes=two)
    with pytest.raises(ValueError, match="ncols must be positive, got 0"):
        viz.attention_heads(_weights(3, 4, 4), ncols=0)
    with pytest.raises(TypeError, match=r"ncols must be an int, got float \(2.0\)"):
        viz.attention_heads(_weights(3, 4, 4), ncols=2.0)
    with pytest.raises(ValueError, match="titles has 2 labels but there are 3 heads"):
        viz.attention_heads(_weights(3, 4, 4), titles=["x", "y"])


# ------------------------------------------------------------------------------------------ mask


def test_mask_heatmap_draws_the_keep_mask():
    keep = torch.ones(4, 4, dtype=torch.bool).tril()
    ax = viz.mask_heatmap(
        keep, query_labels=TOKENS, key_labels=TOKENS, annotate=True, title="causal"
    )
    assert len(ax.images) == 1
    np.testing.assert_array_equal(ax.images[0].get_array(), keep.float().numpy())
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "attend (True)",
        "masked (False)",
    ]
    assert sorted(t.get_text() for t in ax.texts) == ["0"] * 6 + ["1"] * 10
    assert _ticklabels(ax.xaxis) == TOKENS and ax.get_title() == "causal"


def test_mask_heatmap_padding_mask_of_one_sequence_is_one_row():
    pad = torch.tensor([True, True, True, False]).view(1, 1, 1, 4)  # (B=1, 1, 1, S)
    ax = viz.mask_heatmap(pad)
    np.testing.assert_array_equal(ax.images[0].get_array(), [[1.0, 1.0, 1.0, 0.0]])


def test_mask_heatmap_bad_input():
    with pytest.raises(TypeError, match="mask must be a bool keep-mask, got dtype torch.float32"):
        viz.mask_heatmap(torch.zeros(3, 3))
    with pytest.raises(TypeError, match="mask must be a bool keep-mask, got dtype int64"):
        viz.mask_heatmap(np.ones((3, 3), dtype=np.int64))
    with pytest.raises(
        ValueError, match=r"mask must be \(L, S\) after dropping size-1 leading dims"
    ):
        viz.mask_heatmap(torch.ones(2, 3, 3, dtype=torch.bool))


# ---------------------------------------------------------------------------------------- curves


def test_loglog_curves_lines_scales_and_fitted_slopes():
    x = [256, 512, 1024, 2048]
    ys = {"naive": [v**2 / 1e4 for v in x], "flash": [v / 100 for v in x]}
    ax = viz.loglog_curves(x, ys, ylabel="MiB", title="peak memory")
    assert len(ax.get_lines()) == 2
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert _ticklabels(ax.xaxis) == ["256", "512", "1024", "2048"]
    assert ax.get_ylabel() == "MiB" and ax.get_xlabel() == "sequence length"

    ax = viz.loglog_curves(x, ys, fit=True)
    assert len(ax.get_lines()) == 4  # each curve and its dashed fit
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["naive (slope 2.00)", "flash (slope 1.00)"]
    fitted = ax.get_lines()[1]
    assert fitted.get_linestyle() == "--"
    np.testing.assert_allclose(fitted.get_ydata(), ys["naive"], rtol=1e-9)


def test_loglog_curves_skips_missing_points():
    ax = viz.loglog_curves(
        [1, 2, 4], {"a": [1.0, 2.0, None], "b": torch.tensor([1.0, 4.0, 16.0])}, fit=True
    )
    assert list(ax.get_lines()[0].get_xdata()) == [1.0, 2.0]
    assert "b (slope 2.00)" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_loglog_curves_bad_input():
    with pytest.raises(ValueError, match=r"ys\['a'\] has 2 values but x has 3"):
        viz.loglog_curves([1, 2, 3], {"a": [1, 2]})
    with pytest.raises(TypeError, match="ys must be a non-empty mapping"):
        viz.loglog_curves([1, 2], [[1, 2]])
    with pytest.raises(ValueError, match="y must hold positive finite numbers"):
        viz.loglog_curves([1, 2], {"a": [1, 0]}, fit=True)


# ----------------------------------------------------------------------------------------- tiles


def _causal_status(L, block):
    """Tiles computed by mha.flash_attention for causal attention, from its own schedule."""
    n = -(-L // block)
    status = np.zeros((n, n), dtype=int)
    for t in tile_schedule(L, L, block_size=block, is_causal=True):
        status[t.q0 // block : -(-t.q1 // block), t.k0 // block] = 1
    return status


def test_tile_grid_from_the_flash_schedule():
    status = _causal_status(200, 64)  # 4 x 4 tiles, the last one ragged (192-199)
    text = [[str(v) for v in row] for row in status]
    ax = viz.tile_grid(status, block_size=64, lengths=(200, 200), text=text, title="causal")
    assert len(ax.images) == 1
    np.testing.assert_array_equal(ax.images[0].get_array(), status)
    assert _ticklabels(ax.xaxis) == ["0-63", "64-127", "128-191", "192-199"]
    assert _ticklabels(ax.yaxis) == ["0-63", "64-127", "128-191", "192-199"]
    assert len(ax.texts) == 16
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["skipped", "computed"]
    assert ax.get_title() == "causal"


def test_tile_grid_categories_bools_and_plain_axes():
    ax = viz.tile_grid(torch.tensor([[True, False], [True, True]]))
    assert _ticklabels(ax.xaxis) == ["0", "1"] and ax.get_xlabel() == "key block"
    status = [[2, 0], [1, 2]]
    ax = viz.tile_grid(status, categories=("skipped", "full", "diagonal"), colors=["w", "b", "r"])
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["skipped", "full", "diagonal"]
    assert len(ax.texts) == 0


def test_tile_grid_bad_input():
    with pytest.raises(
        ValueError, match=r"status values must index categories \(0..1\), got values 0..2"
    ):
        viz.tile_grid([[0, 2]])
    with pytest.raises(
        TypeError, match="status must hold integer categories or bools, got dtype float64"
    ):
        viz.tile_grid([[0.5, 1.0]])
    with pytest.raises(ValueError, match="status must be 2-D"):
        viz.tile_grid([0, 1])
    with pytest.raises(ValueError, match=r"text must have the shape of status \(1, 2\)"):
        viz.tile_grid([[0, 1]], text=[["a"]])
    with pytest.raises(ValueError, match="colors has 1 entries but categories has 2"):
        viz.tile_grid([[0, 1]], colors=["r"])
    with pytest.raises(ValueError, match="block_size must be positive, got 0"):
        viz.tile_grid([[0, 1]], block_size=0)
    with pytest.raises(TypeError, match="block_size must be an int, got str"):
        viz.tile_grid([[0, 1]], block_size="64")
    with pytest.raises(ValueError, match="lengths"):
        viz.tile_grid([[0, 1]], block_size=64, lengths=(64, 300))
