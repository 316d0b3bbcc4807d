"""`load_media_image`: what `inkling2 serve` accepts as an image from a client, and what it refuses.

Fast and offline: a small threaded HTTP server on 127.0.0.1 plays every web server. The default policy refuses it
(loopback), so the fetching mechanics (size cap, redirects, time budget, format and pixel checks) run with
`allow_private_addresses=True`; the address rules run through the module's seams: `resolve_host` is replaced to give
test names public-looking addresses, and `open_connection` to record where the loader connects (and to reach the
loopback server instead).
"""

import base64
import http.server
import io
import os
import socket
import ssl
import struct
import threading
import time
import urllib.parse
import zlib
from dataclasses import FrozenInstanceError

import numpy as np
import PIL.Image
import pytest

from transformers_inkling2.processing.image_processing_inkling2 import load_image
from transformers_inkling2.serving import media
from transformers_inkling2.serving.media import MediaError, MediaPolicy, is_public_address, load_media_image

PUBLIC_IP = "93.184.216.34"  # a global address; nothing ever connects to it (open_connection is replaced)
NOT_PUBLIC = "does not resolve to a public internet address"
LOOPBACK = MediaPolicy(allow_private_addresses=True, timeout_s=5)


def png_bytes(width=5, height=3, mode="RGBA", seed=0) -> bytes:
    channels = len(mode)
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    buffer = io.BytesIO()
    PIL.Image.fromarray(pixels, mode).save(buffer, "PNG")
    return buffer.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims `width x height` pixels and holds none: Pillow opens it (the header), loading fails."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def data_url(data: bytes, media_type="image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


SMALL_PNG = png_bytes()


def bmp_bytes() -> bytes:
    buffer = io.BytesIO()
    PIL.Image.new("RGB", (4, 4), (10, 20, 30)).save(buffer, "BMP")
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------------------------------
# The loopback web server
# ---------------------------------------------------------------------------------------------------------------


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def send(self, status, body=b"", content_type="image/png", headers=()):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def redirect(self, location, status=302):
        self.send(status, headers=[("Location", location)])

    def trickle(self, piece: bytes, seconds=2.0, every=0.05):
        """Write `piece` every `every` seconds until the client hangs up or `seconds` pass."""
        end = time.monotonic() + seconds
        try:
            while time.monotonic() < end:
                self.wfile.write(piece)
                time.sleep(every)
        except OSError:
            pass

    def do_GET(self):
        self.server.requests.append((self.path, dict(self.headers)))
        parts = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(parts.query))
        route = parts.path
        if route == "/small.png":
            self.send(200, SMALL_PNG)
        elif route == "/png-as-text":
            self.send(200, SMALL_PNG, "text/plain")
        elif route == "/page.html":
            self.send(200, b"<html><body>internal dashboard</body></html>", "text/html")
        elif route == "/image.bmp":
            self.send(200, bmp_bytes(), "image/bmp")
        elif route == "/huge":  # 4 MB, no Content-Length: only counting the bytes read can stop it
            self.send_response(200)
            self.end_headers()
            try:
                for _ in range(64):
                    self.wfile.write(b"\0" * 65536)
            except OSError:
                pass
        elif route == "/huge-declared":
            self.send_response(200)
            self.send_header("Content-Length", str(10**12))
            self.end_headers()
            self.trickle(b"\0" * 1024, seconds=1.0)
        elif route == "/drip":  # a valid start, then one byte at a time
            self.send_response(200)
            self.send_header("Content-Length", "100000")
            self.end_headers()
            self.trickle(b"\0")
        elif route == "/drip-headers":  # never finishes its headers
            self.wfile.write(b"HTTP/1.0 200 OK\r\n")
            self.trickle(b"X-Padding: 1\r\n")
        elif route == "/big-pixels.png":
            self.send(200, png_header_only(8000, 8000))
        elif route == "/hops":
            left = int(query["n"])
            self.redirect(f"/hops?n={left - 1}" if left > 1 else "/small.png")
        elif route == "/loop":
            self.redirect("/loop")
        elif route == "/to":
            self.redirect(query["url"], int(query.get("status", 302)))
        elif route == "/no-location":
            self.send(302)
        else:
            self.send(404, b"not here", "text/plain")


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    httpd.requests = []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()
    thread.join()


