"""The ``hladsl`` command. Spec problems print ``file:line:col``, the line and a
caret, and exit 1; no Python traceback ever reaches the user: a failure inside hladsl
itself says so in one line and exits 3 (``HLADSL_TRACEBACK=1`` shows the traceback)."""
from __future__ import annotations

import argparse
import os
import sys

from hladsl.emit import EMIT_KINDS, check_report, emit
from hladsl.errors import SettingError, SpecError
from hladsl.version import __version__

INTERNAL_ERROR = 3   # exit status of a failure inside hladsl (argparse takes 2 for usage errors)


def _positive_int(text) -> int:
    """--chunk (an argparse type) and each --size value: an integer above 0."""
    value = int(text) if str(text).isdigit() else 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'")
    return value


def _sizes(items: list[str]) -> dict[str, int]:
    out = {}
    for dim, value in _parse_params(items).items():
        try:
            out[dim] = _positive_int(value)
        except argparse.ArgumentTypeError as exc:
            raise SettingError(f"--size {dim}: {exc}") from None
    return out


def _parse_params(items: list[str]) -> dict:
    params = {}
    for item in items:
        if "=" not in item:
            raise SpecError(f"-p expects key=value, got '{item}'")
        key, value = item.split("=", 1)
        text = value.strip().lower()
        if text in ("true", "false"):
            params[key.strip()] = text == "true"
        else:
            try:
                params[key.strip()] = int(text)
            except ValueError:
                try:
                    params[key.strip()] = float(text)
                except ValueError:
                    raise SpecError(f"-p {key}: '{value}' is not a number or true/false") from None
    return params


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hladsl", description="Compile state-algebra specs (.hla) of causal sequence mixers.")
    parser.add_argument("--version", action="version", version=f"hladsl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    comp = sub.add_parser("compile", help="derive and print (or write) what a spec compiles to")
    comp.add_argument("spec", help="path to a .hla file or a shipped spec name (e.g. hla2)")
    comp.add_argument("--emit", default=None, metavar="KIND",
                      help="what to print: " + ", ".join(EMIT_KINDS) + "; default: write the "
                           "Triton module (to -o DIR, default .) and say where")
    comp.add_argument("-o", "--output-dir", default=None, help="directory to write generated code to")
    comp.add_argument("-p", "--param", action="append", default=[], metavar="KEY=VALUE",
                      help="set a spec parameter, e.g. -p p=3")
    comp.add_argument("--size", action="append", default=[], metavar="DIM=N",
                      help="a dim's size for --emit cost (default 64), e.g. --size d=128")
    comp.add_argument("--chunk", type=_positive_int, default=64, help="chunk size for --emit cost")
    chk = sub.add_parser("check", help="verify a spec: syntax, names, indices, associativity, "
                                       "grading, VJP")
    chk.add_argument("spec")
    chk.add_argument("-p", "--param", action="append", default=[], metavar="KEY=VALUE")
    from hladsl import bench
    bench.add_arguments(sub.add_parser("bench", help="time specs beside installed baselines "
                                                     "(fla, SDPA, retention): table, JSON, plot"))
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = _build_parser().parse_args(argv)   # (imports the launch layer: HLADSL_LAUNCH)
        if args.command == "bench":
            from hladsl import bench
            return bench.run(args)
        params = _parse_params(args.param)
        if args.command == "check":
            print(check_report(args.spec, **params))
            return 0
        sizes = _sizes(args.size)
        print(emit(args.spec, args.emit, params, args.output_dir, sizes, args.chunk), end="")
        return 0
    except SpecError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except (OSError, SettingError) as exc:
        print(f"hladsl: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:   # what code generation cannot do for this spec (its limits raise ValueError)
        print(f"hladsl: cannot generate this: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:   # not the input's fault: a bug to report, in one line
        if os.environ.get("HLADSL_TRACEBACK", "0").strip().lower() not in ("", "0", "false", "no"):
            raise
        first = (str(exc).splitlines() or [""])[0]
        print(f"hladsl: internal error ({type(exc).__name__}: {first}): a bug in hladsl, please "
              "report it with the command (HLADSL_TRACEBACK=1 shows the traceback)", file=sys.stderr)
        return INTERNAL_ERROR


if __name__ == "__main__":
    sys.exit(main())
