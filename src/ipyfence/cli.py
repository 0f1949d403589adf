"""The command line. The only Click module: every IpyfenceError becomes a ClickException."""

from __future__ import annotations

import json
import logging
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio
import click

from ipyfence.errors import IpyfenceError
from ipyfence.policy import available_profiles, to_srt_settings, weakenings
from ipyfence.settings import Backend, Settings, build_settings, platform_backend

log = logging.getLogger("ipyfence")


def _settings(ctx_obj: dict[str, Any]) -> Settings:
    try:
        return build_settings(
            ctx_obj["workspace"],
            sandbox=ctx_obj["sandbox"],
            backend=ctx_obj["backend"],
            profile=ctx_obj["profile"],
            sandbox_config=ctx_obj["sandbox_config"],
            standby=ctx_obj["standby"],
        )
    except IpyfenceError as exc:
        raise click.ClickException(str(exc)) from None


def _setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)  # stdout belongs to the MCP transport
    handler.setFormatter(logging.Formatter("ipyfence: %(levelname)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--workspace", default=".", show_default=True, help="Working directory of the kernel; mcptools/ lives here."
)
@click.option(
    "--sandbox/--no-sandbox",
    default=True,
    show_default=True,
    help="--sandbox is the default (accepted for ipybox compatibility); --no-sandbox runs the kernel unconfined.",
)
@click.option(
    "--sandbox-config",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="sandbox-runtime settings JSON layered over the profile.",
)
@click.option("--profile", default="default", show_default=True, help="Named profile in sandbox-profiles/.")
@click.option(
    "--sandbox-backend",
    "backend",
    type=click.Choice(["auto", "bwrap", "srt"]),
    default="auto",
    show_default=True,
    help="auto: bwrap on Linux (srt if domains are allowed), srt on macOS.",
)
@click.option("--print-policy", is_flag=True, help="Print the effective policy and kernel launch command, then exit.")
@click.option("--standby/--no-standby", default=True, show_default=True, help="Keep a warm kernel for fast reset().")
@click.option(
    "--log-level", default="INFO", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]), show_default=True
)
@click.pass_context
def main(
    ctx: click.Context,
    workspace: str,
    sandbox: bool,
    sandbox_config: Path | None,
    profile: str,
    backend: Backend,
    print_policy: bool,
    standby: bool,
    log_level: str,
) -> None:
    """ipyfence: a stateful IPython kernel for AI agents, served over MCP stdio, inside an OS sandbox."""
    _setup_logging(log_level)
    ctx.obj = {
        "workspace": workspace,
        "sandbox": sandbox,
        "sandbox_config": sandbox_config,
        "profile": profile,
        "backend": backend,
        "standby": standby,
    }
    if ctx.invoked_subcommand is not None:
        return
    settings = _settings(ctx.obj)
    if print_policy:
        click.echo(render_policy_report(settings))
        return
    _serve(settings)


def _serve(settings: Settings) -> None:
    try:
        _preflight(settings)
    except IpyfenceError as exc:
        raise click.ClickException(str(exc)) from None
    _banner(settings)
    try:
        anyio.run(_serve_async, settings)
    except KeyboardInterrupt:
        pass
    except IpyfenceError as exc:
        raise click.ClickException(str(exc)) from None


async def _serve_async(settings: Settings) -> None:
    from ipyfence.app import App

    app = App(settings)
    await app.start()  # the kernel process is launched: it boots while the MCP SDK is imported
    from ipyfence.server import serve_stdio

    await serve_stdio(app)


def _preflight(settings: Settings) -> None:
    if not settings.sandbox:
        log.warning("--no-sandbox: the kernel runs UNCONFINED with your full user rights (files, network, processes)")
        return
    backend = platform_backend(settings)
    if backend == "bwrap":
        from ipyfence.sandbox.preflight import require_bwrap

        require_bwrap()
    else:
        from ipyfence.sandbox import srt_launch

        srt_launch.preflight(settings)
    for line in weakenings(settings.policy, settings.workspace):
        log.warning("policy weakens the default sandbox: %s", line)


def policy_summary(settings: Settings) -> str:
    if not settings.sandbox:
        return "NO SANDBOX"
    fs, net = settings.policy.filesystem, settings.policy.network
    network = "no network" if not net.allowed_domains else f"network to {', '.join(net.allowed_domains)}"
    return (
        f"profile {settings.profile}; read all but {len(fs.deny_read)} deny pattern(s); "
        f"write {', '.join(fs.allow_write) or 'nothing'}; {network}"
    )


