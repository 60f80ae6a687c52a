"""`clipserve`: serve (the default). Flags and CLIPSERVE_* variables map onto ServerConfig."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from clipserve import __version__
from clipserve.config import ServerConfig, iter_options, load_config
from clipserve.errors import StartupError
from clipserve.logs import configure_logging

SUBCOMMANDS = {
    "dedupe": "find exact and near-duplicate photos in folders (see 'clipserve dedupe --help')",
    "export": "export the image tower to ONNX, check it and compare it with PyTorch",
    "profile": "profile an ONNX Runtime backend: op-type time shares and CPU fallbacks",
    "doctor": "what the server would run on here with these flags, and why not otherwise",
}
PRINTING = frozenset({"export", "profile", "doctor"})  # reports a pipe may cut short


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    if command is None:
        description = (
            "Serve CLIP image embeddings over HTTP with dynamic batching. Every flag can also "
            "be set as CLIPSERVE_<FLAG> (e.g. CLIPSERVE_MAX_BATCH_SIZE); the flag wins. "
            "Subcommands: " + "; ".join(f"'clipserve {k}': {v}" for k, v in SUBCOMMANDS.items())
        )
    else:
        description = SUBCOMMANDS[command]
    parser = argparse.ArgumentParser(
        prog="clipserve" + (f" {command}" if command else ""), description=description
    )
    parser.add_argument("--version", action="version", version=f"clipserve {__version__}")
    for option in iter_options():
        shown = "none" if option.default is None else option.default
        helptext = f"{option.help} [env {option.env}; default {shown or '-'}]"
        if option.type is bool:
            parser.add_argument(
                option.flag,
                dest=option.name,
                default=None,
                action="store_const",
                const="true",
                help=helptext,
            )
            continue
        parser.add_argument(
            option.flag,
            dest=option.name,
            default=None,
            action="append" if option.type == tuple[str, ...] else "store",
            choices=option.choices,
            metavar=None if option.choices else option.name.split("_")[-1].upper(),
            help=helptext,
        )
    if command is not None:
        from clipserve.inference.commands import add_subcommand_flags

        add_subcommand_flags(parser, command)
    return parser


def serve(config: ServerConfig) -> int:
    from clipserve.http.connections import ensure_fd_limit

    # Before anything starts (front ends inherit the raised limit): a limit too low to hold
    # --max-connections fails here, in a second.
    ensure_fd_limit(config.http.max_connections)
    if config.http.workers > 1:
        from clipserve.engine.supervisor import supervise

        return supervise(config)

    from clipserve.http.heap import keep_body_pages

    keep_body_pages(config.limits.max_body_bytes_in_flight)  # front ends: engine/frontend.py

    from clipserve.http.access import check_access
    from clipserve.http.app import create_app
    from clipserve.http.listeners import bind_port, check_tls
    from clipserve.http.server import build_uvicorn_config, draining_server
    from clipserve.inference.runtime import build_runtime

    # A bad key file, certificate or taken gRPC port fails in a second, not after the model
    # has loaded.
    check_access(config.access)
    check_tls(config.http)
    if config.http.grpc_port:
        bind_port(config.http.host, config.http.grpc_port, "--grpc-port").close()
    # Built before uvicorn starts so a failure is one line and a non-zero exit, not a traceback
    # from inside the lifespan protocol.
    runtime = build_runtime(config)
    app = create_app(config, runtime=runtime)
    server = draining_server(build_uvicorn_config(app, config.http), config.http.shutdown_delay_s)
    server.run()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in PRINTING:
        return _main(argv)
    try:  # `clipserve doctor --json | head`: the reader may leave before the end
        code = _main(argv)
        sys.stdout.flush()  # what is buffered meets the closed pipe here, not at exit
        return code
    except BrokenPipeError:
        # Python would report the pipe again as it flushes stdout at exit: flush to nothing.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv: list[str]) -> int:
    if argv and argv[0] == "dedupe":
        # A client of the server, not a server: its own parser, none of the server's flags.
        from clipserve.dedupe.cli import main as dedupe_main

        return dedupe_main(argv[1:])
    command = argv.pop(0) if argv and argv[0] in SUBCOMMANDS else None
    args = vars(build_parser(command).parse_args(argv))
    try:
        config = load_config(args)
        configure_logging(config.http.log_level, fmt=config.http.log_format)
        if command == "export":
            from clipserve.inference.commands import export_main

            return export_main(config, args["output"])
        if command == "doctor":
            from clipserve.inference.doctor import doctor_main

            return doctor_main(config, args["json"])
        if command == "profile":
            from clipserve.inference.commands import profile_main

            return profile_main(config, args["batches"], args["batch_size"])
        return serve(config)
    except StartupError as e:
        print(f"clipserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
