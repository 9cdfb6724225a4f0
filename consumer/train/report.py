"""The bottleneck report: one self-contained HTML file, verdict first, then what the run looked like.

``write_report(path, title, verdict, timeline, facts)`` writes a page that opens in
any browser without a server or network: inline CSS and inline SVG line charts
(no scripts, no external files). Charts: queue occupancy over time (with the
input-bound and training-bound bands), step time, images/s per producer, and per
producer the milliseconds per image its workers spent reading, decoding,
augmenting and waiting to send. Each chart is an ``<svg class="chart">`` whose
series are ``<polyline class="series">`` elements (tests look for them).
"""

from __future__ import annotations

import html
import math
import os
from typing import Mapping, Sequence

from stoker.consumer.train.timeline import STAGES, Timeline

_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")
_W, _H, _LEFT, _RIGHT, _TOP, _BOTTOM = 760, 240, 62, 170, 34, 40


def _ticks(top: float) -> list[float]:
    """About four round tick values from 0 to at least ``top``."""
    if top <= 0:
        return [0.0, 1.0]
    step = 10 ** math.floor(math.log10(top / 4))
    for factor in (1, 2, 2.5, 5, 10):
        if top / (step * factor) <= 5:
            step *= factor
            break
    return [step * i for i in range(int(math.ceil(top / step)) + 1)]


def line_chart(title: str, series: Mapping[str, Sequence[tuple[float, float]]], y_label: str,
               y_max: float | None = None, bands: Sequence[tuple[float, float, str, str]] = (),
               x_max: float | None = None, note: str = "") -> str:
    """An SVG line chart: ``series`` name -> [(x seconds, y)], x from 0 to ``x_max`` (default: the last x).

    ``bands``: (y from, y to, colour, label); values above ``y_max`` are drawn at the top;
    ``note``: a line under the title (e.g. what is off the scale).
    """
    points = [p for values in series.values() for p in values]
    parts = [f'<svg class="chart" data-title="{html.escape(title)}" width="{_W}" height="{_H}" '
             f'viewBox="0 0 {_W} {_H}" xmlns="http://www.w3.org/2000/svg" role="img">',
             f'<text x="{_LEFT}" y="18" class="title">{html.escape(title)}</text>']
    if note:
        parts.append(f'<text x="{_LEFT}" y="31" class="note">{html.escape(note)}</text>')
    if not points:
        parts.append(f'<text x="{_LEFT + 20}" y="{_H / 2}" class="empty">no data</text></svg>')
        return "".join(parts)
    x0, x1 = 0.0, max(x_max or 0.0, max(p[0] for p in points))
    x1 = x1 if x1 > x0 else x0 + 1
    ticks = _ticks(y_max if y_max is not None else max(p[1] for p in points) * 1.05)
    y1 = ticks[-1]
    plot_w, plot_h = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM

    def sx(x: float) -> float:
        return _LEFT + (x - x0) / (x1 - x0) * plot_w

    def sy(y: float) -> float:
        return _TOP + plot_h - min(max(y, 0.0), y1) / y1 * plot_h

    for lo, hi, colour, label in bands:
        parts.append(f'<rect x="{_LEFT}" y="{sy(hi):.1f}" width="{plot_w}" height="{sy(lo) - sy(hi):.1f}" '
                     f'fill="{colour}" opacity="0.12"><title>{html.escape(label)}</title></rect>')
    for tick in ticks:
        parts.append(f'<line x1="{_LEFT}" x2="{_LEFT + plot_w}" y1="{sy(tick):.1f}" y2="{sy(tick):.1f}" class="grid"/>'
                     f'<text x="{_LEFT - 6}" y="{sy(tick) + 4:.1f}" class="tick" text-anchor="end">{tick:g}</text>')
    for tick in _ticks(x1 - x0):
        if x0 + tick <= x1:
            parts.append(f'<text x="{sx(x0 + tick):.1f}" y="{_TOP + plot_h + 16}" class="tick" '
                         f'text-anchor="middle">{x0 + tick:g}</text>')
    parts.append(f'<text x="{_LEFT + plot_w / 2}" y="{_H - 6}" class="axis" text-anchor="middle">seconds</text>'
                 f'<text x="14" y="{_TOP + plot_h / 2}" class="axis" text-anchor="middle" '
                 f'transform="rotate(-90 14 {_TOP + plot_h / 2})">{html.escape(y_label)}</text>')
    legend_rows = (plot_h - 4) // 18  # what fits beside the plot; the rest is summed up in the last row
    for i, (name, values) in enumerate(series.items()):
        colour = _COLOURS[i % len(_COLOURS)]
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in values)
        if len(values) == 1:
            x, y = values[0]
            parts.append(f'<circle class="series" cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{colour}"/>')
        elif values:
            parts.append(f'<polyline class="series" data-name="{html.escape(name)}" points="{coords}" fill="none" '
                         f'stroke="{colour}" stroke-width="1.8"><title>{html.escape(name)}</title></polyline>')
        legend_y = _TOP + 14 + 18 * i
        if i < legend_rows - 1 or len(series) <= legend_rows:
            parts.append(f'<rect x="{_W - _RIGHT + 14}" y="{legend_y - 9}" width="12" height="3" fill="{colour}"/>'
                         f'<text x="{_W - _RIGHT + 32}" y="{legend_y - 4}" class="legend">{html.escape(name[:22])}</text>')
        elif i == legend_rows - 1:
            parts.append(f'<text x="{_W - _RIGHT + 14}" y="{legend_y - 4}" class="legend">'
                         f'+{len(series) - i} more (hover a line)</text>')

    parts.append("</svg>")
    return "".join(parts)


