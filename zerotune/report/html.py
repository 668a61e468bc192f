"""``report.html``: the tuning as one self-contained page, its plots drawn by plotly.js, inlined (opens offline; D29).

Three plots from `zerotune.report.data.ReportData`: the metric against mbs (`throughput_figure`), predicted against
measured peak per device (`memory_figure`) and the launches' timeline (`timeline_figure`). Every series has its own
marker symbol and line dash and every bar its outcome written on it, so the page reads without colour. Each plot is
a plain plotly figure dict, which the tests check against plotly's schema.
"""
from __future__ import annotations

import html
import json
from typing import Any, Iterable

from zerotune.core.experiment import LAUNCH_COLD, Experiment, ExperimentKind, Status
from zerotune.core.units import format_bytes
from zerotune.model.flops import tokens_per_device
from zerotune.report.data import OUTCOMES, ReportData, outcome
from zerotune.report.results import cost_line, saver_names
from zerotune.strategy.answer import TIE_ORDER

GiB = 2 ** 30
SYMBOLS = ("circle", "square", "diamond", "triangle-up", "triangle-down", "cross", "hexagon", "pentagon",
           "triangle-left", "triangle-right", "hourglass", "bowtie")
DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
FAILED_SYMBOLS = {"oom": "x", "failed": "triangle-down-open", "timed out": "hourglass", "interrupted": "circle-open"}
OUTCOME_STYLE = {"ok": ("#2b8a3e", ""), "stopped early": ("#74b816", "/"), "oom": ("#c92a2a", "x"),
                 "failed": ("#495057", "\\"), "timed out": ("#e67700", "."), "interrupted": ("#748ffc", "+")}
"""Per outcome: a colour and a fill pattern (plotly's ``marker.pattern.shape``)."""
FIGURE_IDS = ("throughput", "memory", "timeline")


def series_label(exp: Experiment) -> str:
    """The series an experiment's point belongs to in the throughput plot: ``ZeRO 1``, ``ZeRO 3 + checkpointing,
    gas 2``, ``ZeRO 2, reduce_bucket_size=5e8``."""
    parts = [f"ZeRO {exp.stage}" + "".join(f" + {s}" for s in saver_names(exp.ds_config))]
    if exp.gas != 1:
        parts.append(f"gas {exp.gas}")
    parts += [f"{k.rsplit('.', 1)[-1]}={v}" for k, v in sorted(exp.knobs.items())]
    return ", ".join(parts)


def _tuned_runs(data: ReportData) -> list[Experiment]:
    return [e for e in data.experiments if e.kind is not ExperimentKind.PROFILE]


def throughput_figure(data: ReportData) -> dict[str, Any] | None:
    """The metric against mbs: a trace per series of ok runs (`series_label`, first-seen order) with 95%
    error bars, a trace per failed outcome (at its mbs, under the lowest ok reading, labelled), and the answer
    (a star at its pooled value). None when nothing but the profile ran."""
    runs = _tuned_runs(data)
    if not runs:
        return None
    series: dict[str, list[Experiment]] = {}
    for e in runs:
        if e.status is Status.OK and e.metric is not None:
            series.setdefault(series_label(e), []).append(e)
    traces = []
    for i, (label, points) in enumerate(series.items()):
        points = sorted(points, key=lambda e: e.mbs)
        traces.append({"type": "scatter", "mode": "lines+markers", "name": label, "x": [e.mbs for e in points],
                       "y": [e.metric for e in points],
                       "text": [f"{e.name} ±{e.metric_rel_half_width or 0:.1%}" for e in points],
                       "error_y": {"type": "data", "array": [e.metric * (e.metric_rel_half_width or 0) for e in points],
                                   "visible": True},
                       "marker": {"symbol": SYMBOLS[i % len(SYMBOLS)], "size": 9},
                       "line": {"dash": DASHES[i % len(DASHES)], "width": 1.5},
                       "hovertemplate": "%{text}<br>mbs %{x}: %{y:.4g}<extra>%{fullData.name}</extra>"})
    floor = 0.95 * min((e.metric for points in series.values() for e in points), default=0.0)
    for name in OUTCOMES[2:]:
        failed = [e for e in runs if outcome(e) == name]
        if failed:
            traces.append({"type": "scatter", "mode": "markers+text", "name": f"{name} (at its mbs)",
                           "x": [e.mbs for e in failed], "y": [floor] * len(failed), "text": [name] * len(failed),
                           "textposition": "top center", "hovertext": [f"{e.name}: {e.error}"[:200] for e in failed],
                           "marker": {"symbol": FAILED_SYMBOLS[name], "size": 11, "color": OUTCOME_STYLE[name][0]}})
    if data.answer is not None:
        value = data.pooled[data.answer.name].value
        traces.append({"type": "scatter", "mode": "markers+text", "name": "answer", "x": [data.answer.mbs],
                       "y": [value], "text": [f"answer: {data.answer.name}"], "textposition": "top left",
                       "marker": {"symbol": "star", "size": 20, "color": "#f59f00", "line": {"width": 1.5,
                                                                                           "color": "black"}}})
    mbs = sorted({e.mbs for e in runs})
    objective = data.objective
    return _figure(traces, f"{objective.name} against micro batch size, per ZeRO stage and variant (95% intervals)",
                   {"title": {"text": "micro batch size per GPU (mbs)"}, "type": "log", "tickvals": mbs,
                    "ticktext": [str(m) for m in mbs]},
                   {"title": {"text": f"{objective.name} ({objective.unit})"}})


