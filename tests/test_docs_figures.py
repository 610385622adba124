"""The documentation's figures: every plot is shown somewhere, and the headline numbers agree.

A PNG under docs/ that no page links is a result nobody finds; the README and
docs/benchmarks.md quoting different added latencies for the same proxy is worse. Both are
checked against the files in the tree, so a new plot or a rerun of bench/overhead.py that is
not carried into the pages fails here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# [text](target) and ![alt](target); the target up to whitespace or ')' (titles are allowed after it).
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def _linked_files() -> dict[Path, list[Path]]:
    """Every local file a Markdown link or image in README.md or docs/ points at -> the pages."""
    linked: dict[Path, list[Path]] = {}
    for page in _pages():
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith(("#", "mailto:")):
                continue
            path = (page.parent / unquote(target.split("#", 1)[0])).resolve()
            linked.setdefault(path, []).append(page)
    return linked


def test_every_png_under_docs_is_linked_from_a_page():
    pngs = sorted(p.resolve() for p in DOCS.rglob("*.png"))
    assert pngs, "no PNG under docs/: the test would check nothing"
    linked = _linked_files()
    orphans = [str(p.relative_to(ROOT)) for p in pngs if p not in linked]
    assert not orphans, ("PNGs no Markdown page links (add ![what it shows](file.png) to the page that "
                         f"explains it): {orphans}")


def test_every_linked_png_exists():
    missing = sorted({f"{str(p.relative_to(ROOT))} (from {', '.join(str(q.relative_to(ROOT)) for q in pages)})"
                      for p, pages in _linked_files().items()
                      if p.suffix == ".png" and not p.exists() and p.is_relative_to(ROOT)})
    assert not missing, f"links to PNGs that are not in the tree: {missing}"


def test_readme_and_benchmarks_quote_the_latest_overhead_run():
    """The added p50 at concurrency 1 (non-streamed), in README.md and at the top of
    docs/benchmarks.md, is the one docs/benchmarks/overhead.json measured."""
    summary = json.loads((DOCS / "benchmarks" / "overhead.json").read_text())["summary"]
    added = f"{summary['json-c1']['omni']['add_p50_ms']['median']:.2f} ms"
    ttfb = f"{summary['stream-c1']['omni']['add_ttfb_p50_ms']['median']:.2f} ms"
    readme = (ROOT / "README.md").read_text()
    assert re.search(rf"add\s+{re.escape(added)}\s+to the p50 at concurrency 1", readme), (
        f"README.md's 'Measured' section must quote overhead.json's added p50 ({added})")
    bench = (DOCS / "benchmarks.md").read_text()
    first = bench[:bench.index("\n## ", bench.index("\n## ") + 1)]   # the first section
    assert f"**{added}**" in first and f"**{ttfb}**" in first, (
        f"docs/benchmarks.md must open with overhead.json's figures: added p50 {added}, TTFB {ttfb}")
