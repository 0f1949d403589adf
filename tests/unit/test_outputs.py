"""Cell output: head+tail truncation with a marker, ANSI stripping, images."""

from __future__ import annotations

import base64
import re
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from ipyfence.outputs import MAX_IMAGE_BYTES, MAX_IMAGES, CellOutput, HeadTail
from ipyfence.sanitize import clean

MARKER = re.compile(r"\n\[\.\.\. (\d+) characters truncated \(max_output_chars=(\d+)\) \.\.\.\]\n")


def msg(kind: str, **content: Any) -> dict[str, Any]:
    return {"header": {"msg_type": kind}, "parent_header": {}, "content": content}


def test_short_output_is_untouched() -> None:
    buf = HeadTail(100)
    buf.write("hello ")
    buf.write("world\n")
    assert buf.render() == "hello world\n"


def test_exactly_at_limit_is_untouched() -> None:
    buf = HeadTail(10)
    buf.write("0123456789")
    assert buf.render() == "0123456789"


def test_truncation_keeps_head_and_tail_and_says_how_much() -> None:
    buf = HeadTail(20)
    text = "".join(f"line{i:03d}\n" for i in range(100))  # 800 chars
    for chunk in (text[i : i + 7] for i in range(0, len(text), 7)):
        buf.write(chunk)
    out = buf.render()
    m = MARKER.search(out)
    assert m, out
    head, tail = out[: m.start()], out[m.end() :]
    assert head == text[:10]
    assert tail == text[-10:]
    assert int(m.group(1)) == len(text) - 20
    assert m.group(2) == "20"


def test_truncation_single_big_write() -> None:
    buf = HeadTail(5)
    buf.write("a" * 3 + "b" * 1000 + "c" * 2)
    out = buf.render()
    assert out == "aaa\n[... 1000 characters truncated (max_output_chars=5) ...]\ncc"


@given(st.lists(st.text(max_size=50), max_size=40), st.integers(1, 60))
def test_head_tail_property(chunks: list[str], limit: int) -> None:
    buf = HeadTail(limit)
    for chunk in chunks:
        buf.write(chunk)
    full = "".join(chunks)
    out = buf.render()
    if len(full) <= limit:
        assert out == full
        return
    m = MARKER.search(out)
    assert m
    head, tail = out[: m.start()], out[m.end() :]
    assert len(head) + len(tail) == limit
    assert full.startswith(head)
    assert full.endswith(tail)
    assert int(m.group(1)) == len(full) - limit


def test_clean_strips_colours_and_titles() -> None:
    colored = "\x1b[0;31mValueError\x1b[0m: \x1b[1mboom\x1b[22m \x1b]0;title\x07done"
    assert clean(colored) == "ValueError: boom done"


def test_error_traceback_is_stripped_and_kept_after_output() -> None:
    out = CellOutput(1000)
    out.handle(msg("stream", name="stdout", text="before\n"))
    out.handle(
        msg(
            "error",
            ename="ValueError",
            evalue="boom",
            traceback=["\x1b[0;31m---------\x1b[0m", "\x1b[0;31mValueError\x1b[0m: boom"],
        )
    )
    text = out.text.render()
    assert "\x1b" not in text
    assert text.index("before") < text.index("ValueError: boom")
    assert out.error_name == "ValueError"


def test_execute_result_text_plain_is_stripped() -> None:
    out = CellOutput(1000)
    out.handle(msg("execute_result", data={"text/plain": "\x1b[32m42\x1b[0m"}, execution_count=1))
    assert out.text.render() == "42\n"


def test_png_becomes_image_plus_note() -> None:
    raw = b"\x89PNG\r\n\x1a\n" + b"x" * 100
    data = base64.b64encode(raw).decode()
    out = CellOutput(1000)
    out.handle(msg("display_data", data={"image/png": data[:50] + "\n" + data[50:], "text/plain": "<Figure>"}))
    assert len(out.images) == 1
    assert out.images[0].mime == "image/png"
    assert base64.b64decode(out.images[0].data) == raw  # newlines removed, payload intact
    text = out.text.render()
    assert "image/png" in text and f"{len(raw)} bytes" in text
    assert "<Figure>" not in text


def test_too_many_images_are_counted_not_returned() -> None:
    out = CellOutput(100_000)
    png = base64.b64encode(b"png").decode()
    for _ in range(MAX_IMAGES + 3):
        out.handle(msg("display_data", data={"image/png": png}))
    assert len(out.images) == MAX_IMAGES
    assert out.images_dropped == 3
    assert "3 image(s) (9 bytes) were not returned" in out.render()
    assert f"at most {MAX_IMAGES} images" in out.render()


def test_image_bytes_are_bounded_per_cell() -> None:
    out = CellOutput(100_000)
    big = base64.b64encode(b"\0" * (3 * 1024 * 1024)).decode()  # 3 MiB decoded
    for _ in range(5):
        out.handle(msg("display_data", data={"image/png": big}))
    assert len(out.images) == 2  # a third would pass 8 MiB
    assert out.image_bytes == 6 * 1024 * 1024 <= MAX_IMAGE_BYTES
    assert out.images_dropped == 3
    assert "3 image(s) (9437184 bytes) were not returned" in out.render()
    # an image that fits the remaining room is still returned
    small = base64.b64encode(b"png!").decode()
    out.handle(msg("display_data", data={"image/png": small}))
    assert len(out.images) == 3


def test_image_size_is_known_without_decoding_and_padding_counts() -> None:
    out = CellOutput(1000)
    for raw in (b"a", b"ab", b"abc", b"abcd"):
        out.handle(msg("display_data", data={"image/png": base64.b64encode(raw).decode()}))
    assert out.image_bytes == 1 + 2 + 3 + 4


def test_image_data_that_is_not_base64_is_not_returned() -> None:
    out = CellOutput(1000)
    for bad in ("\x1b]52;c;aGk=\x07", "abc", "ab=c", 12345):
        out.handle(msg("display_data", data={"image/png": bad}))
    assert out.images == []
    assert out.render().count("not base64") == 4


def test_clear_output_clears_images_too() -> None:
    out = CellOutput(1000)
    png = base64.b64encode(b"png").decode()
    for _ in range(MAX_IMAGES * 2):
        out.handle(msg("clear_output", wait=True))
        out.handle(msg("display_data", data={"image/png": png}))
    assert len(out.images) == 1 and out.images_dropped == 0


def test_clear_output_and_status() -> None:
    out = CellOutput(100)
    out.handle(msg("stream", name="stdout", text="progress 1"))
    out.handle(msg("clear_output", wait=False))
    out.handle(msg("stream", name="stdout", text="done\n"))
    out.handle(msg("status", execution_state="idle"))
    assert out.text.render() == "done\n"
    assert out.status == "idle"


def test_note_is_appended_even_when_truncated() -> None:
    out = CellOutput(50)
    out.handle(msg("stream", name="stdout", text="y" * 500))
    out.add_note("[ipyfence: cell timed out]")
    text = out.text.render()
    assert "truncated" in text
    # a long note may itself be cut, but its end (the tail) survives
    assert text.endswith("timed out]\n")
