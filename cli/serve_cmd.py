"""`mosos serve`: the planning service over HTTP (needs the `api` extra; imported lazily)."""

from __future__ import annotations

import errno
from pathlib import Path

import typer

from cli.app import app, error_console, friendly
from planner.errors import MososError
# Imports inside functions here are deferred for start-up time: a command loads what it alone uses when it runs:
# `mosos --help` and the light commands start without OR-Tools, torch, the service or Ray.


class ServeError(MososError):
    pass


@app.command("serve")
@friendly
def serve_command(
    host: str = typer.Option("127.0.0.1", help="address to bind; anything but loopback needs a token or --insecure"),
    port: int = typer.Option(8000, help="TCP port"),
    db: Path = typer.Option(None, help="SQLite file for plans (default: in the user's data directory)"),
    workers: int = typer.Option(2, help="solves running at once (solve processes, or Ray tasks with --backend ray)"),
    backend: str = typer.Option("local", help="where solves run: local (processes on this machine) or ray"),
    ray_address: str = typer.Option(None, help="with --backend ray: the cluster to join (host:port, auto); "
                                    "default a local Ray ($RAY_ADDRESS if set)"),
    request_processes: int = typer.Option(2, help="processes that validate bodies, simulate and render, off the server's loop"),
    queue_size: int = typer.Option(16, help="plans that may wait for a solve process; beyond it, 429"),
    token_file: Path = typer.Option(None, help="file holding the bearer token (else $MOSOS_API_TOKEN)"),
    insecure: bool = typer.Option(False, help="allow binding a non-loopback address without a token"),
    max_body_bytes: int = typer.Option(16 * 2**20, help="largest request body, bytes"),
    max_nodes: int = typer.Option(5000, help="most nodes a profile may have"),
    max_time_limit: float = typer.Option(120.0, help="longest solver time limit a request may ask for, seconds"),
    default_time_limit: float = typer.Option(30.0, help="solver time limit when a request gives none, seconds"),
    max_solver_workers: int = typer.Option(None, help="most solver threads per solve (default: half the cores, at most 4)"),
    max_wait: float = typer.Option(60.0, help="longest a POST may wait for its plan before answering 202, seconds"),
    max_search_time: float = typer.Option(600.0, help="longest time limit of a whole max-batch search, seconds"),
    plugin: list[str] = typer.Option([], "--plugin", help="module or .py file to import in every process (extra strategies)"),
    log_level: str = typer.Option("info", help="uvicorn log level"),
) -> None:
    """Serve plans over HTTP: POST /v1/plans with a profile and a budget; OpenAPI at /docs."""
    try:
        import fastapi_swagger  # noqa: F401  (Swagger UI's files for /docs)
        import uvicorn

        from api.settings import Settings, is_loopback, read_token
    except ImportError as error:
        raise ServeError(f"the service needs the api extra: pip install 'mosos[api]' ({error})") from None
    try:
        token = read_token(token_file)
    except OSError as error:
        raise ServeError(f"cannot read the token file {token_file}: {error.strerror}") from None
    except ValueError as error:
        raise ServeError(f"unusable token: {error}") from None
    if backend not in ("local", "ray"):
        raise ServeError(f"--backend must be local or ray, not {backend!r}")
    if ray_address is not None and backend != "ray":
        raise ServeError("--ray-address needs --backend ray")
    if backend == "ray":
        from cluster.runtime import import_ray

        import_ray("mosos serve --backend ray")
    if not is_loopback(host) and token is None and not insecure:
        raise ServeError(
            f"refusing to bind {host} without a token: set MOSOS_API_TOKEN or --token-file, "
            "or pass --insecure if the network is trusted"
        )
    values = dict(
        host=host, port=port, solve_processes=workers, backend=backend, ray_address=ray_address, request_processes=request_processes, queue_size=queue_size, token=token, insecure=insecure,
        max_body_bytes=max_body_bytes, max_nodes=max_nodes, max_time_limit_s=max_time_limit,
        default_time_limit_s=default_time_limit, max_wait_s=max_wait, max_search_time_s=max_search_time,
        plugins=list(plugin),
    )
    if db is not None:
        values["db_path"] = db
    if max_solver_workers is not None:
        values["max_solver_workers"] = max_solver_workers
    from pydantic import ValidationError

    from planner.validation import issues_from_validation_error

    try:
        settings = Settings(**values)
    except ValidationError as error:
        issues = "; ".join(str(issue) for issue in issues_from_validation_error(error))
        raise ServeError(f"bad setting: {issues}") from None
    from api.app import create_app
    from api.ownership import OwnedStore

    address = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    # Before anything starts: a store another live server holds, or a path SQLite cannot use, is refused here
    # with the reason (exit 2), never after recovery has touched the other server's plans.
    store_path = Path(settings.db_path)
    new_store = not store_path.exists()
    owned = OwnedStore.open(settings, address)
    try:
        _check_address_free(host, port, address)
        application = create_app(settings, owned)  # imports the plugins: a PluginError says which one failed, and how
    except BaseException:
        owned.close()
        if new_store:  # a start refused before serving leaves no empty store (nor its lock) behind
            from api.ownership import lock_path

            for leftover in (store_path, lock_path(store_path), store_path.with_name(store_path.name + "-wal"),
                             store_path.with_name(store_path.name + "-shm")):
                leftover.unlink(missing_ok=True)
        raise
    solves = f"{workers} solve process(es)" if backend == "local" else (
        f"{workers} solves at once on Ray ({ray_address or 'local'})")
    error_console.print(
        f"mosos serve: {address}  store {owned.store.path}  {solves}"
        f"{'  bearer token required' if token else ''}",
        highlight=False,
    )
    server = uvicorn.Server(uvicorn.Config(application, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=5))
    application.state.http_server = server  # requests waiting on a solve see the shutdown and answer 503 at once
    server.run()


def _check_address_free(host: str, port: int, address: str) -> None:
    """A port another program listens on is refused before the solve processes start (uvicorn would say so only
    after them). The probe binds as uvicorn does (SO_REUSEADDR); other bind errors are left to uvicorn's message."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise ServeError(f"cannot listen on {address}: the port is in use (another server?); choose another "
                                 "--port") from None
