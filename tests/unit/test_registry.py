"""The registry of registered MCP servers: a corrupt file is set aside, never silently overwritten."""

from __future__ import annotations

from pathlib import Path

from ipyfence.mcptools.registry import Registry


def test_corrupt_registry_is_kept_aside_not_lost(tmp_path: Path) -> None:
    path = tmp_path / "registry.json"
    path.write_text("{not json")
    registry = Registry(path)
    registry.load()
    assert registry.servers == {}
    kept = list(tmp_path.glob("registry.unreadable-*.json"))
    assert len(kept) == 1 and kept[0].read_text() == "{not json"
    registry.save()  # a later save starts a fresh file and leaves the old one alone
    assert kept[0].read_text() == "{not json"


def test_missing_registry_is_empty(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "registry.json")
    registry.load()
    assert registry.servers == {}
