"""What the agent reads about each tool: kept apart from the adapters so it can be long and exact.

Plain text without leading indentation (clients show descriptions verbatim).
"""

EXECUTE_IPYTHON_CELL = """\
Execute Python code in a stateful IPython kernel and return its output (stdout, stderr, the last
expression's value, tracebacks; images come back as image content).

Variables, imports and definitions persist across calls until reset(). The kernel runs an asyncio
event loop: use top-level `await` directly, never asyncio.run().

The kernel runs inside an OS sandbox: it can read most files but not .env files, it can write only
inside the workspace (its working directory), and it has no network. Use the install_package tool to
add packages (`!pip install` / `%pip install` do not work in the sandbox).

Tools of MCP servers registered with register_mcp_server are called from code through the generated
API; such calls are auto-approved:
    from mcptools.<server_name>.<tool_name> import Params, run
    result = run(Params(arg1=value1))
run() returns a Result model when the tool declares an output schema, otherwise the tool's text.

On timeout the cell is interrupted and its partial output returned (state is kept); a cell that
ignores the interrupt gets the kernel restarted (state lost), and the result says so."""

REGISTER_MCP_SERVER = """\
Connect to an MCP server and generate a typed Python API for its tools under
mcptools/<server_name>/, importable from execute_ipython_cell at once. Returns the module names.

server_params:
- stdio: {"command": "npx", "args": ["-y", "@some/mcp-server"], "env": {"API_KEY": "${API_KEY}"}},
  optionally "cwd". The server runs on the host (not in the sandbox), from a private directory.
- HTTP: {"url": "https://api.example.com/mcp", "headers": {"Authorization": "Bearer ${TOKEN}"}}
${VAR} placeholders are filled on the host from ipyfence's environment or the workspace .env; the
secrets never reach the kernel.

Each generated module has Params (a pydantic model of the arguments), Result (when the tool has an
output schema) and run(params). Tool names that are not identifiers are mapped (get-sum -> get_sum).
Re-registering a name replaces its API: call reset() afterwards so the kernel imports the new code."""

INSTALL_PACKAGE = """\
Install one Python package with pip, inside the sandbox (build code never runs on the host), into
this workspace's package directory. The package is importable at once and persists across reset().
package_name: a requirement ("requests", "numpy>=1.20", "pkg[extra]==1.2") or one URL
("git+https://github.com/org/repo.git"). Options and several packages per call are refused."""

RESET = """\
Replace the kernel with a fresh one: all variables, imports and definitions are cleared.
Installed packages and the generated mcptools/ persist. Call it after re-registering an MCP server
so the new API is imported."""

LIST_PACKAGES = """\
List what install_package put into this workspace's package dir (name, version, when), and anything
else found there, such as files that shadow the kernel's own runtime."""

UNINSTALL_PACKAGE = """\
Remove one package from this workspace's package dir (installed by install_package, or a module put
there by hand), then refresh the kernel, or start a new one if the package kept it from starting.
package_name: the distribution name as list_packages() shows it, e.g. "requests"."""
