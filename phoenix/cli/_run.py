"""The one way a phoenix command line runs: a user's mistake ends as one line and exit status 2.

CLI side, control plane. Every command (``phx``, ``phx info``, ``phx bench [kv-trace |
loader]``, ``phx-port``, ``python -m phoenix.phxloader``) runs through :func:`run_main`:

* :class:`~phoenix.errors.PhxError`, ``ValueError``, ``OSError`` and ``ImportError`` (what
  a user can act on: a vendor name, a setting, a path, a missing extra) become
  ``<prog>: <message>`` on stderr, one line, exit status 2; ``KeyboardInterrupt`` becomes
  ``<prog>: interrupted``, exit status 130. Any other exception is a bug and keeps its
  traceback.
* ``--debug`` (anywhere before a ``--``; also ``PHX_DEBUG=1``) shows the traceback instead.
* :class:`ArgumentParser` reports a bad option in one line too (a missing one after the usage) (``<prog>: --size: 'abc' is
  not a size (examples: 64M, 1G, 4096) (see 'phx bench --help')``), and the option types
  below name the valid values, so that a typo is refused instead of measuring nothing.

What must stay true: nothing here imports phoenix's I/O stack or a vendor (``phx
--version`` and a parse error cost no more than argparse), and the message of an error is
the error's own text: the code that raises says what to fix, this module only formats it.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence

DIST_NAME = "phoenix-direct-storage"
EXIT_USAGE = 2  #: a user mistake: bad option, bad setting, bad path, unusable vendor
EXIT_INTERRUPTED = 130  #: Ctrl-C (128 + SIGINT)
DEBUG_FLAG = "--debug"
DEBUG_HELP = "on an error, show its traceback instead of one line (also PHX_DEBUG=1)"

# the prog of the innermost parser that parsed the command line (``phx bench kv-trace``),
# so that an error names the subcommand the user typed; set by ArgumentParser
_parsed_prog: list[str] = []


def version() -> str:
    """The installed distribution's version; ``phoenix.__version__`` in a source tree."""
    import importlib.metadata

    try:
        return importlib.metadata.version(DIST_NAME)
    except importlib.metadata.PackageNotFoundError:
        import phoenix

        return getattr(phoenix, "__version__", "unknown")


# ---- errors ------------------------------------------------------------------------------------

#: what a user can act on; anything else is a bug and keeps its traceback
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, ImportError)


def _user_errors() -> tuple[type[BaseException], ...]:
    try:
        from phoenix.errors import PhxError
    except ImportError:  # the package itself does not import (e.g. a clash): still one line
        return USER_ERRORS
    return (PhxError, *USER_ERRORS)


def describe(exc: BaseException) -> str:
    """One line for ``exc``: its message, the file name once (OSError), newlines folded."""
    if isinstance(exc, OSError) and exc.strerror:
        msg = exc.strerror
        names = [os.fsdecode(n) for n in (exc.filename, exc.filename2) if n is not None]
        names = [n for n in names if n not in msg]
        if names:
            msg = f"{' -> '.join(names)}: {msg}"
    else:
        msg = str(exc)
        if isinstance(exc, KeyError) and len(exc.args) == 1:
            msg = str(exc.args[0])  # not repr'd
    msg = " ".join(part.strip() for part in msg.splitlines() if part.strip())
    return msg or type(exc).__name__


def debug_requested(argv: Sequence[str] = ()) -> bool:
    """``--debug`` among our arguments (before a ``--``), or ``PHX_DEBUG`` set to a true value."""
    ours = list(argv)[: list(argv).index("--")] if "--" in argv else list(argv)
    env = os.environ.get("PHX_DEBUG", "").strip().lower()
    return DEBUG_FLAG in ours or env not in ("", "0", "false", "no", "off")


