"""Pure code generation: an MCP server's tool list → the sources of ``mcptools/<server>/``.

Models come from ``datamodel-code-generator``. Everything a server controls (names, descriptions,
schemas) is untrusted: text lands in source only through ``doc_literal`` or ``repr``, and the
generated model code is parsed and checked against an allow-list before it is accepted, so a
hostile server cannot put code into a module that the kernel will import.
"""

from __future__ import annotations

import ast
import copy
import keyword
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ipyfence.errors import RegistrationError

MAX_DOC_CHARS = 20_000
CLIENT_MODULE = "ipyfence.mcptools.client"

# What generated model code may import and which builtins it may name.
_ALLOWED_IMPORTS = frozenset(
    {"__future__", "enum", "typing", "typing_extensions", "pydantic", "datetime", "decimal", "uuid",
     "ipaddress", "pathlib", "re", "collections.abc"}
)  # fmt: skip
_SAFE_BUILTINS = frozenset(
    {"int", "float", "str", "bool", "bytes", "list", "dict", "set", "frozenset", "tuple", "object", "None",
     "True", "False", "type"}
)  # fmt: skip
_ALLOWED_NODES = (
    ast.Module, ast.ImportFrom, ast.Import, ast.alias, ast.ClassDef, ast.Assign, ast.AnnAssign, ast.Expr,
    ast.Constant, ast.Name, ast.Load, ast.Store, ast.Attribute, ast.Subscript, ast.Tuple, ast.List, ast.Dict,
    ast.Call, ast.keyword, ast.BinOp, ast.BitOr, ast.UnaryOp, ast.USub, ast.Pass, ast.Slice, ast.Set,
)  # fmt: skip


@dataclass(frozen=True)
class ToolSpec:
    """The parts of an MCP ``Tool`` that codegen uses (all server-controlled)."""

    name: str
    description: str = ""
    input_schema: Mapping[str, Any] = field(default_factory=dict)
    output_schema: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class GeneratedPackage:
    files: dict[str, str]  # file name inside mcptools/<server>/ → source
    modules: dict[str, str]  # module name (mcptools.<server>.<mod>) → tool name


def module_names(tool_names: Sequence[str]) -> dict[str, str]:
    """Tool name → unique, valid, non-keyword module name.

    Every character outside ``[A-Za-z0-9_]`` becomes ``_`` (``get-sum`` → ``get_sum``,
    ``foo.bar`` → ``foo_bar``, case is kept); a leading digit or ``_`` gets a ``tool_`` prefix; a keyword
    gets a trailing ``_`` (``class`` → ``class_``); clashes get ``_2``, ``_3``, ... in order.
    """
    taken: set[str] = set()
    out: dict[str, str] = {}
    for name in tool_names:
        base = re.sub(r"[^A-Za-z0-9_]", "_", name.encode("ascii", "replace").decode()) or "tool"
        if base[0].isdigit() or base.startswith("_"):
            base = "tool_" + base.lstrip("_")
        if keyword.iskeyword(base) or keyword.issoftkeyword(base):
            base += "_"
        candidate, n = base, 2
        while candidate in taken:
            candidate, n = f"{base}_{n}", n + 1
        taken.add(candidate)
        out[name] = candidate
    return out


def doc_literal(text: str, indent: str = "") -> str:
    """A triple-quoted literal that evaluates to exactly ``text``, whatever it contains."""
    text = text[:MAX_DOC_CHARS]
    parts: list[str] = []
    for ch in text:
        if ch == "\\":
            parts.append("\\\\")
        elif ch == '"':
            parts.append('\\"')
        elif ch == "\n":
            parts.append("\n" + indent)
        elif ch == "\t" or ch.isprintable():
            parts.append(ch)
        else:  # control, separator or other non-printable characters: escape them
            parts.append(ch.encode("unicode_escape").decode("ascii"))
    return '"""' + "".join(parts) + '"""'


