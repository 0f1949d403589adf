"""Pure code generation: tool list → module sources. Hostile input must never become code."""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ipyfence.errors import RegistrationError
from ipyfence.mcptools.codegen import (
    ToolSpec,
    check_models_source,
    combined_schema,
    doc_literal,
    generate_package,
    module_names,
)

HOSTILE_TEXTS = [
    '"""\nimport os; os.system("touch MARKER")\n"""',
    "'''\n__import__('os').system('touch MARKER')\n'''",
    'ends with quote"',
    "ends with backslash \\",
    '\\"""\\',
    "nul \x00 esc \x1b[31m cr \r lf \n tab \t",
    "unicode line sep \u2028 para sep \u2029 bom \ufeff",
    '"""" + __import__(\'os\').getcwd() + """"',
    "{server} {tool} {models} %s %(x)s",
]


@pytest.mark.parametrize("text", HOSTILE_TEXTS)
def test_doc_literal_round_trips_exactly(text: str) -> None:
    source = f"{doc_literal(text)}\n"
    tree = ast.parse(source)
    assert len(tree.body) == 1
    assert ast.get_docstring(tree, clean=False) == text


def test_module_names() -> None:
    names = ["get-sum", "foo.bar", "class", "9lives", "_hidden", "__init__", "echo", "get_sum", "weird name!", "ünï"]
    mapped = module_names(names)
    assert mapped["get-sum"] == "get_sum"
    assert mapped["get_sum"] == "get_sum_2"  # clash with get-sum, resolved in order
    assert mapped["foo.bar"] == "foo_bar"
    assert mapped["class"] == "class_"
    assert mapped["9lives"] == "tool_9lives"
    assert mapped["_hidden"] == "tool_hidden"
    assert mapped["__init__"] == "tool_init__"
    assert mapped["weird name!"] == "weird_name_"
    for module in mapped.values():
        assert module.isidentifier() and module.isascii() and not module.startswith("_")
    assert len(set(mapped.values())) == len(names)


@pytest.fixture
def import_dir(tmp_path: Path) -> Iterator[Path]:
    sys.path.insert(0, str(tmp_path))
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m == "mcptools" or m.startswith("mcptools.")]:
            del sys.modules[name]


def _write(root: Path, server: str, tools: list[ToolSpec]) -> dict[str, str]:
    package = generate_package(server, tools)
    pkg = root / "mcptools" / server
    pkg.mkdir(parents=True)
    (root / "mcptools" / "__init__.py").write_text("")
    for name, source in package.files.items():
        (pkg / name).write_text(source)
    importlib.invalidate_caches()
    return package.modules


def test_hostile_server_cannot_inject_code(import_dir: Path) -> None:
    marker = import_dir / "PWNED"
    texts = [t.replace("MARKER", str(marker)) for t in HOSTILE_TEXTS]
    evil = "\n".join(texts)
    tools = [
        ToolSpec(
            name='evil"""\nimport os',
            description=evil,
            input_schema={
                "type": "object",
                "title": evil,
                "description": evil,
                "properties": {
                    'x"""': {"type": "string", "description": evil, "title": evil, "default": evil},
                    "class": {"type": "integer", "description": evil},
                    "choice": {"enum": texts[:3], "description": evil},
                    "nested": {"type": "object", "title": evil, "properties": {evil: {"type": "string"}}},
                },
                "required": ["class"],
            },
            output_schema={
                "type": "object",
                "description": evil,
                "properties": {"out": {"type": "string", "description": evil}},
            },
        )
    ]
    modules = _write(import_dir, "hostile", tools)
    (module,) = modules
    for name, source in ((m, (import_dir / (m.replace(".", "/") + ".py")).read_text()) for m in modules):
        ast.parse(source)
        assert name == "mcptools.hostile.evil____import_os"
    mod = importlib.import_module(module)
    assert not marker.exists()
    assert mod.__doc__ == f"MCP tool {tools[0].name!r} of server 'hostile'.\n\n{evil.strip()}"
    assert tools[0].name == mod.TOOL
    params = mod.Params.model_validate({"class": 3, 'x"""': "v"})
    assert params.model_dump(mode="json", by_alias=True, exclude_unset=True) == {"class": 3, 'x"""': "v"}
    assert "Result" in vars(mod) and "out" in mod.Result.model_fields
    assert inspect.signature(mod.run).parameters.keys() == {"params"}
    assert evil.strip().splitlines()[0] in inspect.getdoc(mod.run)  # help(run) shows the description
    assert not marker.exists()


