#!/usr/bin/env python3
"""Check every internal link of the rendered book (Python 3 standard library).

    python3 docs/check-links.py BOOK_DIR

Reads each HTML page under BOOK_DIR (what `mdbook build` wrote) and checks
every <a href> and <img src> that is not an absolute URL: the file it names
must exist inside BOOK_DIR, and its #fragment must be an id in that file.
A link that leaves the book (../../src/lib.rs) counts as broken: the book is
published on its own, so name repository files as code, not as links.
Prints each broken link and exits 1 when there is one.
"""

from __future__ import annotations

import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

# Pages mdBook generates whose links are written for another location.
SKIP_PAGES = {"404.html"}


class Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[tuple[int, str]] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for key in ("id", "name"):
            if a.get(key) and (key == "id" or tag == "a"):
                self.ids.add(a[key])
        if tag == "a" and a.get("href") is not None:
            self.links.append((self.getpos()[0], a["href"]))
        elif tag == "img" and a.get("src") is not None:
            self.links.append((self.getpos()[0], a["src"]))


def parse(path: Path) -> Page:
    p = Page()
    p.feed(path.read_text(encoding="utf-8", errors="replace"))
    return p


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    root = Path(sys.argv[1]).resolve()
    pages = sorted(root.rglob("*.html"))
    if not pages:
        print(f"check-links: no HTML under {root}", file=sys.stderr)
        return 1
    cache: dict[Path, Page] = {}

    def page(path: Path) -> Page:
        if path not in cache:
            cache[path] = parse(path)
        return cache[path]

    broken = []
    checked = 0
    for src in pages:
        if src.name in SKIP_PAGES:
            continue
        for line, link in page(src).links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith("//"):
                continue  # external: not checked (no internet in CI)
            checked += 1
            if parts.path:
                target = (src.parent / unquote(parts.path)).resolve()
                if target.is_dir():
                    target = target / "index.html"
            else:
                target = src
            rel = src.relative_to(root)
            if root not in target.parents and target != root:
                broken.append(f"{rel}:{line}: {link} leaves the book")
                continue
            if not target.exists():
                broken.append(f"{rel}:{line}: {link}: no file {target.relative_to(root)}")
                continue
            frag = unquote(parts.fragment)
            if frag and target.suffix == ".html" and frag not in page(target).ids:
                broken.append(f"{rel}:{line}: {link}: no id '{frag}' in {target.relative_to(root)}")
    for b in broken:
        print(f"check-links: {b}")
    print(f"check-links: {checked} internal links in {len(pages)} pages, {len(broken)} broken")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
