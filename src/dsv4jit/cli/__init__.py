"""``python -m dsv4jit`` / ``dsv4jit``: demo, bench, precompile, package, list, clean, info.

This package parses arguments and prints, a module per command with its subparser beside it
(`selection` picks variants and arches for those that take them); what the commands do lives in the
library (jit/ for the cache). Exit codes:

* 0: success;
* 1: the command ran and something it checked failed: a build, ``info --check``, a demo comparison,
  or another `DSV4JITError` (its message, no traceback);
* 2: the command cannot run as asked, and the message says what to change: an argument (argparse's
  own errors, and a `UsageError` raised here while parsing or validating one), a ``DSV4JIT_*``
  setting (`DSV4JITSettingError`), or a missing compiler (`DSV4JITToolchainError`);
* 3: a bug in dsv4jit: any other exception, a ValueError from inside the library included, with
  its traceback;
* 130, 143: interrupted by Ctrl-C (SIGINT) or stopped by SIGTERM (128 + the signal, the shell's
  convention): compiles under way are killed and publish nothing, and one line says so;
* 141: the reader of the output left before it ended (``| head``), as SIGPIPE would stop the process:
  nothing more is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import signal
import sys
import threading
import traceback

from .. import __version__, env
from ..errors import DSV4JITError, DSV4JITSettingError, DSV4JITToolchainError
from . import bench, clean, demo, info, listing, package, precompile
from .common import EXIT_BUG, EXIT_FAILED, EXIT_USAGE, Help, UsageError

#: The subcommands, in the order --help lists them.
COMMANDS = (demo, bench, precompile, package, listing, clean, info)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv4jit", description="dsv4jit kernel cache and tools", formatter_class=Help)
    p.add_argument("--version", action="version", version=f"dsv4jit {__version__}")
    sub = p.add_subparsers(dest="command", required=True,
                           parser_class=functools.partial(argparse.ArgumentParser, formatter_class=Help))
    for command in COMMANDS:
        command.add_parser(sub)
    return p


class Terminated(BaseException):
    """SIGTERM, raised in the main thread as Ctrl-C raises KeyboardInterrupt, so that builds under way
    are stopped and cleaned up (jit/batch.py) instead of the process vanishing without a word."""


def _terminated(signum, frame):
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    in_main_thread = threading.current_thread() is threading.main_thread()  # where handlers can be set
    previous = signal.signal(signal.SIGTERM, _terminated) if in_main_thread else None
    try:
        logging.basicConfig(level=env.log_level(), format="%(message)s", stream=sys.stderr)
        return args.func(args)
    except (UsageError, DSV4JITSettingError, DSV4JITToolchainError) as e:
        print(f"dsv4jit: {e}", file=sys.stderr)
        return EXIT_USAGE
    except DSV4JITError as e:
        print(str(e), file=sys.stderr)
        return EXIT_FAILED
    except BrokenPipeError:
        # Quietly, and with stdout on /dev/null: the interpreter's last flush would fail again.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except (KeyboardInterrupt, Terminated) as e:
        signum = signal.SIGINT if isinstance(e, KeyboardInterrupt) else signal.SIGTERM
        print(f"dsv4jit: {args.command} stopped by {signum.name}; compiles under way were killed and published "
              "nothing", file=sys.stderr)
        return 128 + signum
    except Exception:  # noqa: BLE001 - a bug: the traceback says where
        traceback.print_exc()
        print(f"dsv4jit: internal error (exit {EXIT_BUG}): a bug in dsv4jit {__version__}; please report it "
              "with the traceback above", file=sys.stderr)
        return EXIT_BUG
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous or signal.SIG_DFL)
