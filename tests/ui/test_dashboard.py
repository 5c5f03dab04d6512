"""The dashboard (/ and /ui/) in headless Chromium against a real server: it lists the
loaded models with their kinds, its tokens/s moves after a request, the log shows, and
its buttons unload and load through the admin API with the token and fail cleanly
without it."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.ui.conftest import admin_token

from tests.ui.conftest import until

pytestmark = pytest.mark.integration


def health(srv) -> dict:
    return httpx.get(srv.url + "/health", timeout=10).json()


def worker(srv, model: str) -> dict | None:
    return next((w for w in health(srv)["workers"] if w["model"] == model), None)


def row(page, model: str):
    return page.locator(f'#workers tbody tr[data-model="{model}"]')


def test_the_dashboard_lists_every_model_and_its_tokens_per_second_moves(
        page, ui_server, tiny_model, vision_model, stt_model, tts_model):
    p = page.page
    p.goto(ui_server.url + "/#token=" + admin_token(ui_server))
    # The token left the address bar for the tab's session storage.
    assert "token" not in p.url
    assert p.evaluate("sessionStorage.getItem('mlxd.adminToken')") == admin_token(ui_server)
    for model, kind in ((tiny_model, "text"), (vision_model, "vision"), (stt_model, "stt"),
                        (tts_model, "tts")):
        r = row(p, str(model))
        r.wait_for()
        assert r.locator("td").nth(1).inner_text() == kind
    tiny = row(p, str(tiny_model))
    until(p, "document.querySelector('#facts').innerText.includes('uptime')")
    assert tiny.locator(".badge").inner_text() == "ready"
    # With the token: memory, the workers' RSS and the log.
    assert "available" in p.locator("#memory").inner_text()
    assert re.search(r"\d+(\.\d+)? [KMG]B", tiny.locator("td").nth(4).inner_text())
    until(p, "document.querySelector('#log').innerText.includes('mlxd')")
    before = float(tiny.locator(".tps").inner_text())

    r = httpx.post(ui_server.url + "/v1/chat/completions", timeout=120, json={
        "model": str(tiny_model), "max_tokens": 48, "temperature": 0,
        "messages": [{"role": "user", "content": "count"}]})
    assert r.status_code == 200, r.text
    n = r.json()["usage"]["completion_tokens"]
    assert n > 0
    # The minute's mean in the table grows, and the live chart saw the burst.
    until(p, 
        f"parseFloat(document.querySelector('tr[data-model=\"{tiny_model}\"] .tps')"
        f".innerText) > {before}", timeout=15_000)
    until(p, 
        "parseFloat(document.querySelector('#chart text').textContent.slice(4)) > 1",
        timeout=15_000)
    # Its KV memory: bytes per token of context and the tokens the prompt cache now holds
    # (the request's), as /health says once the worker's next heartbeat has told it.
    deadline = time.monotonic() + 15
    kv = worker(ui_server, str(tiny_model))["kv"]
    while kv["tokens"] == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
        kv = worker(ui_server, str(tiny_model))["kv"]
    assert kv["tokens"] > 0 and kv["bytes_per_token"] > 0
    until(p, f"document.querySelector('tr[data-model=\"{tiny_model}\"] td.kv').innerText"
             f".endsWith(' · {kv['tokens']}')", timeout=15_000)
    cell = tiny.locator("td.kv")
    assert re.fullmatch(r"\d+(\.\d+)? (B|KB|MB) · \d+", cell.inner_text())
    assert "full precision KV" in cell.get_attribute("title")
    # The request's log line arrived in the tail (the log is read every few seconds).
    until(p, 
        f"document.querySelector('#log').innerText.includes('completion_tokens={n}')",
        timeout=15_000)
    page.shot("dashboard")


def test_without_the_token_it_shows_the_models_and_refuses_to_unload(page, ui_server,
                                                                     tiny_model):
    p = page.page
    p.goto(ui_server.url + "/ui/")
    tiny = row(p, str(tiny_model))
    tiny.wait_for()
    assert p.locator("#admin-note").is_visible()
    assert "Needs the admin token" in p.locator("#memory").inner_text()
    tiny.locator("button.unload").click()
    p.wait_for_selector("#message.error")
    message = p.locator("#message").inner_text()
    assert "unload failed" in message and "admin token" in message
    time.sleep(0.5)
    assert worker(ui_server, str(tiny_model))["state"] == "ready"
    # A wrong token: refused, said so, and still nothing happens.
    p.fill("#token", "not-the-token")
    p.click("#token-form button[type=submit]")
    until(p, "document.querySelector('#message').innerText.includes('refused')")
    tiny.locator("button.kill").click()
    until(p, "document.querySelector('#message').innerText.includes('kill failed')")
    assert worker(ui_server, str(tiny_model))["restarts"] == 0
    page.shot("dashboard-without-token")


def test_with_the_token_unload_then_load_again(page, ui_server, tiny_model):
    p = page.page
    p.goto(ui_server.url + "/ui/#token=" + admin_token(ui_server))
    tiny = row(p, str(tiny_model))
    tiny.wait_for()
    tiny.locator("button.unload").click()
    until(p, 
        "document.querySelector('#message').innerText.includes('unloaded')", timeout=60_000)
    assert "error" not in (p.locator("#message").get_attribute("class") or "")
    w = worker(ui_server, str(tiny_model))
    assert w is None or w["state"] == "stopped"

    p.fill("#load-model", str(tiny_model))
    p.click("#load")
    p.wait_for_selector("#message.done", timeout=120_000)
    assert "ready" in p.locator("#message").inner_text()
    assert worker(ui_server, str(tiny_model))["state"] == "ready"
    tiny.locator(".badge", has_text="ready").wait_for()

    # Kill: the worker is replaced, and its row counts the restart with its cause.
    pid = worker(ui_server, str(tiny_model))["pid"]
    tiny.locator("button.kill").click()
    until(p, "document.querySelector('#message').innerText.includes('killed')", 60_000)
    until(p, f"document.querySelector('tr[data-model=\"{tiny_model}\"] td.restarts')"
             ".innerText.startsWith('1 (admin')", 60_000)
    tiny.locator(".badge", has_text="ready").wait_for()
    assert worker(ui_server, str(tiny_model))["pid"] != pid
    page.shot("dashboard-after-kill")
