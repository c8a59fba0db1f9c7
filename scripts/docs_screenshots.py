"""Opens the built documentation site in headless Chromium: screenshots, the framework tabs, the search.

Not run by CI and no dependency of unimp: its tools go in a virtual environment of their own.

    apt-get install -y chromium               # Debian's; or: /tmp/shotvenv/bin/playwright install chromium
    python3 -m venv /tmp/shotvenv && /tmp/shotvenv/bin/pip install playwright
    NO_MKDOCS_2_WARNING=1 mkdocs build --strict --site-dir /tmp/site     # in unimp's own venv
    /tmp/shotvenv/bin/python scripts/docs_screenshots.py /tmp/site --out /tmp/shots

It serves the site on localhost, then in one browser: the home page; a page with framework tabs
(``--tabs-page``), before and after clicking its first tab set's second tab; the search for
``--query`` (``GradScaler``); the concepts page at its first formula. Each state is a PNG under
``--out``; what it checked is printed. Exit status 1 when a tab does not switch (the clicked tab's
block visible, the first's hidden), the search finds nothing, a page shows Markdown the build left
unrendered (``=== "``, ``--8<--``, ``$$`` outside code), MathJax loaded but left a formula as TeX,
or a page raised a JavaScript error.

The site loads Roboto from Google Fonts and MathJax from unpkg.com; the requests that leave
localhost are listed. Without network they fail: the text falls back to the system font and the
math stays TeX, reported but not an error. ``--mathjax DIR`` answers unpkg.com's MathJax from a
local copy (``npm pack mathjax@3 && tar xzf mathjax-3.*.tgz``: ``DIR`` is ``package/``), so the
math is checked offline too; ``--offline`` blocks every other request, so none can stall a page.
Chromium runs with an empty profile and the switches that keep it off the network on its own
(background networking, component updates, sync, QUIC), which a closed network can make it hang on.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import pathlib
import sys
import tempfile
import threading

CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
#: Text that only shows on a page when the build left Markdown unrendered.
UNRENDERED = ['=== "', "--8<--", "$$"]
#: Where mkdocs.yml's extra_javascript loads MathJax from.
MATHJAX_URL = "https://unpkg.com/mathjax@3/"


def _serve(site: pathlib.Path) -> http.server.ThreadingHTTPServer:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _unrendered(page) -> list[str]:
    text = page.locator("article.md-content__inner").evaluate(
        "e => { const c = e.cloneNode(true); c.querySelectorAll('pre, code').forEach(x => x.remove());"
        " return c.textContent; }")
    return [marker for marker in UNRENDERED if marker in text]


def _visible(locator) -> bool:
    return locator.evaluate("e => e.offsetParent !== null && e.getClientRects().length > 0")


def check_tabs(page, before_shot: pathlib.Path, after_shot: pathlib.Path) -> list[str]:
    """Clicks the second tab of the page's first tab set, screenshots before and after; the problems."""
    tabset = page.locator(".tabbed-set").first
    labels = tabset.locator(".tabbed-labels > label")
    blocks = tabset.locator(".tabbed-content > .tabbed-block")
    names = [name.strip() for name in labels.all_inner_texts()]
    if len(names) < 2 or blocks.count() != len(names):
        return [f"first tab set has labels {names} and {blocks.count()} blocks"]
    tabset.evaluate("e => window.scrollTo(0, e.getBoundingClientRect().top + window.scrollY - 80)")
    page.wait_for_timeout(800)  # the header's title fades to the page's on a scroll
    page.screenshot(path=before_shot)
    before = (_visible(blocks.nth(0)), _visible(blocks.nth(1)))
    labels.nth(1).click()
    page.wait_for_timeout(300)
    after = (_visible(blocks.nth(0)), _visible(blocks.nth(1)))
    page.screenshot(path=after_shot)
    print(f"  tabs {names}: before the click [{names[0]}, {names[1]}] visible = {before}, "
          f"after clicking {names[1]!r}: {after}")
    problems = []
    if before != (True, False):
        problems.append(f"before the click the visible blocks were {before}, not (True, False)")
    if after != (False, True):
        problems.append(f"clicking {names[1]!r} left the blocks visible = {after}, not (False, True)")
    return problems


def check_search(page, query: str, shot: pathlib.Path) -> list[str]:
    """Types ``query`` into the header's search box; the problems found."""
    box = page.locator("input.md-search__input")
    if not box.is_visible():  # a narrow window: the search opens from the header's icon
        page.locator("label.md-header__button[for='__search']").first.click()
    box.click()
    box.type(query, delay=50)
    items = page.locator(".md-search-result__item")
    try:
        items.first.wait_for(state="visible", timeout=10_000)
    except Exception:  # playwright's TimeoutError: nothing found; reported below
        pass
    page.wait_for_timeout(500)
    page.screenshot(path=shot)
    meta = page.locator(".md-search-result__meta").inner_text().strip()  # "14 matching documents"
    pages = page.locator(".md-search-result__item > .md-search-result__link").evaluate_all(
        "links => links.map(a => [a.querySelector('h1, h2')?.innerText.trim(), "
        "new URL(a.href).pathname + new URL(a.href).hash])")
    print(f"  search {query!r}: {meta!r}; {len(pages)} result(s) listed")
    for title, where in pages:
        print(f"    {title}  ({where})")
    return [] if pages else [f"the search for {query!r} found nothing ({meta!r})"]


