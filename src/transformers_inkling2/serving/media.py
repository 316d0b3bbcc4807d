"""Loading the images that clients of `inkling2 serve` send, under a `MediaPolicy`.

The library's own `load_image` (in `processing`) opens any path and fetches any URL: right for a user's own script,
wrong for a server, where the URL comes from whoever can reach the port (server-side request forgery: a URL such as
`http://169.254.169.254/...` or `http://localhost:6379/` would make the server fetch from its own network).
`load_media_image(url, policy)` is the server's loader:

- `data:image/<format>;base64,...` URLs: always allowed; at most `max_bytes` once decoded, which is checked on the
  base64 text before anything is decoded.
- `http://` and `https://` URLs: only to public internet addresses. The host is resolved once, every address it
  resolves to must be public (not loopback, private, link-local, multicast, reserved, unspecified, shared or
  otherwise non-global; IPv4 embedded in IPv6 -- mapped, 6to4, NAT64 -- is judged by that IPv4), and the connection
  goes to an address that was checked. Each redirect is checked again from scratch, at most `max_redirects`; the
  body is read in chunks up to `max_bytes`; one wall-clock budget (`timeout_s`) covers resolution, connections,
  redirects and reads. With `allowed_domains`, only those hosts (and their subdomains) are fetched at all.
- `file://` URLs and plain paths: refused, unless `allowed_local_path` names a directory; then only regular files
  inside it (after following symlinks) are read, relative paths are taken relative to it, and every other case --
  missing, a directory, unreadable, outside -- gets the same message, so that clients cannot probe the filesystem.
- Any other scheme: refused.

Then the bytes must be an image in one of `allowed_formats` whose width x height, read from its header before
anything is decoded, is at most `max_image_pixels` (decompression bombs). The result is an upright (EXIF-rotated) PIL
image with its alpha channel kept, the same kind of image the library's `load_image` returns, so the processor treats
both alike.

Every refusal is a `MediaError` (a `ValueError`) whose message names the problem and the fix; the server answers it
with HTTP 400. Messages never carry fetched content, and they do not tell a closed port from a refused connection or
an unresolvable name from a private one, so that the server cannot be used to map a network.

Why `http.client` from the standard library, not urllib or httpx: the address check must hold for the connection
that is actually made. urllib and httpx resolve the host name again when they connect (a DNS answer that changes
between the check and the connection, "DNS rebinding", would slip through), follow redirects on their own (each hop
must be checked again) and honour proxy environment variables; pinning the connected address there means reaching
into their transports. With `http.client` the connection's `connect()` is ours: it opens a socket to the checked
address while the Host header, and for HTTPS the certificate check (SNI, hostname verification), keep the name.

Seams for tests: `resolve_host` (name -> addresses), `open_connection` (address -> socket) and `is_public_address`
are module functions looked up at call time; `MediaPolicy(allow_private_addresses=True)` lifts the address check
(for tests on loopback and for trusted networks only).
"""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import ipaddress
import math
import os
import re
import socket
import ssl
import stat
import threading
import time
import urllib.parse
from dataclasses import dataclass

import PIL.Image
import PIL.ImageOps

MB = 1024 * 1024
DEFAULT_MAX_BYTES = 20 * MB
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_REDIRECTS = 3
# 40 megapixels: any camera photo, below Pillow's own warning threshold (PIL.Image.MAX_IMAGE_PIXELS, ~89 MP)
DEFAULT_MAX_IMAGE_PIXELS = 40_000_000
# what OpenAI's API accepts (GIF: its first frame); other formats, e.g. "BMP" or "TIFF", can be allowed by name
DEFAULT_ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
MAX_SHOWN_CHARS = 200
READ_CHUNK = 64 * 1024
USER_AGENT = "transformers-inkling2"

_HOST_NAME = re.compile(r"[a-z0-9_](?:[a-z0-9_-]*[a-z0-9_])?(?:\.[a-z0-9_](?:[a-z0-9_-]*[a-z0-9_])?)*")
_FORMAT_ALIASES = {"JPG": "JPEG"}
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


