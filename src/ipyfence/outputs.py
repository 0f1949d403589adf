"""Turn a cell's iopub messages into text and images, in bounded memory.

Text keeps its head and its tail: an agent needs both the first lines (what started) and
the last ones (how it ended). Whatever is dropped in between is counted and announced.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ipyfence.sanitize import clean

# Images are held in the server until the cell ends and then sent in one tool result, so they
# are bounded like text: a cell that displays thousands of large figures must not grow the
# server, nor send the client a result it cannot take. Past either bound, images are counted
# and announced in the text, never returned.
MAX_IMAGES = 20  # per cell
MAX_IMAGE_BYTES = 8 * 1024 * 1024  # decoded image data per cell, all images together
# Standard base64 (what Jupyter sends); checked without decoding, so a hostile payload is
# never decoded and nothing but base64 text reaches the client as image data.
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")


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
    image_bytes: int = 0  # decoded size of ``images``
    images_dropped: int = 0
    dropped_bytes: int = 0
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
            # Cleaned here too (the boundary cleans again) so colour codes do not eat max_output_chars.
            self.text.write(clean("\n".join(content.get("traceback", []))) + "\n")
        elif kind == "clear_output":
            # Jupyter clears every output, images too: an animation loop keeps only its last frame.
            self.text.clear()
            self.images.clear()
            self.image_bytes = 0
        elif kind == "status":
            self.status = content.get("execution_state")

    def _rich(self, data: dict[str, Any]) -> None:
        for mime in ("image/png", "image/jpeg"):
            if mime in data:
                self._image(mime, data[mime])
                return
        plain = data.get("text/plain")
        if plain is not None:
            self.text.write(clean(str(plain)) + "\n")

    def _image(self, mime: str, payload: Any) -> None:
        raw = payload.replace("\n", "") if isinstance(payload, str) else ""
        if not raw or len(raw) % 4 or not _BASE64.fullmatch(raw):
            self.text.write(f"[{mime} not returned: its data is not base64]\n")
            return
        size = len(raw) // 4 * 3 - (len(raw) - len(raw.rstrip("=")))  # decoded size, without decoding
        if len(self.images) >= MAX_IMAGES or self.image_bytes + size > MAX_IMAGE_BYTES:
            self.images_dropped += 1
            self.dropped_bytes += size
            self.text.write(f"[{mime}, {size} bytes, not returned: image limit reached]\n")
            return
        self.images.append(Image(mime, raw))
        self.image_bytes += size
        self.text.write(f"[{mime} image {len(self.images)}, {size} bytes, returned as image content]\n")

    def image_note(self) -> str | None:
        if not self.images_dropped:
            return None
        return (
            f"[ipyfence: {self.images_dropped} image(s) ({self.dropped_bytes} bytes) were not returned: "
            f"a cell returns at most {MAX_IMAGES} images and {MAX_IMAGE_BYTES // (1024 * 1024)} MiB of image data. "
            "Save figures to files in the workspace, or display fewer or smaller ones per cell.]"
        )

    def render(self) -> str:
        """The text part of the tool result: output, notes, and what happened to images."""
        text = self.text.render()
        note = self.image_note()
        if note is None:
            return text
        separator = "" if not text or text.endswith("\n") else "\n"
        return f"{text}{separator}{note}\n"

    def add_note(self, note: str) -> None:
        self.text.write(("\n" if self.text.total else "") + note + "\n")

    def page(self, payloads: list[dict[str, Any]]) -> None:
        """``obj?`` and friends reply with a 'page' payload instead of output."""
        for payload in payloads:
            if payload.get("source") == "page":
                plain = payload.get("data", {}).get("text/plain", "")
                self.text.write(clean(str(plain)) + "\n")