@pytest.fixture
def port(server):
    server.requests.clear()
    return server.server_address[1]


@pytest.fixture
def connections(monkeypatch, server):
    """Where the loader connects: `(address, port)` per connection; every connection actually reaches the loopback
    server, whatever the address."""
    targets = []

    def connect(address, port, timeout):
        targets.append((address, port))
        return socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=timeout)

    monkeypatch.setattr(media, "open_connection", connect)
    return targets


@pytest.fixture
def public_names(monkeypatch):
    """`*.test` names resolve to a public-looking address (others to what `names` says); records each lookup."""
    names = {}
    lookups = []

    def resolve(host, port):
        lookups.append(host)
        if host in names:
            answer = names[host]
            return answer() if callable(answer) else answer
        if host.endswith(".test"):
            return [PUBLIC_IP]
        raise socket.gaierror("unknown host")

    monkeypatch.setattr(media, "resolve_host", resolve)
    return names, lookups


def refused(url, policy=None) -> str:
    with pytest.raises(MediaError) as info:
        load_media_image(url, policy)
    return str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# Addresses
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1", "127.1.2.3", "10.0.0.1", "172.16.5.4", "192.168.1.1", "169.254.169.254", "100.64.0.1",
        "0.0.0.0", "224.0.0.1", "255.255.255.255", "240.0.0.1", "192.0.2.1",
        "::1", "::", "fe80::1", "fc00::1", "ff02::1", "::ffff:127.0.0.1", "::ffff:10.0.0.1", "::127.0.0.1",
        "64:ff9b::7f00:1", "2002:7f00:1::", "2002:a00:1::", "2001::1", "2001:db8::1", "fec0::1",
        "not an address",
    ],
)  # fmt: skip
def test_non_public_addresses_are_refused(address):
    assert not is_public_address(address)


@pytest.mark.parametrize(
    "address", [PUBLIC_IP, "8.8.8.8", "2606:4700:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808", "2002:808:808::"]
)
def test_public_addresses_are_allowed(address):
    assert is_public_address(address)


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:{port}/small.png",
        "http://localhost:{port}/small.png",
        "http://[::1]:{port}/small.png",
        "http://2130706433:{port}/small.png",  # 127.0.0.1 in decimal
        "http://0x7f.1:{port}/small.png",  # and in hex, short form
        "http://017700000001:{port}/small.png",  # and in octal
        "http://[::ffff:127.0.0.1]:{port}/small.png",
        "http://0.0.0.0:{port}/small.png",
        "https://127.0.0.1:{port}/small.png",
        "http://169.254.169.254/latest/meta-data/",
        "http://10.0.0.1/x.png",
    ],
)
def test_the_default_policy_refuses_loopback_and_private_hosts_without_connecting(url, port, monkeypatch):
    def never(*args):
        raise AssertionError("connected")

    monkeypatch.setattr(media, "open_connection", never)
    assert NOT_PUBLIC in refused(url.format(port=port))


def test_a_host_with_any_non_public_address_is_refused(public_names, connections, port):
    names, _ = public_names
    names["mixed.test"] = [PUBLIC_IP, "127.0.0.1"]
    assert NOT_PUBLIC in refused(f"http://mixed.test:{port}/small.png")
    assert connections == []


def test_an_unresolvable_host_reads_like_a_private_one(public_names, connections):
    message = refused("http://nowhere.invalid/x.png")
    assert NOT_PUBLIC in message and connections == []


# ---------------------------------------------------------------------------------------------------------------
# Fetching (loopback allowed)
# ---------------------------------------------------------------------------------------------------------------


def test_a_small_png_is_fetched_with_its_alpha_like_the_library_loader(port, server):
    image = load_media_image(f"http://127.0.0.1:{port}/small.png", LOOPBACK)
    expected = load_image(data_url(SMALL_PNG))
    assert image.mode == expected.mode == "RGBA" and image.size == (5, 3)
    assert np.array_equal(np.asarray(image), np.asarray(expected))
    path, headers = server.requests[-1]
    assert path == "/small.png" and headers["Host"] == f"127.0.0.1:{port}"