def memory_figure(data: ReportData) -> dict[str, Any] | None:
    """Per run (launch order), the memory model's prediction and the measured peak per device, GiB, with the budget
    as a line; a run that did not finish ok is labelled with how it ended. None when no run has either figure."""
    runs = [e for e in data.experiments if e.memory_bytes or e.peak_memory_bytes]
    if not runs:
        return None
    predicted = [e for e in runs if e.memory_bytes]
    measured = [e for e in runs if e.peak_memory_bytes]
    label = [("" if outcome(e) in OUTCOMES[:2] else outcome(e)) for e in predicted]
    traces = [{"type": "scatter", "mode": "markers+text", "name": "predicted (memory model)",
               "x": [e.name for e in predicted], "y": [e.memory_bytes / GiB for e in predicted], "text": label,
               "textposition": "top center", "marker": {"symbol": "diamond-open", "size": 11, "color": "#1971c2"}},
              {"type": "scatter", "mode": "markers", "name": "measured peak",
               "x": [e.name for e in measured], "y": [e.peak_memory_bytes / GiB for e in measured],
               "marker": {"symbol": "circle", "size": 8, "color": "#e8590c"}}]
    shapes, notes = [], []
    if data.budget_bytes:
        budget = data.budget_bytes / GiB
        shapes.append({"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": budget, "y1": budget,
                       "line": {"dash": "dash", "color": "#c92a2a"}})
        notes.append({"xref": "paper", "x": 1, "y": budget, "xanchor": "right", "yanchor": "bottom",
                      "text": f"budget {format_bytes(data.budget_bytes)} per device", "showarrow": False})
    figure = _figure(traces, "memory per device: the memory model's prediction against the measured peak",
                     {"title": {"text": "experiment (launch order)", "standoff": 12}, "type": "category",
                      "tickangle": -30, "automargin": True,
                      "categoryorder": "array", "categoryarray": [e.name for e in runs]},
                     {"title": {"text": "memory per device (GiB)"}, "rangemode": "tozero"})
    figure["layout"].update(shapes=shapes, annotations=notes)
    return figure


def timeline_figure(data: ReportData) -> dict[str, Any] | None:
    """The launches as bars from their start (s since the first launch) for their wall time, one trace per outcome,
    first launch on top; a bar's hover text adds `launch_text`. None when no launch has a start time."""
    start = data.tuning_start()
    runs = [e for e in data.experiments if e.started_at is not None]
    if start is None:
        return None
    traces = []
    for name in OUTCOMES:
        bars = [e for e in runs if outcome(e) == name]
        if not bars:
            continue
        color, pattern = OUTCOME_STYLE[name]
        traces.append({"type": "bar", "orientation": "h", "name": name, "y": [e.name for e in bars],
                       "x": [max(e.wall_s or 0.0, 0.0) for e in bars], "base": [e.started_at - start for e in bars],
                       "text": [name] * len(bars), "textposition": "inside", "insidetextanchor": "start",
                       "textfont": {"color": "black", "size": 12},
                       "marker": {"color": color, "pattern": {"shape": pattern, "fillmode": "overlay",
                                                              "fgcolor": "white", "fgopacity": 0.5},
                                  "line": {"color": "black", "width": 0.5}},
                       "customdata": [f"; {t}" if (t := launch_text(e)) else "" for e in bars],
                       "hovertemplate": "%{y}: from %{base:.1f} s for %{x:.1f} s%{customdata}"
                                        "<extra>%{fullData.name}</extra>"})
    figure = _figure(traces, "launches: when each ran, for how long, and how it ended",
                     {"title": {"text": "time since the first launch (s)"}, "rangemode": "tozero"},
                     {"type": "category", "autorange": "reversed", "categoryorder": "array",
                      "categoryarray": [e.name for e in runs], "automargin": True})
    figure["layout"]["height"] = 160 + 24 * len(runs)
    figure["layout"]["barmode"] = "overlay"
    return figure


