"""The command line. The only Click module: every IpyfenceError becomes a ClickException."""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

import anyio
import click

from ipyfence import __version__
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
            allow_workspace_servers=ctx_obj["allow_workspace_servers"],
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
    "--allow-workspace-servers",
    is_flag=True,
    help="Trust decision: let registered MCP servers start from the workspace (cwd, command, PATH); "
    "they run on the host and would run whatever the kernel wrote there.",
)
@click.option(
    "--log-level",
    default="INFO",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], case_sensitive=False),
    show_default=True,
)
# ipybox's own flags, accepted so that an ipybox configuration starts ipyfence unchanged.
@click.option("--sandbox-settings", "sandbox_settings", type=click.Path(dir_okay=False, path_type=Path), hidden=True)
@click.option("--tool-server-host", hidden=True)
@click.option("--tool-server-port", hidden=True)
@click.option("--kernel-gateway-host", hidden=True)
@click.option("--kernel-gateway-port", hidden=True)
@click.version_option(__version__, "--version", prog_name="ipyfence")
@click.pass_context
def main(
    ctx: click.Context,
    /,
    workspace: str,
    sandbox: bool,
    sandbox_config: Path | None,
    profile: str,
    backend: Backend,
    print_policy: bool,
    standby: bool,
    allow_workspace_servers: bool,
    log_level: str,
    sandbox_settings: Path | None,
    **ipybox_only: str | None,
) -> None:
    """ipyfence: a stateful IPython kernel for AI agents, served over MCP stdio, inside an OS sandbox."""
    _setup_logging(log_level)
    for name, value in ipybox_only.items():
        if value is not None:
            flag = "--" + name.replace("_", "-")
            log.warning("%s is an ipybox option that does not apply to ipyfence (no separate servers); ignored", flag)
    if sandbox_settings is not None:
        if sandbox_config is not None:
            raise click.UsageError("give --sandbox-config or ipybox's older --sandbox-settings, not both")
        log.warning("--sandbox-settings is ipybox's older name; read as --sandbox-config %s", sandbox_settings)
        sandbox_config = sandbox_settings
    ctx.obj = {
        "workspace": workspace,
        "sandbox": sandbox,
        "sandbox_config": sandbox_config,
        "profile": profile,
        "backend": backend,
        "standby": standby,
        "allow_workspace_servers": allow_workspace_servers,
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
    from ipyfence.statedirs import mark_running

    marker = mark_running(settings.state_dir, settings.workspace)
    try:
        anyio.run(_serve_async, settings)
    except KeyboardInterrupt:
        pass
    except IpyfenceError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        marker.unlink(missing_ok=True)


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
        "  connect: claude mcp add ipyfence -- " + shlex.join(connect_command(settings)),
        "  (this process speaks MCP on stdin/stdout; run `make demo` to see a client drive it)",
    ]
    for line in lines:
        click.echo(line, err=True)


def connect_command(settings: Settings) -> list[str]:
    """This server's command line, absolute and complete, for a client configuration."""
    exe = shutil.which(sys.argv[0]) or sys.argv[0]
    argv = [os.path.abspath(exe), "--workspace", str(settings.workspace)]
    if not settings.sandbox:
        argv.append("--no-sandbox")
    if settings.backend != "auto":
        argv += ["--sandbox-backend", settings.backend]
    if settings.profile != "default":
        argv += ["--profile", settings.profile]
    if settings.sandbox_config is not None:
        argv += ["--sandbox-config", str(settings.sandbox_config.resolve())]
    if not settings.standby:
        argv.append("--no-standby")
    if settings.allow_workspace_servers:
        argv.append("--allow-workspace-servers")
    return argv


