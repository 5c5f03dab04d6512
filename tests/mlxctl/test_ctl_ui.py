"""`mlxctl ui`: the dashboard opened through a 0600 launcher page that holds the token in
the URL's fragment; never the token on a browser's command line."""

from __future__ import annotations

import argparse
import stat
from types import SimpleNamespace

from mlxctl.ui import LAUNCH_FILE, cmd_ui, dashboard_url


class FakeClient:
    def __init__(self, state_dir, token="tok-123"):
        self.url, self.state_dir, self.token = "http://127.0.0.1:8080", state_dir, token
        self.calls = []

    def call(self, method, path, body=None, timeout=None):
        self.calls.append((method, path))
        return {"status": "ok"}


def args(**kw):
    return argparse.Namespace(**{"json": False, "print_url": False, **kw})


def test_opens_a_private_launcher_with_the_token_in_the_fragment(tmp_path, capsys):
    opened = []
    client = FakeClient(tmp_path)
    deps = SimpleNamespace(open_browser=lambda url: opened.append(url) or True)
    assert cmd_ui(args(), client, deps) == 0
    assert client.calls == [("GET", "/admin/status")]   # checked the server and the token
    launcher = tmp_path / LAUNCH_FILE
    assert opened == [launcher.as_uri()]                # the browser gets a file, no token
    assert stat.S_IMODE(launcher.stat().st_mode) == 0o600
    assert "http://127.0.0.1:8080/ui/#token=tok-123" in launcher.read_text()
    out = capsys.readouterr().out
    assert "opened the dashboard" in out and "tok-123" not in out


def test_without_a_browser_it_says_where_to_go(tmp_path, capsys):
    deps = SimpleNamespace(open_browser=lambda url: False)
    assert cmd_ui(args(), FakeClient(tmp_path), deps) == 0
    out = capsys.readouterr().out
    assert "no browser could be opened" in out and str(tmp_path / LAUNCH_FILE) in out
    assert "tok-123" not in out


def test_print_url_prints_the_url_with_the_token_and_opens_nothing(tmp_path, capsys):
    deps = SimpleNamespace(open_browser=lambda url: (_ for _ in ()).throw(AssertionError))
    assert cmd_ui(args(print_url=True), FakeClient(tmp_path), deps) == 0
    assert capsys.readouterr().out.strip() == "http://127.0.0.1:8080/ui/#token=tok-123"
    assert not (tmp_path / LAUNCH_FILE).exists()


def test_the_url_has_no_fragment_without_a_token():
    assert dashboard_url("http://h:1/", None) == "http://h:1/ui/"
    assert dashboard_url("http://h:1", "a b/") == "http://h:1/ui/#token=a%20b%2F"
