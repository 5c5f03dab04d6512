"""Images named by http(s) URL, fetched by the supervisor (--allow-remote-media; off by
default), for media.py's `fetch_remote`.

A request must not turn the server into a way into the network it sits in (SSRF), so:
- only http and https, and only public addresses: every address a host resolves to is
  checked by `is_public` (the policy; injectable, for tests) inside the session's resolver,
  so the connection goes to exactly the addresses checked (a DNS answer that changes
  between a check and the connect, "rebinding", cannot pass: there is no second lookup).
  aiohttp connects to an IP literal without asking the resolver, so each hop's literal
  host is checked here first;
- at most MAX_REDIRECTS redirects, followed here one by one, each hop checked again;
- one time limit for the whole fetch (redirects and body), and a byte limit checked
  against Content-Length up front and again while the body streams in (decompressed);
- only a 2xx with an image/* content type is taken.
No cookies are kept between fetches, no proxy is taken from the environment. Logs name
the host at most: a URL's path and query may hold tokens.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from typing import TYPE_CHECKING, Callable, Optional

import aiohttp
from aiohttp import web
from aiohttp.abc import AbstractResolver
from yarl import URL

from supervisor.http.errors import INVALID_REQUEST, APIError

if TYPE_CHECKING:
    from aiohttp.abc import ResolveResult  # aiohttp >= 3.10

log = logging.getLogger("mlxd.media")

MAX_REDIRECTS = 3
REDIRECTS = (301, 302, 303, 307, 308)
CHUNK = 64 << 10

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Policy = Callable[[Address], bool]

_NAT64 = (ipaddress.IPv6Network("64:ff9b::/96"), ipaddress.IPv6Network("64:ff9b:1::/48"))
_GLOBAL_UNICAST = ipaddress.IPv6Network("2000::/3")


def is_public(addr: Address) -> bool:
    """The default policy: a globally routable unicast address. Refused: private
    (10/8, 172.16/12, 192.168/16, fc00::/7), shared (100.64/10), loopback, link-local
    (169.254/16: cloud metadata; fe80::/10), multicast, reserved, unspecified (0.0.0.0,
    ::), documentation and benchmarking ranges, and IPv6 forms that carry an IPv4
    address (mapped ::ffff:a.b.c.d, 6to4, Teredo, NAT64) whose IPv4 address is refused."""
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return is_public(addr.ipv4_mapped)
        if addr.sixtofour is not None and not is_public(addr.sixtofour):
            return False
        if addr.teredo is not None and not all(is_public(a) for a in addr.teredo):
            return False
        if any(addr in net for net in _NAT64):
            return is_public(ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF))
        if addr not in _GLOBAL_UNICAST:  # ::/96 (IPv4-compatible), ::1, fc00::/7, ff00::/8...
            return False
    return addr.is_global and not (addr.is_private or addr.is_loopback or addr.is_link_local
                                   or addr.is_multicast or addr.is_reserved
                                   or addr.is_unspecified)


class AddressRefused(OSError):
    """A host that resolves to an address the policy refuses (an OSError: aiohttp wraps
    its resolver's OSErrors in a ClientConnectorDNSError, whose cause this is)."""


class PolicyResolver(AbstractResolver):
    """aiohttp's resolver, its answers checked: a host any of whose addresses the policy
    refuses is refused whole (the connection goes only to addresses from this list)."""

    def __init__(self, allow: Policy, inner: AbstractResolver | None = None):
        self.allow = allow
        self.inner = inner or aiohttp.DefaultResolver()

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        answers = await self.inner.resolve(host, port, family)
        for answer in answers:
            if not _allowed(answer["host"], self.allow):
                raise AddressRefused("the host resolves to a refused address")
        return answers

    async def close(self) -> None:
        await self.inner.close()


def _literal(host: str) -> Optional[Address]:
    """`host` as an IP address (an IPv6 scope id, fe80::1%eth0, left out); None: a name."""
    try:
        return ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None


def _allowed(host: str, allow: Policy) -> bool:
    addr = _literal(host)
    return addr is not None and allow(addr)


def _refused(exc: BaseException) -> bool:
    """Whether `exc` came from the resolver's refusal (through aiohttp's wrapping)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, AddressRefused):
            return True
        seen.add(id(exc))
        exc = getattr(exc, "os_error", None) or exc.__cause__ or exc.__context__
    return False


def _host(url) -> str:
    """A URL's host for the logs (never its path or query)."""
    try:
        return URL(str(url)).host or "?"
    except (ValueError, TypeError):
        return "?"


class Fetcher:
    """Fetches remote images for one server: one aiohttp session (made on first use, in
    the running loop; closed by `close`, on app cleanup), its resolver bound to `allow`.
    `resolver` (tests): the lookups the policy checks, instead of aiohttp's default."""

    def __init__(self, timeout: float = 10.0, allow: Policy = is_public,
                 max_redirects: int = MAX_REDIRECTS,
                 resolver: AbstractResolver | None = None):
        self.timeout = timeout
        self.allow = allow
        self.max_redirects = max_redirects
        self._resolver = resolver
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                resolver=PolicyResolver(self.allow, self._resolver), limit=64)
            self._session = aiohttp.ClientSession(
                connector=connector, cookie_jar=aiohttp.DummyCookieJar(), trust_env=False,
                timeout=aiohttp.ClientTimeout(total=None),  # fetch() bounds it all
                headers={"Accept": "image/*", "User-Agent": "mlxd"})
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def fetch(self, url: str, param: str, max_bytes: int) -> bytes:
        """The image at `url` (http or https): its bytes, or the APIError to answer with:
        413 over `max_bytes`, else a 400 saying why (`param` names the URL's place)."""
        host = _host(url)
        try:
            data = await asyncio.wait_for(self._fetch(url, param, max_bytes), self.timeout)
        except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11)
            log.info("remote image from %s: not fetched in %g s", host, self.timeout)
            raise _failed(param, f"the image could not be fetched in {self.timeout:g} s"
                          ) from None
        except aiohttp.ClientError as e:
            if _refused(e):
                log.info("remote image from %s: refused, a private or local address", host)
                raise _private(param) from None
            log.info("remote image from %s: not fetched (%s)", host, type(e).__name__)
            raise _failed(param, "the image could not be fetched (the connection to its "
                                 "server failed)") from None
        log.debug("remote image from %s: %d bytes", host, len(data))
        return data

    async def _fetch(self, url: str, param: str, max_bytes: int) -> bytes:
        session = self._open()
        try:
            target = URL(url)
        except (ValueError, TypeError):
            raise _bad(param, "not a valid URL") from None
        for hop in range(self.max_redirects + 1):
            self._check(target, param)
            async with session.get(target, allow_redirects=False) as resp:
                if resp.status in REDIRECTS:
                    location = resp.headers.get("Location")
                    if not location:
                        raise _failed(param, f"the image's server answered {resp.status} "
                                             "without a Location")
                    if hop == self.max_redirects:
                        raise _failed(param, f"the image's URL redirects more than "
                                             f"{self.max_redirects} times")
                    try:
                        target = resp.url.join(URL(location))
                    except (ValueError, TypeError):
                        raise _failed(param, "the image's server redirected to an invalid "
                                             "URL") from None
                    continue
                if not 200 <= resp.status < 300:
                    raise _failed(param, f"the image's server answered {resp.status}")
                if not resp.content_type.lower().startswith("image/"):
                    raise _bad(param, "the URL's content is not an image (its content type "
                                      f"is {resp.content_type[:100]})")
                return await _body(resp, param, max_bytes)
        raise AssertionError("unreachable")

    def _check(self, target: URL, param: str) -> None:
        """A hop's URL before it is asked: http(s), a host, an IP literal allowed (names
        are checked by the resolver, as they are resolved)."""
        if target.scheme not in ("http", "https"):
            raise _bad(param, "only http and https URLs are fetched")
        if not target.host:
            raise _bad(param, "the URL has no host")
        literal = _literal(target.host)
        if literal is not None and not self.allow(literal):
            log.info("remote image: refused, a private or local address")
            raise _private(param)


