"""The figures' shared rules (experiments/figures.py): colours per preset, readable heatmap text, log
scales for outliers, labelled bars, small multiples."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.colors as mcolors  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from copc_jax import presets  # noqa: E402
from experiments import figures, study  # noqa: E402


def test_a_preset_keeps_its_colour_in_every_cell_name():
  assert figures.color_of("copc_k64") == figures.color_of("copc_k16") == figures.color_of("copc")
  assert figures.color_of("copc_anchor_behavior_k64") != figures.color_of("copc_k64")   # longest prefix
  assert figures.color_of("dr_grpo_k16") != figures.color_of("grpo_k16")
  assert figures.color_of("not_a_preset") == figures.OTHER_COLOR


def test_every_distinct_preset_has_a_colour_of_its_own():
  """Per distinct setting, the name the studies plot it under: `copc`, the pick of experiments/copc_default,
  under the picked setting's own name (a study's `copc` cells are the spec's setting, `copc_spec`)."""
  picked = {"copc": "copc_anchor_behavior"}
  assert presets.get_preset("copc").actor.anchor == "behavior"          # what `picked` says `copc` is
  colours = [figures.color_of(picked.get(name, name)) for name in presets.DISTINCT]
  assert figures.OTHER_COLOR not in colours
  assert len(set(colours)) == len(colours)


def test_line_styles_dash_the_second_name_of_a_colour():
  styles = figures.line_styles(["copc", "copc_toy_best", "vtrace"])
  assert styles["copc"] == {"color": figures.color_of("copc"), "linestyle": "-"}
  assert styles["copc_toy_best"] == {"color": figures.color_of("copc"), "linestyle": "--"}
  assert styles["vtrace"]["linestyle"] == "-"


def test_heatmap_text_reads_on_its_cell():
  viridis = plt.get_cmap("viridis")
  assert figures.text_color(viridis(1.0)) == "black"       # yellow
  assert figures.text_color(viridis(0.0)) == "white"       # dark purple
  fig, ax = plt.subplots()
  figures.heatmap(ax, [[0.0, 1.0], [0.5, np.nan]], ["a", "b"], ["c", "d"], "t")
  texts = {t.get_text(): t.get_color() for t in ax.texts}
  assert texts == {"0.00": "white", "1.00": "black", "0.50": "black", "–": "black"}   # teal: black reads
  plt.close(fig)


def test_an_outlier_turns_the_colour_scale_logarithmic():
  assert isinstance(figures.color_norm([1.0, 1.2, 1.5, 17.7]), mcolors.LogNorm)
  assert not isinstance(figures.color_norm([1.0, 1.2, 1.5, 2.7]), mcolors.LogNorm)
  assert not isinstance(figures.color_norm([-1.0, 0.0, 20.0]), mcolors.LogNorm)   # not all positive


def test_bars_carry_their_values_and_a_zero_reads_zero():
  fig, ax = plt.subplots()
  figures.label_bars(ax, ax.bar([0, 1, 2], [0.0, 0.25, -0.5]))
  assert [t.get_text() for t in ax.texts] == ["0.00", "0.25", "-0.50"]
  plt.close(fig)


def test_curves_are_small_multiples_one_panel_per_cell(tmp_path, monkeypatch):
  def run(values):
    return {"eval_curve": [[0, values[0]], [10, values[1]]]}
  results = {"cells": {"sync_ppo_k0": {"runs": {"0": run([0.4, 0.8]), "1": run([0.5, 0.9])}},
                       "copc_k4": {"runs": {"0": run([0.4, 0.6]), "1": run([0.5, 0.7])}},
                       "vtrace_k4": {"runs": {"0": run([0.4, 0.7])}},
                       "copc_k16": {"runs": {}}}}
  drawn = []
  monkeypatch.setattr(plt, "close", lambda fig: drawn.append(fig))
  study.curves_figure(results, str(tmp_path / "curves.png"),
                      {"k = 4": ["sync_ppo_k0", "copc_k4", "vtrace_k4"], "k = 16": ["sync_ppo_k0", "copc_k16"]})
  panels = [ax for ax in drawn[0].axes if ax.get_visible()]
  assert [ax.get_title() for ax in panels] == ["copc_k4", "vtrace_k4"]       # the empty row is left out
  copc = panels[0]
  # the reference dashed and grey, each seed a thin line, the mean thick, in COPC's colour
  assert [line.get_linestyle() for line in copc.lines] == ["--", "-", "-", "-"]
  assert mcolors.to_hex(copc.lines[-1].get_color()) == figures.color_of("copc")
  assert (tmp_path / "curves.png").exists()
