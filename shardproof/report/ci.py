"""The report in the formats CI tools read: GitHub workflow annotations at the culprit lines
(`--format github`) and SARIF 2.1.0 (`--format sarif`, for code-scanning uploads). Paths are
relative to the working directory, as both expect paths in the repository checked out there."""

from __future__ import annotations

import json
from importlib import metadata

from shardproof.relations.diagnose.finding import KINDS
from shardproof.report.model import Report, Site, relative
from shardproof.report.text import render

LEVELS = {"discrepancy": ("error", "error"), "unknown": ("warning", "warning"), "equivalent": ("notice", "note")}


def github(report: Report) -> str:
    """One workflow command per site (the culprit an error, the sites after it notices), or one
    without a site; the text report follows for the log."""
    level = LEVELS[report.verdict][0]
    title = f"shardproof: {report.kind or report.verdict}"
    message = _escape(_summary(report))
    sites = [*report.distributed, *report.reference]
    if not sites:
        commands = [f"::{level} title={_property(title)}::{message}"]
    else:
        commands = [
            f"::{level if i == 0 else 'notice'} file={_property(relative(site.file))},line={site.line},"
            f"title={_property(title if i == 0 else title + ' (related)')}::{message if i == 0 else _escape(_where(site))}"
            for i, site in enumerate(sites)
        ]
    return "\n".join([*commands, render(report)])


def sarif(report: Report) -> str:
    """A SARIF log with one result (none when equivalent) at the culprit, the other sites related."""
    kind = (report.kind or "unknown").replace(" ", "_")
    rules = [{"id": k.replace(" ", "_"), "shortDescription": {"text": text}} for k, text in KINDS.items()]
    results = []
    if report.verdict != "equivalent":
        sites = [*report.distributed, *report.reference]
        result = {"ruleId": kind, "level": LEVELS[report.verdict][1], "message": {"text": _summary(report)}}
        if sites:
            result["locations"] = [_location(sites[0])]
            result["relatedLocations"] = [{**_location(site), "id": i, "message": {"text": _where(site)}}
                                          for i, site in enumerate(sites[1:], 1)]
        results.append(result)
    log = {
        "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {"name": "shardproof", "version": metadata.version("shardproof"), "rules": rules}},
            "results": results,
        }],
    }
    return json.dumps(log, indent=2)


def _summary(report: Report) -> str:
    if report.verdict == "equivalent":
        return render(report).splitlines()[0]
    return f"{report.verdict}: {report.diagnosis}" + (f" Fix: {report.fix}" if report.fix else "")


def _where(site: Site) -> str:
    who = "reference" if site.rank is None else f"rank {site.rank}"
    return f"{who}: `{site.op}` at {site.code.strip()}"


def _location(site: Site) -> dict:
    return {"physicalLocation": {"artifactLocation": {"uri": relative(site.file)}, "region": {"startLine": max(site.line, 1)}}}


def _escape(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _property(text: str) -> str:
    return _escape(text).replace(":", "%3A").replace(",", "%2C")