def _banner(settings: Settings) -> None:
    backend = platform_backend(settings) if settings.sandbox else "none"
    lines = [
        f"ipyfence serving MCP on stdio — workspace {settings.workspace}",
        f"  sandbox: {backend}; {policy_summary(settings)}",
        "  connect: claude mcp add ipyfence -- ipyfence --workspace " + shlex.quote(str(settings.workspace)),
        "  (this process speaks MCP on stdin/stdout; run `make demo` to see a client drive it)",
    ]
    for line in lines:
        click.echo(line, err=True)


def render_policy_report(settings: Settings) -> str:
    """The effective policy (srt format) and the exact kernel launch command, without starting anything."""
    from ipyfence.launcher import KERNEL_OPTIONS
    from ipyfence.sandbox.launch import base_env, build_launch, kernel_argv, kernel_paths, parent_guard

    runtime_root = Path(tempfile.gettempdir()) / "ipyfence-XXXXXXXX"
    kernel_dir = runtime_root / "k1"
    env = base_env(settings, kernel_dir, "<per-kernel-token>")
    paths = kernel_paths(settings, kernel_dir, runtime_root)
    try:
        launch = build_launch(settings, paths, env, kernel_argv(kernel_dir / "kernel.json"), options=KERNEL_OPTIONS)
    except IpyfenceError as exc:
        raise click.ClickException(str(exc)) from None
    report: dict[str, Any] = {
        "workspace": str(settings.workspace),
        "sandbox": settings.sandbox,
        "backend": launch.backend,
        "profile": settings.profile,
        "sources": list(settings.policy.sources),
        "policy": to_srt_settings(settings.policy),
        "limits": vars(settings.policy.limits),
        "weakenings": weakenings(settings.policy, settings.workspace),
        "kernel_env_keys": sorted(env),
    }
    if launch.plan is not None:
        report["mounts"] = {
            "writable": list(launch.plan.writable),
            "masked_files": list(launch.plan.masked_files),
            "hidden_dirs": list(launch.plan.hidden_dirs),
            "readonly": list(launch.plan.readonly),
            "reallowed": list(launch.plan.reallowed),
            "placeholders": [*launch.plan.absent_files, *launch.plan.absent_dirs],
            "pinned": list(launch.plan.pinned),
            "unscanned": list(launch.plan.unscanned),
            "sockets": list(launch.plan.sockets),
            "sealed": list(launch.plan.sealed),
            "rebound": list(launch.plan.rebound),
            "warnings": list(launch.plan.warnings),
        }
    argv = parent_guard(launch.argv, 0) if settings.sandbox else launch.argv
    shown = _redact_env(argv, settings)
    if settings.sandbox:
        shown[shown.index("ipyfence-guard") + 1] = "<server-pid>"
    note = "# (when per-kernel cgroups are available, a shell that joins them runs before bwrap)\n"
    return json.dumps(report, indent=2) + "\n\n# kernel launch command\n" + note * settings.sandbox + shlex.join(shown)


def _redact_env(argv: list[str], settings: Settings) -> list[str]:
    """Never print KERNEL_ENV_ values (``--setenv KEY VALUE``): they are secrets more often than not."""
    shown = list(argv)
    for i, arg in enumerate(argv[:-2]):
        if arg == "--setenv" and argv[i + 1] in settings.kernel_env:
            shown[i + 2] = "<redacted>"
    return shown


@main.command()
@click.pass_context
def doctor(ctx: click.Context) -> None:
    """Check the sandbox prerequisites and say how to fix what is missing."""
    from ipyfence.sandbox.preflight import checks

    failed = False
    for check in checks():
        mark = "ok " if check.ok else ("FAIL" if check.required else "warn")
        click.echo(f"[{mark}] {check.name}: {check.detail}")
        if not check.ok:
            click.echo(f"       fix: {check.fix}")
            failed = failed or check.required
    click.echo(f"profiles: {', '.join(available_profiles())}")
    if failed:
        raise click.ClickException("some required prerequisites are missing (see above)")


@main.command("profiles")
def list_profiles() -> None:
    """List the named sandbox profiles."""
    for name in available_profiles():
        click.echo(name)


if __name__ == "__main__":
    main()