async def _body(resp: aiohttp.ClientResponse, param: str, max_bytes: int) -> bytes:
    length = resp.content_length
    if length is not None and length > max_bytes:
        raise _too_large(param, max_bytes)
    body = bytearray()
    async for chunk in resp.content.iter_chunked(CHUNK):
        body += chunk
        if len(body) > max_bytes:
            raise _too_large(param, max_bytes)
    if not body:
        raise _failed(param, "the image at the URL is empty")
    return bytes(body)


def _bad(param: str, why: str) -> APIError:
    return APIError.bad_request(f"{param}: {why}.", param, "invalid_image_url")


def _failed(param: str, why: str) -> APIError:
    return APIError.bad_request(f"{param}: {why}.", param, "image_fetch_failed")


def _private(param: str) -> APIError:
    return _bad(param, "the image's host resolves to a private or local address; only "
                       "public addresses are fetched")


def _too_large(param: str, max_bytes: int) -> APIError:
    return APIError(413, f"{param}: an image may hold at most {max_bytes} bytes.",
                    INVALID_REQUEST, param, "image_too_large")


FETCHER = web.AppKey("mlxd_remote_media", Fetcher)


def install(app: web.Application, config) -> None:
    """With --allow-remote-media, the app's Fetcher (its session closed on cleanup);
    without, none: media.py then refuses http(s) URLs naming the flag."""
    if not config.allow_remote_media:
        return
    app[FETCHER] = Fetcher(timeout=config.remote_media_timeout)

    async def close(app: web.Application) -> None:
        await app[FETCHER].close()
    app.on_cleanup.append(close)
