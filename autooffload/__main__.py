"""The launcher: ``python -m autooffload [options] script.py args`` runs a script with it enabled.

Like ``python script.py`` (or ``python -m module``): the script runs as ``__main__`` with the
``sys.argv`` it expects and its folder as ``sys.path[0]``; its exit code passes through, and a
script that raises shows the traceback python would show, from the script's own frames on (the
launcher's and runpy's are left out). Options become ``AUTOOFFLOAD_*`` env vars, so subprocesses
see them too.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import runpy
import sys
import types
import zipfile
from collections.abc import Callable
from types import TracebackType

import autooffload
from autooffload.errors import SettingsError
from autooffload.settings import LOG_LEVELS, env_vars

USAGE = (
    "python -m autooffload [options] [--] script.py [args ...]\n"
    "       python -m autooffload [options] -m module [args ...]"
)

# Options that take a value; everything else before the script is a flag.
_VALUE_OPTIONS = ("--budget", "--log")


def _parser() -> argparse.ArgumentParser:
    rows = env_vars()
    width = max(len(env) for env, _, _ in rows)
    env_help = "\n".join(
        f"  {env:<{width}}  {doc} (default: {default})" for env, default, doc in rows
    )
    parser = argparse.ArgumentParser(
        prog="python -m autooffload",
        usage=USAGE,
        description=(
            "Run a PyTorch / Hugging Face training script with autooffload enabled, as if the"
            " script began with `import autooffload; autooffload.enable()`. Everything after the"
            " script name (or after -m module) is passed to it untouched."
        ),
        epilog=(
            "environment variables (options above set them; kwargs of enable() override them):\n"
            f"{env_help}\n\n"
            "Sizes accept 12GiB, 12GB (10**9), 12000MB, bytes, or a fraction such as 0.5 of the"
            " device.\nAUTOOFFLOAD=0 runs the script with nothing enabled."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument(
        "--budget",
        metavar="SIZE",
        help="device memory budget, e.g. 12GiB or 0.5 (sets AUTOOFFLOAD_BUDGET)",
    )
    parser.add_argument(
        "--no-offload",
        action="store_true",
        help="keep weights on the device; manage activations and masking only"
        " (sets AUTOOFFLOAD_OFFLOAD=0)",
    )
    parser.add_argument(
        "--force-attach",
        action="store_true",
        help="attach every trained model moved to the device, however small (the CPU"
        " simulation's quick start; sets AUTOOFFLOAD_FORCE_ATTACH=1)",
    )
    parser.add_argument(
        "--no-mask",
        action="store_true",
        help="leave labels as the script builds them (sets AUTOOFFLOAD_MASK=0)",
    )
    parser.add_argument(
        "--print-plan",
        action="store_true",
        help="print the plan summary to stdout and exit (sets AUTOOFFLOAD_PRINT_PLAN=1)",
    )
    parser.add_argument(
        "--log",
        metavar="LEVEL",
        choices=LOG_LEVELS,
        help=f"logger level: {', '.join(LOG_LEVELS)} (sets AUTOOFFLOAD_LOG)",
    )
    parser.add_argument(
        "-m",
        dest="module",
        metavar="MODULE",
        help="run a library module as a script, like python -m",
    )
    return parser


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split argv into (launcher options, [script or -m module] + its args)."""
    index = 0
    while index < len(argv):
        token = argv[index]
        if token == "--":
            return argv[:index], argv[index + 1 :]
        if token == "-m":
            return argv[: index + 2], argv[index + 2 :]
        if token.startswith("-m") and not token.startswith("--"):
            return argv[: index + 1], argv[index + 1 :]
        if not token.startswith("-") or token == "-":
            return argv[:index], argv[index:]
        index += 2 if token in _VALUE_OPTIONS else 1
    return argv, []


def main(argv: list[str] | None = None) -> None:
    """Parse the launcher options, enable autooffload, and run the target as ``__main__``."""
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    own, rest = _split(argv)
    options = parser.parse_args(own)
    if options.module is None and not rest:
        parser.error("a script (or -m module) to run is required")

    flags = {
        "AUTOOFFLOAD_BUDGET": options.budget,
        "AUTOOFFLOAD_OFFLOAD": "0" if options.no_offload else None,
        "AUTOOFFLOAD_FORCE_ATTACH": "1" if options.force_attach else None,
        "AUTOOFFLOAD_MASK": "0" if options.no_mask else None,
        "AUTOOFFLOAD_PRINT_PLAN": "1" if options.print_plan else None,
        "AUTOOFFLOAD_LOG": options.log,
    }
    os.environ.update({env: value for env, value in flags.items() if value is not None})
    try:
        autooffload.enable()
    except SettingsError as error:
        parser.exit(2, f"python -m autooffload: error: {error}\n")

    if options.module is not None:
        problem = _module_problem(options.module)
        if problem is not None:
            parser.exit(1, f"{sys.executable}: {problem}\n")
        sys.argv = [options.module, *rest]
        _run_as_python_would(
            lambda: runpy.run_module(options.module, run_name="__main__", alter_sys=True)
        )
    else:
        script, *args = rest
        if not os.path.isfile(script):
            path = os.path.abspath(script)
            missing = f"can't open file {path!r}: [Errno 2] No such file or directory"
            parser.exit(2, f"{sys.executable}: {missing}\n")
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        _run_as_python_would(lambda: _run_script(script))


def _run_script(script: str) -> None:
    """Run a file as ``python script.py`` does: as ``__main__``, with the absolute path as its
    ``__file__`` and in its tracebacks, ``sys.argv[0]`` as given. Folders and zip files with a
    ``__main__.py`` go through runpy."""
    path = os.path.abspath(script)
    if zipfile.is_zipfile(path):
        runpy.run_path(script, run_name="__main__")
        return
    with open(path, "rb") as source:
        code = compile(source.read(), path, "exec", dont_inherit=True)
    module = types.ModuleType("__main__")
    module.__dict__.update(
        __file__=path, __cached__=None, __loader__=None, __package__=None, __spec__=None
    )
    launcher = sys.modules["__main__"]
    sys.modules["__main__"] = module  # pickling by reference finds the script's classes
    try:
        exec(code, module.__dict__)
    finally:
        sys.modules["__main__"] = launcher


def _module_problem(name: str) -> str | None:
    """Why ``python -m name`` could not start, in python's words; None if it can."""
    try:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:
            if importlib.util.find_spec(f"{name}.__main__") is None:
                return (
                    f"No module named {name}.__main__; '{name}' is a package and cannot be"
                    " directly executed"
                )
    except (ImportError, ValueError) as error:
        return f"Error while finding module specification for {name!r} ({error!r})"
    return None if spec is not None else f"No module named {name}"


def _run_as_python_would(run: Callable[[], object]) -> None:
    """Run the target; an exception out of it is printed from the target's first frame on,
    through ``sys.excepthook`` as python does, and the process exits with status 1."""
    try:
        run()
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as error:
        error = error.with_traceback(_without_launcher_frames(error.__traceback__))
        sys.excepthook(type(error), error, error.__traceback__)
        sys.exit(1)


def _without_launcher_frames(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` from its first frame outside this module and runpy."""
    while tb is not None and (
        tb.tb_frame.f_globals is globals() or tb.tb_frame.f_globals.get("__name__") == "runpy"
    ):
        tb = tb.tb_next
    return tb


if __name__ == "__main__":
    main()