def test_the_bytes_decide_not_the_content_type(port):
    assert load_media_image(f"http://127.0.0.1:{port}/png-as-text", LOOPBACK).size == (5, 3)


def test_a_page_that_is_not_an_image_is_refused_without_echoing_it(port):
    message = refused(f"http://127.0.0.1:{port}/page.html", LOOPBACK)
    assert "not an image in an allowed format (PNG, JPEG, WEBP, GIF)" in message
    assert "dashboard" not in message


def test_formats_outside_the_allowed_set_are_refused_until_allowed(port):
    assert "not an image in an allowed format" in refused(f"http://127.0.0.1:{port}/image.bmp", LOOPBACK)
    policy = MediaPolicy(allow_private_addresses=True, allowed_formats=("PNG", "BMP"))
    assert load_media_image(f"http://127.0.0.1:{port}/image.bmp", policy).size == (4, 4)


def test_a_body_larger_than_max_bytes_is_cut_off_while_reading(port):
    policy = MediaPolicy(allow_private_addresses=True, max_bytes=100_000, timeout_s=5)
    started = time.monotonic()
    assert "larger than the limit of 100000 bytes" in refused(f"http://127.0.0.1:{port}/huge", policy)
    assert time.monotonic() - started < 2


def test_a_declared_content_length_above_max_bytes_is_refused_before_reading(port):
    started = time.monotonic()
    assert "larger than the limit of 20 MB" in refused(f"http://127.0.0.1:{port}/huge-declared", LOOPBACK)
    assert time.monotonic() - started < 0.5  # the server keeps sending for a second


@pytest.mark.parametrize("route", ["drip", "drip-headers"])
def test_a_trickling_server_is_stopped_at_the_total_time_budget(port, route):
    policy = MediaPolicy(allow_private_addresses=True, timeout_s=0.4)
    started = time.monotonic()
    assert "took longer than the limit of 0.4 s" in refused(f"http://127.0.0.1:{port}/{route}", policy)
    assert 0.35 < time.monotonic() - started < 1.2


def test_redirects_are_followed_up_to_max_redirects(port, server):
    assert load_media_image(f"http://127.0.0.1:{port}/hops?n=3", LOOPBACK).size == (5, 3)
    assert [path for path, _ in server.requests] == ["/hops?n=3", "/hops?n=2", "/hops?n=1", "/small.png"]
    assert "more than 3 redirects" in refused(f"http://127.0.0.1:{port}/hops?n=4", LOOPBACK)
    assert "more than 3 redirects" in refused(f"http://127.0.0.1:{port}/loop", LOOPBACK)
    assert "more than 0 redirects" in refused(f"http://127.0.0.1:{port}/hops?n=1", MediaPolicy(
        allow_private_addresses=True, max_redirects=0
    ))  # fmt: skip


@pytest.mark.parametrize("status", [301, 303, 307, 308])
def test_every_redirect_status_is_followed(port, status):
    target = urllib.parse.quote(f"http://127.0.0.1:{port}/small.png")
    assert load_media_image(f"http://127.0.0.1:{port}/to?status={status}&url={target}", LOOPBACK).size == (5, 3)


def test_error_statuses_and_broken_redirects_are_refused(port):
    assert "answered HTTP 404" in refused(f"http://127.0.0.1:{port}/missing.png", LOOPBACK)
    assert "without a Location" in refused(f"http://127.0.0.1:{port}/no-location", LOOPBACK)


def test_connection_failures_get_one_generic_message(monkeypatch):
    messages = set()
    for failure in (ConnectionRefusedError, ConnectionResetError, ssl.SSLError, OSError):

        def fail(address, port, timeout, failure=failure):
            raise failure("details that must not reach the client")

        monkeypatch.setattr(media, "open_connection", fail)
        messages.add(refused("http://127.0.0.1:9/x.png", LOOPBACK))
    assert messages == {"Could not fetch the image from 127.0.0.1."}


def test_a_closed_port_gets_the_generic_message():
    with socket.socket() as probe:  # a port that was free a moment ago
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    assert refused(f"http://127.0.0.1:{closed}/x.png", LOOPBACK) == "Could not fetch the image from 127.0.0.1."


