"""The serving engine: continuous batching over paged caches, with DSpark (see `engine.py`)."""

from .engine import Inkling2Engine
from .requests import RequestOutput, SamplingParams
from .scheduler import RequestTooLong

__all__ = ["Inkling2Engine", "RequestOutput", "RequestTooLong", "SamplingParams"]
