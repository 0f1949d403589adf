"""Pure parts of the install guards: runtime pins, conflict sentences, shadowing, paths, pipguard, manage."""

from __future__ import annotations

from pathlib import Path

import pytest

from ipyfence.errors import ToolInputError
from ipyfence.packages import manage
from ipyfence.packages.runtime_check import may_change_start
from ipyfence.packages.runtime_pins import (
    RuntimeDist,
    RuntimeModules,
    constraints_text,
    explain_conflict,
    runtime_dists,
    shadowing,
)
from ipyfence.pipguard import wants_network_install
from ipyfence.sandbox.launch import merge_search_paths

RUNTIME = {
    "traitlets": RuntimeDist("traitlets", "5.16.1", ("ipykernel",)),
    "pydantic": RuntimeDist("pydantic", "2.14.3", ()),
}


def test_runtime_is_the_kernels_closure_not_the_servers() -> None:
    found = runtime_dists()
    for name in ("ipykernel", "pydantic", "traitlets", "pyzmq", "ipython", "ipyfence", "pip"):
        assert name in found, name
    for server_only in ("mcp", "click", "datamodel-code-generator", "black"):
        assert server_only not in found, server_only
    assert found["traitlets"].needed_by[0] == "ipykernel"


def test_constraints_pin_exact_versions() -> None:
    assert constraints_text(RUNTIME.values()) == "pydantic==2.14.3\ntraitlets==5.16.1\n"


DIRECT = """\
ERROR: Cannot install traitlets==4.3.3 because these package versions have conflicting dependencies.

The conflict is caused by:
    The user requested traitlets==4.3.3
    The user requested (constraint) traitlets==5.16.1

ERROR: ResolutionImpossible: for help visit https://pip.pypa.io/...
"""
INDIRECT = """\
ERROR: Cannot install needs-old-pydantic==1.0 because these package versions have conflicting dependencies.
The conflict is caused by:
    needs-old-pydantic 1.0 depends on pydantic<2
    The user requested (constraint) pydantic==2.14.3
ERROR: ResolutionImpossible: for help visit https://pip.pypa.io/...
"""


def test_conflict_sentences() -> None:
    text = explain_conflict("traitlets==4.3.3", DIRECT, RUNTIME)
    assert text is not None
    assert "'traitlets==4.3.3' conflicts with ipyfence's kernel runtime: you asked for traitlets==4.3.3" in text
    assert "traitlets 5.16.1, needed by ipykernel" in text and "separate Python environment" in text
    text = explain_conflict("needs-old-pydantic", INDIRECT, RUNTIME)
    assert text is not None and "needs-old-pydantic 1.0 depends on pydantic<2" in text and "pydantic 2.14.3" in text


def test_other_failures_are_left_to_pip() -> None:
    assert explain_conflict("x", "ERROR: No matching distribution found for x", RUNTIME) is None
    other = DIRECT.replace("traitlets==5.16.1", "traitlets==9").replace("traitlets", "numpy")
    assert explain_conflict("numpy==1", other, RUNTIME) is None  # a constraint, but not the runtime's


def _write(path: Path, text: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


MODULES = RuntimeModules(
    {"traitlets": "traitlets 5.16.1", "jaraco": "jaraco.functools 4"},
    frozenset({"traitlets/__init__.py", "jaraco/functools/__init__.py"}),
)


def test_shadowing(tmp_path: Path) -> None:
    _write(tmp_path / "traitlets" / "__init__.py")  # a regular package: shadows
    _write(tmp_path / "jaraco" / "text" / "__init__.py")  # a namespace portion sharing no file: fine
    _write(tmp_path / "fencetab" / "__init__.py")
    _write(tmp_path / "traitlets-4.3.3.dist-info" / "RECORD")
    found = shadowing(tmp_path, MODULES)
    assert [(s.entry, s.module) for s in found] == [("traitlets", "traitlets")]

    other = tmp_path / "other"
    other.mkdir()
    _write(other / "jaraco" / "functools" / "__init__.py")  # the same file as the runtime's: shadows
    _write(other / "traitlets.py")
    (other / "link").mkdir()
    assert sorted(s.entry for s in shadowing(other, MODULES)) == ["jaraco", "traitlets.py"]
    (other / "traitlets.py").unlink()
    (other / "traitlets").symlink_to(other / "link")  # import follows links
    assert sorted(s.entry for s in shadowing(other, MODULES)) == ["jaraco", "traitlets"]


def test_stdlib_names_are_reserved(tmp_path: Path) -> None:
    _write(tmp_path / "enum" / "__init__.py")  # enum34: replaces the stdlib's enum for the kernel
    _write(tmp_path / "concurrent" / "futures" / "x.py")  # a namespace portion: the stdlib package wins
    assert [(s.entry, s.owner) for s in shadowing(tmp_path)] == [("enum", "the standard library's enum")]


def test_start_check_is_needed_only_when_start_up_could_see_the_files(tmp_path: Path) -> None:
    staging, pkgs = tmp_path / "staging", tmp_path / "pkgs"
    _write(staging / "fencetab" / "__init__.py")
    _write(staging / "fencetab-1.0.dist-info" / "RECORD", "fencetab/__init__.py,,\n")
    pkgs.mkdir()
    attempted = frozenset({"traitlets", "orjson"})
    assert not may_change_start(staging, pkgs, attempted)
    assert may_change_start(staging, pkgs, attempted | {"fencetab"})  # an optional import start-up tries
    _write(staging / "fencetab-1.0.dist-info" / "entry_points.txt", "[console_scripts]\nft = fencetab:main\n")
    assert not may_change_start(staging, pkgs, attempted)
    _write(staging / "fencetab-1.0.dist-info" / "entry_points.txt", "[pygments.lexers]\nft = fencetab:Lexer\n")
    assert may_change_start(staging, pkgs, attempted)  # a plugin, looked up by group
    (staging / "fencetab-1.0.dist-info" / "entry_points.txt").unlink()
    # The old version in the package dir provided orjson, which start-up imports: replacing it matters.
    _write(pkgs / "fencetab-0.9.dist-info" / "RECORD", "orjson.py,,\n")
    assert may_change_start(staging, pkgs, attempted)
    _write(tmp_path / "hook" / "sitecustomize.py")
    assert may_change_start(tmp_path / "hook", pkgs, frozenset())


def test_user_paths_extend_the_kernels() -> None:
    base = {"PATH": "/venv/bin:/usr/local/bin:/usr/bin:/bin", "PYTHONPATH": "/pkgs:/ws"}
    merged = merge_search_paths(base, {"PATH": "/opt/x/bin::/usr/bin", "PYTHONPATH": "/mine::/pkgs"})
    assert merged["PATH"] == "/venv/bin:/opt/x/bin:/usr/bin:/usr/local/bin:/bin"
    assert merged["PYTHONPATH"] == "/pkgs:/ws:/mine"  # no empty entry (= the current directory)
    assert merge_search_paths(base, {"OTHER": "1"}) == {}


@pytest.mark.parametrize(
    ("command", "guarded"),
    [
        ("pip install requests", True),
        ("pip3 -q install requests", True),
        ("/venv/bin/python3.11 -m pip install x", True),
        ("echo hi && pip download x", True),
        ("uv pip install x", True),
        ("conda install numpy", True),
        ("pip list", False),
        ("pip show install", False),
        ("pip --version", False),
        ("pipx install x", False),
        ("python -c 'print(1)'", False),
    ],
)
def test_pipguard_recognises_installs(command: str, guarded: bool) -> None:
    assert wants_network_install(command) is guarded


def test_manage_lists_and_removes(tmp_path: Path) -> None:
    info = tmp_path / "fencetab-1.0.dist-info"
    _write(info / "METADATA", "Metadata-Version: 2.1\nName: fencetab\nVersion: 1.0\n")
    _write(tmp_path / "fencetab" / "__init__.py")
    _write(info / "RECORD", "fencetab/__init__.py,,\nfencetab-1.0.dist-info/METADATA,,\n../../bin/fence,,\n")
    _write(tmp_path / "bin" / "fence")
    _write(tmp_path / "stray.py")
    dists, unowned = manage.list_installed(tmp_path)
    assert [(d.name, d.version) for d in dists] == [("fencetab", "1.0")]
    assert [u.entry for u in unowned] == ["stray.py"]
    assert "fencetab 1.0" in manage.render_listing(tmp_path)

    assert manage.uninstall(tmp_path, "FenceTab").what == "fencetab 1.0"
    assert not (tmp_path / "fencetab").exists() and not (tmp_path / "bin" / "fence").exists() and not info.exists()
    assert manage.uninstall(tmp_path, "stray").what == "stray.py (put there by hand)"
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    with pytest.raises(ToolInputError, match="is not installed"):
        manage.uninstall(tmp_path, "fencetab")
    for bad in ("", "../x", "a b", "-r x", "x==1", "/etc"):
        with pytest.raises(ToolInputError, match="give one distribution name"):
            manage.uninstall(tmp_path, bad)
