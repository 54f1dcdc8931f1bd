"""``errands dashboard module:app``: serve the web dashboard with uvicorn."""

from __future__ import annotations

import socket

import click

from .loading import URL_HELP, load_app


@click.command()
@click.argument("app_path", required=False, metavar="MODULE:APP")
@click.option(
    "-A",
    "--app",
    "app_option",
    envvar="ERRANDS_APP",
    help="the App as module:attribute (also ERRANDS_APP)",
)
@click.option("--url", help=URL_HELP)
@click.option("--host", default="127.0.0.1", show_default=True, help="address to bind")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option(
    "--password",
    envvar="ERRANDS_DASHBOARD_PASSWORD",
    help="login password (prefer the ERRANDS_DASHBOARD_PASSWORD environment variable)",
)
@click.option(
    "--token",
    envvar="ERRANDS_DASHBOARD_TOKEN",
    help="login token (prefer the ERRANDS_DASHBOARD_TOKEN environment variable)",
)
@click.option(
    "--secret",
    envvar="ERRANDS_DASHBOARD_SECRET",
    help="key signing the session cookie (also ERRANDS_DASHBOARD_SECRET; default: random "
    "per process, so sessions end on restart)",
)
@click.option("--read-only", is_flag=True, help="nobody may replay, discard, cancel or pause")
@click.option("--https-only", is_flag=True, help="mark the session cookie Secure (behind TLS)")
@click.option(
    "--allowed-origin",
    "allowed_origins",
    multiple=True,
    metavar="URL",
    help="an address forms may be posted from besides the request's Host, e.g. "
    "https://jobs.example.com behind a proxy that rewrites Host (repeatable)",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
    default="info",
    show_default=True,
)
def dashboard(
    app_path: str | None,
    app_option: str | None,
    url: str | None,
    host: str,
    port: int,
    password: str | None,
    token: str | None,
    secret: str | None,
    read_only: bool,
    https_only: bool,
    allowed_origins: tuple[str, ...],
    log_level: str,
) -> None:
    """Serve the web dashboard (binds 127.0.0.1; another address needs a login)."""
    try:
        import uvicorn

        from ..dashboard import create_app
        from ..dashboard.app import describe
        from ..dashboard.security import refuse_open_bind
    except ImportError as exc:
        raise click.UsageError(
            f"the dashboard needs the dashboard extra: pip install 'errands[dashboard]' ({exc})"
        ) from None
    app = load_app(app_path or app_option, url, existing=True)
    web = create_app(
        app,
        password=password or "",
        token=token or "",
        secret_key=secret or "",
        authorize=(lambda request: "read") if read_only else None,
        https_only=https_only,
        allowed_origins=allowed_origins,
    )
    refuse_open_bind(host, web.state.errands.auth)  # ConfigurationError: one line, exit 1
    shown = f"[{host}]" if ":" in host else host
    if port == 0:  # the OS picks the port: bound here, to say which (it said ":0")
        sock = _bound(host)
        port = int(sock.getsockname()[1])
        click.echo(
            f"errands dashboard on http://{shown}:{port}/ ({describe(web)}); Ctrl-C stops it"
        )
        config = uvicorn.Config(
            web, host=host, port=port, log_level=log_level.lower(), server_header=False
        )
        uvicorn.Server(config).run(sockets=[sock])
        return
    click.echo(f"errands dashboard on http://{shown}:{port}/ ({describe(web)}); Ctrl-C stops it")
    uvicorn.run(web, host=host, port=port, log_level=log_level.lower(), server_header=False)


def _bound(host: str) -> socket.socket:
    """A listening-ready socket bound to ``host`` on a port the OS chooses (as uvicorn
    binds one: IPv6 for an address with a colon)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family=family, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
    except OSError as exc:
        sock.close()
        raise click.ClickException(
            f"cannot serve the dashboard on {host!r}: {exc.strerror or exc}; "
            "give --host an address of this machine"
        ) from None
    return sock