_CSS = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; max-width: 820px; }
h1 { font-size: 20px; margin-bottom: 4px; }
.verdict { font-size: 17px; background: #f3f6fb; border-left: 5px solid #1f77b4; padding: 12px 14px; }
table { border-collapse: collapse; margin: 12px 0 18px; }
td { padding: 3px 14px 3px 0; } td.value { font-variant-numeric: tabular-nums; }
svg.chart { display: block; margin: 10px 0 22px; background: #fff; }
svg .title { font-size: 14px; font-weight: 600; } svg .tick, svg .legend, svg .axis { font-size: 11px; fill: #444; }
svg .grid { stroke: #ddd; stroke-width: 1; } svg .empty { fill: #999; font-size: 13px; }
svg .note { font-size: 11px; fill: #777; }
"""


def render_report(title: str, verdict: str, timeline: Timeline, facts: Mapping[str, str]) -> str:
    """The report's HTML (see the module doc)."""
    samples, steps = timeline.samples, timeline.steps
    end = max([s.t for s in samples] + [t for t, _ in steps] + [1.0])
    charts = [line_chart("Queue occupancy (near 0: training waits for input)",
                         {"occupancy": [(s.t, s.occupancy) for s in samples]}, "fraction of capacity", y_max=1.0,
                         bands=((0.0, 0.2, "#d62728", "input-bound"), (0.6, 1.0, "#2ca02c", "training-bound")),
                         x_max=end)]
    step_ms = [(t, seconds * 1000) for t, seconds in steps]
    step_top, step_note = None, ""
    if len(step_ms) > 2 and step_ms[0][1] > 2 * max(ms for _, ms in step_ms[1:]):
        # The first step traces and compiles the tf.function: off the scale, said so rather than flatten the rest.
        step_top = 1.2 * max(ms for _, ms in step_ms[1:])
        step_note = f"first step (tracing, compiling): {step_ms[0][1]:.0f} ms, drawn at the top"
    charts.append(line_chart("Step time", {"step": step_ms}, "ms", y_max=step_top, x_max=end, note=step_note))
    producers = sorted({p for s in samples for p in s.images_per_s})
    charts.append(line_chart("Images/s received per producer",
                             {p: [(s.t, s.images_per_s[p]) for s in samples if p in s.images_per_s]
                              for p in producers}, "images/s", x_max=end))
    for producer in producers:
        charts.append(line_chart(f"Producer {producer}: time per image, by stage (summed over its workers)",
                                 {stage: [(s.t, s.stage_ms[producer][stage]) for s in samples
                                          if producer in s.stage_ms] for stage in STAGES}, "ms per image",
                                 x_max=end))
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td class='value'>{html.escape(v)}</td></tr>" for k, v in facts.items())
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"
            f"<p class='verdict'>{html.escape(verdict)}</p><table>{rows}</table>{''.join(charts)}"
            "<p><small>Queue occupancy is sampled every half second; stage times come from each batch's header "
            "(seconds its worker spent reading, decoding, augmenting, and waiting for the trainer to take it: "
            "'send'). See docs/performance.md, 'How to read queue occupancy'.</small></p></body></html>")


def write_report(path: str | os.PathLike, title: str, verdict: str, timeline: Timeline,
                 facts: Mapping[str, str]) -> None:
    """Write the report to ``path`` (atomically: a half-written file never appears)."""
    text = render_report(title, verdict, timeline, facts)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as out:
        out.write(text)
    os.replace(tmp, path)
