"""``hybridkv`` command line: one sub-command per module in this package.

Every sub-command module exposes ``add_parser(subparsers)``, which registers its
parser and sets ``func`` to a callable ``(args) -> int``. Sub-commands print their
results with :func:`write_out`.

Conventions:

* bad input (an option, a file, a config, a full disk) is one line on stderr,
  ``hybridkv COMMAND: error: ...``, and exit code 2; never a traceback. Library
  errors (:class:`hybridkv.errors.HybridKVError`) arrive here already worded;
  options are checked by the types of :mod:`hybridkv.cli.options` before any work;
* ``hybridkv`` alone prints the usage and the commands on stdout and exits 2 (no
  command ran: a usage error, like a missing argument); ``hybridkv --help`` prints
  the same and exits 0; ``hybridkv --version`` prints the version;
* results go to stdout; a closed pipe (``| head``) ends quietly with exit 0.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys

from hybridkv import __version__
from hybridkv.errors import HybridKVError

__all__ = ["main", "build_parser", "write_out", "EXIT_USAGE"]

#: sub-command name -> module that implements it (imported lazily; none imports torch at import)
COMMANDS: dict[str, str] = {
    "plan": "hybridkv.cli.plan",
    "simulate": "hybridkv.cli.simulate",
    "generate": "hybridkv.cli.generate",
    "serve": "hybridkv.cli.serve",
    "route": "hybridkv.cli.route",
    "ray-serve": "hybridkv.cli.ray_serve",
}

EXIT_USAGE = 2


class OutputError(HybridKVError):
    """Writing the results to stdout failed (a full disk, an I/O error)."""


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line: ``hybridkv plan: error: ...``."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="hybridkv",
        description=f"hybridkv {__version__}: plan, simulate and run a hybrid paged KV cache "
        "(full, sliding-window and chunked local attention layers).",
        epilog="Run 'hybridkv COMMAND --help' for a command's options. Bad input: one line on stderr, exit 2.",
    )
    parser.add_argument("--version", action="version", version=f"hybridkv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_OneLineParser)
    sub.required = True
    for name, module_name in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:  # a sub-command not built yet
            if exc.name != module_name:
                raise
            continue
        module.add_parser(sub)
    return parser


@contextlib.contextmanager
def _output_errors():
    """A failed write to stdout (full disk, ...) as :class:`OutputError`; a closed pipe as is."""
    try:
        yield
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise OutputError(f"cannot write the output: {exc.strerror or exc}") from None


def write_out(text: str, end: str = "\n", flush: bool = False) -> None:
    """``text`` and ``end`` on stdout (``flush``: now, for streamed text); a failed write
    raises :class:`OutputError`."""
    with _output_errors():
        sys.stdout.write(text + end)
        if flush:
            sys.stdout.flush()


def _flush_out() -> None:
    with _output_errors():
        sys.stdout.flush()


def _drop_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's last flush cannot fail again."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (a test's capture)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _fail(command: str, message: str) -> int:
    prog = f"hybridkv {command}" if command else "hybridkv"
    print(f"{prog}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _run(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    if not argv:
        parser.print_help()
        return EXIT_USAGE
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit as exc:  # --help, --version (0) or a usage error (2, already printed)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if extra:
        return _fail(args.command, f"unrecognized arguments: {' '.join(extra)}")
    return int(args.func(args) or 0)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if a in COMMANDS), "")
    try:
        code = _run(parser, argv)
        _flush_out()
        return code
    except OutputError as exc:
        _drop_stdout()
        return _fail(command, str(exc))
    except HybridKVError as exc:
        return _fail(command, str(exc))
    except KeyboardInterrupt:
        print("hybridkv: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _drop_stdout()
        return 0
    except OSError as exc:  # a file the command could not read or write, named when known
        where = f"{exc.filename}: " if exc.filename else ""
        return _fail(command, f"{where}{exc.strerror or exc}")
    except MemoryError:
        return _fail(command, "out of memory; try smaller sizes")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