# ---------------------------------------------------------------------------------------------------------------
# Redirects and the address check, through the seams
# ---------------------------------------------------------------------------------------------------------------


def test_a_redirect_from_a_public_host_to_loopback_is_refused(public_names, connections, port, server):
    to = urllib.parse.quote(f"http://127.0.0.1:{port}/small.png")
    assert NOT_PUBLIC in refused(f"http://public.test:{port}/to?url={to}")
    assert [path for path, _ in server.requests] == [f"/to?url={to}"]  # the loopback URL was never requested
    assert connections == [(PUBLIC_IP, port)]


@pytest.mark.parametrize(
    "location, message",
    [
        ("http://internal.corp/x.png", NOT_PUBLIC),  # a name that resolves to a private address
        ("http://[::1]/x.png", NOT_PUBLIC),
        ("file:///etc/passwd", "redirects may only lead to http(s) URLs"),
        ("data:image/png;base64,AAAA", "redirects may only lead to http(s) URLs"),
        ("ftp://public.test/x.png", "redirects may only lead to http(s) URLs"),
    ],
)
def test_every_redirect_is_checked_again(public_names, connections, port, location, message):
    names, _ = public_names
    names["internal.corp"] = ["10.1.2.3"]
    assert message in refused(f"http://public.test:{port}/to?url={urllib.parse.quote(location)}")
    assert len(connections) == 1


def test_a_redirect_between_public_hosts_resolves_each_host(public_names, connections, port, server):
    _, lookups = public_names
    to = urllib.parse.quote(f"http://cdn.test:{port}/small.png")
    assert load_media_image(f"http://public.test:{port}/to?url={to}").size == (5, 3)
    assert lookups == ["public.test", "cdn.test"]
    assert [headers["Host"] for _, headers in server.requests] == [f"public.test:{port}", f"cdn.test:{port}"]


def test_the_connection_goes_to_the_checked_address_so_dns_rebinding_fails(public_names, connections, port, server):
    names, lookups = public_names
    answers = iter([[PUBLIC_IP], ["127.0.0.1"], ["127.0.0.1"]])  # a rebinding DNS server: public first, then loopback
    names["rebind.test"] = lambda: next(answers)
    assert load_media_image(f"http://rebind.test:{port}/small.png").size == (5, 3)
    assert lookups == ["rebind.test"]  # resolved once ...
    assert connections == [(PUBLIC_IP, port)]  # ... and connected to what was checked
    assert server.requests[-1][1]["Host"] == f"rebind.test:{port}"  # while the Host header keeps the name


def test_https_verifies_the_certificate_against_the_name_on_the_checked_address(public_names, connections, port,
                                                                               monkeypatch):  # fmt: skip
    wrapped = []

    class Context:
        def wrap_socket(self, sock, server_hostname=None, do_handshake_on_connect=True):
            wrapped.append(server_hostname)
            raise ssl.SSLCertVerificationError("certificate verify failed")

    monkeypatch.setattr(media.ssl, "create_default_context", Context)
    assert refused(f"https://public.test:{port}/small.png") == "Could not fetch the image from public.test."
    assert wrapped == ["public.test"] and connections == [(PUBLIC_IP, port)]


def test_allowed_domains_allow_the_domain_and_its_subdomains_only(public_names, connections, port):
    _, lookups = public_names
    policy = MediaPolicy(allowed_domains=("Public.Test.",))
    assert policy.allowed_domains == ("public.test",)
    for host in ("public.test", "img.public.test"):
        assert load_media_image(f"http://{host}:{port}/small.png", policy).size == (5, 3)
    for host in ("evilpublic.test", "public.test.evil.test", "other.test"):
        assert "not one of the server's allowed media domains" in refused(f"http://{host}:{port}/small.png", policy)
    assert lookups == ["public.test", "img.public.test"]  # refused before resolving
    assert "allowed media domains" in refused(f"http://public.test:{port}/small.png", MediaPolicy(allowed_domains=()))