def launch_text(exp: Experiment) -> str:
    """How a launch spent its wall time and started, as far as its record says: ``start-up 3.2 s, measuring 10.1 s
    (warm)``; a cold run of a warm tuning gives its note instead (``(re-run cold: its warm server went away during
    the run)``); ``""`` when nothing is known (the simulated backend)."""
    phases = ", ".join(f"{label} {seconds:.1f} s" for label, seconds in (("start-up", exp.startup_s),
                                                                         ("measuring", exp.measure_s))
                       if seconds is not None)
    how = exp.launch_note if exp.launch == LAUNCH_COLD and exp.launch_note else exp.launch
    return " ".join(part for part in (phases, f"({how})" if how else "") if part)


def _figure(traces: list[dict], title: str, xaxis: dict, yaxis: dict) -> dict[str, Any]:
    return {"data": traces, "layout": {"title": {"text": title}, "xaxis": xaxis, "yaxis": yaxis,
                                        "hovermode": "closest",
                                        "font": {"family": "sans-serif", "size": 13}, "height": 520,
                                        "plot_bgcolor": "white", "paper_bgcolor": "white"}}


def figures(data: ReportData) -> dict[str, dict[str, Any]]:
    """The page's plots by element id (`FIGURE_IDS`), as plotly figure dicts; one with nothing to show is left out."""
    made = {"throughput": throughput_figure(data), "memory": memory_figure(data), "timeline": timeline_figure(data)}
    return {k: _plain_text(v) for k, v in made.items() if v is not None}


def _plain_text(value: Any, key: str = "") -> Any:
    """``value`` with ``&``, ``<`` and ``>`` in every string but the hover templates as HTML entities: plotly.js reads
    its texts as HTML, and a record's name or error is shown as written, never as a link or markup."""
    if isinstance(value, dict):
        return {k: _plain_text(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain_text(v, key) for v in value]
    if isinstance(value, str) and key != "hovertemplate":
        return html.escape(value, quote=False)
    return value


def page(data: ReportData) -> str:
    """``report.html``: one self-contained page (plotly.js inlined; no network access needed to open it)."""
    from plotly.offline import get_plotlyjs  # imported here: only the report needs plotly

    made = figures(data)
    plots = "".join(f'<section><div id="{fid}" class="plot"></div></section>\n' for fid in made)
    calls = "".join(f"Plotly.newPlot({json.dumps(fid)}, {_json(fig['data'])}, {_json(fig['layout'])}, "
                    f'{{"responsive": true, "displaylogo": false}});\n' for fid, fig in made.items())
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>zerotune report</title>\n"
            f"<style>{_CSS}</style>\n<script>{get_plotlyjs()}</script></head>\n<body>\n"
            f"{_header(data)}{plots}{_cost(data)}{_not_run(data)}{_notes(data)}{_runs_table(data)}"
            f"<script>{calls}</script>\n</body></html>\n")


def _json(value: Any) -> str:
    """JSON safe inside a ``<script>`` element: ``<``, ``>``, ``&`` and the two JavaScript line breaks as ``\\u``
    escapes, so no text a record holds (``</script>``, ``<!--``) ends or comments out the element."""
    text = json.dumps(value, default=str)
    for char in "<>&\u2028\u2029":
        text = text.replace(char, f"\\u{ord(char):04x}")
    return text


_CSS = ("body{font-family:sans-serif;margin:2em auto;max-width:1300px;color:#212529}"
        "table{border-collapse:collapse;margin:0.5em 0}td,th{border:1px solid #ced4da;padding:3px 8px;"
        "text-align:left;font-size:13px}th{background:#f1f3f5}.answer{background:#fff3bf;padding:0.6em 1em;"
        "border-left:5px solid #f59f00}.plot{min-height:300px}.state{color:#495057}code{font-size:13px}")


def _header(data: ReportData) -> str:
    state = {"running": "still running (or killed): this page is refreshed as experiments finish; reload it",
             "finished": "finished", "interrupted": "interrupted by a signal: rerun to resume",
             "failed": "ended without an answer"}.get(data.state, data.state)
    launched = len(data.experiments)
    head = (f"<h1>zerotune report</h1><p class=\"state\">Tuning {_e(state)}; {launched} launch(es) shown; "
            f"experiments in <code>{_e(str(data.exps_dir))}</code>.</p>\n")
    return head + _answer(data)


