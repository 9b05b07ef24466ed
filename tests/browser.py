"""Headless Chromium for the viewer's browser test and benchmark: Debian's chromium driven by Playwright.

Playwright never downloads a browser here: it launches the system's Chromium by path. Where none can be had the
test skips, unless MOSOS_BROWSER_TESTS=required (CI sets it in .ci/run), where it fails instead: a CI that
silently skipped its only browser test would prove nothing.
"""

from __future__ import annotations

import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run",
]
CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "chromium", "chromium-browser")


def chromium_executable() -> str | None:
    """MOSOS_CHROMIUM if set, else Debian's /usr/bin/chromium, else one on PATH."""
    for candidate in (os.environ.get("MOSOS_CHROMIUM"), *CHROMIUM_CANDIDATES):
        if not candidate:
            continue
        path = candidate if os.path.isabs(candidate) else shutil.which(candidate)
        if path and os.access(path, os.X_OK):
            return path
    return None


def unavailable_reason() -> str | None:
    """Why no browser can be driven here, or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright for Python is not installed (it comes with the test extra: bash scripts/setup.sh --dev)"
    if chromium_executable() is None:
        return ("no Chromium here: install Debian's package (apt-get install -y chromium, as .ci/run does) "
                "or point MOSOS_CHROMIUM at a Chromium binary")
    return None


@contextmanager
def chromium():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_executable(), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@dataclass
class Watched:
    """A page whose console errors, uncaught exceptions, failed requests and requests elsewhere are recorded."""

    page: object
    allowed_prefix: str
    problems: list[str] = field(default_factory=list)
    load_s: float = 0.0

    def check(self) -> None:
        assert not self.problems, "the page reported problems:\n" + "\n".join(self.problems)


def open_viewer(browser, url: str, *, width: int = 1400, height: int = 1000, timeout_s: float = 60.0) -> Watched:
    """Open the viewer at `url` and wait for its script to finish its first drawing."""
    page = browser.new_page(viewport={"width": width, "height": height})
    watched = Watched(page, allowed_prefix=url.split("#", 1)[0])
    page.on("console", lambda message: message.type in ("error", "warning") and watched.problems.append(
        f"console {message.type}: {message.text}"))
    page.on("pageerror", lambda error: watched.problems.append(f"uncaught: {error}"))
    page.on("dialog", lambda dialog: (watched.problems.append(f"a dialog opened: {dialog.message}"), dialog.dismiss()))
    page.on("requestfailed", lambda request: watched.problems.append(f"request failed: {request.url} {request.failure}"))
    page.on("request", lambda request: request.url.startswith(watched.allowed_prefix) or watched.problems.append(
        f"the page fetched {request.url}"))
    started = time.perf_counter()
    page.goto(url)
    try:
        page.wait_for_selector("body[data-ready='1']", timeout=timeout_s * 1000)
    except Exception as error:  # a blocked or broken script never finishes: say what the page said
        raise AssertionError(f"the viewer's script did not finish in {timeout_s:g} s ({type(error).__name__}); "
                             f"the page reported: {watched.problems or 'nothing'}") from None
    watched.load_s = time.perf_counter() - started
    return watched


def next_frames(page) -> None:
    """Wait until the browser has drawn what the last event asked for."""
    page.evaluate("() => new Promise(done => requestAnimationFrame(() => requestAnimationFrame(done)))")
