"""One exception tree for everything ipyfence reports to a user.

::

    IpyfenceError                     any expected failure; its message is shown as is
    ├── ConfigError                   bad CLI flags, settings, .env or environment
    │   └── PolicyError               a profile or --sandbox-config file is invalid (names file + key path)
    ├── UnsafePathError               a host write would go through a symlink or non-directory the kernel can plant
    ├── SandboxError                  the sandbox cannot be built or started (never falls back to no sandbox)
    │   └── SandboxUnavailableError   a prerequisite is missing (bwrap, srt, user namespaces); says how to fix
    ├── KernelError                   the kernel failed to start or died
    │   └── KernelStartError          a new kernel did not come up (install_package checks the package dir)
    ├── ToolInputError                an MCP tool got an argument it cannot accept
    ├── RegistrationError             register_mcp_server failed (bad params, unreachable server, codegen)
    ├── BridgeError                   a kernel→host tool call was refused or failed
    └── PackageInstallError           install_package was rejected or pip failed

The CLI turns any ``IpyfenceError`` into a ``click.ClickException`` (message, exit 1);
the MCP tools turn it into a tool error (``isError``).  Anything else is a bug.
"""


class IpyfenceError(Exception):
    """An expected failure whose message is meant for the user."""


class ConfigError(IpyfenceError):
    """Bad CLI flags, settings, ``.env`` or environment."""


class PolicyError(ConfigError):
    """A sandbox profile or ``--sandbox-config`` file is invalid."""


class UnsafePathError(IpyfenceError):
    """A host file operation in a kernel-writable tree met a symlink or a non-directory: refused."""


class SandboxError(IpyfenceError):
    """The sandbox cannot be built or started."""


class SandboxUnavailableError(SandboxError):
    """A sandbox prerequisite is missing on this machine."""


class KernelError(IpyfenceError):
    """The kernel failed to start or died."""


class KernelStartError(KernelError):
    """A new kernel exited or hung during start-up."""


class ToolInputError(IpyfenceError):
    """An MCP tool argument is out of range or malformed."""


class RegistrationError(IpyfenceError):
    """``register_mcp_server`` failed."""


class BridgeError(IpyfenceError):
    """A tool call from the kernel through the bridge was refused or failed."""


class PackageInstallError(IpyfenceError):
    """``install_package`` was rejected or pip failed."""