def _answer(data: ReportData) -> str:
    answer = data.answer
    if answer is None:
        return "<p class=\"answer\">No experiment has finished ok yet: there is no answer.</p>\n"
    value, hw = data.pooled[answer.name].value, data.answer_half_width or 0.0
    savers = "".join(f", {s}" for s in saver_names(answer.ds_config))
    lines = [f"<b>Answer: {_e(answer.name)}</b>: ZeRO stage {answer.stage}{_e(savers)}, mbs {answer.mbs}, gas "
             f"{answer.gas}; {_e(data.objective.name)} {value:.4g} ±{hw:.1%} {_e(data.objective.unit)} (95%, "
             f"{data.pooled[answer.name].runs} run(s))."]
    runner = data.runner_up()
    if runner is not None:
        verdict = "beyond the noise" if runner.beyond_noise else "within the noise"
        if runner.tie:
            verdict = (f"a tie (within the ±{data.precision:.1%} precision), decided without a launch by the tie "
                       f"order: {_e(TIE_ORDER)}")
        lines.append(f"Runner-up: {_e(runner.name)}, {runner.value:.4g} {_e(data.objective.unit)}; the answer is "
                     f"{runner.gain:+.1%} against it, {verdict} (two runs can differ by ±{runner.noise:.1%} at 95%).")
    return f"<div class=\"answer\">{'<br>'.join(lines)}{_projection(data)}</div>\n"


def _projection(data: ReportData) -> str:
    p = data.projection()
    if p is None:
        return ("<p>Projection of the full training run: give <code>--train-samples N</code> or "
                "<code>--train-steps N</code> (and <code>--cost-per-device-hour</code>) to "
                "<code>zerotune tune</code> or <code>zerotune report</code>.</p>")
    rows = [("samples", f"{p.samples:,}"), ("optimizer steps", f"{p.steps:,}"),
            ("wall time", f"{p.seconds / 3600:,.2f} h ({p.seconds:,.0f} s) ±{p.rel_half_width:.1%}"),
            ("devices", str(p.devices)), ("device-hours", f"{p.device_hours:,.1f}")]
    if p.cost is not None:
        rows.append(("cost", f"{p.cost:,.2f} at {data.plan.cost_per_device_hour:g} per device-hour"))
    return "<h3>Projection of the full training run with the answer</h3>" + _table(("", ""), rows, header=False)


def _cost(data: ReportData) -> str:
    return f"<p>{_e(cost_line(data.experiments))}.</p>\n"


def _not_run(data: ReportData) -> str:
    if not data.strategy_known:
        return ("<h2>Not run</h2><p>Not known: the tuner records what it did not run in results.json, and this "
                "results dir has none from it.</p>\n")
    if not data.not_run:
        return "<h2>Not run</h2><p>Every stage and candidate the strategy considered was launched.</p>\n"
    return "<h2>Not run, and why</h2>" + _table(("stage or candidate", "reason"),
                                                 [(n.what, n.reason) for n in data.not_run])


def _notes(data: ReportData) -> str:
    if not data.notes:
        return ""
    return "<h2>Notes</h2><ul>" + "".join(f"<li>{_e(n)}</li>" for n in data.notes) + "</ul>\n"


def _runs_table(data: ReportData) -> str:
    rows = []
    for e in data.experiments:
        metric = "-" if e.metric is None else f"{e.metric:.4g}" + (
            f" ±{e.metric_rel_half_width:.1%}" if e.metric_rel_half_width else "")
        tokens, mfu = tokens_per_device(e), data.mfu(e)
        rows.append((e.name + (" (answer)" if data.answer is not None and e.name == data.answer.name else ""),
                     data.origin(e), outcome(e), metric, "-" if tokens is None else f"{tokens:,.0f}",
                     "-" if mfu is None else f"{mfu:.1%}", format_bytes(e.memory_bytes) if e.memory_bytes else "-",
                     format_bytes(e.peak_memory_bytes) if e.peak_memory_bytes else "-", f"{e.wall_s or 0:.1f}",
                     e.error[:160]))
    flops = f"<p>{_e(data.flops.describe())}.</p>" if data.flops is not None else ""
    return "<h2>Launches</h2>" + flops + _table(
        ("experiment", "origin", "ended", f"{data.objective.name} ({data.objective.unit})", "tokens/s per device",
         "MFU", "predicted", "measured peak", "wall time (s)", "error"), rows)


def _table(columns: Iterable[str], rows: Iterable[Iterable[Any]], header: bool = True) -> str:
    head = "<tr>" + "".join(f"<th>{_e(c)}</th>" for c in columns) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(f"<td>{_e(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table>{head}{body}</table>\n"


def _e(text: str) -> str:
    return html.escape(text, quote=True)
