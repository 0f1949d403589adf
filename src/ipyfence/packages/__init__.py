"""install_package: validate the spec, run pip inside the sandbox, move the result in."""

from ipyfence.packages.installer import PackageInstaller
from ipyfence.packages.spec import PackageSpec, parse_spec

__all__ = ["PackageInstaller", "PackageSpec", "parse_spec"]
