"""Turn a cell's iopub messages into text and images, in bounded memory.

Text keeps its head and its tail: an agent needs both the first lines (what started) and
the last ones (how it ended). Whatever is dropped in between is counted and announced.
"""

from __future__ import annotations

import base64
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any

ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07]*\x07")
MAX_IMAGES = 20  # per cell; more images are counted, not returned


def strip_ansi(text: str) -> str:
    return ANSI.sub("", text)


class HeadTail:
    """Text buffer that keeps at most ``limit`` characters: the first half and the last half."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.head_limit = (limit + 1) // 2
        self.tail_limit = limit - self.head_limit
        self.head: list[str] = []
        self.head_len = 0
        self.tail: deque[str] = deque()
        self.tail_len = 0
        self.total = 0

    def write(self, text: str) -> None:
        if not text:
            return
        self.total += len(text)
        room = self.head_limit - self.head_len
        if room > 0:
            take = text[:room]
            self.head.append(take)
            self.head_len += len(take)
            text = text[room:]
        if text and self.tail_limit > 0:
            self.tail.append(text[-self.tail_limit :])
            self.tail_len += min(len(text), self.tail_limit)
            while self.tail and self.tail_len - len(self.tail[0]) >= self.tail_limit:
                self.tail_len -= len(self.tail.popleft())

    def clear(self) -> None:
        self.__init__(self.limit)  # type: ignore[misc]

    def render(self) -> str:
        head = "".join(self.head)
        tail = "".join(self.tail)
        if self.total <= self.limit:
            return head + tail  # nothing was dropped
        tail = tail[-self.tail_limit :] if self.tail_limit else ""
        dropped = self.total - len(head) - len(tail)
        return f"{head}\n[... {dropped} characters truncated (max_output_chars={self.limit}) ...]\n{tail}"


@dataclass
class Image:
    mime: str
    data: str  # base64


@dataclass
class CellOutput:
    """What one cell produced, accumulated message by message."""

    limit: int
    text: HeadTail = field(init=False)
    images: list[Image] = field(default_factory=list)
    images_dropped: int = 0
    error_name: str | None = None
    error_value: str | None = None
    status: str | None = None  # busy/idle as last seen on iopub

    def __post_init__(self) -> None:
        self.text = HeadTail(self.limit)

    def handle(self, msg: dict[str, Any]) -> None:
        kind = msg["header"]["msg_type"]
        content = msg["content"]
        if kind == "stream":
            self.text.write(content.get("text", ""))
        elif kind in ("execute_result", "display_data"):
            self._rich(content.get("data", {}))
        elif kind == "error":
            self.error_name = content.get("ename", "Error")
            self.error_value = content.get("evalue", "")
            self.text.write(strip_ansi("\n".join(content.get("traceback", []))) + "\n")
        elif kind == "clear_output":
            self.text.clear()
        elif kind == "status":
            self.status = content.get("execution_state")

    def _rich(self, data: dict[str, Any]) -> None:
        for mime in ("image/png", "image/jpeg"):
            if mime in data:
                self._image(mime, data[mime])
                return
        plain = data.get("text/plain")
        if plain is not None:
            self.text.write(strip_ansi(str(plain)) + "\n")

    def _image(self, mime: str, payload: Any) -> None:
        raw = str(payload).replace("\n", "")
        if len(self.images) >= MAX_IMAGES:
            self.images_dropped += 1
            self.text.write(f"[{mime} not returned: more than {MAX_IMAGES} images in one cell]\n")
            return
        size = len(base64.b64decode(raw, validate=False)) if raw else 0
        self.images.append(Image(mime, raw))
        self.text.write(f"[{mime} image {len(self.images)}, {size} bytes, returned as image content]\n")

    def add_note(self, note: str) -> None:
        self.text.write(("\n" if self.text.total else "") + note + "\n")

    def page(self, payloads: list[dict[str, Any]]) -> None:
        """``obj?`` and friends reply with a 'page' payload instead of output."""
        for payload in payloads:
            if payload.get("source") == "page":
                plain = payload.get("data", {}).get("text/plain", "")
                self.text.write(strip_ansi(str(plain)) + "\n")
