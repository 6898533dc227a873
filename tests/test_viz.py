"""Tests for the lab's drawing modules (viz, charts, figures): each function draws what it says into
the Axes it returns."""

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

from mha.flash import tile_schedule
from mha.lab import charts, figures, viz

TOKENS = ["the", "cat", "eats", "fish"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _weights(*shape):
    g = torch.Generator().manual_seed(0)
    return torch.softmax(torch.randn(*shape, generator=g), dim=-1)


def test_drawing_does_not_import_the_measuring_instruments():
    # The drawing modules need only the log-log fit (mha.lab.fit), not the timing and profiling
    # machinery of timing, memory and bench.
    code = (
        "import sys, mha.lab.viz, mha.lab.charts, mha.lab.figures; "
        "print(sorted({'mha.lab.bench', 'mha.lab.timing', 'mha.lab.memory'} & set(sys.modules)))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert result.stdout.strip() == "[]"


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


def test_text_color_on_picks_the_higher_contrast():
    assert viz.text_color_on((0.0, 0.0, 0.0)) == "white"
    assert viz.text_color_on((1.0, 1.0, 1.0, 1.0)) == "black"  # an alpha channel is ignored
    assert viz.text_color_on((0.0, 0.0, 1.0)) == "white"  # pure blue is dark
    assert viz.text_color_on((1.0, 1.0, 0.0)) == "black"  # yellow is light
    # viridis: white on its dark purple end, black on its yellow end *and* on its mid greens,
    # where the old "white below 60 % of the range" rule gave white text on a light cell
    cmap = matplotlib.colormaps["viridis"]
    assert [viz.text_color_on(cmap(x)) for x in (0.0, 0.55, 1.0)] == ["white", "black", "black"]


def test_attention_heatmap_annotations_readable_on_every_cell():
    w = torch.linspace(0, 1, 12).reshape(3, 4)
    ax = viz.attention_heatmap(w, annotate=True, colorbar=False, vmin=0.0, vmax=1.0)
    image = ax.images[0]
    for text in ax.texts:
        i, j = round(text.get_position()[1]), round(text.get_position()[0])
        cell = image.cmap(image.norm(w[i, j].item()))
        assert text.get_color() == viz.text_color_on(cell)
        assert text.get_fontsize() >= 9
    assert {t.get_color() for t in ax.texts} == {"white", "black"}


def test_heatmap_grid_two_columns_shared_scale_and_labels():
    square, narrow = _weights(3, 3), _weights(3, 2)
    axes = viz.heatmap_grid(
        {"a": square, "b": narrow, "c": square},
        query_labels=TOKENS[:3],
        key_labels=[TOKENS[:3], ["d0", "d1"], TOKENS[1:]],
        title="three panels",
    )
    assert len(axes) == 3 and [a.get_title() for a in axes] == ["a", "b", "c"]
    fig = axes[0].figure
    assert sum(a.get_visible() for a in fig.axes) == 3  # 2 columns: the 4th cell is hidden
    assert fig.get_size_inches()[0] <= 10 and fig.get_suptitle() == "three panels"
    assert [len(a.texts) for a in axes] == [9, 6, 9]  # every cell annotated
    assert all(a.images[0].get_clim() == (0.0, 1.0) for a in axes)
    assert _ticklabels(axes[1].xaxis) == ["d0", "d1"] and _ticklabels(axes[2].xaxis) == TOKENS[1:]
    assert _ticklabels(axes[1].yaxis) == TOKENS[:3]
    np.testing.assert_allclose(axes[1].images[0].get_array(), narrow.numpy(), rtol=1e-6)


def test_heatmap_grid_and_outline_cell_bad_input():
    with pytest.raises(TypeError, match="matrices must be a non-empty mapping"):
        viz.heatmap_grid({})
    with pytest.raises(ValueError, match="key_labels has 1 label lists but there are 2 matrices"):
        viz.heatmap_grid({"a": _weights(2, 2), "b": _weights(2, 2)}, key_labels=[["x", "y"]])
    with pytest.raises(TypeError, match="query_labels must be a sequence of labels"):
        viz.heatmap_grid({"a": _weights(2, 2)}, query_labels="xy")
    with pytest.raises(ValueError, match="ncols"):
        viz.heatmap_grid({"a": _weights(2, 2)}, ncols=0)
    _, ax = plt.subplots()
    with pytest.raises(ValueError, match="col must be a non-negative integer, got -1"):
        viz.outline_cell(ax, 0, -1)


def test_outline_cell_frames_one_cell():
    ax = viz.attention_heatmap(_weights(4, 4), colorbar=False)
    assert viz.outline_cell(ax, 2, 3) is ax
    (frame,) = ax.patches
    assert frame.get_xy() == (2.5, 1.5) and frame.get_width() == frame.get_height() == 1
    assert not frame.get_fill()


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
    ax = charts.loglog_curves(x, ys, ylabel="MiB", title="peak memory")
    assert len(ax.get_lines()) == 2
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert _ticklabels(ax.xaxis) == ["256", "512", "1024", "2048"]
    assert ax.get_ylabel() == "MiB" and ax.get_xlabel() == "sequence length"

    ax = charts.loglog_curves(x, ys, fit=True)
    assert len(ax.get_lines()) == 4  # each curve and its dashed fit
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["naive (slope 2.00)", "flash (slope 1.00)"]
    fitted = ax.get_lines()[1]
    assert fitted.get_linestyle() == "--"
    np.testing.assert_allclose(fitted.get_ydata(), ys["naive"], rtol=1e-9)


def test_loglog_curves_skips_missing_points():
    ax = charts.loglog_curves(
        [1, 2, 4], {"a": [1.0, 2.0, None], "b": torch.tensor([1.0, 4.0, 16.0])}, fit=True
    )
    assert list(ax.get_lines()[0].get_xdata()) == [1.0, 2.0]
    assert "b (slope 2.00)" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_loglog_curves_bad_input():
    with pytest.raises(ValueError, match=r"ys\['a'\] has 2 values but x has 3"):
        charts.loglog_curves([1, 2, 3], {"a": [1, 2]})
    with pytest.raises(TypeError, match="ys must be a non-empty mapping"):
        charts.loglog_curves([1, 2], [[1, 2]])
    with pytest.raises(ValueError, match="y must hold positive finite numbers"):
        charts.loglog_curves([1, 2], {"a": [1, 0]}, fit=True)


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


# ------------------------------------------------------------------------------ bars and ratios


def test_grouped_bars_one_container_per_group_and_gaps():
    ax = charts.grouped_bars(
        ["ch01", "ch02", "ch03"],
        {"CPU": [10.0, 20.0, 30.0], "H100": [2.0, None, 3.0]},
        ylabel="seconds",
        title="wall time",
    )
    assert len(ax.containers) == 2
    assert [len(c) for c in ax.containers] == [3, 2]  # the missing bar is left out
    assert [p.get_height() for p in ax.containers[0]] == [10.0, 20.0, 30.0]
    assert _ticklabels(ax.xaxis) == ["ch01", "ch02", "ch03"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["CPU", "H100"]
    assert ax.get_ylabel() == "seconds" and ax.get_title() == "wall time"


def test_grouped_bars_bad_input():
    with pytest.raises(ValueError, match=r"groups\['a'\] has 1 values but there are 2 categories"):
        charts.grouped_bars(["x", "y"], {"a": [1.0]})
    with pytest.raises(TypeError, match="groups must be a non-empty mapping"):
        charts.grouped_bars(["x"], {})
    with pytest.raises(TypeError, match="categories must be a sequence of labels"):
        charts.grouped_bars("xy", {"a": [1.0, 2.0]})


def test_ratio_curves_with_target_line():
    x = [1024, 2048, 4096]
    ax = charts.ratio_curves(x, {"D=64": [0.4, 0.6, None], "D=128": [0.7, 0.8, 0.9]}, target=0.5)
    assert len(ax.get_lines()) == 3  # two curves and the target
    assert list(ax.get_lines()[0].get_xdata()) == [1024.0, 2048.0]
    assert list(ax.get_lines()[2].get_ydata()) == [0.5, 0.5]
    assert ax.get_xscale() == "log" and ax.get_ylim()[0] == 0
    assert _ticklabels(ax.xaxis) == ["1024", "2048", "4096"]
    assert "target 0.5" in [t.get_text() for t in ax.get_legend().get_texts()]
    with pytest.raises(ValueError, match=r"ys\['a'\] has 1 values but x has 3"):
        charts.ratio_curves(x, {"a": [1.0]})


# ---------------------------------------------------------------------------- mask panels, tiles


def _block_mask(blocks, block):
    """A block pattern (n, n) expanded to positions (n * block, n * block)."""
    return blocks.repeat_interleave(block, 0).repeat_interleave(block, 1)


def test_skippable_tiles_match_the_flash_schedule():
    g = torch.Generator().manual_seed(0)
    blocks = torch.rand(6, 6, generator=g) < 0.4
    mask = _block_mask(blocks, 8)[:45, :41]  # ragged last tiles on both axes
    skip = viz.skippable_tiles(mask, 8)
    assert skip.shape == (6, 6)
    np.testing.assert_array_equal(skip, ~blocks.numpy())
    # tile_schedule visits exactly the tiles that are not skippable, one query block at a time
    visited = sum(
        len(tile_schedule(min(8, 45 - r), 41, block_size=8, attn_mask=mask[r : r + 8]))
        for r in range(0, 45, 8)
    )
    assert visited == int((~skip).sum())


def test_mask_tiles_hatches_the_skippable_tiles():
    blocks = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    ax = viz.mask_tiles(_block_mask(blocks, 4), 4, title="blocks")
    hatched = [p for p in ax.patches if p.get_hatch()]
    assert len(hatched) == 5  # the five all-False tiles, at (row, col) * 4 - 0.5
    corners = sorted(p.get_xy() for p in hatched)
    assert corners == [(-0.5, 7.5), (3.5, -0.5), (3.5, 7.5), (7.5, -0.5), (7.5, 3.5)]
    assert len(ax.images) == 1 and ax.images[0].get_array().shape == (12, 12)
    assert ax.get_title() == "blocks" and ax.get_legend() is not None
    assert ax.get_xlim() == (-0.5, 11.5) and ax.get_ylim() == (11.5, -0.5)


def test_mask_panels_two_columns_one_legend():
    masks = {"causal": torch.ones(5, 5, dtype=torch.bool).tril(), "full": torch.ones(5, 5) > 0}
    masks["none"] = ~masks["full"]
    axes = viz.mask_panels(masks, title="three masks")
    assert len(axes) == 3 and all(isinstance(a, Axes) for a in axes)
    fig = axes[0].figure
    assert [a.get_title() for a in axes] == ["causal", "full", "none"]
    assert sum(a.get_visible() for a in fig.axes) == 3  # the fourth grid cell is hidden
    assert fig.get_size_inches()[0] <= 10  # two columns: readable on a phone
    assert all(a.get_legend() is None for a in axes) and len(fig.legends) == 1
    np.testing.assert_array_equal(axes[0].images[0].get_array(), masks["causal"].float().numpy())
    tiled = viz.mask_panels({"a": masks["causal"]}, block_size=2)
    assert len(tiled) == 1 and len(tiled[0].figure.legends[0].get_texts()) == 3


def test_mask_panels_and_tiles_bad_input():
    with pytest.raises(TypeError, match="masks must be a non-empty mapping"):
        viz.mask_panels({})
    with pytest.raises(TypeError, match="mask must be a bool keep-mask"):
        viz.mask_panels({"float": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="block_size"):
        viz.mask_tiles(torch.ones(4, 4, dtype=torch.bool), 0)
    with pytest.raises(ValueError, match="ncols"):
        viz.mask_panels({"a": torch.ones(2, 2, dtype=torch.bool)}, ncols=0)


def test_quantile_band_median_line_and_band():
    x = [4, 16, 64]
    samples = torch.arange(1, 31, dtype=torch.float32).reshape(3, 10)  # (len(x), N)
    ax = charts.quantile_band(x, samples, label="grad", marker="s-")
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == x
    assert np.allclose(line.get_ydata(), samples.median(dim=1).values + 0.5)  # even N: mean of two
    assert line.get_label() == "grad" and len(ax.collections) == 1
    lo, hi = np.quantile(samples.numpy(), [0.25, 0.75], axis=1)
    band = ax.collections[0].get_paths()[0].vertices[:, 1]
    assert np.isclose(band.min(), lo.min()) and np.isclose(band.max(), hi.max())
    assert ax.get_xscale() == ax.get_yscale() == "log"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["4", "16", "64"]
    plt.close(ax.figure)


def test_quantile_band_bad_input():
    with pytest.raises(ValueError, match=r"samples must have shape \(len\(x\), N\) = \(2, N\)"):
        charts.quantile_band([1, 2], np.ones((3, 4)))
    with pytest.raises(ValueError, match="0.25 quantile of samples must be positive"):
        charts.quantile_band([1, 2], np.zeros((2, 4)))
    few_zeros = np.ones((2, 8))
    few_zeros[:, 0] = 0.0  # below the band: drawn without complaint
    plt.close(charts.quantile_band([1, 2], few_zeros).figure)
    with pytest.raises(ValueError, match="band must satisfy"):
        charts.quantile_band([1, 2], np.ones((2, 4)), band=(0.8, 0.2))
    with pytest.raises(TypeError, match="ax must be a matplotlib Axes"):
        charts.quantile_band([1, 2], np.ones((2, 4)), ax="left")


# ------------------------------------------------------------------------- the layer, drawn


def _texts(ax):
    return [t.get_text() for t in ax.texts]


def test_record_shapes_self_attention_and_the_layer_is_restored():
    import mha

    layer = mha.MultiHeadAttention(6, 3)
    x = torch.randn(1, 3, 6, generator=torch.Generator().manual_seed(0))
    shapes = figures.record_shapes(layer, x)
    assert shapes["query"] == (1, 3, 6) and shapes["key"] is None and shapes["value"] is None
    assert shapes["q_proj"] == shapes["out_proj"] == (6, 6)
    assert shapes["q_projected"] == shapes["v_projected"] == (1, 3, 6)
    assert shapes["q"] == shapes["k"] == shapes["v"] == shapes["heads"] == (1, 3, 3, 2)
    assert shapes["weights"] == (1, 3, 3, 3)
    assert shapes["concat"] == shapes["out"] == (1, 3, 6)
    # the recording wrappers are gone: the layer runs its own methods again, hook removed
    assert "_project" not in vars(layer) and "_attend" not in vars(layer)
    assert not layer.out_proj._forward_hooks


def test_record_shapes_cross_attention_with_grouped_heads():
    import mha

    layer = mha.MultiHeadAttention(8, 4, kdim=5, vdim=3, num_kv_heads=2)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 4, 8, generator=g), torch.randn(2, 7, 5, generator=g)
    v = torch.randn(2, 7, 3, generator=g)
    shapes = figures.record_shapes(layer, q, k, v)
    assert shapes["key"] == (2, 7, 5) and shapes["value"] == (2, 7, 3)
    assert shapes["k_proj"] == (4, 5) and shapes["k_projected"] == (2, 7, 4)
    assert shapes["q"] == (2, 4, 4, 2) and shapes["k"] == shapes["v"] == (2, 2, 7, 2)
    assert shapes["weights"] == (2, 4, 4, 7) and shapes["out"] == (2, 4, 8)


def test_record_shapes_rejects_other_modules():
    with pytest.raises(TypeError, match="layer must be an mha.MultiHeadAttention"):
        figures.record_shapes(torch.nn.Linear(4, 4), torch.zeros(1, 2, 4))


def test_layer_diagram_writes_the_recorded_shapes():
    import mha

    layer = mha.MultiHeadAttention(6, 3)
    shapes = figures.record_shapes(layer, torch.zeros(1, 3, 6))
    ax = figures.layer_diagram(shapes)
    texts = "\n".join(_texts(ax))
    assert "(B, L, E) = (1, 3, 6)" in texts
    assert texts.count("weight (6, 6)") == 4  # q, k, v and out projections
    assert "q (1, 3, 3, 2)" in texts
    assert sum(t.startswith("head ") for t in _texts(ax)) == 3  # one box per head
    assert "(1, 3, 3, 2) → (1, 3, 6)" in texts  # the concatenation


def test_layer_diagram_elides_many_heads_and_rejects_bad_input():
    import mha

    shapes = figures.record_shapes(mha.MultiHeadAttention(16, 8), torch.zeros(1, 2, 16))
    ax = figures.layer_diagram(shapes, max_heads=4)
    heads = [t.split("\n")[0] for t in _texts(ax) if t.startswith("head ")]
    assert heads == ["head 0", "head 1", "head 7"] and "..." in _texts(ax)
    with pytest.raises(ValueError, match="record_shapes"):
        figures.layer_diagram({"query": (1, 2, 3)})
    with pytest.raises(ValueError, match="max_heads"):
        figures.layer_diagram(shapes, max_heads=1)


def test_layer_sketch_draws_one_box_per_head():
    ax = figures.layer_sketch(4)
    heads = [t.split("\n")[0] for t in _texts(ax) if t.startswith("head ")]
    assert heads == ["head 0", "head 1", "head 2", "head 3"]
    assert any("H = 4" in t for t in _texts(ax))
    for bad in (1, 7):
        with pytest.raises(ValueError, match="num_heads must be between 2 and 6"):
            figures.layer_sketch(bad)


def test_block_diagram_writes_the_block_sizes():
    from mha.block import TransformerBlock

    ax = figures.block_diagram(TransformerBlock(32, 4, 80, activation="relu"))
    texts = "\n".join(_texts(ax))
    assert "H = 4 heads, E = 32" in texts
    assert "Linear 32 → 80\nRELU\nLinear 80 → 32" in texts
    assert texts.count("LayerNorm") == 2 and texts.count("residual") == 2
    with pytest.raises(TypeError, match="block must be an mha.TransformerBlock"):
        figures.block_diagram(torch.nn.Linear(4, 4))


def test_split_slots_names_token_and_feature_of_every_slot():
    ids = torch.arange(3 * 6).view(1, 3, 6)  # 3 tokens, E = 6
    wrong = ids.view(3, -1, 2)  # view without transpose: head 0 is token 0 alone
    ax = figures.split_slots(wrong[0], embed_dim=6, token_names=["cat", "eats", "fish"], title="h0")
    assert sorted(_texts(ax)) == sorted(f"cat\nf{f}" for f in range(6))
    assert len(ax.patches) == 6 and ax.get_title() == "h0"
    right = ids.view(1, 3, 3, 2).transpose(1, 2)[0]
    ax = figures.split_slots(right[1], embed_dim=6, token_names=["cat", "eats", "fish"])
    expected = [f"{t}\nf{f}" for t in ("cat", "eats", "fish") for f in (2, 3)]
    assert sorted(_texts(ax)) == sorted(expected)
    with pytest.raises(ValueError, match="token_names has 1 names"):
        figures.split_slots(right[1], embed_dim=6, token_names=["cat"])
    with pytest.raises(ValueError, match="2-D integer"):
        figures.split_slots(torch.zeros(3, 2), embed_dim=6, token_names=["a"])


def test_kv_head_sharing_names_the_kv_head_of_each_query_head():
    ax = figures.kv_head_sharing(8, {"MHA": 8, "GQA": 2, "MQA": 1})
    grid = ax.images[0].get_array()
    assert grid.shape == (8, 3)
    assert list(grid[:, 0]) == list(range(8))
    assert list(grid[:, 1]) == [0, 0, 0, 0, 1, 1, 1, 1] and not grid[:, 2].any()
    assert "kv 7" in _texts(ax)
    with pytest.raises(ValueError, match="divisible"):
        figures.kv_head_sharing(8, {"odd": 3})
    with pytest.raises(TypeError, match="layouts"):
        figures.kv_head_sharing(8, {})


def test_roofline_draws_measured_and_reference_roofs_and_points():
    points = {"matmul": (100.0, 2e10), "softmax": (0.6, 1e9)}
    refs = {"GPU (published)": (1e14, 1e12)}
    ax = figures.roofline(points, peak=2e10, bandwidth=1e10, references=refs)
    roof, ref, *markers = ax.get_lines()
    x, y = roof.get_data()
    # min(peak, bandwidth * I): the slope below the ridge (2 FLOP/byte), flat above it
    np.testing.assert_allclose(y, np.minimum(2e10, 1e10 * x))
    np.testing.assert_allclose(ref.get_data()[1], np.minimum(1e14, 1e12 * x))
    assert ref.get_linestyle() == "--" and x.min() < 0.6 and x.max() > 100
    assert [m.get_data()[0][0] for m in markers] == [100.0, 0.6]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["this machine (measured)", "GPU (published)", "matmul", "softmax"]
    assert ax.get_xscale() == ax.get_yscale() == "log"
    with pytest.raises(ValueError, match="peak"):
        figures.roofline(points, peak=0, bandwidth=1e10)
    with pytest.raises(ValueError, match="pair"):
        figures.roofline({"bad": (1.0,)}, peak=1.0, bandwidth=1.0)
    with pytest.raises(TypeError, match="points"):
        figures.roofline({}, peak=1.0, bandwidth=1.0)
