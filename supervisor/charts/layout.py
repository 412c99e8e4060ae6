"""Where a chart's words go (issue 37, "charts that tell the truth"): a legend in a margin of its
own beside the axes, never over the data, and annotation labels that never overprint one another.
With plots.py, the only module that imports matplotlib.

Both need text sizes, so both measure with the figure's Agg renderer: a legend of ~20 entries and a
handful of labels cost a few ms, where layout="constrained" measured every tick label (plots.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.legend import Legend
from matplotlib.patches import Rectangle
from matplotlib.text import Text
from matplotlib.transforms import Bbox, blended_transform_factory, offset_copy

LEGEND_GAP_PX = 10  # between the axes' right edge and the legend
EDGE_PX = 6  # between the legend and the figure's right edge
LEGEND_SHARE = 0.35  # the legend takes at most this share of the width (a narrow chart: labels shortened)
ELLIPSIS = "…"


@dataclass(slots=True)
class Entry:
    handle: object  # an artist drawn in the axes, or a proxy drawn nowhere
    label: str
    whole: bool = False  # never shortened (the "+M more" row: its count is the point)


def shorten(label: str, width: int) -> str:
    return label if len(label) <= width else label[: max(1, width - 1)] + ELLIPSIS


def legend_chars(width_px: int) -> int:
    """Characters a legend label may keep at this figure width (7 pt: ~5 px a character)."""
    return max(12, min(48, int(width_px * 0.28 / 5)))


def place_legend(fig: Figure, fixed: list[Entry], series: list[tuple[float, Entry]], *, named: int,
                 margins_px: tuple[int, int, int, int]) -> Legend | None:
    """The legend at the figure's right edge, top-aligned with the axes, and the axes narrowed to
    end LEGEND_GAP_PX before it. `series` are (peak, entry) in the chart's order: all of them in
    that order when they fit, else the hottest first, as many as fit up to `named`, then
    "+M more (lower peaks)". `fixed` (marks, bands, thresholds) are always listed. Series rows are
    dropped until the legend is no taller than the axes. Returns the legend (None: nothing to list)."""
    w, h = fig.bbox.width, fig.bbox.height
    _, _, top, bottom = margins_px
    axes_h = h - top - bottom
    width = legend_chars(int(w))
    k = min(named, len(series))
    hottest = [e for _, e in sorted(series, key=lambda pe: -pe[0])]  # stable: equal peaks keep their order
    renderer = fig.canvas.get_renderer()
    legend = None
    for _ in range(4):  # each pass drops what overflowed; two passes suffice in practice
        if legend is not None:
            legend.remove()
        more = Entry(_Blank(), f"+{len(series) - k} more" + (" (lower peaks)" if w >= 600 else ""), whole=True)
        entries = [e for _, e in series] if k == len(series) else hottest[:k] + [more]
        entries += fixed
        if not entries:
            return None
        legend = fig.legend([e.handle for e in entries], [e.label if e.whole else shorten(e.label, width) for e in entries],
                            loc="upper right", bbox_to_anchor=(1 - EDGE_PX / w, 1 - top / h),
                            fontsize=7, framealpha=0.9, borderaxespad=0, handlelength=1.8,
                            handler_map={_Blank: _BlankHandler()})
        box = legend.get_window_extent(renderer)
        if box.height <= axes_h or k == 0:
            break
        row = box.height / max(1, len(entries))
        k = max(0, k - math.ceil((box.height - axes_h) / row))
    box = legend.get_window_extent(renderer)
    # the axes end where the legend begins; a narrow chart keeps at least 1 - LEGEND_SHARE of the width
    right_px = min(box.width + LEGEND_GAP_PX + EDGE_PX, LEGEND_SHARE * w)
    fig.subplots_adjust(right=1 - right_px / w)
    if box.width + EDGE_PX + LEGEND_GAP_PX > right_px:  # still too wide: shorten the labels to fit
        shortenable = [t for t, e in zip(legend.get_texts(), entries) if not e.whole]
        _shrink_legend(legend, shortenable, renderer, right_px - EDGE_PX - LEGEND_GAP_PX)
    return legend


class _Blank:
    """The "+M more" row's handle: no swatch, only the words."""


class _BlankHandler:
    def legend_artist(self, legend, orig_handle, fontsize, handlebox):
        box = Rectangle((handlebox.xdescent, handlebox.ydescent), handlebox.width, handlebox.height, visible=False)
        handlebox.add_artist(box)
        return box


def _shrink_legend(legend: Legend, texts: list[Text], renderer, width_px: float) -> None:
    """Shorten the longest of `texts` by a few characters at a time until the legend fits."""
    for _ in range(30):
        if legend.get_window_extent(renderer).width <= width_px:
            return
        longest = max(texts, key=lambda t: len(t.get_text()))
        s = longest.get_text().rstrip(ELLIPSIS)
        if len(s) <= 4:
            return
        longest.set_text(s[: len(s) - 3] + ELLIPSIS)