def test_generated_package_shape(import_dir: Path) -> None:
    tools = [
        ToolSpec(
            name="get-sum",
            description="Adds.",
            input_schema={
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        ),
        ToolSpec(name="no_args", description="", input_schema={"type": "object"}),
        ToolSpec(
            name="typed",
            description="Has output.",
            input_schema={"type": "object", "properties": {"when": {"type": "string", "format": "date-time"}}},
            output_schema={"type": "object", "properties": {"total": {"type": "integer"}}, "required": ["total"]},
        ),
    ]
    modules = _write(import_dir, "srv", tools)
    assert modules == {
        "mcptools.srv.get_sum": "get-sum",
        "mcptools.srv.no_args": "no_args",
        "mcptools.srv.typed": "typed",
    }
    pkg = importlib.import_module("mcptools.srv")
    assert pkg.TOOLS == {"get_sum": "get-sum", "no_args": "no_args", "typed": "typed"}
    assert "get_sum: tool 'get-sum'" in (pkg.__doc__ or "")
    get_sum = importlib.import_module("mcptools.srv.get_sum")
    assert get_sum.Params(a=1, b=2).a == 1
    assert "Result" not in vars(get_sum)
    with pytest.raises(Exception, match="b"):
        get_sum.Params(a=1)
    typed = importlib.import_module("mcptools.srv.typed")
    assert typed.Result.model_validate({"total": 3}).total == 3
    no_args = importlib.import_module("mcptools.srv.no_args")
    assert no_args.Params().model_dump() == {}
    assert "no description" in (no_args.__doc__ or "")


def test_input_and_output_defs_with_the_same_name_do_not_clash(import_dir: Path) -> None:
    tool = ToolSpec(
        name="refs",
        input_schema={
            "type": "object",
            "properties": {"item": {"$ref": "#/$defs/Item"}, "p": {"$ref": "#/$defs/Params"}},
            "$defs": {
                "Item": {"type": "object", "properties": {"a": {"type": "integer"}}},
                "Params": {"type": "object", "properties": {"z": {"type": "string"}}},
            },
        },
        output_schema={
            "type": "object",
            "properties": {"items": {"type": "array", "items": {"$ref": "#/definitions/Item"}}},
            "definitions": {"Item": {"type": "object", "properties": {"b": {"type": "string"}}}},
        },
    )
    schema = combined_schema(tool.input_schema, tool.output_schema)
    assert {"Params", "Result", "Item"} <= set(schema["$defs"])
    _write(import_dir, "r", [tool])
    mod = importlib.import_module("mcptools.r.refs")
    p = mod.Params.model_validate({"item": {"a": 1}, "p": {"z": "q"}})
    assert p.item.a == 1
    r = mod.Result.model_validate({"items": [{"b": "x"}]})
    assert r.items[0].b == "x"


@pytest.mark.parametrize(
    "source",
    [
        "import os",
        "from os import system",
        "from subprocess import run",
        "__import__('os')",
        "x = eval('1')",
        "class A:\n    x = exec('1')",
        "def f():\n    pass",
        "y = (lambda: 1)()",
        "z = int.__subclasses__()",
        "@dataclass\nclass A:\n    pass",
        "open('/etc/passwd')",
        "from pydantic import BaseModel\nclass A(BaseModel, metaclass=type):\n    pass",
        "[x for x in ()]",
    ],
)
def test_model_source_check_rejects_code(source: str) -> None:
    with pytest.raises(RegistrationError):
        check_models_source(source)


def test_model_source_check_accepts_declarative_models() -> None:
    check_models_source(
        "from __future__ import annotations\nfrom enum import Enum\nfrom pydantic import BaseModel, Field\n"
        "class E(Enum):\n    a = 'a'\n"
        "class Params(BaseModel):\n    x: int | None = Field(None, alias='class')\n    e: list[E] = []\n"
    )


def test_odd_but_valid_schemas_generate() -> None:
    schemas: list[dict[str, Any]] = [
        {},
        {"type": "object", "properties": {}},
        {"type": "object", "additionalProperties": {"type": "string"}},
        {
            "type": "object",
            "properties": {
                "u": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "o": {"oneOf": [{"type": "integer"}, {"type": "object"}]},
                "c": {"const": "fixed"},
                "t": {"type": ["string", "number"]},
                "arr": {"type": "array", "items": {"type": "array", "items": {}}},
            },
        },
        {"properties": {"x": {"type": "string", "minLength": 1, "pattern": '^a"""$'}}},
    ]
    package = generate_package("odd", [ToolSpec(name=f"t{i}", input_schema=s) for i, s in enumerate(schemas)])
    assert len(package.modules) == len(schemas)
    for source in package.files.values():
        ast.parse(source)
