"""The gate in front of the API: API keys, the Host header, JSON content types, CORS.

Why each, for a server that listens on a laptop while its owner browses the web:
- **API keys** (`--api-key`, `--api-key-file`, `MLXD_API_KEY`): with any set, every API
  route (`/v1/*`, `/tokenize`, `/tokenizer_info`, `/detokenize`, `/rerank`) needs `Authorization: Bearer KEY`
  (Anthropic's routes also take `x-api-key: KEY`, as its clients send it). Keys are
  compared in constant time against every key, so timing tells nothing about a near miss.
  `/health` stays open (it says nothing a caller could use), `/metrics` needs a key unless
  `--public-metrics` (scrapers can send one), `/admin/*` has its own token.
- **Host** (DNS rebinding): a web page can make a browser send requests to 127.0.0.1
  under the attacker's own domain name, and read the answers, since the browser sees one
  origin. Such a request carries that domain in its Host header, so on a loopback
  address only `localhost`, the loopback addresses, the bound address and the names given
  with `--allowed-host` are served. (On a wildcard address the host names are unknown:
  there keys are required anyway, and `--allowed-host` turns the check on.)
- **Content type**: a page on another site can POST to any address without a CORS
  preflight only with a "simple" content type (text/plain, form encodings). Requiring a
  JSON type on the API's POSTs makes every cross-site POST a preflighted one, which this
  server never approves unless `--cors-origin` names the site.
- **Uploads** (`/v1/audio/transcriptions`, `/translations`) take multipart/form-data, as
  OpenAI's do: a "simple" type, so there the guard against other sites is the Origin
  header every browser sends on a cross-site POST: one that is not this server's own
  origin nor one `--cors-origin` allows is refused. Clients outside a browser send none.
- **WebSockets** (`GET /v1/responses` upgraded): no CORS rule keeps a page of any site from
  opening one to localhost and reading it, and a browser cannot send a key on it, so the
  same Origin rule as uploads applies to every upgrade.
- **CORS**: off by default (no Access-Control-* headers: browsers keep pages from reading
  the answers); `--cors-origin ORIGIN` (repeatable, `*` for any) allows those origins,
  preflights included. Keys still apply.

Every refusal is an APIError, rendered by the error middleware in the route's envelope.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import stat
from pathlib import Path

from aiohttp import web

from supervisor.http.errors import APIError

log = logging.getLogger("mlxd.guard")

API_PREFIXES = ("/v1/", "/tokenize", "/tokenizer_info", "/detokenize", "/rerank",
                "/reranking")
ANTHROPIC_PREFIX = ("/v1/messages", "/v1/models")  # where Anthropic clients send x-api-key
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARDS = frozenset({"", "0.0.0.0", "::", "*"})
JSON_TYPES = ("application/json",)
FORM_ROUTES = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations"})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
CORS_HEADERS = "Authorization, Content-Type, X-API-Key, Anthropic-Version, Anthropic-Beta, " \
               "OpenAI-Organization, OpenAI-Project, X-Request-ID, X-Stainless-*"
GUARD = web.AppKey("mlxd_guard", object)


class KeyFileError(Exception):
    """The key file cannot be read, or others can read it."""


def read_key_file(path: Path) -> tuple[str, ...]:
    """Keys, one per line (blank lines and `#` comments skipped). A file that group or
    others may read is refused: the keys in it are not secret any more."""
    try:
        mode = os.stat(path).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise KeyFileError(f"{path} is readable by others (mode {stat.S_IMODE(mode):o}); "
                               f"run `chmod 600 {path}`")
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise KeyFileError(f"cannot read the API key file {path}: {e.strerror or e}") from None
    return tuple(line.strip() for line in lines if line.strip() and not
                 line.lstrip().startswith("#"))


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name in a Host header, lowercased, without its port: `[::1]:8080` → `::1`."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h
    if h.count(":") == 1:
        return h.split(":", 1)[0]
    return h


class Guard:
    def __init__(self, *, keys=(), host: str = "127.0.0.1", allowed_hosts=(),
                 cors_origins=(), public_metrics: bool = False):
        self.keys = tuple(k.encode("utf-8") for k in keys if k)
        self.public_metrics = public_metrics
        self.cors_origins = frozenset(cors_origins)
        extra = {h.strip().lower() for h in allowed_hosts if h.strip()}
        if host.strip().lower() in WILDCARDS:
            # The names this machine answers to are not known: check only those given.
            self.hosts = (LOOPBACK_NAMES | extra) if extra else None
        else:
            self.hosts = LOOPBACK_NAMES | {host_name(host)} | extra

    @classmethod
    def from_config(cls, config) -> "Guard":
        keys = tuple(config.api_key)
        if config.api_key_file is not None:
            keys += read_key_file(config.api_key_file)
        return cls(keys=keys, host=config.host, allowed_hosts=config.allowed_hosts,
                   cors_origins=config.cors_origins, public_metrics=config.public_metrics)

    # ---- the checks ---------------------------------------------------------------------
    def host_allowed(self, header: str | None) -> bool:
        if self.hosts is None or not header:  # no Host at all: not a browser's request
            return True
        return host_name(header) in self.hosts

    def needs_key(self, path: str) -> bool:
        if not self.keys:
            return False
        if path == "/metrics":
            return not self.public_metrics
        return path.startswith(API_PREFIXES)

    def key_ok(self, request: web.BaseRequest) -> bool:
        given = []
        auth = request.headers.get("Authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            given.append(token.strip())
        if request.path.startswith(ANTHROPIC_PREFIX) and request.headers.get("x-api-key"):
            given.append(request.headers["x-api-key"].strip())
        ok = False
        for candidate in given:
            raw = candidate.encode("utf-8", "surrogateescape")
            for key in self.keys:  # every key, always: the time says nothing
                ok |= hmac.compare_digest(raw, key)
        return ok

    def cors_origin(self, origin: str | None) -> str | None:
        """The Access-Control-Allow-Origin value for this request's Origin (None: none)."""
        if not origin or not self.cors_origins:
            return None
        if "*" in self.cors_origins:
            return "*"
        return origin if origin in self.cors_origins else None


