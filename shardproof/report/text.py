"""The terminal rendering of a Report."""

from __future__ import annotations

from shardproof.report.model import Report, Site


def render(report: Report) -> str:
    if report.verdict == "equivalent":
        summary = (
            f"equivalent: {report.world_size} ranks, {report.reference_ops:,} reference ops and "
            f"{report.distributed_ops:,} distributed ops proven in {report.seconds:.1f} s"
        )
        return "\n".join([summary, *(f"  proven: {note}" for note in report.notes)])
    lines = [f"{report.verdict}: {report.diagnosis}"]
    for site in report.distributed:
        lines.append(f"  rank {site.rank}  {_site(site)}")
    for site in report.reference:
        lines.append(f"  reference  {_site(site)}")
    return "\n".join(lines)


def _site(site: Site) -> str:
    return f"{site.file.rsplit('/', 1)[-1]}:{site.line}  {site.code}   [{site.op}]"
