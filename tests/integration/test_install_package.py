"""install_package end to end: real MCP client, real server, real bwrap, real pip.

Packages come from a PEP 503 index this module serves on loopback (tests send no traffic
elsewhere), handed to the server as PIP_INDEX_URL, the way a corporate mirror would be.
The wheels and the hostile source package are built here, from nothing but the stdlib.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import http.server
import json
import os
import sys
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.conftest import ClientFactory, require_bwrap, run_cell, text_of

pytestmark = pytest.mark.sandbox

SECRET = "s3cr3t-from-dotenv"


# --- fixtures: wheels, a loopback index, the server venv's fingerprint ------------------------


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(dest: Path, name: str, version: str, files: dict[str, str], requires: tuple[str, ...] = ()) -> Path:
    """A minimal, valid pure-Python wheel."""
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    wheel = "Wheel-Version: 1.0\nGenerator: ipyfence-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    entries = {**files, f"{info}/METADATA": meta, f"{info}/WHEEL": wheel}
    path = dest / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        record = []
        for arc, text in entries.items():
            data = text.encode()
            zf.writestr(arc, data)
            record.append(f"{arc},{_record_hash(data)},{len(data)}")
        record.append(f"{info}/RECORD,,")
        zf.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def index_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """http://127.0.0.1:PORT/simple/ serving fencetab 0.9.0 and 1.0.0 (needing fencedep and packaging)."""
    root = tmp_path_factory.mktemp("index")
    files = root / "files"
    files.mkdir()
    wheels = {
        "fencetab": [
            build_wheel(files, "fencetab", "0.9.0", {"fencetab/__init__.py": "__version__ = '0.9.0'\n"}),
            build_wheel(files, "fencetab", "1.0.0", {"fencetab/__init__.py": "__version__ = '1.0.0'\n"}),
        ],
        # Depends on a package the server's venv has: it must not be reinstalled.
        "fencedep-user": [
            build_wheel(
                files,
                "fencedep-user",
                "2.0",
                {"fencedep_user.py": "import fencedep\nVALUE = fencedep.VALUE\n"},
                requires=("fencedep>=1", "packaging>=20"),
            )
        ],
        "fencedep": [build_wheel(files, "fencedep", "1.1", {"fencedep.py": "VALUE = 11\n"})],
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
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple/"
    finally:
        server.shutdown()
        server.server_close()


def venv_fingerprint() -> str:
    """Hash of the server venv's file list (names and sizes; byte-code caches excluded)."""
    root = Path(sys.prefix)
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            path = Path(dirpath, name)
            digest.update(f"{path.relative_to(root)}\0{path.lstat().st_size}\n".encode())
    return digest.hexdigest()


@pytest.fixture(scope="module", autouse=True)
def server_venv_untouched() -> Iterator[None]:
    before = venv_fingerprint()
    yield
    assert venv_fingerprint() == before, "install_package changed the server's venv"


def mirror_env(index_url: str) -> dict[str, str]:
    # The mirror replaces the default index for this server, as a corporate mirror would.
    return {"PIP_INDEX_URL": index_url, "PIP_RETRIES": "0", "PIP_TIMEOUT": "20"}


async def install(client: Any, spec: str) -> tuple[str, bool]:
    result = await client.call_tool("install_package", {"package_name": spec})
    return text_of(result), bool(result.is_error)


# --- a package installed in the sandbox is importable now, after reset, after a restart --------


@pytest.mark.anyio
async def test_install_import_reset_restart(make_client: ClientFactory, index_url: str, state_dir: Path) -> None:
    require_bwrap()
    env = mirror_env(index_url)
    async with make_client(env=env) as client:
        out, err = await run_cell(
            client, "try:\n    import fencetab\nexcept ImportError as e:\n    print('missing', e)"
        )
        assert "missing" in out, out  # the kernel looked before the install: caches must not hide it after

        text, err = await install(client, "fencetab==0.9.0")
        assert not err, text
        assert "fencetab 0.9.0" in text

        out, err = await run_cell(client, "import fencetab; print('version', fencetab.__version__)")
        assert not err and "version 0.9.0" in out, out

        text, err = await install(client, "fencetab==0.9.0")
        assert not err and "already satisfied" in text and "fencetab 0.9.0" in text, text

        assert (await client.call_tool("reset", {})).is_error is False
        out, err = await run_cell(client, "import fencetab; print('version', fencetab.__version__)")
        assert not err and "version 0.9.0" in out, out

    async with make_client(env=env) as client:  # same workspace, same IPYFENCE_STATE_DIR
        out, err = await run_cell(client, "import fencetab; print('version', fencetab.__version__, fencetab.__file__)")
        assert not err and "version 0.9.0" in out, out
        assert str(state_dir) in out  # from the persistent package directory

        # Upgrade: the new version replaces the old one's files and metadata.
        text, err = await install(client, "fencetab>=1.0")
        assert not err and "fencetab 1.0.0" in text and "Replaced fencetab 0.9.0" in text, text
        assert (await client.call_tool("reset", {})).is_error is False
        code = (
            "import fencetab, importlib.metadata as md\n"
            "print('version', fencetab.__version__, md.version('fencetab'))\n"
            "print(sorted(d.metadata['Name'] for d in md.distributions() if d.metadata['Name'] == 'fencetab'))"
        )
        out, err = await run_cell(client, code)
        assert not err and "version 1.0.0 1.0.0" in out and "['fencetab']" in out, out


@pytest.mark.anyio
async def test_dependencies_layer_over_the_server_venv(make_client: ClientFactory, index_url: str) -> None:
    """A dependency the kernel can already import (packaging, from the server venv) is not reinstalled."""
    require_bwrap()
    async with make_client(env=mirror_env(index_url)) as client:
        text, err = await install(client, "fencedep-user")
        assert not err, text
        assert "fencedep-user 2.0" in text and "fencedep 1.1" in text, text
        assert "packaging" not in text, text
        code = (
            "import fencedep_user, packaging, pydantic, ipykernel, os\n"
            "print('value', fencedep_user.VALUE)\n"
            "print('server', all(os.path.realpath(m.__file__).startswith(os.path.realpath(__import__('sys').prefix))"
            " for m in (packaging, pydantic, ipykernel)))"
        )
        out, err = await run_cell(client, code)
        assert not err and "value 11" in out and "server True" in out, out


@pytest.mark.anyio
async def test_install_while_a_cell_runs(make_client: ClientFactory, index_url: str) -> None:
    require_bwrap()
    async with make_client(env=mirror_env(index_url)) as client:
        results: dict[str, tuple[str, bool]] = {}

        async def cell() -> None:
            results["cell"] = await run_cell(client, "import time\nfor i in range(20): time.sleep(0.1)\nkept = 7")

        async def installer() -> None:
            results["install"] = await install(client, "fencetab==0.9.0")

        async with anyio.create_task_group() as tg:
            tg.start_soon(cell)
            tg.start_soon(installer)
        assert not results["cell"][1], results
        assert not results["install"][1], results
        out, err = await run_cell(client, "import fencetab; print(kept, fencetab.__version__)")
        assert not err and "7 0.9.0" in out, out


# --- failures and rejected specs are tool errors that say why ----------------------------------


REJECTED = [
    ("", "empty"),
    ("-r requirements.txt", "'-r' is a pip option"),
    ("--index-url=http://127.0.0.1:9/simple fencetab", "'--index-url' is a pip option"),
    ("-e .", "'-e' is a pip option"),
    ("fencetab --extra-index-url http://127.0.0.1:9/", "contains the pip option"),
    ("fencetab fencedep", "more than one package"),
    ("fencetab; touch /tmp/pwned", "shell metacharacter"),
    ("$(touch /tmp/pwned)", "shell metacharacter"),
    ("fencetab\nfencedep", "newline"),
    ("ftp://127.0.0.1/x.tar.gz", "URL scheme 'ftp' is not supported"),
]


@pytest.mark.anyio
async def test_rejected_specs_and_pip_failures(make_client: ClientFactory, index_url: str) -> None:
    require_bwrap()
    async with make_client(env=mirror_env(index_url)) as client:
        for spec, says in REJECTED:
            text, err = await install(client, spec)
            assert err, (spec, text)
            assert "install_package rejected" in text and says in text, (spec, text)

        text, err = await install(client, "no-such-package-ipyfence")
        assert err and "No matching distribution found for no-such-package-ipyfence" in text, text
        assert "Traceback" not in text

        text, err = await install(client, "fencetab==7.7.7")
        assert err and "fencetab==7.7.7" in text and "0.9.0" in text, text  # pip lists the versions it saw

        out, err = await run_cell(client, "print('still fine')")
        assert not err and "still fine" in out


# --- build code runs inside the sandbox ---------------------------------------------------------

BACKEND = '''\
"""An in-tree PEP 517 backend: the package's build code, which pip runs while installing."""
import base64, hashlib, json, os, zipfile

ENV_FILE = {env_file!r}
HOME_FILE = os.path.join({home!r}, "pwned-by-setup.txt")
LOG = {log!r}


def _attempt():
    rec = {{"pid": os.getpid()}}
    try:
        with open(ENV_FILE) as f:
            rec["env"] = f.read()
    except OSError as e:
        rec["env"] = "error: " + str(e)
    try:
        with open(HOME_FILE, "w") as f:
            f.write("written by setup.py")
        rec["home"] = "written"
    except OSError as e:
        rec["home"] = "error: " + str(e)
    with open(LOG, "a") as f:
        f.write(json.dumps(rec) + "\\n")


_attempt()


def get_requires_for_build_wheel(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    info = "fence_evil-1.0.dist-info"
    entries = {{
        "fence_evil.py": b"VALUE = 42\\n",
        info + "/METADATA": b"Metadata-Version: 2.1\\nName: fence-evil\\nVersion: 1.0\\n",
        info + "/WHEEL": b"Wheel-Version: 1.0\\nGenerator: test\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n",
    }}
    name = "fence_evil-1.0-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as zf:
        record = []
        for arc, data in entries.items():
            zf.writestr(arc, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(arc + ",sha256=" + digest + "," + str(len(data)))
        zf.writestr(info + "/RECORD", "\\n".join(record + [info + "/RECORD,,"]) + "\\n")
    return name
'''


def make_hostile_source(workspace: Path, home: Path) -> tuple[str, Path]:
    """A source package whose setup.py reads the workspace .env and writes to $HOME."""
    (workspace / ".env").write_text(f"SECRET_TOKEN={SECRET}\n")
    src = workspace / "fence-evil-src"
    src.mkdir()
    log = workspace / "attempts.jsonl"
    (src / "pyproject.toml").write_text(
        '[build-system]\nrequires = []\nbuild-backend = "setup"\nbackend-path = ["."]\n'
    )
    (src / "setup.py").write_text(BACKEND.format(env_file=str(workspace / ".env"), home=str(home), log=str(log)))
    return f"fence-evil @ {src.as_uri()}", log


def attempts(log: Path) -> list[dict[str, Any]]:
    assert log.exists(), "setup.py never ran"
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


@pytest.fixture
def fake_home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    return home


@pytest.mark.anyio
async def test_build_code_cannot_read_dotenv_or_write_home(
    make_client: ClientFactory, workspace: Path, fake_home: Path
) -> None:
    require_bwrap()
    spec, log = make_hostile_source(workspace, fake_home)
    async with make_client(env={"HOME": str(fake_home)}) as client:
        text, err = await install(client, spec)
        assert not err and "fence-evil 1.0" in text, text
        out, err = await run_cell(client, "import fence_evil; print('value', fence_evil.VALUE)")
        assert not err and "value 42" in out, out
    records = attempts(log)
    assert records
    assert all(SECRET not in r["env"] for r in records), records
    assert all(r["home"].startswith("error") for r in records), records
    assert list(fake_home.iterdir()) == []


@pytest.mark.anyio
async def test_same_build_code_succeeds_without_sandbox(
    make_client: ClientFactory, workspace: Path, fake_home: Path
) -> None:
    """The control: unsandboxed, both attacks work, so the test above can fail."""
    spec, log = make_hostile_source(workspace, fake_home)
    async with make_client("--no-sandbox", env={"HOME": str(fake_home)}) as client:
        text, err = await install(client, spec)
        assert not err and "fence-evil 1.0" in text, text
    records = attempts(log)
    assert any(SECRET in r["env"] for r in records), records
    assert any(r["home"] == "written" for r in records), records
    assert (fake_home / "pwned-by-setup.txt").exists()


# --- optional: the real thing from the machine's configured index (network) --------------------


@pytest.mark.anyio
@pytest.mark.skipif(
    os.environ.get("IPYFENCE_NETWORK_TESTS") != "1",
    reason="reaches the machine's package index; IPYFENCE_NETWORK_TESTS=1",
)
async def test_real_tabulate_from_configured_index(make_client: ClientFactory) -> None:
    require_bwrap()
    async with make_client() as client:
        text, err = await install(client, "tabulate==0.9.0")
        assert not err and "tabulate 0.9.0" in text, text
        out, err = await run_cell(client, "import tabulate; print(tabulate.tabulate([[1, 2]]))")
        assert not err and "1  2" in out, out