def _rename_defs(schema: dict[str, Any], rename: Mapping[str, str]) -> dict[str, Any]:
    """Rewrite local ``$ref``s to ``#/$defs/<new name>`` everywhere in ``schema``."""

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: walk(v) for k, v in node.items()}
            ref = node.get("$ref")
            if isinstance(ref, str):
                for prefix in ("#/$defs/", "#/definitions/"):
                    if ref.startswith(prefix) and ref[len(prefix) :] in rename:
                        out["$ref"] = "#/$defs/" + rename[ref[len(prefix) :]]
            return out
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    result: dict[str, Any] = walk(schema)
    return result


def _split_defs(schema: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    body = {k: copy.deepcopy(v) for k, v in schema.items() if k not in ("$defs", "definitions", "$schema", "$id")}
    defs: dict[str, Any] = {}
    for key in ("definitions", "$defs"):
        if isinstance(schema.get(key), dict):
            defs.update(copy.deepcopy(schema[key]))
    return body, defs


def combined_schema(input_schema: Mapping[str, Any], output_schema: Mapping[str, Any] | None) -> dict[str, Any]:
    """One schema whose ``$defs`` hold ``Params``, ``Result`` and their sub-schemas, refs rewritten."""
    reserved = {"Params", "Result"}
    all_defs: dict[str, Any] = {}
    roots: dict[str, dict[str, Any]] = {}
    for root_name, schema in (("Params", input_schema), ("Result", output_schema)):
        if schema is None:
            continue
        body, defs = _split_defs(schema)
        rename: dict[str, str] = {}
        for name in defs:
            new, n = name, 1
            while new in reserved or new in all_defs or not isinstance(new, str):
                new, n = f"{root_name}{name}{n}", n + 1
            rename[name] = new
        for name, sub in defs.items():
            all_defs[rename[name]] = _rename_defs(sub, rename) if isinstance(sub, dict) else sub
        body = _rename_defs(body, rename)
        body.pop("title", None)  # the class is called Params/Result, not the server's title
        if not body.get("type") and "properties" in body:
            body["type"] = "object"
        roots[root_name] = body
    return {"$defs": {**all_defs, **roots}}


def generate_models(schema: Mapping[str, Any]) -> str:
    """JSON Schema → pydantic v2 model source, via datamodel-code-generator."""
    import datamodel_code_generator as dcg
    from datamodel_code_generator._format_types import Formatter

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = dcg.generate(
                dict(schema),
                input_file_type=dcg.InputFileType.JsonSchema,
                output_model_type=dcg.DataModelType.PydanticV2BaseModel,
                use_field_description=True,
                use_schema_description=True,
                disable_timestamp=True,
                formatters=[Formatter.BUILTIN],
                use_union_operator=True,
                use_standard_collections=True,
            )
    except Exception as exc:  # the generator raises many types on odd schemas
        raise RegistrationError(f"cannot generate models from the schema: {type(exc).__name__}: {exc}") from None
    if not isinstance(out, str):
        raise RegistrationError("the model generator returned no single module")
    return out


def check_models_source(source: str) -> None:
    """Accept generated model code only if it is declarative: allowed imports, classes and constants.

    A name may only be one the module binds itself (imports, classes, assignments) or a plain
    type builtin, so even a generator escaping bug cannot smuggle in ``__import__('os')``.
    """
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise RegistrationError(f"generated model code does not parse: {exc}") from None
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.module not in _ALLOWED_IMPORTS or node.level:
                raise RegistrationError(f"generated model code imports {node.module!r}")
            bound.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name not in _ALLOWED_IMPORTS:
                    raise RegistrationError(f"generated model code imports {a.name!r}")
                bound.add((a.asname or a.name).split(".")[0])
        elif isinstance(node, ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_NODES):
            raise RegistrationError(f"generated model code contains a disallowed construct ({type(node).__name__})")
        if isinstance(node, ast.Name) and node.id not in bound and node.id not in _SAFE_BUILTINS:
            raise RegistrationError(f"generated model code names {node.id!r}")
        if isinstance(node, ast.Attribute) and node.attr.startswith("__"):
            raise RegistrationError(f"generated model code accesses {node.attr!r}")
        if isinstance(node, ast.ClassDef) and (node.decorator_list or node.keywords):
            raise RegistrationError("generated model code uses class decorators or keywords")


_MODULE_TEMPLATE = """\
{doc}
# Generated by ipyfence for MCP server {server!r}, tool {tool!r}. Do not edit: re-register instead.
{models}

from typing import Any as _Any

from {client} import ToolCallError as ToolCallError
from {client} import call_tool as _call_tool

SERVER = {server!r}
TOOL = {tool!r}


def run(params: Params | dict[str, _Any]) -> {returns}:
    {run_doc}
    return _call_tool(SERVER, TOOL, params, Params, {result})
"""

_INIT_TEMPLATE = """\
{doc}
# Generated by ipyfence. Do not edit: re-register instead.

SERVER = {server!r}
TOOLS: dict[str, str] = {tools!r}  # module name -> MCP tool name
"""

_RUN_RETURNS = """\
Calls the tool through ipyfence's bridge (auto-approved) and returns its result:
- a Result model when the tool declares an output schema and returns structured content;
- otherwise a str (text content), a dict (structured content only), or a list of
  str / Image / Audio / Resource values for mixed content.
Raises ToolCallError with the server's message when the tool reports an error."""


def _strip_header(models: str) -> str:
    """Drop the generator's comment header and its ``from __future__`` import (ours comes first)."""
    lines = [line for line in models.splitlines() if not line.startswith("#")]
    text = "\n".join(lines).replace("from __future__ import annotations\n", "", 1)
    return text.strip("\n")


def tool_module(server: str, tool: ToolSpec, module: str) -> str:
    schema = combined_schema(tool.input_schema or {"type": "object"}, tool.output_schema)
    models = _strip_header(generate_models(schema))
    check_models_source(models)
    classes = {n.name for n in ast.parse(models).body if isinstance(n, ast.ClassDef)}
    has_result = tool.output_schema is not None
    if "Params" not in classes or (has_result and "Result" not in classes):
        raise RegistrationError("the model generator did not produce the Params/Result classes")
    description = (tool.description or "").strip() or "(the server gives no description)"
    doc = f"MCP tool {tool.name!r} of server {server!r}.\n\n{description}"
    source = _MODULE_TEMPLATE.format(
        doc=doc_literal(doc),
        server=server,
        tool=tool.name,
        models="from __future__ import annotations\n\n" + models,
        client=CLIENT_MODULE,
        returns="Result | str | dict[str, _Any] | list[_Any]" if has_result else "str | dict[str, _Any] | list[_Any]",
        run_doc=doc_literal(f"{description}\n\n{_RUN_RETURNS}", indent="    "),
        result="Result" if has_result else "None",
    )
    verify_module(source, doc)
    return source


def verify_module(source: str, doc: str) -> None:
    """The module must parse and its docstring must be exactly the intended text."""
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise RegistrationError(f"generated module does not parse: {exc}") from None
    if ast.get_docstring(tree, clean=False) != doc[:MAX_DOC_CHARS]:
        raise RegistrationError("generated module docstring does not round-trip")


def generate_package(server: str, tools: Sequence[ToolSpec]) -> GeneratedPackage:
    names = module_names([t.name for t in tools])
    files: dict[str, str] = {}
    modules: dict[str, str] = {}
    for tool in tools:
        mod = names[tool.name]
        try:
            files[f"{mod}.py"] = tool_module(server, tool, mod)
        except RegistrationError as exc:
            raise RegistrationError(f"tool {tool.name!r}: {exc}") from None
        modules[f"mcptools.{server}.{mod}"] = tool.name
    listing = "\n".join(f"- {m.rsplit('.', 1)[1]}: tool {t!r}" for m, t in modules.items()) or "(no tools)"
    init_doc = (
        f"Python API for the tools of MCP server {server!r}, generated by ipyfence.\n\n"
        "Each tool is a module with a Params model, run(params) and, when the tool declares an\n"
        "output schema, a Result model. Non-identifier tool names map to module names by\n"
        "replacing other characters with '_' (a keyword gets a trailing '_').\n\n" + listing
    )
    files["__init__.py"] = _INIT_TEMPLATE.format(
        doc=doc_literal(init_doc), server=server, tools={m.rsplit(".", 1)[1]: t for m, t in modules.items()}
    )
    verify_module(files["__init__.py"], init_doc)
    return GeneratedPackage(files=files, modules=modules)
