"""`mlxctl ui`: open the dashboard in the browser, already holding the admin token.

The token travels in the URL's fragment (`/ui/#token=...`): a browser never sends a
fragment to a server nor puts it in a Referer, and the page moves it into the tab's
session storage and out of the address bar at once. It is not handed to the browser on
its command line either (any user of the machine may read a process's arguments): like
Jupyter, mlxctl writes a small redirecting page, readable by this user only, next to
the token in the state directory, and opens that file.
`--print-url` prints the URL with the token instead (a script, or a browser elsewhere
behind an SSH tunnel), and opens nothing.
"""

from __future__ import annotations

import html
import os
import urllib.parse
import webbrowser
from pathlib import Path

from mlxctl.connection import EXIT_OK, emit

LAUNCH_FILE = "open-dashboard.html"


def dashboard_url(base: str, token: str | None) -> str:
    url = base.rstrip("/") + "/ui/"
    return url + "#token=" + urllib.parse.quote(token, safe="") if token else url


def write_launcher(state_dir: Path, url: str) -> Path:
    """A page that sends the browser on to `url`, created 0600 (it holds the token)."""
    path = Path(state_dir) / LAUNCH_FILE
    target = html.escape(url, quote=True)
    page = ("<!doctype html><meta charset=utf-8><title>mlxd</title>"
            f'<meta http-equiv="refresh" content="0;url={target}">'
            f'<p><a href="{target}">Open the mlxd dashboard</a></p>\n')
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, page.encode())
    finally:
        os.close(fd)
    os.chmod(path, 0o600)
    return path


def cmd_ui(args, client, deps) -> int:
    client.call("GET", "/admin/status", timeout=10)   # up, and the token is the right one
    url = dashboard_url(client.url, client.token)
    if args.print_url:
        print(url)
        return EXIT_OK
    plain = dashboard_url(client.url, None)
    launcher = write_launcher(client.state_dir, url)
    opened = (deps.open_browser or webbrowser.open)(launcher.as_uri())
    text = (f"opened the dashboard in your browser: {plain}" if opened else
            f"no browser could be opened here: open {launcher} in one, or visit {plain} "
            "and paste the admin token (`mlxctl ui --print-url` prints the URL with it)")
    emit(args, {"url": plain, "opened": bool(opened), "launcher": str(launcher)}, text)
    return EXIT_OK


def add_parser(add) -> None:
    sp = add("ui", cmd_ui, "open the dashboard in the browser, with the admin token")
    sp.add_argument("--print-url", action="store_true",
                    help="print the dashboard's URL with the admin token; open nothing")