class MediaError(ValueError):
    """A client's image cannot be used; the message says why and what to send instead (the server: HTTP 400)."""


# ----------------------------------------------------------------------------------------------------------------
# The policy
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MediaPolicy:
    """What `load_media_image` may fetch and decode. Every field is checked when the policy is made.

    Args:
        max_bytes: the largest image in bytes, for every source (default 20 MB = 20 * 1024 * 1024).
        timeout_s: wall-clock budget for one http(s) fetch, resolution, connections, redirects and reads together
            (default 10 s).
        max_redirects: redirects followed, each checked like the first URL (default 3; 0 refuses any).
        allowed_domains: `None` (default): any host with public addresses. Otherwise the host names that may be
            fetched, each allowing itself and its subdomains (`"example.com"` allows `example.com` and
            `cdn.example.com`, not `badexample.com`), compared case-insensitively without a trailing dot; an IP
            address listed allows exactly that address. The addresses must still be public. `()` allows no remote
            host: only data: URLs (and local files, if allowed).
        allowed_local_path: `None` (default) refuses `file://` URLs and paths; a directory allows the regular
            files inside it (symlinks followed, and the target must be inside too).
        max_image_pixels: the largest width x height, read from the image's header before it is decoded (default
            40,000,000). At most Pillow's own limit `PIL.Image.MAX_IMAGE_PIXELS`, so that every image Pillow warns
            about is refused here.
        allowed_formats: Pillow format names that may be decoded (default PNG, JPEG, WEBP, GIF); Pillow is not
            even asked to try the others. JPEG includes MPO (JPEGs with several pictures, as cameras write them).
        allow_private_addresses: `True` lifts the public-address check: for tests on loopback and for servers
            on trusted networks only (it makes server-side request forgery possible).
    """

    max_bytes: int = DEFAULT_MAX_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_redirects: int = DEFAULT_MAX_REDIRECTS
    allowed_domains: tuple[str, ...] | None = None
    allowed_local_path: str | os.PathLike | None = None  # stored resolved (os.path.realpath), as a str
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    allowed_formats: tuple[str, ...] = DEFAULT_ALLOWED_FORMATS
    allow_private_addresses: bool = False

    def __post_init__(self):
        _check_int("max_bytes", self.max_bytes, 1)
        timeout = self.timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (0 < timeout < math.inf):
            raise ValueError(f"MediaPolicy.timeout_s must be a number of seconds > 0, got {timeout!r}.")
        _check_int("max_redirects", self.max_redirects, 0)
        _check_int("max_image_pixels", self.max_image_pixels, 1)
        pillow_limit = PIL.Image.MAX_IMAGE_PIXELS
        if pillow_limit is not None and self.max_image_pixels > pillow_limit:
            raise ValueError(
                f"MediaPolicy.max_image_pixels ({self.max_image_pixels}) is above Pillow's own limit "
                f"PIL.Image.MAX_IMAGE_PIXELS ({pillow_limit}), which Pillow checks first (a warning, and an error at "
                "twice the limit): raise PIL.Image.MAX_IMAGE_PIXELS too, or lower max_image_pixels."
            )
        if not isinstance(self.allow_private_addresses, bool):
            raise ValueError(
                f"MediaPolicy.allow_private_addresses must be True or False, got {self.allow_private_addresses!r}."
            )
        object.__setattr__(self, "allowed_domains", _checked_domains(self.allowed_domains))
        object.__setattr__(self, "allowed_local_path", _checked_directory(self.allowed_local_path))
        object.__setattr__(self, "allowed_formats", _checked_formats(self.allowed_formats))

    def allows_host(self, host: str) -> bool:
        """Whether `allowed_domains` lets `host` (normalized as `normalize_host` does) be fetched."""
        if self.allowed_domains is None:
            return True
        if _is_ip_literal(host):
            return host in self.allowed_domains
        return any(host == domain or host.endswith("." + domain) for domain in self.allowed_domains)


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"MediaPolicy.{name} must be an integer >= {minimum}, got {value!r}.")


