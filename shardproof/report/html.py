"""The report as one self-contained HTML page (`--html PATH`): no script, no file or network
reference, so it can be attached to a CI run and opened anywhere.

It shows the verdict and diagnosis with its fix; the source around every site, the reference's
beside each rank's, the culprit line highlighted (the first site of the diagnosis, in `CULPRIT`
colour, the others in `RELATED`); the region of a tensor each side holds where they diverge, drawn
dim by dim; the claims found failing; the relations assumed; and for an equivalent verdict what
was proven (the claims, notes, calls proven once and reused).
"""

from __future__ import annotations

import html
from pathlib import Path

from shardproof.report.model import Region, Report, Site, relative
from shardproof.report.terms import index
from shardproof.report.text import render

CONTEXT = 5  # source lines shown before and after a site's line
CULPRIT, RELATED = "#ffd400", "#ffe9a8"  # background of the culprit line and of the other sites' lines
VERDICT_COLOURS = {"equivalent": "#1a7f37", "discrepancy": "#cf222e", "unknown": "#9a6700"}
SIDE_COLOURS = {"rank": "#cf222e", "reference": "#1a7f37"}
BAR = 320  # pixels of a dim's bar in the drawing of regions

STYLE = f"""
body {{ font: 15px/1.45 system-ui, sans-serif; margin: 2em auto; padding: 0 1em; max-width: 1400px; color: #1f2328; }}
h1 {{ font-size: 1.5em; }} .verdict {{ color: white; padding: .1em .5em; border-radius: .3em; }}
.fix {{ border-left: 4px solid #0969da; padding: .3em .8em; background: #ddf4ff; }}
.sides {{ display: grid; grid-template-columns: 1fr 1fr; gap: 1em; }} .sides > div {{ min-width: 0; }}
.excerpt {{ border: 1px solid #d0d7de; border-radius: .3em; margin-bottom: 1em; overflow-x: auto; }}
.excerpt h3 {{ margin: 0; padding: .3em .6em; font-size: .95em; background: #f6f8fa; border-bottom: 1px solid #d0d7de; }}
pre {{ margin: 0; font: 13px/1.4 ui-monospace, monospace; }}
.line {{ display: block; padding: 0 .6em; white-space: pre; }} .no {{ color: #8c959f; display: inline-block; width: 3.5em; }}
.culprit {{ background: {CULPRIT}; }} .related {{ background: {RELATED}; }}
table {{ border-collapse: collapse; }} td, th {{ border: 1px solid #d0d7de; padding: .2em .6em; text-align: left; }}
"""


def page(report: Report) -> str:
    colour = VERDICT_COLOURS[report.verdict]
    parts = [
        f"<h1><span class='verdict' style='background:{colour}'>{report.verdict}</span></h1>",
        f"<p>{_text(render(report).splitlines()[0].partition(': ')[2])}</p>",
    ]
    if report.fix and report.verdict == "discrepancy":
        parts.append(f"<p class='fix'><b>What to do:</b> {_text(report.fix)}</p>")
    sites = [*report.distributed, *report.reference]
    if sites:
        culprit = sites[0]
        ranks = "".join(_excerpt(s, s is culprit) for s in report.distributed)
        reference = "".join(_excerpt(s, s is culprit) for s in report.reference) or "<p>(no reference site)</p>"
        parts.append(f"<h2>Where</h2><div class='sides'><div><h3>ranks</h3>{ranks}</div>"
                     f"<div><h3>reference</h3>{reference}</div></div>")
    drawing = _regions(report.regions)
    if drawing:
        parts.append(f"<h2>What each side holds</h2>{drawing}")
    if report.claims:
        parts.append("<h2>Claims found failing</h2><ul>" + "".join(f"<li>{_text(c)}</li>" for c in report.claims) + "</ul>")
    if report.verdict == "equivalent":
        proven = [f"{claim}: on every rank" for claim in report.proven] + report.notes
        if report.calls_proven:
            proven.append(f"{report.calls_proven} distinct module calls proven once, {report.calls_reused} more answered by those proofs")
        parts.append("<h2>Proven</h2><ul>" + "".join(f"<li>{_text(p)}</li>" for p in proven) + "</ul>")
    if report.inputs:
        parts.append("<h2>Relations assumed</h2><ul>" + "".join(f"<li>{_text(i)}</li>" for i in report.inputs) + "</ul>")
    parts.append(_figures(report))
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>shardproof: {report.verdict}</title>"
            f"<style>{STYLE}</style></head><body>{''.join(parts)}</body></html>\n")


def _excerpt(site: Site, culprit: bool) -> str:
    """The lines around a site, its own highlighted; its recorded code alone when the file is gone."""
    who = "reference" if site.rank is None else f"rank {site.rank}"
    title = f"{who} · {_text(relative(site.file))}:{site.line} · <code>{_text(site.op)}</code>"
    try:
        lines = Path(site.file).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        lines = []
    if not 1 <= site.line <= len(lines):
        lines, first = [site.code], site.line
    else:
        first = max(1, site.line - CONTEXT)
        lines = lines[first - 1 : site.line + CONTEXT]
    rows = []
    for number, text in enumerate(lines, first):
        marked = " culprit" if culprit and number == site.line else " related" if number == site.line else ""
        rows.append(f"<span class='line{marked}'><span class='no'>{number}</span>{_text(text)}</span>")
    return f"<div class='excerpt'><h3>{title}</h3><pre>{''.join(rows)}</pre></div>"


def _regions(regions: list[Region]) -> str:
    """Each side's region as one bar per dim of its whole tensor, the part it holds filled; nothing
    when every side holds whole tensors (the drawing would say nothing the diagnosis does not)."""
    if all(r.box == tuple((0, size) for size in r.shape) for r in regions):
        return ""
    rows = []
    for r in regions:
        colour = SIDE_COLOURS["reference" if r.side == "reference" else "rank"]
        bars = "".join(
            f"<svg width='{BAR + 2}' height='14' role='img' aria-label='dim {d}: {lo}:{hi} of {size}'>"
            f"<rect x='1' y='1' width='{BAR}' height='12' fill='#eaeef2' stroke='#8c959f'/>"
            f"<rect x='{1 + BAR * lo / size:.1f}' y='1' width='{BAR * (hi - lo) / size:.1f}' height='12' fill='{colour}'/></svg>"
            f" <code>dim {d}: {lo}:{hi} of {size}</code><br>"
            for d, ((lo, hi), size) in enumerate(zip(r.box, r.shape)) if size
        )
        rows.append(f"<tr><th>{_text(r.side)}</th><td><code>{_text(r.tensor)}{_text(index(r.box, r.shape))}</code>"
                    f"<br>{bars}</td></tr>")
    return f"<table class='regions'>{''.join(rows)}</table>"


def _figures(report: Report) -> str:
    rows = [("ranks", report.world_size), ("reference ops", f"{report.reference_ops:,}"),
            ("distributed ops (all ranks)", f"{report.distributed_ops:,}"), ("seconds", f"{report.seconds:.1f}")]
    return "<h2>Figures</h2><table>" + "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows) + "</table>"


def _text(value: object) -> str:
    return html.escape(str(value))
