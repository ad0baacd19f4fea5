"""``hybridkv`` command line: one sub-command per module in this package.

Every sub-command module exposes ``add_parser(subparsers)``, which registers its
parser and sets ``func`` to a callable ``(args) -> int``. Bad input never shows a
traceback: any :class:`hybridkv.errors.HybridKVError` becomes one line on stderr
and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from hybridkv.errors import HybridKVError

__all__ = ["main"]

#: sub-command name -> module that implements it (imported lazily; none imports torch at import)
COMMANDS: dict[str, str] = {
    "plan": "hybridkv.cli.plan",
    "simulate": "hybridkv.cli.simulate",
    "generate": "hybridkv.cli.generate",
}

EXIT_USAGE = 2


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line: ``hybridkv plan: error: ...``."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="hybridkv", description=__doc__.splitlines()[0])
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except HybridKVError as exc:
        print(f"hybridkv {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("hybridkv: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