def take_debug(argv: Sequence[str]) -> tuple[list[str], bool]:
    """``argv`` without ``--debug`` (before a ``--``), and whether a traceback was asked for."""
    argv = list(argv)
    debug = debug_requested(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    return [a for a in argv[:cut] if a != DEBUG_FLAG] + argv[cut:], debug


def guarded(prog: str, fn: Callable[[], int | None], *, debug: bool = False) -> int:
    """Run ``fn()``; its exit status, or 2 with one line on stderr for a user's mistake."""
    _parsed_prog.clear()  # a parser of an earlier run in this process does not name this one
    try:
        rc = fn()
    except KeyboardInterrupt:
        if debug:
            raise
        _say(_prog(prog), "interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `phx ... | head`: the reader left; not an error of ours
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        return 141  # 128 + SIGPIPE, what a shell reports for a writer the pipe closed on
    except BaseException as exc:
        if debug or isinstance(exc, SystemExit) or not isinstance(exc, _user_errors()):
            raise
        _say(_prog(prog), describe(exc))
        return EXIT_USAGE
    return 0 if rc is None else int(rc)


def run_main(prog: str, main: Callable[[list[str]], int | None], argv: Sequence[str] | None = None) -> int:
    """What a console script's ``main(argv)`` calls: ``--debug`` taken out, then
    ``main(argv)`` :func:`guarded`. Errors name the innermost subcommand parsed."""
    argv, debug = take_debug(sys.argv[1:] if argv is None else argv)
    _parsed_prog.clear()
    try:
        return guarded(prog, lambda: main(argv), debug=debug)
    finally:  # an in-process caller (a test, a wrapper) must not find this command's name later
        _parsed_prog.clear()


def _prog(default: str) -> str:
    return _parsed_prog[0] if _parsed_prog else default


def _say(prog: str, message: str) -> None:
    sys.stdout.flush()  # what was printed before the error stays above it
    print(f"{prog}: {message}", file=sys.stderr, flush=True)


def vendor_runtime(select_only: bool = False):
    """The runtime of the vendor ``PHX_VENDOR`` selects (``select_only``: its Selection, no
    runtime made), for a command that needs one: an unknown name lists the installed ones, and
    an explicitly named vendor that cannot serve says what to set instead. Called by every
    bench, so that a vendor typo is never ignored (even where only host memory is used)."""
    from phoenix import registry
    from phoenix.errors import VendorUnavailable

    try:
        return registry.select() if select_only else registry.get_runtime()
    except VendorUnavailable as exc:
        named = os.environ.get("PHX_VENDOR", "auto").strip()
        if named in ("", "auto"):
            raise
        raise VendorUnavailable(
            f"PHX_VENDOR={named}: {exc}; set PHX_VENDOR=auto (or host) to use what is usable "
            "here ('phx info' lists the vendors)"
        ) from exc


# ---- argparse ----------------------------------------------------------------------------------


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors (``<prog>: <message> (see '<prog> --help')``, exit 2);
    its subparsers are of this class too. Records the innermost parser's prog for
    :func:`run_main`. A value that starts with a minus and a digit (``--size -1G``,
    ``--threads -1,2``) is the option's value, refused by its type with what is valid,
    not an unknown option that leaves ``--size`` "expecting one argument" (no option of
    ours looks like a negative number)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str):
        # something missing (no command, no FILE): the usage shows what to give; a wrong
        # value: one line that names it
        usage = self.format_usage() if message.startswith("the following arguments are required") else ""
        message = message.removeprefix("argument ")
        self.exit(EXIT_USAGE, f"{usage}{self.prog}: {message} (see '{self.prog} --help')\n")

    def parse_known_args(self, args=None, namespace=None):
        ns, rest = super().parse_known_args(args, namespace)
        if not _parsed_prog:  # the innermost parser returns first
            _parsed_prog.append(self.prog)
        return ns, rest


_GIVEN = "_options_given"  # the namespace attribute where a parser's own options note themselves


class _SubcommandsAfterOptions(argparse._SubParsersAction):
    """The subcommands of a parser that has options of its own: an option given before the
    subcommand is the parent's, which does not run, so it is refused (it was ignored)."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = vars(namespace).pop(_GIVEN, [])
        if given and values:
            name, them, one = values[0], ", ".join(dict.fromkeys(given)), len(set(given)) == 1
            parser.error(
                f"{them} {'is an option' if one else 'are options'} of '{parser.prog}' itself: before the "
                f"subcommand '{name}' {'it is' if one else 'they are'} ignored; put the options of "
                f"'{parser.prog} {name}' after '{name}'"
            )
        super().__call__(parser, namespace, values, option_string)


def _noting(action: argparse.Action) -> None:
    """Make ``action`` note its option string in the namespace whenever the command line gives it."""
    base = type(action)

    def __call__(self, parser, namespace, values, option_string=None):
        vars(namespace).setdefault(_GIVEN, []).append(option_string)
        base.__call__(self, parser, namespace, values, option_string)

    action.__class__ = type(base.__name__, (base,), {"__call__": __call__})


def add_subcommands(parser: argparse.ArgumentParser, **kwargs):
    """``parser.add_subparsers(**kwargs)`` for a parser whose own options (all added before this
    call) mean nothing to its subcommands: ``phx bench --size 1G loader x`` is refused in one
    line instead of loading with --size ignored."""
    for action in parser._actions:
        if action.option_strings and not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            _noting(action)
    return parser.add_subparsers(action=_SubcommandsAfterOptions, **kwargs)


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """Show ``--debug`` in the help; :func:`take_debug` removes it before parsing, so that it
    works after any subcommand too."""
    parser.add_argument(DEBUG_FLAG, action="store_true", help=DEBUG_HELP)


SIZE_EXAMPLES = "examples: 64M, 1G, 4096"


def size(text: str) -> int:
    """An argparse type: bytes from ``4096``, ``64K``, ``16M``, ``2G``, ``1.5G``, ``64KiB``."""
    from phoenix.vendor import parse_size

    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"{text!r}: a size cannot be negative ({SIZE_EXAMPLES})")
    try:
        return parse_size(text)
    except (ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size ({SIZE_EXAMPLES})") from None


def positive_size(text: str) -> int:
    """:func:`size`, more than zero."""
    n = size(text)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the size must be more than 0 ({SIZE_EXAMPLES})")
    return n


def _whole(text: str, least: int) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < least:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least {least}")
    return n


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    return _whole(text, 1)


def nonnegative_int(text: str) -> int:
    """An argparse type: an integer of at least 0."""
    return _whole(text, 0)


#: settings whose values are sizes (K/M/G suffixes); the others are whole numbers
_SIZE_SETTINGS = ("chunk_size", "inflight", "bounce_pool_size")


def setting(name: str, what: str = "") -> Callable[[str], int]:
    """An argparse type for an option phoenix takes as its setting ``name`` (``threads``,
    ``chunk_size``, ``queue_depth``): refused when the command line is read, by the setting's
    own rule (:mod:`phoenix.settings`), the message naming the option, not
    ``phoenix.settings.override`` in the middle of a run. Used in :func:`comma_list`, every
    item of a list is checked before any runs. ``what`` says who takes the value (default:
    phoenix's ``name`` setting)."""

    def parse(text: str) -> int:
        n = positive_size(text) if name in _SIZE_SETTINGS else positive_int(text)
        from phoenix import settings

        token = "\0option"
        try:
            settings._validate({name: n}, token)
        except ValueError as exc:
            rule = str(exc).removeprefix(f"{token}: ").removeprefix(f"{name}={n} ")
            who = what or f"phoenix's {name} setting"
            raise argparse.ArgumentTypeError(f"{text!r}: {rule} ({who})") from None
        return n

    parse.__name__ = "size" if name in _SIZE_SETTINGS else "number"
    return parse


def nonnegative_float(text: str) -> float:
    """An argparse type: a number of at least 0."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not x >= 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a number of at least 0")
    return x


def _can_create_in(directory: str) -> OSError | None:
    """Whether a file can be made in ``directory``, found by making one (and removing it):
    mode bits say nothing for root, nor for /proc, a read-only mount or a full quota."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".phx-probe-", dir=directory)
    except OSError as exc:
        return exc
    os.close(fd)
    os.unlink(probe)
    return None


def _why(exc: OSError) -> str:
    return "read-only" if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS) else f"not writable ({exc.strerror})"


def output_file(text: str) -> str:
    """An argparse type: a file a command writes (``--json``, ``--plot``, ``--out``), checked when
    the command line is read, so that a run is not lost at its end for a bad destination: not a
    directory, in a directory that exists and where a file can be made (tried: the file may be
    replaced through a temporary one beside it), and, if it exists, writable (opened for writing,
    nothing written)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty: give a file path")
    path = os.path.abspath(text)
    parent = os.path.dirname(path)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text} is a directory: give a file path (e.g. {os.path.join(text, 'out')})")
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{text}: its directory {parent} does not exist; create it or give another")
    problem = _can_create_in(parent)
    if problem is not None:
        raise argparse.ArgumentTypeError(
            f"{text}: the directory {parent} is {_why(problem)}; give a file in a writable directory"
        )
    if os.path.isfile(path):
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND))  # no O_TRUNC: the file is not changed
        except OSError as exc:
            raise argparse.ArgumentTypeError(f"{text} exists and is {_why(exc)}; give a file you may write") from None
    return text


output_file.__name__ = "file"


def plot_file(text: str) -> str:
    """:func:`output_file` for a PNG (``--plot``), refused at once where matplotlib is missing:
    not after the run with a note and exit status 0."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError(
            "needs matplotlib, which is not installed: pip install 'phoenix-direct-storage[bench]' "
            "(or leave the option out)"
        )
    return output_file(text)


