"""Image URLs fetched safely (--allow-url-fetch): an allow-list, no private addresses unless
listed, bounded in time, size and concurrency, and never trusting what the remote says it sent.

The address check runs where the connection is made: a resolver that answers only with allowed
addresses, so a name that re-resolves to 127.0.0.1 between a check and the connect (DNS
rebinding) still cannot reach it, and every redirect hop goes through it again. URLs that name
an IP directly skip resolvers, so they are checked before the request, parsed as aiohttp
parses them (yarl), which is the host it connects to.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urljoin

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver
from yarl import URL

from clipserve.config import AccessConfig
from clipserve.errors import ImageFetchFailed, ImageTooLarge, ImageUrlForbidden, with_item_index
from clipserve.protocol.urls import MAX_URL

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
MAX_REDIRECTS = 3
CONNECT_TIMEOUT_S = 5.0
# What a decoder reads, by its first bytes: the remote's Content-Type is not trusted.
MAGIC = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n")
# Cloud metadata services answer on link-local and these; refused even where a CIDR allows
# their range, unless that exact address is listed.
METADATA = {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")}
NAT64 = ipaddress.ip_network("64:ff9b::/96")  # global to Python, yet it reaches IPv4 hosts


@dataclass(frozen=True)
class AllowList:
    """Host names (exact, or `*.example.com` for its subdomains) and CIDRs."""

    names: frozenset[str]
    suffixes: tuple[str, ...]
    networks: tuple[Network, ...]

    @classmethod
    def parse(cls, entries: Sequence[str]) -> AllowList:
        names: set[str] = set()
        suffixes: list[str] = []
        networks: list[Network] = []
        for entry in (e.strip().lower() for item in entries for e in item.split(",")):
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                if entry.startswith("*."):
                    suffixes.append(entry[1:])
                else:
                    names.add(entry)
        return cls(frozenset(names), tuple(suffixes), tuple(networks))

    def __bool__(self) -> bool:
        return bool(self.names or self.suffixes or self.networks)

    def listed_name(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return host in self.names or host.endswith(self.suffixes)

    def listed_address(self, ip: IPAddress) -> bool:
        return any(ip in net for net in self.networks)

    def check(self, host: str, ip: IPAddress) -> None:
        """Raise unless `host` resolving to `ip` may be fetched: the name or the address must
        be listed, and an address that is not public must be inside a listed CIDR itself (a
        listed name pointing inside the network is how SSRF gets in). An IPv6 address that
        carries an IPv4 one (mapped, 6to4, NAT64) is judged by the IPv4 address it reaches."""
        ip = embedded_ipv4(ip) or ip
        in_cidr = self.listed_address(ip)
        if not ip.is_global or ip in METADATA:
            exact = any(net.num_addresses == 1 and ip in net for net in self.networks)
            if not in_cidr or (ip in METADATA and not exact):
                raise ImageUrlForbidden(
                    f"host {host!r} resolves to the non-public address {ip}; list its CIDR in "
                    "--allow-url-fetch to allow it"
                )
        if not (in_cidr or self.listed_name(host)):
            raise ImageUrlForbidden(f"host {host!r} is not in --allow-url-fetch")


def embedded_ipv4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one reaches through a translator, or None."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return None
    if ip in NAT64:  # the well-known prefix: the last 32 bits are the IPv4 address
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip.ipv4_mapped or ip.sixtofour


class _CheckedResolver(AbstractResolver):
    """Answers with the addresses the allow-list permits, or refuses the host."""

    def __init__(self, allow: AllowList) -> None:
        self.allow = allow
        self.inner = DefaultResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self.inner.resolve(host, port, family)
        allowed = [r for r in results if self._allowed(host, r["host"])]
        if not allowed:
            self.allow.check(host, ipaddress.ip_address(results[0]["host"]))  # raises: why
        return allowed

    def _allowed(self, host: str, address: str) -> bool:
        try:
            self.allow.check(host, ipaddress.ip_address(address))
        except ImageUrlForbidden:
            return False
        return True

    async def close(self) -> None:
        await self.inner.close()


class ImageFetcher:
    """Fetches a request's image URLs; one per process (the concurrency bound is shared)."""

    def __init__(self, config: AccessConfig) -> None:
        self.allow = AllowList.parse(config.allow_url_fetch)
        self.timeout_s = config.url_timeout_s
        self.max_bytes = config.url_max_bytes
        self._slots = asyncio.Semaphore(config.url_fetch_concurrency)

    @property
    def enabled(self) -> bool:
        return bool(self.allow)

    async def fetch_all(self, urls: Sequence[tuple[int, str]]) -> list[bytes]:
        """The images at `urls` ((position in the request, URL) pairs), in order; the first
        failure raises, naming its position. One session per call: URLs are rare next to
        inline images, and a session per call needs no shutdown hook."""
        timeout = aiohttp.ClientTimeout(
            total=self.timeout_s, sock_connect=min(CONNECT_TIMEOUT_S, self.timeout_s)
        )
        connector = aiohttp.TCPConnector(resolver=_CheckedResolver(self.allow), use_dns_cache=False)
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, trust_env=False, auto_decompress=False
        ) as session:
            jobs = [self._fetch(session, index, url) for index, url in urls]
            return list(await asyncio.gather(*jobs))

    async def _fetch(self, session: aiohttp.ClientSession, index: int, url: str) -> bytes:
        try:
            async with self._slots:
                return await self._follow(session, url)
        except (ImageUrlForbidden, ImageFetchFailed, ImageTooLarge) as e:
            raise with_item_index(e, index) from None
        except TimeoutError:
            failed = ImageFetchFailed(f"fetching {_short(url)} took over {self.timeout_s:g} s")
            raise with_item_index(failed, index) from None
        except aiohttp.ClientError as e:
            failed = ImageFetchFailed(f"fetching {_short(url)} failed: {_reason(e)}")
            raise with_item_index(failed, index) from None

    async def _follow(self, session: aiohttp.ClientSession, url: str) -> bytes:
        for _ in range(MAX_REDIRECTS + 1):
            target = self._check_literal(url)
            async with session.get(target, allow_redirects=False) as response:
                if response.status in (301, 302, 303, 307, 308):
                    location = response.headers.get("Location", "")
                    url = urljoin(url, location)
                    if len(url) > MAX_URL:
                        raise ImageFetchFailed("a redirect to an over-long URL")
                    continue
                if response.status != 200:
                    raise ImageFetchFailed(f"{_short(url)} answered HTTP {response.status}")
                return await self._read(response, url)
        raise ImageFetchFailed(f"more than {MAX_REDIRECTS} redirects")

    def _check_literal(self, url: str) -> URL:
        """The URL as aiohttp will connect to it (yarl's parse: IDNA folds `①②⑦.0.0.1` and
        fullwidth digits into 127.0.0.1, which urllib reads as a name), checked: its scheme,
        a host given as an IP address (it bypasses the resolver), and a name no address could
        allow: with no CIDR listed, an unlisted name is refused unresolved (a client's name
        must not reach the DNS, where it could carry data out)."""
        try:
            target = URL(url)
            host = target.host
            if host:  # an empty or over-long label: the resolver's UnicodeError, else (a 500)
                host.encode("idna")
        except (ValueError, UnicodeError):
            raise ImageUrlForbidden(f"{_short(url)} is not a valid URL") from None
        if target.scheme not in ("http", "https") or not host:
            raise ImageUrlForbidden(f"{_short(url)} is not an http(s) URL with a host")
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            if not self.allow.networks and not self.allow.listed_name(host):
                raise ImageUrlForbidden(f"host {host!r} is not in --allow-url-fetch") from None
            return target
        self.allow.check(host, ip)
        return target

    async def _read(self, response: aiohttp.ClientResponse, url: str) -> bytes:
        """The body as a stream, stopped at --url-max-bytes; the format sniffed from it."""
        declared = response.content_length
        if declared is not None and declared > self.max_bytes:
            raise ImageTooLarge(
                f"{_short(url)} is {declared} bytes; --url-max-bytes is {self.max_bytes}"
            )
        body = bytearray()
        async for chunk in response.content.iter_chunked(64 * 1024):
            body += chunk
            if len(body) > self.max_bytes:
                raise ImageTooLarge(f"{_short(url)} is over --url-max-bytes ({self.max_bytes})")
        data = bytes(body)
        if not (data.startswith(MAGIC) or (data[:4] == b"RIFF" and data[8:12] == b"WEBP")):
            raise ImageFetchFailed(f"{_short(url)} is not a JPEG, PNG or WebP image")
        return data


def _short(url: str) -> str:
    return repr(url if len(url) <= 100 else url[:100] + "...")


def _reason(error: aiohttp.ClientError) -> str:
    cause = error.__cause__ or error.__context__
    if isinstance(cause, ImageUrlForbidden):  # raised inside the resolver
        return cause.message
    return str(error) or type(error).__name__
