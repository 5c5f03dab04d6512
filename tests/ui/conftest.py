"""The pages in a real browser: headless Chromium (the system's, Debian's `chromium`)
driven by Playwright, against a real server with real workers.

No browser is downloaded: Playwright launches the executable named by MLXD_CHROMIUM, or
the first of chromium / chromium-browser / google-chrome on PATH. Without one the tests
are skipped, unless MLXD_REQUIRE_UI_TOOLS=1 (CI sets it: there a missing browser fails).

Each test's page records what the browser reports: a console error (a CSP violation is
one), an uncaught exception, a request to any other origin; the `page` fixture fails the
test on any of them. Screenshots go to test-output/ui/ in the checkout, to be looked at.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.serverproc import REPO, ServerProcess

SHOTS = REPO / "test-output" / "ui"
# As this machine's browser probe starts it: without the background-networking flags
# Chromium dials Google's hosts, which a closed network refuses.
ARGS = ["--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run", "--disable-quic",
        # A microphone that plays a tone, granted without a prompt: the playground records.
        "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream"]


def chromium_path() -> str | None:
    named = os.environ.get("MLXD_CHROMIUM")
    if named:
        return named
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


# Package-scoped: sync Playwright runs an event loop on this thread while it is started,
# and pytest-asyncio's tests cannot run beside it; it stops when tests/ui/ is done.
@pytest.fixture(scope="package")
def browser():
    path = chromium_path()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    if path is None or sync_playwright is None:
        why = "no Chromium on PATH (apt install chromium)" if path is None else \
            "Playwright is not installed"
        if os.environ.get("MLXD_REQUIRE_UI_TOOLS") == "1":
            pytest.fail(why + " and MLXD_REQUIRE_UI_TOOLS=1")
        pytest.skip(why)
    # Not under `make test`'s LD_PRELOAD (the BLAS for the MLX workers): preloaded into
    # Playwright's driver (Node) or Chromium, a library that starts threads at load
    # kills them ("pthread_create: Invalid argument").
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("LD_PRELOAD", raising=False)
        p = sync_playwright().start()
        b = p.chromium.launch(executable_path=path, args=ARGS)
    try:
        yield b
    finally:
        b.close()
        p.stop()


@pytest.fixture(scope="session")
def tiny_model(models_dir) -> Path:
    """The pages' text model: tests/conftest.py's tiny one with a 32,768-token window. The
    playground's first reply runs until Stop is clicked and stays in the conversation; on a
    busy machine the click comes seconds late, and in 4,096 tokens the next turn, sent with
    that reply, would not fit (session 17's CI run: `finish: error`)."""
    from worker.demos.text import build_model

    return build_model(models_dir / "tiny-32k", "tiny", context_length=32768).path


@pytest.fixture(scope="package")
def ui_server(tiny_model, vision_model, stt_model, tts_model):
    """One server with a model of each kind the playground talks to."""
    models = [str(tiny_model), str(vision_model), str(stt_model), str(tts_model)]
    with ServerProcess(models) as srv:
        srv.wait_healthy(timeout=240)
        yield srv


def admin_token(srv: ServerProcess) -> str:
    return (srv.state_dir / "admin-token").read_text().strip()


class Watched:
    """A page with what went wrong in it written down."""

    def __init__(self, page, origin: str):
        self.page, self.origin = page, origin
        self.problems: list[str] = []
        self.requests: list = []
        page.on("console", self._console)
        page.on("pageerror", lambda e: self.problems.append(f"uncaught: {e}"))
        page.on("request", self._request)

    def _console(self, msg) -> None:
        # Chrome logs every 4xx as "Failed to load resource": tests that expect one say so.
        if msg.type == "error" and not msg.text.startswith("Failed to load resource"):
            self.problems.append(f"console: {msg.text}")

    def _request(self, request) -> None:
        self.requests.append(request)
        parts = urlsplit(request.url)
        if parts.scheme in ("http", "https", "ws", "wss") and \
                f"{parts.scheme}://{parts.netloc}" != self.origin:
            self.problems.append(f"request to another origin: {request.url}")

    def shot(self, name: str) -> Path:
        SHOTS.mkdir(parents=True, exist_ok=True)
        path = SHOTS / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path


@pytest.fixture
def page(browser, ui_server):
    """A fresh browser context (its own session storage) on the UI server's origin."""
    context = browser.new_context(viewport={"width": 1300, "height": 950})
    watched = Watched(context.new_page(), ui_server.url)
    watched.page.set_default_timeout(60_000)
    try:
        yield watched
        assert not watched.problems, watched.problems
    finally:
        context.close()


def until(page, expression: str, timeout: float | None = None) -> None:
    """Wait until a JavaScript expression holds in the page. Given to Playwright as a
    function: an expression string it would evaluate with `eval`, which the pages'
    Content-Security-Policy (rightly) forbids."""
    page.wait_for_function(f"() => ({expression})", timeout=timeout)
