"""Moving staged installs into the package directory: upgrades remove old files, nothing escapes."""

from __future__ import annotations

from pathlib import Path

from ipyfence.packages.layout import install_staged


def _dist(root: Path, name: str, version: str, files: dict[str, str], record_extra: tuple[str, ...] = ()) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    info = root / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Name: {name}\nVersion: {version}\n")
    rows = [*files, *record_extra, f"{info.name}/METADATA", f"{info.name}/RECORD"]
    (info / "RECORD").write_text("".join(f"{r},,\n" for r in rows))


def test_upgrade_removes_old_files_and_keeps_others(tmp_path: Path) -> None:
    pkgs, staging = tmp_path / "pkgs", tmp_path / "staging"
    pkgs.mkdir()
    staging.mkdir()
    _dist(pkgs, "demo", "1.0", {"demo/__init__.py": "v1", "demo/old.py": "", "bin/demo": "old"})
    _dist(pkgs, "other", "2.0", {"other.py": "", "bin/other": ""})
    _dist(staging, "demo", "2.0", {"demo/__init__.py": "v2", "bin/demo": "new"})

    replaced = install_staged(staging, pkgs)

    assert [(r.name, r.old_version) for r in replaced] == [("demo", "1.0")]
    assert (pkgs / "demo/__init__.py").read_text() == "v2"
    assert not (pkgs / "demo/old.py").exists()
    assert not (pkgs / "demo-1.0.dist-info").exists()
    assert (pkgs / "demo-2.0.dist-info").is_dir()
    assert (pkgs / "bin/demo").read_text() == "new"
    assert (pkgs / "bin/other").exists() and (pkgs / "other.py").exists()


def test_old_record_cannot_delete_outside(tmp_path: Path) -> None:
    pkgs, staging, victim = tmp_path / "pkgs", tmp_path / "staging", tmp_path / "victim.txt"
    pkgs.mkdir()
    staging.mkdir()
    victim.write_text("keep me")
    _dist(pkgs, "demo", "1.0", {"demo.py": ""}, record_extra=("../victim.txt", "../../../victim.txt", str(victim)))
    _dist(staging, "demo", "2.0", {"demo.py": "v2"})
    install_staged(staging, pkgs)
    assert victim.read_text() == "keep me"


def test_planted_symlinks_are_not_moved(tmp_path: Path) -> None:
    pkgs, staging, outside = tmp_path / "pkgs", tmp_path / "staging", tmp_path / "outside"
    pkgs.mkdir()
    outside.mkdir()
    _dist(staging, "demo", "1.0", {"demo.py": ""})
    (staging / "evil").symlink_to(outside)
    (staging / "bin").mkdir()
    (staging / "bin" / "link").symlink_to(outside / "x")
    install_staged(staging, pkgs)
    assert (pkgs / "demo.py").exists()
    assert not (pkgs / "evil").exists() and not (pkgs / "evil").is_symlink()
    assert not (pkgs / "bin" / "link").is_symlink()
