"""The terminal rendering of a Report."""

from __future__ import annotations

from shardproof.report.model import Report, Site


def render(report: Report) -> str:
    if report.verdict == "equivalent":
        summary = (
            f"equivalent: {report.world_size} ranks, {report.reference_ops:,} reference ops and "
            f"{report.distributed_ops:,} distributed ops proven in {report.seconds:.1f} s"
        )
        return "\n".join([summary, *(f"  proven: {note}" for note in report.notes), *_assumed(report)])
    lines = [f"{report.verdict}: {report.diagnosis}"]
    if report.fix and report.verdict == "discrepancy":
        lines.append(f"  fix: {report.fix}")
    for site in report.distributed:
        lines.append(f"  rank {site.rank}  {_site(site)}")
    for site in report.reference:
        lines.append(f"  reference  {_site(site)}")
    return "\n".join(lines + _assumed(report))


def _assumed(report: Report) -> list[str]:
    """Imported graphs: the input relations that are not plain replicas (the full list is in --json)."""
    cut = [i for i in report.inputs if not i.endswith(" as Replicate()")]
    return [f"  assuming: {line}" for line in cut] + ([f"  compared: {report.outputs_compared} outputs"] if report.inputs else [])


def _site(site: Site) -> str:
    return f"{site.file.rsplit('/', 1)[-1]}:{site.line}  {site.code}   [{site.op}]"
