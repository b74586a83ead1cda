"""shardproof: prove a distributed model computes what its single-device reference does."""

from shardproof.api import verify
from shardproof.report.model import Report

__all__ = ["verify", "Report"]