def test_a_redirect_out_of_the_allowed_domains_is_refused(public_names, connections, port):
    policy = MediaPolicy(allowed_domains=("public.test",))
    to = urllib.parse.quote(f"http://other.test:{port}/small.png")
    assert "allowed media domains" in refused(f"http://public.test:{port}/to?url={to}", policy)


# ---------------------------------------------------------------------------------------------------------------
# URLs and schemes
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["ftp://example.com/x.png", "gopher://example.com/", "javascript:alert(1)"])
def test_other_schemes_are_refused(url):
    assert "Unsupported URL scheme" in refused(url)


def test_urls_with_credentials_are_refused_without_echoing_them():
    message = refused("http://user:secret@example.com/x.png")
    assert "user name or password" in message and "secret" not in message


def test_long_urls_are_cut_short_in_messages():
    message = refused("ftp://example.com/" + "a" * 5000)
    assert "a" * 150 + "..." in message and len(message) < 400


# ---------------------------------------------------------------------------------------------------------------
# data: URLs
# ---------------------------------------------------------------------------------------------------------------


def test_a_data_url_is_always_allowed():
    image = load_media_image(data_url(SMALL_PNG))
    assert image.size == (5, 3) and image.mode == "RGBA"
    wrapped = base64.encodebytes(SMALL_PNG).decode()  # with newlines
    assert load_media_image("data:image/png;base64," + wrapped).size == (5, 3)


