"""Serving the browser pages: plain static files, no build step, nothing from elsewhere.

The pages are HTML, CSS and JavaScript in `static/`, read once at start-up into memory
(a fixed set of names: no path from a request ever reaches the disk). They talk to the
server only through its public routes: `/health` and `/v1/*` (with an API key the user
types, when the server has keys) and `/admin/*` (loopback and the admin token, which the
page keeps in the tab's session storage only). So the pages can do nothing a client of
the API could not, and what the admin API guards stays guarded.

Every answer carries a Content-Security-Policy that allows this origin only: no inline
script, no other site's scripts, fonts or images, no framing; `connect-src 'self'`, so
even a bug in a page cannot send a prompt elsewhere. Images a user attaches are read as
`data:`/`blob:` URLs, recorded or synthesised audio as `blob:`.
"""

from __future__ import annotations

from importlib import resources

from aiohttp import web

PAGES = {"/": "dashboard.html", "/ui/": "dashboard.html", "/ui/chat": "chat.html"}
TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
         ".js": "text/javascript; charset=utf-8", ".svg": "image/svg+xml"}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
       "media-src 'self' blob:; connect-src 'self'; form-action 'none'; base-uri 'none'; "
       "frame-ancestors 'none'")
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    # Only this origin's own microphone use (the playground records for speech models).
    "Permissions-Policy": "microphone=(self), camera=(), geolocation=()",
    # The files change with the server, not while it runs: revalidate, never go stale.
    "Cache-Control": "no-cache",
}


def load_files() -> dict[str, tuple[bytes, str]]:
    """Every file of static/ by name, with its content type."""
    found = {}
    for item in resources.files(__package__).joinpath("static").iterdir():
        suffix = "." + item.name.rsplit(".", 1)[-1] if "." in item.name else ""
        if item.is_file() and suffix in TYPES:
            found[item.name] = (item.read_bytes(), TYPES[suffix])
    return found


def _answer(body: bytes, content_type: str) -> web.Response:
    return web.Response(body=body, headers={**HEADERS, "Content-Type": content_type})


def setup(app: web.Application) -> None:
    files = load_files()

    def page(name: str):
        async def handler(request: web.Request) -> web.Response:
            return _answer(*files[name])
        return handler

    async def static(request: web.Request) -> web.Response:
        found = files.get(request.match_info["name"])
        if found is None:
            raise web.HTTPNotFound(text="no such file", headers=HEADERS)
        return _answer(*found)

    async def to_slash(request: web.Request) -> web.Response:
        raise web.HTTPFound("/ui/")

    for path, name in PAGES.items():
        app.router.add_get(path, page(name))
    app.router.add_get("/ui", to_slash)
    app.router.add_get("/ui/static/{name}", static)
