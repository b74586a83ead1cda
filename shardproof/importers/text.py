"""Read a graph dump as text: UTF-8 or refused, with the line of the first byte that is not."""

from __future__ import annotations

from pathlib import Path

from shardproof.errors import GraphFileError


def read_text(path: str | Path) -> str:
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        found = f"byte 0x{data[err.start]:02x}" + (" (a binary file?)" if b"\0" in data[:4096] else "")
        raise GraphFileError(str(path), line, "UTF-8 text", found) from None
    if "\0" in text:
        raise GraphFileError(str(path), text.count("\n", 0, text.index("\0")) + 1, "text without NUL bytes", "a NUL byte (a binary file?)")
    return text