def _checked_domains(domains) -> tuple[str, ...] | None:
    if domains is None:
        return None
    if isinstance(domains, (str, bytes)):
        raise ValueError(
            f"MediaPolicy.allowed_domains must be a tuple of host names, not one string: write ({domains!r},)."
        )
    try:
        entries = tuple(domains)
    except TypeError:
        raise ValueError(f"MediaPolicy.allowed_domains must be a tuple of host names, got {domains!r}.") from None
    checked = []
    for entry in entries:
        host = normalize_host(entry) if isinstance(entry, str) else None
        if host is None:
            raise ValueError(
                f"MediaPolicy.allowed_domains: {entry!r} is not a host name; write it as 'example.com' (subdomains "
                "are included), without scheme, port, path or wildcard."
            )
        checked.append(host)
    return tuple(checked)


def _checked_directory(path) -> str | None:
    if path is None:
        return None
    try:
        resolved = os.path.realpath(os.fspath(path))
    except TypeError:
        raise ValueError(f"MediaPolicy.allowed_local_path must be a directory path or None, got {path!r}.") from None
    if not os.path.isdir(resolved):
        raise ValueError(f"MediaPolicy.allowed_local_path {path!r} is not a directory.")
    return resolved


def _checked_formats(formats) -> tuple[str, ...]:
    if isinstance(formats, (str, bytes)):
        raise ValueError(
            f"MediaPolicy.allowed_formats must be a tuple of format names, not one string: write ({formats!r},)."
        )
    try:
        names = [_FORMAT_ALIASES.get(name.upper(), name.upper()) for name in formats]
    except (TypeError, AttributeError):
        raise ValueError(f"MediaPolicy.allowed_formats must be a tuple of format names, got {formats!r}.") from None
    PIL.Image.init()
    unknown = [name for name in names if name not in PIL.Image.ID]
    if not names or unknown:
        raise ValueError(
            f"MediaPolicy.allowed_formats needs Pillow format names such as {DEFAULT_ALLOWED_FORMATS}; "
            f"{'it is empty' if not names else f'Pillow does not know {unknown}'}."
        )
    return tuple(dict.fromkeys(names))


def normalize_host(host: str) -> str | None:
    """A URL's host as it is compared and connected to: lower case, no trailing dot, IDNA (punycode) for
    non-ASCII names, IP addresses in their canonical form; `None` if it is not a valid host."""
    host = host.strip().lower().rstrip(".")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host:
        return None
    if _is_ip_literal(host):
        return str(ipaddress.ip_address(host))
    try:
        host = host.encode("idna").decode("ascii")
    except UnicodeError:
        return None
    return host if len(host) <= 253 and _HOST_NAME.fullmatch(host) else None


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


# ----------------------------------------------------------------------------------------------------------------
# Addresses
# ----------------------------------------------------------------------------------------------------------------


