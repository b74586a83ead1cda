"""Errors that mean "unusable input": the CLI turns them into exit code 2 with their message."""


class InternalError(Exception):
    """A failure inside shardproof itself, not the input's fault: the CLI exits 3 (a bug to report)."""


class ShardproofError(Exception):
    """Base class: the message alone must tell the user what to do next."""


class CaseError(ShardproofError):
    """The case file is missing, malformed or breaks the contract."""


class UsageError(ShardproofError):
    """A command-line argument that cannot be used (an output file that cannot be written)."""


class CaptureError(ShardproofError):
    """A model or shard function could not be traced."""


class UnsupportedOp(ShardproofError):
    """An operation shardproof has no semantics for."""

    def __init__(self, op: str, where: str = ""):
        self.op = op
        super().__init__(f"no rule for op `{op}`{' at ' + where if where else ''}")


class GraphFileError(ShardproofError):
    """A graph dump (HLO text, FX readable dump) that does not parse: says where and what was expected."""

    def __init__(self, path: str, line: int, expected: str, found: str):
        self.path, self.line = path, line
        super().__init__(f"{path}:{line}: expected {expected}, found `{found.strip()[:60]}`")
