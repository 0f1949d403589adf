"""pip's environment: the machine's pip configuration, never ipyfence's layout options or the .env."""

from __future__ import annotations

from pathlib import Path

from ipyfence.packages.installer import trim_output
from ipyfence.packages.pipenv import pip_env
from ipyfence.settings import build_settings


def test_pip_env_keeps_machine_config_and_drops_layout_options(tmp_path: Path) -> None:
    ws, home, work = tmp_path / "ws", tmp_path / "home", tmp_path / "work"
    ws.mkdir()
    work.mkdir()
    (ws / ".env").write_text("PIP_INDEX_URL=http://from-dotenv.invalid/simple\nSECRET=1\n")
    (home / ".config" / "pip").mkdir(parents=True)
    (home / ".config" / "pip" / "pip.conf").write_text("[global]\nextra-index-url = file:///srv/simple\n")
    (home / ".pip").mkdir()
    (home / ".pip" / "pip.conf").write_text("[global]\ntimeout = 5\n")
    host = {
        "HOME": str(home),
        "PATH": "/usr/bin:/bin",
        "IPYFENCE_STATE_DIR": str(tmp_path / "state"),
        "PIP_FIND_LINKS": "/opt/wheels",
        "PIP_CERT": "/etc/ssl/certs/ca.crt",
        "HTTPS_PROXY": "http://proxy.internal:3128",
        "PIP_TARGET": "/somewhere/else",
        "PIP_PREFIX": "/usr",
        "PIP_REQUIREMENT": "/tmp/more.txt",
        "PIP_CACHE_DIR": "/root/.cache/pip",
        "AWS_SECRET_ACCESS_KEY": "nope",
    }
    settings = build_settings(ws, environ=host)
    env = pip_env(settings, work, tmp_path / "cache", environ=host)

    assert env["PIP_FIND_LINKS"] == "/opt/wheels"
    assert env["PIP_CERT"] == "/etc/ssl/certs/ca.crt"
    assert env["HTTPS_PROXY"] == "http://proxy.internal:3128"
    assert env["PIP_CACHE_DIR"] == str(tmp_path / "cache")
    for key in ("PIP_TARGET", "PIP_PREFIX", "PIP_REQUIREMENT", "PIP_INDEX_URL", "SECRET", "AWS_SECRET_ACCESS_KEY"):
        assert key not in env
    assert env["PYTHONPATH"] == str(settings.packages_dir)
    assert env["HOME"] == str(work / "home")
    # The user's pip config files are where pip looks for them under the private home.
    assert "file:///srv/simple" in (work / "home" / ".config" / "pip" / "pip.conf").read_text()
    assert "timeout = 5" in (work / "home" / ".pip" / "pip.conf").read_text()


def test_trim_output_prefers_errors_and_keeps_the_tail() -> None:
    noisy = "\n".join(f"WARNING: Location 'file:///x/{i}' is ignored" for i in range(50))
    text = trim_output(noisy + "\nERROR: No matching distribution found for foo\n")
    assert text == "ERROR: No matching distribution found for foo"
    long = trim_output("x" * 10_000 + "\nERROR: the end", limit=100)
    assert long.endswith("ERROR: the end") and "trimmed" in long and len(long) < 200
    assert trim_output("") == "(pip printed nothing)"
