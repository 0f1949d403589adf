"""The workspace .env is data the kernel may have written: literal, bounded, never a failed start."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest
from dotenv import dotenv_values

from ipyfence.settings import build_settings, read_dotenv


def test_values_are_literal_no_interpolation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SERVER_SECRET", "s3cret")
    (tmp_path / ".env").write_text("KERNEL_ENV_LEAK=${SERVER_SECRET}\nA=1\nB=${A}\n")
    assert dotenv_values(tmp_path / ".env")["KERNEL_ENV_LEAK"] == "s3cret"  # what python-dotenv does by default
    values = read_dotenv(tmp_path)
    assert values == {"KERNEL_ENV_LEAK": "${SERVER_SECRET}", "A": "1", "B": "${A}"}
    settings = build_settings(tmp_path, environ={"SERVER_SECRET": "s3cret"})
    assert settings.kernel_env["LEAK"] == "${SERVER_SECRET}"


def test_a_fifo_does_not_hang_the_start(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    os.mkfifo(tmp_path / ".env")
    result: list[dict[str, str]] = []
    thread = threading.Thread(target=lambda: result.append(read_dotenv(tmp_path)), daemon=True)
    thread.start()
    thread.join(10)
    assert result == [{}], "reading a FIFO .env hung"
    assert "not a regular file" in caplog.text


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda p: p.symlink_to("/dev/zero"), "without following links"),
        (lambda p: p.write_bytes(b"A=" + b"x" * (300 * 1024)), "larger than"),
        (lambda p: p.write_bytes(b"A=\xff\xfe\n"), "not UTF-8"),
        (lambda p: p.mkdir(), "not a regular file"),
    ],
)
def test_unusable_files_are_ignored_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture, make, why) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.WARNING)
    make(tmp_path / ".env")
    assert read_dotenv(tmp_path) == {}
    assert why in caplog.text