plot_file.__name__ = "file"


def output_dir(text: str) -> str:
    """An argparse type: a directory a command writes files into (``--report-dir``), made if
    missing, checked when the command line is read: not a file, and it (or, where it is still to
    be made, its nearest existing parent) a directory where a file can be made (tried, not
    judged by its mode)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty: give a directory path")
    path = os.path.abspath(text)
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        where = "is a file" if probe == path else f"would be made under {probe}, which is a file"
        raise argparse.ArgumentTypeError(f"{text} {where}: give a directory path")
    problem = _can_create_in(probe)
    if problem is not None:
        what = "is" if probe == path else f"would be made under {probe}, which is"
        raise argparse.ArgumentTypeError(f"{text} {what} {_why(problem)}; give a writable directory")
    return text


output_dir.__name__ = "directory"


def comma_list(choices: Iterable[str] | None = None, item: Callable[[str], object] = str) -> Callable[[str], list]:
    """An argparse type for ``a,b,c``: each item converted by ``item`` and, with ``choices``,
    one of them (else the error lists the valid values); at least one item."""
    valid = list(choices) if choices is not None else None

    def parse(text: str) -> list:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(
                f"{text!r}: give at least one value" + (f" of {', '.join(valid)}" if valid else "")
            )
        if valid is not None:
            bad = [p for p in parts if p not in valid]
            if bad:
                raise argparse.ArgumentTypeError(
                    f"{', '.join(map(repr, bad))} {'is' if len(bad) == 1 else 'are'} not one of {', '.join(valid)}"
                )
        return [item(p) for p in parts]

    parse.__name__ = "list"
    return parse