def check_math(page, shot: pathlib.Path) -> list[str]:
    """Screenshots the page's first formula; the problems found (MathJax loaded, math left as TeX)."""
    try:
        page.wait_for_function("() => document.querySelector('.arithmatex mjx-container')",
                               timeout=10_000)
    except Exception:  # playwright's TimeoutError: MathJax did not load (no network) or failed
        pass
    formulas = page.locator(".arithmatex")
    if formulas.count():
        formulas.first.scroll_into_view_if_needed()
        page.evaluate("window.scrollBy(0, -120)")  # the formula below the header, its lead-in shown
        page.wait_for_timeout(800)  # the header's title fades to the page's on a scroll
    page.screenshot(path=shot)
    typeset = page.locator(".arithmatex:has(mjx-container)").count()
    loaded = page.evaluate("() => typeof window.MathJax?.typesetPromise === 'function'")
    print(f"  math: {typeset} of {formulas.count()} formulas typeset by MathJax"
          + ("" if loaded else " (MathJax did not load: no network? see --mathjax)"))
    if loaded and typeset < formulas.count():
        return [f"MathJax left {formulas.count() - typeset} of {formulas.count()} formulas as TeX"]
    return []


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=pathlib.Path, help="the built site (mkdocs build --site-dir)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("docs-shots"))
    parser.add_argument("--chromium", default="/usr/bin/chromium",
                        help="Chromium to run; '' for Playwright's own (playwright install chromium)")
    parser.add_argument("--tabs-page", default="guides/train-step/")
    parser.add_argument("--query", default="GradScaler")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=900)
    parser.add_argument("--offline", action="store_true",
                        help="block every request that leaves localhost (fonts, MathJax)")
    parser.add_argument("--mathjax", type=pathlib.Path,
                        help=f"a MathJax 3 package to answer {MATHJAX_URL} from, for a machine "
                             "without network (npm pack mathjax@3; tar xzf; the package/ folder)")
    args = parser.parse_args(argv)
    if not (args.site / "index.html").is_file():
        parser.error(f"{args.site} holds no index.html: build it with "
                     f"mkdocs build --strict --site-dir {args.site}")
    from playwright.sync_api import sync_playwright  # the separate venv's; see the top

    args.out.mkdir(parents=True, exist_ok=True)
    server = _serve(args.site)
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    problems: list[str] = []
    external: set[str] = set()
    failed: set[str] = set()
    with tempfile.TemporaryDirectory() as profile, sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(
            profile, executable_path=args.chromium or None, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": args.width, "height": args.height})
        if args.mathjax:  # the site's MathJax URL answered from a local copy of the package
            browser.route(MATHJAX_URL + "**", lambda route: route.fulfill(
                path=args.mathjax / route.request.url.removeprefix(MATHJAX_URL).split("?")[0]))
        if args.offline:
            local = (base, MATHJAX_URL) if args.mathjax else (base,)
            browser.route(lambda url: not url.startswith(local), lambda route: route.abort())
        page = browser.new_page()
        page.on("request", lambda r: r.url.startswith(base) or external.add(r.url))
        page.on("requestfailed", lambda r: failed.add(f"{r.url} ({r.failure})"))
        page.on("console", lambda m: m.type == "error" and print(f"  console error: {m.text}"))
        page.on("pageerror", lambda e: problems.append(f"JavaScript error: {e}"))

        for name, path in [("home", ""), ("tabs", args.tabs_page), ("concepts", "concepts/")]:
            page.goto(base + path, wait_until="load")
            page.wait_for_timeout(500)
            print(f"{base + path}: {page.title()!r}")
            if name == "concepts":
                problems += check_math(page, args.out / f"{name}.png")
            elif name == "tabs":
                problems += check_tabs(page, args.out / "tabs.png", args.out / "tabs-switched.png")
                problems += check_search(page, args.query, args.out / "search.png")
            else:
                page.screenshot(path=args.out / f"{name}.png")
            left = _unrendered(page)
            if left:
                problems.append(f"{path or 'home'} shows unrendered Markdown: {left}")
        browser.close()
    server.shutdown()
    for url in sorted(external):
        local = args.mathjax and url.startswith(MATHJAX_URL)
        print(f"{'answered from --mathjax' if local else 'request leaving localhost'}: {url}")
    for what in sorted(failed):
        print(f"request failed: {what}")
    print(f"screenshots: {', '.join(sorted(p.name for p in args.out.glob('*.png')))} in {args.out}")
    for problem in problems:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
