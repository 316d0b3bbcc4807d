"""Everything `inkling2 serve` can be told, with safe defaults: loopback only, no local files, public media
addresses only, bounded bodies, prompts, images and queues; and the engine's shape (sequences in flight, cache pages,
tokens per step). `ServerSettings` is what the CLI flags fill in."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field

from ..cache.paged import check_page_size
from .media import MediaPolicy

DEFAULT_MAX_TOKENS = 1024
MAX_REQUEST_BYTES = 32 * 1024 * 1024  # images arrive inline as base64: a few 20 MB-capped images at most
MAX_IMAGES_PER_REQUEST = 8
# one image token covers a 40x40 cell: 4,194,304 pixels keep one image to at most about 2,600 image tokens
MAX_IMAGE_PIXELS = 2048 * 2048
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclass
class ServerSettings:
    """Limits and policies of one server. `max_model_len=None`: the model's `max_position_embeddings`. The engine's
    fields are `Inkling2Engine`'s arguments (`num_pages=None`: sized from the free memory)."""

    model_id: str = "inkling-2-small"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_model_len: int | None = None
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    default_effort: str | float | None = None  # None: the template's default (0.9)
    max_request_bytes: int = MAX_REQUEST_BYTES
    max_images_per_request: int = MAX_IMAGES_PER_REQUEST
    max_image_pixels: int = MAX_IMAGE_PIXELS  # images are downscaled to this budget (aspect ratio kept)
    max_waiting: int = 64
    retry_after_s: int = 1
    keep_alive_timeout_s: float = 5.0
    request_timeout_s: float = 30.0  # for a request's head, and then its body, to arrive (slow senders)
    max_connections: int = 256
    trust_request_chat_template: bool = False
    # Host header names answered; None: the loopback names when listening on loopback (a web page that rebinds its
    # own name to 127.0.0.1 cannot reach the server), any when listening beyond it
    allowed_hosts: tuple[str, ...] | None = None
    media: MediaPolicy = field(default_factory=MediaPolicy)
    # the engine (continuous batching): sequences in flight, key/value cache pages, tokens per step, DSpark
    max_num_seqs: int = 64
    page_size: int = 256
    num_pages: int | None = None
    max_step_tokens: int = 2048
    dspark: bool = False

    def __post_init__(self):
        if self.api_key is None:
            self.api_key = os.environ.get("INKLING2_API_KEY") or None
        positive = ("default_max_tokens", "max_request_bytes", "max_images_per_request", "max_image_pixels",
                    "max_waiting", "max_connections", "max_num_seqs", "page_size", "max_step_tokens")  # fmt: skip
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        check_page_size(self.page_size)
        pages = self.num_pages
        if pages is not None and (not isinstance(pages, int) or isinstance(pages, bool) or pages < 2):
            raise ValueError(f"num_pages must be an integer >= 2 (page 0 is reserved), or None, got {pages!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        for name in ("keep_alive_timeout_s", "request_timeout_s"):
            if not 0 < getattr(self, name) <= 3600:
                raise ValueError(f"{name} must be in (0, 3600] seconds, got {getattr(self, name)!r}")
        if self.api_key is not None and len(self.api_key) < 8:
            raise ValueError(
                "the API key is shorter than 8 characters: pick a long random one (e.g. `openssl rand -hex 32`)"
            )

    def host_allowed(self, host_header: str) -> bool:
        allowed = self.allowed_hosts
        if allowed is None:
            if not is_loopback(self.host):
                return True
            allowed = (*LOOPBACK_NAMES, self.host)
        name = host_header.strip().lower()
        name = name[1 : name.index("]")] if name.startswith("[") and "]" in name else name.rsplit(":", 1)[0]
        return name in {host.lower() for host in allowed} or "*" in allowed

    @property
    def exposed_without_key(self) -> bool:
        """Bound beyond loopback with no API key: anyone who reaches the port can use the model."""
        return self.api_key is None and not is_loopback(self.host)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


__all__ = ["ServerSettings", "is_loopback"]