def is_public_address(address: str) -> bool:
    """Whether an IP address is a public internet address that the server may connect to.

    Refused: loopback, private, link-local, multicast, reserved, unspecified (`0.0.0.0`, `::`), shared
    (`100.64.0.0/10`), documentation and every other range Python's `ipaddress` does not call global. An IPv6
    address that carries an IPv4 address (IPv4-mapped `::ffff:a.b.c.d`, 6to4 `2002::/16`, NAT64 `64:ff9b::/96`) is
    judged by that IPv4 address; IPv4-compatible `::a.b.c.d` and Teredo are refused."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is None and ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            return is_public_address(str(embedded))
        if ip.teredo is not None or ip.is_site_local:
            return False
    non_public = (
        ip.is_private,
        ip.is_loopback,
        ip.is_link_local,
        ip.is_multicast,
        ip.is_reserved,
        ip.is_unspecified,
    )
    return ip.is_global and not any(non_public)


def resolve_host(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to, in the resolver's order (numeric spellings such as `2130706433` or
    `0x7f.1` come back as the address they mean). A seam: tests replace it."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


def open_connection(address: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection to an IP address (never a name: nothing is resolved here). A seam: tests replace it to see
    where the loader connects."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect((address, port))
    except BaseException:
        sock.close()
        raise
    return sock


# ----------------------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------------------


def load_media_image(url: str, policy: MediaPolicy | None = None) -> PIL.Image.Image:
    """The image a client sent as `url` (data:, http(s), file: or a path), loaded under `policy` (the defaults of
    `MediaPolicy` without one): an upright PIL image, alpha kept. Raises `MediaError` for anything refused."""
    policy = MediaPolicy() if policy is None else policy
    if not isinstance(url, str):
        raise MediaError(f"An image URL must be a string, got {type(url).__name__}.")
    data = read_media_bytes(url, policy)
    return _decode_image(data, policy, url)


def read_media_bytes(url: str, policy: MediaPolicy) -> bytes:
    """The bytes behind `url`, under `policy`'s sources, size and time rules (no image checks)."""
    scheme = _scheme(url)
    if scheme == "data":
        return _read_data_url(url, policy)
    if scheme in ("http", "https"):
        return _fetch_http(url, policy)
    if scheme in ("file", None):
        return _read_local(url, policy, is_file_url=scheme == "file")
    raise MediaError(
        f"Unsupported URL scheme {scheme!r} in {_shown(url)}: send the image as an http(s) URL or as a "
        "data:image/<format>;base64,... URL."
    )


def _scheme(url: str) -> str | None:
    """The URL's scheme, lower case; `None` for a plain path (a one-letter "scheme" is a Windows drive)."""
    match = re.match(r"([A-Za-z][A-Za-z0-9+.-]*):", url)
    return match.group(1).lower() if match and len(match.group(1)) > 1 else None


def _shown(text: str) -> str:
    """`text` quoted for a message, cut to `MAX_SHOWN_CHARS` characters."""
    return repr(text if len(text) <= MAX_SHOWN_CHARS else text[:MAX_SHOWN_CHARS] + "...")


def _size(count: int) -> str:
    return f"{count // MB} MB" if count % MB == 0 else f"{count} bytes"


def _too_large(where: str, policy: MediaPolicy) -> MediaError:
    return MediaError(f"The image {where} is larger than the limit of {_size(policy.max_bytes)}: send a smaller image.")


# -- data: URLs --------------------------------------------------------------------------------------------------


def _read_data_url(url: str, policy: MediaPolicy) -> bytes:
    header, comma, payload = url[len("data:") :].partition(",")
    params = [param.strip().lower() for param in header.split(";")]
    if not comma or not params[0].startswith("image/"):
        raise MediaError(
            f"The data: URL {_shown(url)} is not an image: send data:image/<format>;base64,<base64 data>."
        )
    if "base64" not in params[1:]:
        raise MediaError("The data: URL is not base64-encoded: send data:image/<format>;base64,<base64 data>.")
    # The size is known from the length of the base64 text: refuse before decoding (and, for a huge text, before
    # even scanning it for whitespace)
    base64_limit = 4 * math.ceil(policy.max_bytes / 3)
    if len(payload) > 2 * base64_limit + 1024:
        raise _too_large("in the data: URL", policy)
    if re.search(r"\s", payload):  # base64 wrapped in lines
        payload = re.sub(r"\s+", "", payload)
    payload += "=" * (-len(payload) % 4)  # tolerate missing padding
    if len(payload) // 4 * 3 - payload[-2:].count("=") > policy.max_bytes:
        raise _too_large("in the data: URL", policy)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(
            "The data: URL's data is not valid base64: send data:image/<format>;base64,<base64 data>."
        ) from None


