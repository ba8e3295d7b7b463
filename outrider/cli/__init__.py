"""The `outrider` command line: the parser, the table of subcommands and their error
handling. Each subcommand group lives in its own module of this package."""

from __future__ import annotations

import argparse
import sys

from outrider.cli import bench, cluster, demo, generate, keys, roles, status

EXAMPLES = """examples:
  outrider serve &                      # router + target + draft on this machine
  outrider generate "def fibonacci(n):"  # through the router (127.0.0.1:50051)
  outrider generate --local "def fibonacci(n):"
  outrider generate --local --gamma 0 --max-tokens 32 --json "import os"
  outrider generate --local --temperature 0.7 --top-p 0.95 --seed 1 --stats "class Stack:"
  outrider demo
"""

class DefaultsShown(argparse.RawDescriptionHelpFormatter):
    """Every flag's help ends with its default, unless the help already says it: one with
    none says `(default: None)`, as vLLM's help does, and a required one says so."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text or not action.option_strings or default is argparse.SUPPRESS:
            return text
        if action.required:
            return f"{text} (required)"
        if default is None or default in ([], ""):
            return f"{text} (default: None)"
        shown = {True: "on", False: "off"}.get(default, default) \
            if isinstance(default, bool) else default
        return f"{text} (default: {str(shown).replace('%', '%%')})"


SUBCOMMANDS = {  # name: (its flags, what runs it, add_parser's options)
    "generate": (generate.generate_flags, generate.cmd_generate,
                 dict(help="generate text (streams it)", epilog=EXAMPLES)),
    "draft-worker": (roles.role_flags("outrider.draft_worker.main"), roles.cmd_draft_worker,
                     dict(help="run one draft replica (gRPC server)")),
    "target-worker": (roles.role_flags("outrider.target_worker.main"), roles.cmd_target_worker,
                      dict(help="run one target replica (gRPC server)")),
    "router": (roles.role_flags("outrider.router.main"), roles.cmd_router,
               dict(help="run the public gRPC router")),
    "serve": (roles.serve_flags, roles.cmd_serve,
              dict(help="router + target + draft worker(s) on this machine")),
    "keys": (keys.keys_flags, keys.cmd_keys,
             dict(help="create an API key in the shared store (Redis)")),
    "up": (cluster.up_flags, cluster.cmd_up,
           dict(help="bring a Ray cluster up from a spec (starts a local Ray when none is "
                     "running)", epilog=cluster.CLUSTER_EXAMPLES)),
    "down": (cluster.down_flags, cluster.cmd_down,
             dict(help="drain and remove everything `up` started")),
    "status": (status.status_flags, status.cmd_status,
               dict(help="the cluster's replicas (node, device, heat, tokens/s) or a "
                         "router's, with acceptance")),
    "bench": (bench.bench_flags, bench.cmd_bench,
              dict(help="serving benchmark: speculation off / fixed γ / auto over 1-32 "
                        "streams (JSON + plots)")),
    "demo": (demo.demo_flags, demo.cmd_demo,
             dict(help="stream a generation from the shipped demo pair")),
}

# the extra of pyproject.toml that installs what each subcommand imports
EXTRA_OF = {"draft-worker": "worker", "target-worker": "worker", "router": "router",
            "keys": "router", "up": "cluster", "down": "cluster", "bench": "bench"}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `outrider` parser. With `command`, only that subcommand gets its flags: the
    roles' come from their modules (outrider.router.main, ...), and `outrider router` need
    not import the target's (torch)."""
    parser = argparse.ArgumentParser(
        prog="outrider", description="Distributed speculative-decoding LLM serving.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add_flags, func, options) in SUBCOMMANDS.items():
        subparser = sub.add_parser(name, formatter_class=DefaultsShown, **options)
        if command is None or command == name:
            add_flags(subparser)
        subparser.set_defaults(func=func)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = _subcommand(argv)
    try:
        args = build_parser(command).parse_args(argv)
    except ModuleNotFoundError as exc:  # a subcommand's flags import what its extra installs
        if not _is_third_party(exc):
            raise
        print(f"outrider: error: {_missing_package(exc, command)}", file=sys.stderr)
        return 1
    try:
        if getattr(args, "cpus", None):
            from outrider.cpus import pin_cpus

            pin_cpus(args.cpus)
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if args.debug:
            raise
        message = (_missing_package(exc, command) if _is_third_party(exc)
                   else _one_line(exc))
        print(f"outrider: error: {message}", file=sys.stderr)
        return 1


def _subcommand(argv: list[str]) -> str:
    """The subcommand argv names ('' for none): `outrider`'s own options take no value, so
    it is the first word that is not an option."""
    return next((arg for arg in argv if not arg.startswith("-")), "")


def _is_third_party(exc: Exception) -> bool:
    """A package an extra installs is missing (not a module of Outrider's own)."""
    return isinstance(exc, ModuleNotFoundError) and not (exc.name or "outrider").startswith(
        "outrider")


def _missing_package(exc: ModuleNotFoundError, command: str) -> str:
    extra = EXTRA_OF.get(command, "all")
    return (f"`outrider {command}` needs the {exc.name!r} package, which this install "
            f"lacks: pip install 'outrider[{extra}]' (on a CPU machine, torch's CPU build "
            "first)")


def _one_line(exc: Exception) -> str:
    import grpc

    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)
