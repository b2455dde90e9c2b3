"""The figures' shared rules, so that every study draws the same way.

- One colour per preset in every figure (`color_of`): a cell named `copc_k64`, `copc_k16` or
  `copc_nomask` is COPC's red wherever it appears.
- Heatmap text takes its colour from the cell's luminance (black on yellow, white on purple), and the
  colour scale turns logarithmic when one outlier would flatten the rest (`heatmap`).
- Bars carry their values, so a zero reads `0.00`, not as missing data (`label_bars`).
- Legends sit outside the data (`legend_outside`); many curves become small multiples
  (`study.curves_figure`), not overlapping bands.
"""

from __future__ import annotations

import matplotlib.colors as mcolors
import numpy as np

# Fixed, not cycled: the reference in black, the policy-side presets in blues and oranges, the
# critic-side ones in purples and reds, the critic-free group presets in greens.
PRESET_COLORS = {
    "sync_ppo": "#222222",
    "async_ppo": "#1f77b4",
    "decoupled_ppo": "#ff7f0e",
    "tis": "#bcbd22",
    "icepop": "#8c564b",
    "mis": "#8c564b",
    "vtrace": "#9467bd",
    "copc": "#d62728",
    "copc_spec": "#d62728",
    "copc_anchor_behavior": "#e377c2",
    "copc_nomask": "#ff9896",
    "copc_nomask_vtrace_pg": "#c49c94",
    "grpo": "#2ca02c",
    "dr_grpo": "#98df8a",
    "rloo": "#17becf",
}
OTHER_COLOR = "#7f7f7f"
# above this ratio of the largest to the smallest positive value, a heatmap's scale is logarithmic
LOG_SCALE_RATIO = 10.0


def color_of(name: str) -> str:
  """The colour of the preset that `name` (a preset or a cell such as `copc_k64`) starts with."""
  matches = [p for p in PRESET_COLORS if name == p or name.startswith(p + "_")]
  return PRESET_COLORS[max(matches, key=len)] if matches else OTHER_COLOR


def line_styles(names, preset_of=None) -> dict[str, dict]:
  """Per name, `color` (its preset's, `preset_of` mapping a label to a preset name) and `linestyle`, the
  second name of the same colour dashed, the third dotted: plot keyword arguments."""
  styles, seen = {}, {}
  for name in names:
    color = color_of(preset_of.get(name, name) if preset_of else name)
    styles[name] = dict(color=color, linestyle=("-", "--", ":", "-.")[seen.get(color, 0) % 4])
    seen[color] = seen.get(color, 0) + 1
  return styles


def text_color(rgba) -> str:
  """Black or white, whichever reads on a cell of colour `rgba` (relative luminance, WCAG)."""
  linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in mcolors.to_rgb(rgba)]
  luminance = 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]
  return "black" if luminance > 0.179 else "white"


def color_norm(values) -> mcolors.Normalize:
  """Logarithmic when every finite value is positive and the largest is `LOG_SCALE_RATIO`× the smallest."""
  finite = np.asarray(values, float)
  finite = finite[np.isfinite(finite)]
  if finite.size and finite.min() > 0 and finite.max() / finite.min() > LOG_SCALE_RATIO:
    return mcolors.LogNorm(finite.min(), finite.max())
  return mcolors.Normalize(*(finite.min(), finite.max()) if finite.size else (0, 1))


def heatmap(ax, values, row_labels, column_labels, title: str, fmt: str = "{:.2f}", cmap: str = "viridis"):
  """`values` (rows × columns) as an image with each cell's value written on it; the image."""
  values = np.asarray(values, float)
  image = ax.imshow(values, cmap=cmap, norm=color_norm(values))
  ax.set_xticks(range(len(column_labels)), column_labels)
  ax.set_yticks(range(len(row_labels)), row_labels)
  for (i, j), value in np.ndenumerate(values):
    finite = np.isfinite(value)
    ax.text(j, i, fmt.format(value) if finite else "–", ha="center", va="center", fontsize=7,
            color=text_color(image.cmap(image.norm(value))) if finite else "black")
  ax.set_title(title, fontsize=9)
  return image


def label_bars(ax, bars, fmt: str = "{:.2f}") -> None:
  """Each bar's value at its end; a zero reads `0.00` (a missing value, NaN, draws no bar and no label)."""
  heights = [bar.get_height() for bar in bars]
  ax.bar_label(bars, labels=[fmt.format(h) if np.isfinite(h) else "" for h in heights], fontsize=6, padding=1)


def legend_outside(ax, **kwargs) -> None:
  """The legend to the right of `ax`, off the data."""
  ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False, **kwargs)