@dataclass(slots=True)
class Label:
    """A mark's words: `text` at x (steps) and y (a fraction of the axes' height). One over the
    data may carry an arrow beneath it, from arrow[0] to arrow[1] (steps), that moves with it (a
    rollback's: from the detection back to the checkpoint)."""
    x: float
    text: str
    color: str
    y: float
    arrow: tuple[float, float] | None = None


ARROW_BELOW_PX = 5  # from a label's baseline down to its arrow
_GROUND = {"facecolor": "white", "alpha": 0.75, "lw": 0, "pad": 0.5}  # pad in points: the box is the text's


def place_labels(ax: Axes, top_rows: list[Label], bottom: list[Label], obstacles: list[Text] = ()) -> list[Text]:
    """Draw the labels so that no two overprint. `top_rows` (horizontal, e.g. a rollback's words
    over its arrow) drop a row at a time until they clear what is placed, and are left out (their
    arrows kept at the first row) when no row down to mid-height is free. `bottom` (vertical, e.g.
    an incident's words beside its detection line; the caller merges those closer than a label is
    wide: cluster()) are shortened until they clear what is placed, or left out. Returns the texts
    drawn, in placing order."""
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    trans = _top(ax)
    below = ARROW_BELOW_PX / frame.height
    placed: list[Bbox] = [t.get_window_extent(renderer) for t in obstacles if t.get_visible()]
    drawn: list[Text] = []
    for lab in top_rows:
        t = ax.text(lab.x, lab.y, lab.text, transform=trans, ha="center", va="bottom", fontsize=7, color=lab.color,
                    bbox=_GROUND)
        _keep_inside(t, renderer, frame)
        box = _with_arrow(ax, t.get_window_extent(renderer), lab.arrow, ARROW_BELOW_PX + 3)
        row = box.height / frame.height + 0.01
        y = lab.y
        while y > 0.5 and _hits(box, placed):
            y -= row
            t.set_y(y)
            box = _with_arrow(ax, t.get_window_extent(renderer), lab.arrow, ARROW_BELOW_PX + 3)
        if y <= 0.5:
            t.remove()
            y = lab.y
        else:
            placed.append(box)
            drawn.append(t)
        if lab.arrow is not None:
            ax.annotate("", xy=(lab.arrow[1], y - below), xytext=(lab.arrow[0], y - below), xycoords=trans,
                        textcoords=trans, arrowprops={"arrowstyle": "->", "color": lab.color, "lw": 1.6})
    for lab in bottom:
        # just left of its line (a line's width off it), on a pale ground: readable over the data
        t = ax.text(lab.x, lab.y, lab.text, transform=offset_copy(trans, fig, x=-3, units="dots"), fontsize=7,
                    color=lab.color, rotation=90, va="bottom", ha="right", bbox=_GROUND)
        box = t.get_window_extent(renderer)
        text = lab.text
        while (_hits(box, placed) or box.y1 > frame.y1) and len(text.rstrip(ELLIPSIS)) > 3:
            text = text.rstrip(ELLIPSIS)
            text = text[: len(text) - 2] + ELLIPSIS
            t.set_text(text)
            box = t.get_window_extent(renderer)
        if _hits(box, placed) or box.y1 > frame.y1:
            t.remove()
            continue
        placed.append(box)
        drawn.append(t)
    return drawn


def _top(ax: Axes):
    """x in steps, y in fractions of the axes' height."""
    return blended_transform_factory(ax.transData, ax.transAxes)


def _with_arrow(ax: Axes, box: Bbox, arrow: tuple[float, float] | None, below_px: float) -> Bbox:
    """A label's box grown to hold its arrow: across the arrow's steps, down to below its line."""
    if arrow is None:
        return box
    x0, x1 = sorted(float(ax.transData.transform((x, 0))[0]) for x in arrow)
    return Bbox([[min(box.x0, x0), box.y0 - below_px], [max(box.x1, x1), box.y1]])


def _hits(box: Bbox, placed: list[Bbox]) -> bool:
    return any(box.overlaps(p) for p in placed)


def _keep_inside(t: Text, renderer, frame: Bbox) -> None:
    """A centred label near an edge of the window: aligned to that edge instead of running off it."""
    box = t.get_window_extent(renderer)
    if box.x0 < frame.x0:
        t.set_ha("left")
        t.set_x(t.axes.get_xlim()[0])
    elif box.x1 > frame.x1:
        t.set_ha("right")
        t.set_x(t.axes.get_xlim()[1])


def cluster(xs_px: list[float], width_px: float) -> list[list[int]]:
    """Indices of sorted pixel positions grouped where each is closer than `width_px` to the
    previous one: the vertical labels that would overprint, to be written as one."""
    groups: list[list[int]] = []
    for i, x in enumerate(xs_px):
        if groups and x - xs_px[groups[-1][-1]] < width_px:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups
