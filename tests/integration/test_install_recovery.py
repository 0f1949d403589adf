"""install_package cannot brick a workspace, and a bricked one can be repaired through the tools.

Real MCP client, real server, real bwrap, real pip against a loopback PEP 503 index made here
(as in test_install_package.py). The wheels that would break the kernel are built here too.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ipyfence.settings import build_settings
from tests.conftest import IPYFENCE, ClientFactory, require_bwrap, run_cell, server_env, text_of
from tests.integration.test_install_package import _QuietHandler, build_wheel, install, mirror_env

pytestmark = pytest.mark.sandbox

# The index: packages that would replace or shadow the kernel's runtime, one that is fine.
BREAKER_SITECUSTOMIZE = "raise SystemExit('fence-breaker stops every interpreter at start-up')\n"
HAND_MADE_TRAITLETS = "raise ImportError('hand-made traitlets, dropped into the package dir')\n"


@pytest.fixture(scope="module")
def index_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("index")
    files = root / "files"
    files.mkdir()
    wheels = {
        # The reproduction: an old traitlets that ipykernel cannot start with.
        "traitlets": [build_wheel(files, "traitlets", "4.3.3", {"traitlets/__init__.py": HAND_MADE_TRAITLETS})],
        # A dependency conflict with the runtime, one level down.
        "needs-old-pydantic": [
            build_wheel(files, "needs-old-pydantic", "1.0", {"needs_old_pydantic.py": ""}, requires=("pydantic<2",))
        ],
        "pydantic": [build_wheel(files, "pydantic", "1.10.0", {"pydantic/__init__.py": "VERSION = '1.10.0'\n"})],
        # Resolves fine, but every interpreter that starts with it on the path exits.
        "fence-breaker": [build_wheel(files, "fence-breaker", "1.0", {"sitecustomize.py": BREAKER_SITECUSTOMIZE})],
        # Another name, but it ships a top-level traitlets/ (that imports fine: only the files give it away).
        "fence-squat": [build_wheel(files, "fence-squat", "1.0", {"traitlets/__init__.py": "VALUE = 1\n"})],
        # In the server's venv but not part of the kernel's runtime: another version is allowed.
        "click": [build_wheel(files, "click", "99.0", {"click/__init__.py": "__version__ = '99.0'\n"})],
        "fencetab": [build_wheel(files, "fencetab", "1.0.0", {"fencetab/__init__.py": "__version__ = '1.0.0'\n"})],
    }
    for project, paths in wheels.items():
        page = root / "simple" / project
        page.mkdir(parents=True)
        links = "".join(
            f'<a href="../../files/{p.name}#sha256={hashlib.sha256(p.read_bytes()).hexdigest()}">{p.name}</a>\n'
            for p in paths
        )
        (page / "index.html").write_text(f"<html><body>\n{links}</body></html>\n")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple/"
    finally:
        server.shutdown()
        server.server_close()


def packages_dir(state_dir: Path) -> Path:
    found = list((state_dir / "workspaces").glob("*/site-packages"))
    assert len(found) == 1, found
    return found[0]


async def tool(client: Any, name: str, **args: Any) -> tuple[str, bool]:
    result = await client.call_tool(name, args)
    return text_of(result), bool(result.is_error)


KERNEL_WORKS = "import traitlets, pydantic, ipykernel; print('kernel ok', traitlets.__version__, pydantic.VERSION)"


@pytest.mark.anyio
async def test_runtime_cannot_be_replaced_or_shadowed(
    make_client: ClientFactory, index_url: str, state_dir: Path
) -> None:
    require_bwrap()
    async with make_client(env=mirror_env(index_url)) as client:
        # 1. The reproduction: refused in one sentence, the kernel keeps working.
        text, err = await install(client, "traitlets==4.3.3")
        assert err, text
        assert "conflicts with ipyfence's kernel runtime" in text and "traitlets==4.3.3" in text, text
        assert "traitlets 5." in text and "needed by ipykernel" in text and "separate Python environment" in text
        text, err = await install(client, "needs-old-pydantic")
        assert err and "needs-old-pydantic 1.0 depends on pydantic<2" in text and "pydantic 2." in text, text

        # 2. Resolves, but with it the kernel could not start: refused before move-in.
        text, err = await install(client, "fence-breaker")
        assert err and "refused 'fence-breaker'" in text and "could not start" in text, text
        assert "fence-breaker stops every interpreter" in text, text
        # 3. A top-level traitlets/ under another name.
        text, err = await install(client, "fence-squat")
        assert err and "refused 'fence-squat'" in text and "traitlets" in text, text

        pkgs = packages_dir(state_dir)
        assert sorted(p.name for p in pkgs.iterdir()) == [], "a refused install left files behind"
        out, err = await run_cell(client, KERNEL_WORKS)
        assert not err and "kernel ok 5." in out and "2." in out, out
        assert (await client.call_tool("reset", {})).is_error is False
        out, err = await run_cell(client, KERNEL_WORKS)
        assert not err and "kernel ok 5." in out, out

        # A library the server uses but the kernel does not: the kernel may have its own version.
        text, err = await install(client, "click==99.0")
        assert not err and "click 99.0" in text, text
        out, err = await run_cell(client, "import click; print('click', click.__version__)")
        assert not err and "click 99.0" in out, out
        text, err = await tool(client, "uninstall_package", package_name="click")
        assert not err and "Removed click 99.0" in text, text

        # list / uninstall of a normal package; uninstall errors say what is allowed.
        text, err = await install(client, "fencetab")
        assert not err and "fencetab 1.0.0" in text, text
        text, err = await tool(client, "list_packages")
        assert not err and "fencetab 1.0.0" in text and str(pkgs) in text, text
        text, err = await tool(client, "uninstall_package", package_name="fencetab")
        assert not err and "Removed fencetab 1.0.0" in text, text
        out, err = await run_cell(client, "import importlib, sys\nsys.modules.pop('fencetab', None)\nimport fencetab")
        assert err and "No module named 'fencetab'" in out, out
        text, err = await tool(client, "list_packages")
        assert not err and "fencetab" not in text and "Nothing is installed" in text, text
        for name, says in (
            ("fencetab", "is not installed in this workspace's package dir"),
            ("ipykernel", "cannot be uninstalled"),
            ("-r requirements.txt", "give one distribution name"),
            ("../../etc", "give one distribution name"),
        ):
            text, err = await tool(client, "uninstall_package", package_name=name)
            assert err and says in text, (name, text)


@pytest.mark.anyio
async def test_package_dir_broken_by_hand_is_explained_and_repaired(
    make_client: ClientFactory, workspace: Path, state_dir: Path
) -> None:
    """A fake traitlets put into the package dir from the host: the control is that the kernel really breaks."""
    require_bwrap()
    pkgs = build_settings(workspace, environ={"IPYFENCE_STATE_DIR": str(state_dir)}).packages_dir

    def break_it() -> None:
        (pkgs / "traitlets").mkdir(parents=True)
        (pkgs / "traitlets" / "__init__.py").write_text(HAND_MADE_TRAITLETS)

    def doctor() -> subprocess.CompletedProcess[str]:
        argv = [IPYFENCE, "--workspace", str(workspace), "doctor"]
        return subprocess.run(argv, env=server_env(state_dir), capture_output=True, text=True, timeout=300)

    break_it()  # before the server starts: its first kernel cannot start
    async with make_client("--no-standby") as client:  # no standby: reset() really starts a kernel
        text, err = await tool(client, "execute_ipython_cell", code="print(1)")
        assert err and "could not start because of the package dir" in text and f"package dir {pkgs} holds" in text
        assert "hand-made traitlets" in text and "uninstall_package('traitlets')" in text, text

        found = doctor()
        assert found.returncode != 0, found.stdout
        assert "[FAIL] package dir" in found.stdout and "uninstall_package('traitlets')" in found.stdout, found

        text, err = await tool(client, "list_packages")
        assert not err and "traitlets/" in text and "SHADOWS the kernel's traitlets 5." in text, text
        text, err = await tool(client, "uninstall_package", package_name="traitlets")
        assert not err and "Removed traitlets/" in text and "a new kernel is running now" in text, text
        assert not (pkgs / "traitlets").exists()
        out, err = await run_cell(client, KERNEL_WORKS)
        assert not err and "kernel ok 5." in out, out

        break_it()  # while a kernel runs: the next kernel to start is the one that fails
        text, err = await tool(client, "reset")
        assert err and "could not start because of the package dir" in text, text
        text, err = await tool(client, "uninstall_package", package_name="traitlets")
        assert not err and "a new kernel is running now" in text, text
        out, err = await run_cell(client, KERNEL_WORKS)
        assert not err and "kernel ok 5." in out, out

    assert "[ok ] package dir" in doctor().stdout


# --- %pip / !pip in a cell, and KERNEL_ENV_PATH / KERNEL_ENV_PYTHONPATH -------------------------

PIP_CELLS = {
    "magic": "%pip install fencetab",
    "shell": "!pip install fencetab",
    "python -m": "!{sys.executable} -m pip install fencetab",
}
NETWORK_TRIES = ("Retrying", "NewConnectionError", "Looking in indexes", "Collecting fencetab")


@pytest.mark.anyio
async def test_pip_in_a_cell_fails_fast_with_a_note_and_user_paths_add(
    make_client: ClientFactory, index_url: str, workspace: Path
) -> None:
    require_bwrap()
    # Inside the workspace: the sandbox replaces the host's /tmp, where pytest's tmp_path lives.
    mine = workspace / "user-pythonpath"
    mine.mkdir()
    (mine / "usermod.py").write_text("WHERE = 'user pythonpath'\n")
    tools = workspace / "user-bin"
    tools.mkdir()
    (tools / "usertool").write_text("#!/bin/sh\necho user tool ran\n")
    (tools / "usertool").chmod(0o755)
    env = {**mirror_env(index_url), "KERNEL_ENV_PYTHONPATH": str(mine), "KERNEL_ENV_PATH": str(tools)}
    async with make_client(env=env) as client:
        out, err = await run_cell(client, "import sys")
        for label, code in PIP_CELLS.items():
            out, err = await run_cell(client, code)
            assert "Use the install_package tool instead" in out, (label, out)
            assert not any(t in out for t in NETWORK_TRIES), (label, out)
        # pip started any other way fails at once too, without retrying a network it cannot reach.
        code = (
            "import subprocess, sys\n"
            "p = subprocess.run([sys.executable, '-m', 'pip', 'install', '--no-cache-dir', 'fencetab'],"
            " capture_output=True, text=True)\nprint('rc', p.returncode, p.stdout, p.stderr)"
        )
        out, err = await run_cell(client, code)
        assert "rc 1" in out and not any(t in out for t in NETWORK_TRIES[:2]), out
        out, err = await run_cell(client, "!pip --version")  # not an install: still runs
        assert "pip " in out and "install_package" not in out, out

        code = (
            "import os, shutil, sys, usermod\n"
            "print('pythonpath', os.environ['PYTHONPATH'].split(os.pathsep))\n"
            "print('path', os.environ['PATH'].split(os.pathsep))\n"
            "print(usermod.WHERE, shutil.which('usertool'), shutil.which('python'))\n"
            "import importlib.util; print('origin', importlib.util.find_spec('traitlets').origin)"
        )
        out, err = await run_cell(client, code)
        assert not err, out
        assert "user pythonpath" in out and str(tools / "usertool") in out, out
        lines = {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in out.splitlines() if " " in ln}
        pythonpath, path = ast.literal_eval(lines["pythonpath"]), ast.literal_eval(lines["path"])
        assert pythonpath[0].endswith("site-packages") and pythonpath[-1] == str(mine), pythonpath
        assert path[0] == os.path.dirname(sys.executable) and path[1] == str(tools) and "/usr/bin" in path, path
        assert os.path.realpath(lines["origin"]).startswith(os.path.realpath(sys.prefix)), out
        out, err = await run_cell(client, "!usertool")
        assert "user tool ran" in out, out