# -- local files ---------------------------------------------------------------------------------------------------


def _read_local(url: str, policy: MediaPolicy, is_file_url: bool) -> bytes:
    if policy.allowed_local_path is None:
        raise MediaError(
            f"Local files are not allowed ({_shown(url)}): send the image inline as a "
            "data:image/<format>;base64,... URL, or as an http(s) URL."
        )
    # One message for a missing file, a directory, an unreadable file and a path outside the allowed directory, so
    # that clients cannot tell them apart (it names only what the client sent)
    unreadable = MediaError(
        f"Cannot read the local image {_shown(url)}: it is not a readable file inside the server's allowed media "
        "directory."
    )
    path = url
    if is_file_url:
        parts = urllib.parse.urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise unreadable
        path = urllib.parse.unquote(parts.path)
    if not path or "\x00" in path:
        raise unreadable
    root = policy.allowed_local_path
    real = os.path.realpath(os.path.join(root, path))  # an absolute `path` replaces `root`; symlinks followed
    if real == root or os.path.commonpath([root, real]) != root:
        raise unreadable
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        descriptor = os.open(real, flags)  # O_NONBLOCK: a FIFO cannot hang the open; O_NOFOLLOW: no swapped link
    except OSError:
        raise unreadable from None
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise unreadable
        if info.st_size > policy.max_bytes:
            raise _too_large(f"in {_shown(url)}", policy)
        chunks, size = [], 0
        while size <= policy.max_bytes:  # a file that grows while it is read stops here too
            chunk = os.read(descriptor, min(READ_CHUNK * 16, policy.max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        data = b"".join(chunks)
    except OSError:
        raise unreadable from None
    finally:
        os.close(descriptor)
    if len(data) > policy.max_bytes:
        raise _too_large(f"in {_shown(url)}", policy)
    return data


# -- http(s) -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Target:
    url: str
    scheme: str
    host: str  # normalized: what is resolved, sent as Host and checked against the certificate
    port: int
    request_path: str


class _Deadline:
    """The wall-clock budget of one fetch."""

    def __init__(self, seconds: float, url: str):
        self.seconds, self.url = seconds, url
        self.end = time.monotonic() + seconds

    def expired(self) -> bool:
        return time.monotonic() >= self.end

    def error(self) -> MediaError:
        return MediaError(
            f"Fetching the image {_shown(self.url)} took longer than the limit of {self.seconds:g} s (redirects "
            "included): send it from a faster host, or inline as a data:image/<format>;base64,... URL."
        )

    def remaining(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise self.error()
        return left


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """An HTTP connection to one checked IP address; `host` is only the Host header (and, for HTTPS, the name the
    certificate must carry)."""

    def __init__(self, host: str, port: int, address: str, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self.address = address
        self.pinned_sock: socket.socket | None = None  # kept: http.client drops `sock` when the response takes over

    def connect(self):
        self.sock = self.pinned_sock = open_connection(self.address, self.port, self.timeout)


class _PinnedHTTPSConnection(_PinnedHTTPConnection):
    default_port = http.client.HTTPS_PORT

    def connect(self):
        super().connect()
        context = ssl.create_default_context()  # certificate and host name verified against `host`
        wrapped = context.wrap_socket(self.sock, server_hostname=self.host, do_handshake_on_connect=False)
        self.sock = self.pinned_sock = wrapped  # before the handshake, so the watchdog can cut it short
        wrapped.do_handshake()


class _Watchdog:
    """Shuts a connection's socket down when the deadline passes, which ends a read that a server keeps alive with
    a trickle of bytes (each of which would restart a socket timeout)."""

    def __init__(self, connection: _PinnedHTTPConnection, deadline: _Deadline):
        self.connection = connection
        self.fired = False
        self._done = False
        self._lock = threading.Lock()
        self._timer = threading.Timer(max(0.0, deadline.end - time.monotonic()), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self):
        with self._lock:
            if self._done:
                return
            self.fired = True
            sock = self.connection.pinned_sock
            if sock is not None:
                try:
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the plain socket's, also for a TLS one
                except OSError:
                    pass

    def stop(self):
        with self._lock:  # after this the socket may be closed (and its descriptor reused): never touch it again
            self._done = True
        self._timer.cancel()


def _fetch_http(url: str, policy: MediaPolicy) -> bytes:
    deadline = _Deadline(policy.timeout_s, url)
    current = url
    for _ in range(policy.max_redirects + 1):
        target = _http_target(current, policy)
        status, location, body = _http_get(target, policy, deadline)
        if status not in REDIRECT_STATUSES:
            return body
        if not location:
            raise MediaError(
                f"Could not fetch the image from {target.host}: it answered HTTP {status} without a Location."
            )
        current = urllib.parse.urljoin(current, location.strip())
    raise MediaError(
        f"Could not fetch the image {_shown(url)}: more than {policy.max_redirects} redirects; send the final URL, or "
        "the image inline as a data:image/<format>;base64,... URL."
    )


def _http_target(url: str, policy: MediaPolicy) -> _Target:
    """The checked parts of an http(s) URL: scheme, no credentials, a valid host that the domain list allows."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        raise MediaError(f"{_shown(url)} is not a valid URL.") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise MediaError(f"Refused to follow a redirect to {_shown(url)}: redirects may only lead to http(s) URLs.")
    if parts.username is not None or parts.password is not None:
        raise MediaError("An image URL may not carry a user name or password: send a URL without them.")
    host = normalize_host(parts.hostname or "")
    if host is None:
        raise MediaError(f"{_shown(url)} does not name a valid host.")
    if not policy.allows_host(host):
        raise MediaError(
            f"Refused to fetch {_shown(url)}: the host {host!r} is not one of the server's allowed media domains; send "
            "the image inline as a data:image/<format>;base64,... URL."
        )
    scheme = parts.scheme.lower()
    # the request target: percent-encoded where it is not ASCII, so that http.client can send it
    path = urllib.parse.quote(parts.path or "/", safe="/%:@!$&'()*+,;=-._~")
    if parts.query:
        path += "?" + urllib.parse.quote(parts.query, safe="/%:@!$&'()*+,;=-._~?")
    return _Target(url, scheme, host, port or (443 if scheme == "https" else 80), path)


def _checked_addresses(target: _Target, policy: MediaPolicy, deadline: _Deadline) -> list[str]:
    """Resolve the host once, within the time budget, and check every address."""
    outcome = {}

    def resolve():
        try:
            outcome["addresses"] = resolve_host(target.host, target.port)
        except Exception:  # any resolver failure reads as "does not resolve"
            pass

    # getaddrinfo has no timeout of its own: wait for it only as long as the budget lasts
    resolver = threading.Thread(target=resolve, name="inkling2-media-resolve", daemon=True)
    resolver.start()
    resolver.join(deadline.remaining())
    if resolver.is_alive():
        raise deadline.error()
    addresses = outcome.get("addresses") or []
    # One message for unresolvable and non-public hosts, so that the server does not tell which internal names exist
    if not addresses or not (policy.allow_private_addresses or all(is_public_address(a) for a in addresses)):
        raise MediaError(
            f"Refused to fetch {_shown(target.url)}: the host {target.host!r} does not resolve to a public internet "
            "address (loopback, private, link-local and other non-public addresses are refused); send a public URL "
            "or the image inline as a data:image/<format>;base64,... URL."
        )
    return addresses


def _connection_failed(target: _Target) -> MediaError:
    return MediaError(f"Could not fetch the image from {target.host}.")


def _http_get(target: _Target, policy: MediaPolicy, deadline: _Deadline) -> tuple[int, str | None, bytes]:
    """One request to one checked address: (status, Location for a redirect, body for 200)."""
    addresses = _checked_addresses(target, policy, deadline)
    connection_class = _PinnedHTTPSConnection if target.scheme == "https" else _PinnedHTTPConnection
    for index, address in enumerate(addresses):
        connection = connection_class(target.host, target.port, address, timeout=deadline.remaining())
        watchdog = _Watchdog(connection, deadline)
        response = None
        try:
            try:
                connection.connect()
            except OSError:
                if index + 1 < len(addresses) and not deadline.expired():
                    continue  # the host's next (checked) address
                raise
            headers = {"User-Agent": USER_AGENT, "Accept": "image/*", "Connection": "close"}
            connection.request("GET", target.request_path, headers=headers)
            response = connection.getresponse()
            if response.status in REDIRECT_STATUSES:
                return response.status, response.getheader("Location"), b""
            if response.status != 200:
                raise MediaError(f"Could not fetch the image from {target.host}: it answered HTTP {response.status}.")
            return 200, None, _read_body(connection, response, policy, deadline, target)
        except MediaError:
            raise
        except (OSError, http.client.HTTPException, ValueError):
            if watchdog.fired or deadline.expired():
                raise deadline.error() from None
            raise _connection_failed(target) from None
        finally:
            watchdog.stop()
            if response is not None:
                response.close()
            connection.close()
    raise _connection_failed(target)


def _read_body(connection, response, policy: MediaPolicy, deadline: _Deadline, target: _Target) -> bytes:
    where = f"from {target.host}"
    declared = (response.getheader("Content-Length") or "").strip()
    if declared.isdigit() and int(declared) > policy.max_bytes:
        raise _too_large(where, policy)
    chunks, total = [], 0
    while True:
        connection.pinned_sock.settimeout(deadline.remaining())  # each read waits at most what is left
        chunk = response.read1(READ_CHUNK)
        if not chunk:
            break
        total += len(chunk)
        if total > policy.max_bytes:
            raise _too_large(where, policy)
        chunks.append(chunk)
    if deadline.expired():  # a read cut short by the watchdog ends like the end of the body
        raise deadline.error()
    return b"".join(chunks)


# -- decoding --------------------------------------------------------------------------------------------------------


def _decode_image(data: bytes, policy: MediaPolicy, url: str) -> PIL.Image.Image:
    formats = ", ".join(policy.allowed_formats)
    not_an_image = MediaError(
        f"The data from {_shown(url)} is not an image in an allowed format ({formats}): send one of those."
    )
    # Only the allowed formats' openers run, and opening reads the header alone
    try:
        image = PIL.Image.open(io.BytesIO(data), formats=list(policy.allowed_formats))
    except PIL.Image.DecompressionBombError:
        raise MediaError(
            f"The image from {_shown(url)} has more pixels than the server accepts: send a smaller image."
        ) from None
    except Exception:  # whatever Pillow raises on bytes that are no image
        raise not_an_image from None
    image_format = "JPEG" if image.format == "MPO" else image.format
    if image_format not in policy.allowed_formats:
        raise not_an_image
    width, height = image.size
    if width * height > policy.max_image_pixels:
        raise MediaError(
            f"The image from {_shown(url)} is {width}x{height} ({width * height} pixels), more than the limit of "
            f"{policy.max_image_pixels} pixels: send a smaller image."
        )
    try:
        image.load()
        return PIL.ImageOps.exif_transpose(image)
    except PIL.Image.DecompressionBombError:
        raise MediaError(
            f"The image from {_shown(url)} has more pixels than the server accepts: send a smaller image."
        ) from None
    except Exception:  # truncated or corrupt data
        raise MediaError(
            f"Could not decode the image from {_shown(url)}: the {image_format} data is truncated or corrupt."
        ) from None


__all__ = [
    "DEFAULT_ALLOWED_FORMATS",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_IMAGE_PIXELS",
    "MediaError",
    "MediaPolicy",
    "is_public_address",
    "load_media_image",
    "normalize_host",
    "open_connection",
    "read_media_bytes",
    "resolve_host",
]