def render_policy_report(settings: Settings) -> str:
    """The effective policy (srt format) and the exact kernel launch command, without starting anything."""
    from ipyfence.launcher import KERNEL_OPTIONS
    from ipyfence.sandbox.bwrap import ARGS_FD
    from ipyfence.sandbox.launch import base_env, build_launch, kernel_argv, kernel_paths, parent_guard

    runtime_root = Path("/var/tmp/ipyfence-<uid>/ipyfence-XXXXXXXX")  # see runtime.private_parent
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
        "kernel_lockdown (always, in the sandbox)": _lockdown_report(settings, env),
        "hidden_host_dirs_why": (
            "/run, /var/run, /tmp, /var/tmp (and the host's /dev/shm) hold other programs' sockets and files: "
            "the kernel sees empty read-only directories there, plus a private /tmp and /dev/shm of its own. "
            "So a sibling of a workspace under /tmp is not visible; only the workspace itself is bound in."
        )
        if settings.sandbox
        else "",
    }
    if launch.plan is not None:
        report["mounts"] = {
            "writable": list(launch.plan.writable),
            "masked_files": list(launch.plan.masked_files),
            "hidden_dirs": list(launch.plan.hidden_dirs),
            "readonly": list(launch.plan.readonly),
            "reallowed": list(launch.plan.reallowed),
            "placeholders": [*launch.plan.absent_files, *launch.plan.absent_dirs],
            "pinned (cannot be renamed)": list(launch.plan.pinned),
            "unscanned (hidden: the scan did not finish)": list(launch.plan.unscanned),
            "sockets (masked)": list(launch.plan.sockets),
            "sealed": list(launch.plan.sealed),
            "rebound": list(launch.plan.rebound),
            "proc_readonly (always)": list(launch.plan.proc_readonly),
            "proc_masked (always)": list(launch.plan.proc_masked),
            "warnings": list(launch.plan.warnings),
        }
    args_path = str(runtime_root / "k1.args") if launch.args else "-"
    argv = parent_guard(launch.argv, 0, args_path) if settings.sandbox else launch.argv
    shown = _redact_env(argv, settings)
    if settings.sandbox:
        shown[shown.index("ipyfence-guard") + 1] = "<server-pid>"
    note = "# (when per-kernel cgroups are available, a shell that joins them runs before bwrap)\n"
    text = json.dumps(report, indent=2) + "\n\n# kernel launch command\n" + note * settings.sandbox + shlex.join(shown)
    if launch.args:
        pairs = _redact_env(launch.args.decode().split("\0")[:-1], settings)
        lines = [shlex.join(pairs[i : i + 3]) for i in range(0, len(pairs), 3)]
        text += f"\n\n# {args_path} (0600, read by bwrap on fd {ARGS_FD} for --args; never on a command line)\n"
        text += "\n".join(lines)
    return text


def _lockdown_report(settings: Settings, env: dict[str, str]) -> dict[str, Any]:
    """The in-kernel rules of kernel_boot, from the same configuration the kernel gets."""
    if not settings.sandbox:
        return {}
    cfg = json.loads(env.get("IPYFENCE_KERNEL", "{}"))
    unix = "allowed (network.allowAllUnixSockets)" if cfg.get("allow_unix_sockets") else "refused after start-up"
    return {
        "start": "python -m ipyfence.kernel_boot from the read-only install; cwd = private dir; PYTHONSAFEPATH",
        "landlock_writes_only_beneath": cfg.get("writable", []),
        "landlock_only_sockets_beneath": cfg.get("sockets", []),
        "landlock_scopes": "abstract unix sockets, signals (Landlock ABI >= 6)",
        "seccomp_socket_AF_UNIX": unix,
        "seccomp_refused": ["keyctl", "add_key", "request_key", "io_uring_setup", "foreign syscall ABIs"],
        "then": "chdir to the workspace and add it to sys.path, before any cell",
    }


def _redact_env(argv: list[str], settings: Settings) -> list[str]:
    """Never print KERNEL_ENV_ values or the bridge token (``--setenv KEY VALUE``)."""
    shown = list(argv)
    for i, arg in enumerate(argv[:-2]):
        if arg == "--setenv" and (argv[i + 1] in settings.kernel_env or argv[i + 1] == "IPYFENCE_BRIDGE_TOKEN"):
            shown[i + 2] = "<redacted>"
    return shown


@main.command()
@click.pass_context
def doctor(ctx: click.Context) -> None:
    """Check the sandbox prerequisites and the workspace's package dir; say how to fix what is wrong."""
    from ipyfence.sandbox.preflight import check_packages, checks

    found = checks()
    found.append(check_packages(_settings(ctx.obj)))
    failed = False
    for check in found:
        mark = "ok " if check.ok else ("FAIL" if check.required else "warn")
        click.echo(f"[{mark}] {check.name}: {check.detail}")
        if not check.ok:
            click.echo(f"       fix: {check.fix}")
            failed = failed or check.required
    click.echo(f"profiles: {', '.join(available_profiles())}")
    if failed:
        raise click.ClickException("some required prerequisites are missing (see above)")


@main.command("state")
@click.option("--remove", "remove", metavar="WORKSPACE", help="Delete this workspace's state (path or state dir name).")
def state(remove: str | None) -> None:
    """List per-workspace state (installed packages, registered servers, size), or remove one."""
    from ipyfence.settings import default_state_root
    from ipyfence.statedirs import list_states, remove_state

    root = default_state_root(os.environ)
    if remove is not None:
        try:
            gone = remove_state(root, remove)
        except IpyfenceError as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(f"removed {gone.directory} ({gone.workspace or 'workspace unknown'})")
        return
    states = list_states(root)
    click.echo(f"state dir: {root}")
    if not states:
        click.echo("  (no workspaces yet)")
    for info in states:
        running = f", running (pid {', '.join(map(str, info.running))})" if info.running else ""
        click.echo(
            f"  {info.workspace or '(workspace unknown)'}\n"
            f"    {info.directory.name}: {info.packages} package(s), {info.servers} MCP server(s), "
            f"{info.size_bytes / 1e6:.1f} MB{running}"
        )


@main.command("profiles")
def list_profiles() -> None:
    """List the named sandbox profiles."""
    for name in available_profiles():
        click.echo(name)


if __name__ == "__main__":
    main()
