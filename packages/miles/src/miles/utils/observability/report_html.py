"""The run report's page: one HTML file with its styles inline and its images as data URIs, no
script and nothing fetched, so it opens anywhere (a browser, an MLflow artifact view, a mail).

Every section is always there, with a line saying why when it has nothing to show (a run without
--memory-snapshot-dir has no memory record, say): a reader never wonders whether it was left out.
"""

from __future__ import annotations

import base64
import html
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from miles.utils.observability.report import TIME_SPLIT, RunFacts, read_run

REPORT_FILE = "report.html"

SECTIONS = (
    ("config", "Configuration"),
    ("curves", "Curves"),
    ("time-split", "Time per step"),
    ("startup", "Start-up phases"),
    ("memory", "Peak memory per process"),
    ("faults", "Engine restarts and failures"),
    ("evaluation", "Held-out evaluation"),
    ("profiles", "Profiler traces"),
)
"""(element id, heading) of each section, in page order."""

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 0 auto; max-width: 1100px; padding: 0 16px;
       color: #1d1d1f; }
header { border-bottom: 1px solid #ddd; margin-bottom: 8px; }
nav a { margin-right: 12px; }
section { margin: 24px 0; }
h2 { border-bottom: 1px solid #eee; padding-bottom: 4px; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
.config td, .config th { text-align: left; font-family: monospace; max-width: 700px; overflow-wrap: anywhere; }
.empty { color: #777; font-style: italic; }
.bar { display: flex; height: 12px; min-width: 240px; }
.bar span { display: block; height: 100%; }
.generate { background: #4e79a7; } .train { background: #f28e2b; }
.update-weights { background: #59a14f; } .save { background: #b07aa1; } .eval { background: #e15759; }
.other { background: #bab0ac; }
.scroll { overflow-x: auto; max-width: 100%; }
.plots img { max-width: 48%; margin: 4px; border: 1px solid #eee; }
pre { background: #f6f6f6; padding: 8px; overflow-x: auto; max-height: 400px; }
"""


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the report of `run_dir` (default RUN_DIR/report.html); returns its path.
    FileNotFoundError when `run_dir` holds no run."""
    facts = read_run(run_dir)
    path = Path(out) if out else facts.run_dir / REPORT_FILE
    path.write_text(render(facts))
    return path


def render(facts: RunFacts) -> str:
    name = html.escape(facts.run_dir.name)
    bodies = {
        "config": _config(facts),
        "curves": _curves(facts),
        "time-split": _time_split(facts),
        "startup": _startup(facts),
        "memory": _memory(facts),
        "faults": _faults(facts),
        "evaluation": _evaluation(facts),
        "profiles": _profiles(facts),
    }
    nav = " ".join(f'<a href="#{key}">{html.escape(title)}</a>' for key, title in SECTIONS)
    sections = "\n".join(
        f'<section id="{key}"><h2>{html.escape(title)}</h2>\n{bodies[key]}\n</section>'
        for key, title in SECTIONS
    )
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>miles run report: {name}</title>
<style>{_STYLE}</style></head>
<body><header><h1>miles run: {name}</h1>
<p>{html.escape(str(facts.run_dir))} &middot; {len(facts.rollouts)} rollout(s) logged &middot;
report written {stamp}</p><nav>{nav}</nav></header>
{sections}
</body></html>
"""


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]], css: str = "") -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_cell(v)}</td>" for v in row) + "</tr>" for row in rows)
    table = f'<table class="{css}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
    return f'<div class="scroll">{table}</div>'


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, str) and value.startswith("<span"):  # the bar cells, built here
        return value
    return html.escape(str(value))


def _empty(text: str) -> str:
    return f'<p class="empty">{html.escape(text)}</p>'


def _config(facts: RunFacts) -> str:
    if not facts.config:
        return _empty("no config.json in the run directory")
    rows = [(key, "" if value is None else value) for key, value in sorted(facts.config.items())]
    # Long lists and paths stay readable: values are text, not numbers, here.
    rows = [(k, v if isinstance(v, str) else repr(v)) for k, v in rows]
    table = _table(("setting", "value"), rows, css="config")
    return f"<details><summary>{len(rows)} settings (config.json)</summary>{table}</details>"


def _curves(facts: RunFacts) -> str:
    if not facts.plots:
        return _empty("no rollout with a plotted metric was logged yet")
    images = "".join(
        f'<img alt="{html.escape(panel)}" title="{html.escape(panel)}" '
        f'src="data:image/png;base64,{base64.b64encode(png).decode()}">'
        for panel, png in facts.plots.items()
    )
    return f'<div class="plots">{images}</div>'


def _time_split(facts: RunFacts) -> str:
    rows = facts.time_split()
    if not rows:
        return _empty("no rollout with a step time (time/step_s) was logged yet")
    parts = [name for name, _ in TIME_SPLIT] + ["other"]
    table_rows = []
    for row in rows:
        step = row["step"] or 1.0
        bar = "".join(
            f'<span class="{p.replace(" ", "-")}" style="width:{100 * row[p] / step:.1f}%" '
            f'title="{p}: {row[p]:.3g} s"></span>'
            for p in parts
        )
        table_rows.append(
            (
                row["rollout_id"],
                *(row[p] for p in parts),
                row["step"],
                f'<span class="bar">{bar}</span>',
            )
        )
    header = ("rollout", *(f"{p} s" for p in parts), "step s", "split")
    return _table(header, table_rows)


def _startup(facts: RunFacts) -> str:
    phases = facts.startup()
    if not phases:
        return _empty("no start-up record (the first rollout logs startup/*)")
    return _table(("phase", "seconds"), [(k.removesuffix("_s"), v) for k, v in phases.items()])


def _memory(facts: RunFacts) -> str:
    peaks = facts.peak_memory()
    if not peaks:
        return _empty("memory was not recorded: run with --memory-snapshot-dir DIR")
    phases = sorted({phase for by_phase in peaks.values() for phase in by_phase})
    rows = [
        (process, max(by_phase.values()), *(by_phase.get(p, "") for p in phases))
        for process, by_phase in sorted(peaks.items())
    ]
    note = "<p>Peak resident memory (MB) of each process, per phase of the loop.</p>"
    return note + _table(("process", "peak MB", *phases), rows)


def _faults(facts: RunFacts) -> str:
    rows = facts.faults()
    parts = []
    if rows:
        columns = sorted({k for r in rows for k in r if k != "rollout_id"})
        parts.append(
            _table(
                ("rollout", *columns),
                [(r["rollout_id"], *(r.get(c, "") for c in columns)) for r in rows],
            )
        )
    else:
        parts.append(_empty("no engine restart or failure was counted"))
    if facts.failure_log:
        parts.append(f"<h3>failure.log</h3><pre>{html.escape(facts.failure_log)}</pre>")
    else:
        parts.append(_empty("no failure.log: the run has not failed"))
    return "\n".join(parts)


def _evaluation(facts: RunFacts) -> str:
    columns, rows = facts.evaluations()
    if not rows:
        return _empty(
            "no held-out evaluation: run with --eval-prompt-data NAME PATH or --eval-config FILE"
        )
    header = ("rollout", *(c.removeprefix("eval/") for c in columns))
    return _table(header, [(r["rollout_id"], *(r.get(c, "") for c in columns)) for r in rows])


def _profiles(facts: RunFacts) -> str:
    if not facts.traces:
        return _empty("no profile: run with --profile-target")
    items = "".join(f"<li><code>{html.escape(path)}</code></li>" for path in facts.traces)
    return (
        "<p>Open them in https://ui.perfetto.dev or TensorBoard (paths relative to the run "
        f"directory).</p><ul>{items}</ul>"
    )
