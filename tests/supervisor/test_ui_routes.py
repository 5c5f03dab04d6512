"""The browser pages as files (supervisor/ui/): served with their security headers from a
fixed set, nothing fetched from elsewhere, nothing CSP would block; `--no-web-ui` turns
them off; the admin log tail behind the admin door; the token count the live chart
reads. (The pages' behaviour in a real browser: tests/ui/.)"""

from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest

from supervisor.admin.logs import tail_lines
from supervisor.ui.routes import CSP, PAGES, load_files
from tests.supervisor.fakes import FakeBehaviour
from tests.supervisor.test_admin import admin_client
from tests.supervisor.test_pool import Worlds, model_dir


class Refs(HTMLParser):
    """What a page loads, and what CSP would refuse in it."""

    def __init__(self):
        super().__init__()
        self.loads: list[str] = []
        self.blocked: list[str] = []
        self.ids: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.append(a["id"])
        if tag == "script":
            self._in_script = True
            if "src" in a:
                self.loads.append(a["src"])
        if tag == "link" and "href" in a:
            self.loads.append(a["href"])
        for name, _ in attrs:
            if name == "style" or name.startswith("on"):
                self.blocked.append(f"<{tag} {name}=...>")

    def handle_endtag(self, tag):
        if tag == "script":
            self._in_script = False

    def handle_data(self, data):
        if self._in_script and data.strip():
            self.blocked.append("inline script")
        if data.strip() and self.lasttag == "style":
            self.blocked.append("inline style")


async def test_pages_are_served_with_their_headers_and_load_only_their_own_files(tmp_path):
    client = await admin_client(tmp_path, Worlds(FakeBehaviour()), [model_dir(tmp_path, "a")])
    try:
        for path in PAGES:
            r = await client.get(path, headers={})
            assert r.status == 200 and r.content_type == "text/html"
            assert r.headers["Content-Security-Policy"] == CSP
            assert r.headers["X-Content-Type-Options"] == "nosniff"
            assert r.headers["X-Frame-Options"] == "DENY"
            refs = Refs()
            refs.feed(await r.text())
            assert refs.loads and not refs.blocked, refs.blocked
            # The scripts find elements by id: a second element with one (the playground's
            # stop-sequences box was "stop", like its Stop button) takes the other's place.
            assert sorted(set(refs.ids)) == sorted(refs.ids), (path, refs.ids)
            for ref in refs.loads:
                assert ref.startswith("/ui/static/"), ref    # this origin only
                f = await client.get(ref, headers={})
                assert f.status == 200, ref
                assert f.headers["Content-Security-Policy"] == CSP
                assert f.content_type in ("text/css", "text/javascript", "image/svg+xml")
        r = await client.get("/ui", headers={}, allow_redirects=False)
        assert r.status == 302 and r.headers["Location"] == "/ui/"
        for bad in ("/ui/static/nope.js", "/ui/static/..%2Froutes.py", "/ui/static/routes.py"):
            assert (await client.get(bad, headers={})).status == 404, bad
    finally:
        await client.close()


def test_the_policy_allows_this_origin_only():
    rules = dict(d.strip().split(" ", 1) for d in CSP.split(";"))
    assert rules["default-src"] == "'none'"
    for directive in ("script-src", "style-src", "connect-src"):
        assert rules[directive] == "'self'", directive   # no inline, no eval, no CDN
    assert rules["frame-ancestors"] == "'none'"


def test_no_file_names_another_site():
    """Offline: no CDN, no web font, no analytics. (SVG's namespace URI is a name, not
    a fetch.)"""
    files = load_files()
    assert {"dashboard.html", "chat.html", "common.js", "style.css"} <= set(files)
    for name, (body, _) in files.items():
        text = body.decode()
        urls = [u for u in re.findall(r"(?:https?:)?//[\w.-]+\.\w+[^\s'\"`)]*", text)
                if not u.startswith("http://www.w3.org/2000/svg")]
        assert not urls, (name, urls)
        if name.endswith(".css"):
            assert "@import" not in text and "url(" not in text, name


async def test_no_web_ui_turns_the_pages_off(tmp_path):
    client = await admin_client(tmp_path, Worlds(FakeBehaviour()), [model_dir(tmp_path, "a")],
                                web_ui=False)
    try:
        for path in (*PAGES, "/ui/static/common.js"):
            assert (await client.get(path, headers={})).status == 404, path
        assert (await client.get("/health", headers={})).status in (200, 503)
    finally:
        await client.close()


async def test_the_log_tail_needs_the_token_and_gives_the_last_lines(tmp_path):
    client = await admin_client(tmp_path, Worlds(FakeBehaviour()), [model_dir(tmp_path, "a")])
    log = tmp_path / "logs" / "mlxd.log"
    log.parent.mkdir(exist_ok=True)
    log.write_text("".join(f"line {i}\n" for i in range(50)))
    try:
        assert (await client.get("/admin/logs", headers={})).status == 401
        r = await client.get("/admin/logs?lines=3", headers=client.headers)
        body = await r.json()
        assert r.status == 200 and body["lines"] == ["line 47", "line 48", "line 49"]
        assert body["file"] == str(log)
        for bad in ("abc", "-1", "100000"):
            r = await client.get(f"/admin/logs?lines={bad}", headers=client.headers)
            assert r.status == 400 and (await r.json())["error"]["param"] == "lines"
    finally:
        await client.close()


def test_tail_lines_reads_only_the_end(tmp_path):
    path = tmp_path / "big.log"
    path.write_text("".join(f"{i:06d} " + "x" * 93 + "\n" for i in range(5000)))  # 100-byte lines
    lines = tail_lines(path, 1000, max_bytes=1050)
    # 1050 bytes hold ten whole lines and a piece of one more, which is dropped.
    assert lines[0].startswith("004990") and lines[-1].startswith("004999") and len(lines) == 10
    assert tail_lines(path, 2)[0].startswith("004998")
    assert tail_lines(tmp_path / "missing.log", 5) == [] and tail_lines(path, 0) == []


async def test_the_token_count_grows_with_each_request(tmp_path):
    client = await admin_client(tmp_path, Worlds(FakeBehaviour(tokens=4)),
                                [model_dir(tmp_path, "a")])
    try:
        from tests.supervisor.test_app import wait_health
        await wait_health(client, lambda s, b: s == 200 and b["status"] == "ok")
        for expected in (4, 8):
            r = await client.post("/v1/completions", json={"model": str(tmp_path / "a"),
                                                           "prompt": "hi", "max_tokens": 4})
            assert r.status == 200
            body = await (await client.get("/health")).json()
            assert body["workers"][0]["tokens_total"] == expected
    finally:
        await client.close()


@pytest.mark.parametrize("name", ["dashboard.html", "chat.html"])
def test_every_element_the_scripts_look_up_exists(name):
    """`$("id")` in a page's script names an element of that page (a typo is a page that
    breaks only when someone clicks)."""
    files = load_files()
    html = files[name][0].decode()
    script = files[name.replace(".html", ".js")][0].decode()
    ids = set(re.findall(r'id="([\w-]+)"', html))
    wanted = set(re.findall(r'\$\("([\w-]+)"\)', script))
    wanted |= {i for group in re.findall(r'for \(const id of \[([^\]]+)\]', script)
               for i in re.findall(r'"([\w-]+)"', group)}
    assert wanted and wanted <= ids, wanted - ids
