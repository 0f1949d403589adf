"""A cell that displays many large images: the tool result stays within the per-cell bounds and says so."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from ipyfence.outputs import MAX_IMAGE_BYTES, MAX_IMAGES
from tests.conftest import require_bwrap, text_of

CELL = """
import os
from IPython.display import Image, display
png = b"\\x89PNG\\r\\n\\x1a\\n" + os.urandom(1_500_000)
for _ in range(40):
    display(Image(data=png, format="png"))
print("displayed 40")
"""


@pytest.mark.anyio
async def test_many_large_images_are_bounded_with_a_note(make_client: Any) -> None:
    require_bwrap()
    async with make_client() as client:
        result = await client.call_tool("execute_ipython_cell", {"code": CELL, "timeout": 120})
        text = text_of(result)
        assert not result.is_error, text
        images = [block for block in result.content if getattr(block, "type", "") == "image"]
        decoded = sum(len(base64.b64decode(block.data)) for block in images)
        # control: the kernel displayed 40 images of 1.5 MB (60 MB), far past both bounds
        assert "displayed 40" in text
        assert 0 < len(images) <= MAX_IMAGES
        assert decoded <= MAX_IMAGE_BYTES
        assert len(images) == MAX_IMAGE_BYTES // 1_500_008  # as many as fit, no more
        dropped = 40 - len(images)
        assert f"[ipyfence: {dropped} image(s) ({dropped * 1_500_008} bytes) were not returned" in text
        assert f"at most {MAX_IMAGES} images" in text
        # the kernel is fine and the next cell is not affected
        result = await client.call_tool("execute_ipython_cell", {"code": "print('next')"})
        assert text_of(result) == "next\n"