def test_an_oversize_data_url_is_refused_before_decoding(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("decoded")

    policy = MediaPolicy(max_bytes=1000)
    payload = data_url(b"\0" * 1001)
    monkeypatch.setattr(media.base64, "b64decode", never)
    assert "larger than the limit of 1000 bytes" in refused(payload, policy)
    assert "larger than the limit of 1000 bytes" in refused("data:image/png;base64," + "A" * 10**6, policy)


@pytest.mark.parametrize(
    "url, message",
    [
        ("data:text/html;base64,PGh0bWw+", "is not an image"),
        ("data:image/png,rawbytes", "not base64-encoded"),
        ("data:image/png;base64,@@@@", "not valid base64"),
        ("data:image/png;base64", "is not an image"),
    ],
)
def test_malformed_data_urls_are_refused(url, message):
    assert message in refused(url)


# ---------------------------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------------------------


def test_the_pixel_cap_is_checked_from_the_header_before_decoding(port):
    # the image holds no pixel data: a decode would fail with another message
    message = refused(data_url(png_header_only(8000, 8000)))
    assert "is 8000x8000 (64000000 pixels), more than the limit of 40000000 pixels" in message
    assert "more than the limit of 40000000 pixels" in refused(f"http://127.0.0.1:{port}/big-pixels.png", LOOPBACK)
    policy = MediaPolicy(max_image_pixels=14)
    assert "more than the limit of 14 pixels" in refused(data_url(SMALL_PNG), policy)


def test_pillows_own_decompression_bomb_error_becomes_a_media_error(monkeypatch):
    policy = MediaPolicy(max_image_pixels=1000)
    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", 1000)
    assert "more pixels than the server accepts" in refused(data_url(png_header_only(100, 100)), policy)


def test_a_truncated_image_is_refused():
    assert "truncated or corrupt" in refused(data_url(SMALL_PNG[:-30]))


def test_exif_orientation_is_applied():
    buffer = io.BytesIO()
    exif = PIL.Image.Exif()
    exif[0x0112] = 6  # rotated: upright, the image is 60 tall and 10 wide
    PIL.Image.new("RGB", (60, 10)).save(buffer, "JPEG", exif=exif)
    assert load_media_image(data_url(buffer.getvalue(), "image/jpeg")).size == (10, 60)


# ---------------------------------------------------------------------------------------------------------------
# Local files
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def media_dir(tmp_path):
    allowed = tmp_path / "allowed"
    (allowed / "sub").mkdir(parents=True)
    (allowed / "cat.png").write_bytes(SMALL_PNG)
    (tmp_path / "secret.png").write_bytes(SMALL_PNG)
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    (allowed / "inside-link.png").symlink_to(allowed / "cat.png")
    return allowed


def test_local_files_are_refused_by_default(media_dir):
    for url in (str(media_dir / "cat.png"), (media_dir / "cat.png").as_uri()):
        assert "Local files are not allowed" in refused(url)


def test_files_inside_the_allowed_directory_are_read(media_dir):
    policy = MediaPolicy(allowed_local_path=media_dir)
    for url in (str(media_dir / "cat.png"), "cat.png", "sub/../cat.png", (media_dir / "cat.png").as_uri(),
                "inside-link.png"):  # fmt: skip
        image = load_media_image(url, policy)
        assert image.size == (5, 3) and image.mode == "RGBA", url


def test_missing_outside_escaping_and_odd_paths_all_get_the_same_message(media_dir):
    policy = MediaPolicy(allowed_local_path=media_dir)
    fifo = media_dir / "fifo.png"
    os.mkfifo(fifo)  # opening it must not hang
    cases = [
        str(media_dir / "missing.png"),
        "missing.png",
        str(media_dir / "sub"),  # a directory
        str(media_dir),
        str(media_dir / ".." / "secret.png"),  # `..` out of the directory
        "../secret.png",
        "link.png",  # a symlink pointing outside
        (media_dir.parent / "secret.png").as_uri(),
        "file://otherhost/" + str(media_dir / "cat.png"),
        "/etc/passwd",
        str(fifo),
    ]
    messages = {refused(url, policy).replace(repr(url), "<url>") for url in cases}
    assert messages == {
        "Cannot read the local image <url>: it is not a readable file inside the server's allowed media directory."
    }


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_file_gets_the_same_message(media_dir):
    (media_dir / "locked.png").write_bytes(SMALL_PNG)
    (media_dir / "locked.png").chmod(0)
    message = refused("locked.png", MediaPolicy(allowed_local_path=media_dir))
    assert message == refused("missing.png", MediaPolicy(allowed_local_path=media_dir)).replace("missing", "locked")


def test_a_local_file_above_max_bytes_is_refused(media_dir):
    policy = MediaPolicy(allowed_local_path=media_dir, max_bytes=100)
    assert "larger than the limit of 100 bytes" in refused("cat.png", policy)


# ---------------------------------------------------------------------------------------------------------------
# The policy
# ---------------------------------------------------------------------------------------------------------------


def test_the_default_policy():
    policy = MediaPolicy()
    assert policy.max_bytes == 20 * 1024 * 1024 and policy.timeout_s == 10 and policy.max_redirects == 3
    assert policy.allowed_domains is None and policy.allowed_local_path is None
    assert policy.max_image_pixels == 40_000_000 and policy.allowed_formats == ("PNG", "JPEG", "WEBP", "GIF")
    assert policy.allow_private_addresses is False
    with pytest.raises(FrozenInstanceError):
        policy.max_bytes = 1
    assert issubclass(MediaError, ValueError)


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_bytes", 0),
        ("max_bytes", 1.5),
        ("max_bytes", True),
        ("timeout_s", 0),
        ("timeout_s", float("inf")),
        ("timeout_s", "10"),
        ("max_redirects", -1),
        ("allowed_domains", "example.com"),
        ("allowed_domains", ("https://example.com/",)),
        ("allowed_domains", ("*.example.com",)),
        ("allowed_domains", (42,)),
        ("allowed_local_path", "/no/such/directory"),
        ("max_image_pixels", 0),
        ("max_image_pixels", 10**12),  # above Pillow's own limit
        ("allowed_formats", ()),
        ("allowed_formats", "PNG"),
        ("allowed_formats", ("PNG", "NOPE")),
        ("allow_private_addresses", 1),
    ],
)
def test_invalid_policies_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"MediaPolicy.{field}"):
        MediaPolicy(**{field: value})


def test_policy_values_are_normalized(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    policy = MediaPolicy(allowed_domains=["EXAMPLE.com.", "[::1]", "bücher.example"], allowed_formats=["png", "jpg"],
                         allowed_local_path=tmp_path / "alias")  # fmt: skip
    assert policy.allowed_domains == ("example.com", "::1", "xn--bcher-kva.example")
    assert policy.allowed_formats == ("PNG", "JPEG")
    assert policy.allowed_local_path == os.path.realpath(tmp_path / "real")