class ExposedError(Exception):
    """A non-loopback address with no API key and no --insecure-no-auth."""


def check_startup(config) -> Guard:
    """The guard this configuration makes, refusing what must not start: an unreadable or
    shared key file, and an address other than loopback without any key (anyone on the
    network could use the models and load new ones) unless --insecure-no-auth says so."""
    guard = Guard.from_config(config)
    if not is_loopback_host(config.host) and not guard.keys:
        if not config.insecure_no_auth:
            raise ExposedError(
                f"refusing to serve {config.host} (not loopback) without an API key: anyone "
                "who can reach it could use and load models. Set --api-key-file (or "
                "--api-key / MLXD_API_KEY), or pass --insecure-no-auth to serve it open")
        log.warning("serving %s WITHOUT API KEYS (--insecure-no-auth): anyone who can reach "
                    "it may use and load models", config.host)
    return guard


def _needs_json(request: web.BaseRequest) -> bool:
    """A body-carrying method on the API or admin routes (but the upload routes)."""
    return request.method in BODY_METHODS and request.path not in FORM_ROUTES and (
        request.path.startswith(API_PREFIXES) or request.path.startswith("/admin/"))


def _foreign_page(request: web.BaseRequest, guard: "Guard") -> bool:
    """An upload or a WebSocket upgrade sent by a page of another site: its Origin is
    neither this server's own (scheme://Host) nor one --cors-origin allows."""
    origin = request.headers.get("Origin")
    exposed = request.path in FORM_ROUTES or \
        request.headers.get("Upgrade", "").lower() == "websocket"
    if not exposed or not origin or guard.cors_origin(origin):
        return False
    own = f"{request.scheme}://{request.headers.get('Host', '')}"
    return origin.lower() != own.lower()


def _json_type(header: str | None, has_body: bool) -> bool:
    if header is None:
        return not has_body  # nothing sent, nothing to misread (e.g. a bare cancel)
    media = header.split(";", 1)[0].strip().lower()
    return media in JSON_TYPES or (media.startswith("application/") and media.endswith("+json"))


@web.middleware
async def guard_middleware(request: web.Request, handler) -> web.StreamResponse:
    guard: Guard = request.app[GUARD]
    origin = guard.cors_origin(request.headers.get("Origin"))
    if request.method == "OPTIONS" and origin is not None \
            and "Access-Control-Request-Method" in request.headers:
        return web.Response(status=204, headers={
            "Access-Control-Allow-Origin": origin, "Vary": "Origin",
            "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
            "Access-Control-Allow-Headers": request.headers.get(
                "Access-Control-Request-Headers", CORS_HEADERS),
            "Access-Control-Max-Age": "600"})
    if not guard.host_allowed(request.headers.get("Host")):
        raise APIError.forbidden(
            f"Host `{host_name(request.headers.get('Host', ''))[:100]}` is not served: this "
            "server answers to localhost and its own address only (a guard against DNS "
            "rebinding). Start mlxd with --allowed-host NAME to serve another name.")
    if guard.needs_key(request.path) and not guard.key_ok(request):
        raise APIError.unauthorized(
            "Missing or invalid API key: send it as `Authorization: Bearer KEY`"
            + (" or `x-api-key: KEY`" if request.path.startswith(ANTHROPIC_PREFIX) else "")
            + ".")
    if _foreign_page(request, guard):
        raise APIError.forbidden("Uploads and WebSockets from the pages of other sites are "
                                 "refused: this "
                                 "Origin is not allowed (start mlxd with --cors-origin "
                                 "ORIGIN to allow it).")
    if _needs_json(request) and not _json_type(request.headers.get("Content-Type"),
                                               request.body_exists):
        raise APIError(415, "This route takes a JSON body: send `Content-Type: "
                            "application/json`.", code="unsupported_media_type")
    return await handler(request)


async def _cors_headers(request: web.BaseRequest, response: web.StreamResponse) -> None:
    guard = request.app.get(GUARD)
    origin = guard.cors_origin(request.headers.get("Origin")) if guard else None
    if origin is not None:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Vary"] = "Origin"
        response.headers["Access-Control-Expose-Headers"] = "X-Request-ID, Retry-After"


def install(app: web.Application, guard: Guard) -> None:
    """Put the guard right inside the error middleware (its refusals get the route's
    envelope, and the metrics count them), before any route runs."""
    from supervisor.http.errors import error_middleware

    app[GUARD] = guard
    where = app.middlewares.index(error_middleware) + 1 if error_middleware in \
        app.middlewares else 0
    app.middlewares.insert(where, guard_middleware)
    app.on_response_prepare.append(_cors_headers)
