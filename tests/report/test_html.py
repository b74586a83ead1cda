"""The HTML report: self-contained, and rendered by headless Chromium (Debian's `chromium`, which
.ci/run installs) with the culprit line on screen."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from shardproof import verify
from shardproof.cli import main
from shardproof.report.html import CULPRIT, page

CASES = Path(__file__).parent.parent / "cases"
BUGGY = CASES / "row-bias-before-reduce_buggy.py"
CULPRIT_LINE = 39  # the `# BUG(double-count)` line of BUGGY
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's `chromium` package (apt-get install -y chromium; .ci/run installs it)")


@pytest.fixture(scope="module")
def buggy_page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("html") / "report.html"
    assert main(["verify", str(BUGGY), "--quiet", "--html", str(path)]) == 1
    return path


def test_the_page_is_self_contained_and_shows_the_culprit_line(buggy_page: Path) -> None:
    text = buggy_page.read_text()
    assert not re.search(r"(src|href)\s*=|<script|@import|url\(", text)  # nothing to fetch
    culprit = BUGGY.read_text().splitlines()[CULPRIT_LINE - 1].strip()
    assert re.search(rf"<span class='line culprit'><span class='no'>{CULPRIT_LINE}</span>\s*{re.escape(culprit[:40])}", text)
    assert "What to do:" in text and "double counting" in text


def test_an_equivalent_page_says_what_was_proven() -> None:
    text = page(verify(CASES / "row-bias-before-reduce_fixed.py"))
    assert ">equivalent<" in text and "<h2>Proven</h2>" in text and "What to do" not in text


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}"]
    return subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=120)


@needs_chromium
def test_chromium_renders_the_page_with_the_culprit_line_in_view(buggy_page: Path, tmp_path: Path) -> None:
    dom = _chromium(tmp_path, "--dump-dom", buggy_page.as_uri()).stdout
    assert "row-bias-before-reduce_buggy.py:39" in dom and "bias added on every rank" in dom
    shot = tmp_path / "shot.png"
    _chromium(tmp_path, f"--screenshot={shot}", "--window-size=900,700", buggy_page.as_uri())
    width, height, pixels = _png_rgb(shot.read_bytes())
    wanted = bytes.fromhex(CULPRIT.lstrip("#"))
    highlighted = sum(1 for i in range(0, len(pixels), 3) if pixels[i : i + 3] == wanted)
    assert highlighted > 100, "the culprit line's highlight is not in the screenshot"


def _png_rgb(data: bytes) -> tuple[int, int, bytes]:
    """Width, height and RGB bytes of an 8-bit, non-interlaced RGB or RGBA PNG (what Chromium writes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks, header = 8, b"", None
    while pos < len(data):
        size, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + size]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            chunks += body
        pos += 12 + size
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0
    channels = 4 if colour == 6 else 3
    raw, stride = zlib.decompress(chunks), width * channels
    rows, previous = [], bytearray(stride)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for x in range(stride):
            left = line[x - channels] if x >= channels else 0
            up, corner = previous[x], previous[x - channels] if x >= channels else 0
            if kind == 1:
                line[x] = (line[x] + left) & 255
            elif kind == 2:
                line[x] = (line[x] + up) & 255
            elif kind == 3:
                line[x] = (line[x] + (left + up) // 2) & 255
            elif kind == 4:
                p = left + up - corner
                nearest = min((abs(p - left), 0, left), (abs(p - up), 1, up), (abs(p - corner), 2, corner))[2]
                line[x] = (line[x] + nearest) & 255
        rows.append(bytes(line))
        previous = line
    pixels = b"".join(row[x : x + 3] for row in rows for x in range(0, stride, channels))
    return width, height, pixels


def test_a_wrong_layout_page_draws_the_region_each_side_holds() -> None:
    text = page(verify(CASES / "wrong-rank-shard_buggy.py"))
    rank = text.split("<th>rank 0</th>", 1)[1].split("</tr>", 1)[0]
    assert "<h2>What each side holds</h2>" in text and "<svg" in rank and "dim 1: 32:64 of 64" in rank
    assert "dim 1: 0:64 of 64" in text.split("<th>reference</th>", 1)[1]
    assert not re.search(r"(src|href)\s*=", text)
