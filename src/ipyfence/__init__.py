"""ipyfence: a sandboxed IPython kernel over MCP."""

__version__ = "0.1.0"
