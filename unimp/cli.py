"""The ``unimp`` command: ``info`` (and, as they land, ``compare`` and ``explain``)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import unimp
from unimp import registry


class UsageError(Exception):
    """A bad argument: printed as one line, exit code 2."""


def _info(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    for name in registry.list_backends():
        info = registry.backend_info(name)
        installed = name in registry.available_backends()
        versions = {k: v for k, v in registry.framework_versions(name).items() if v}
        row: dict[str, Any] = {
            "backend": name,
            "aliases": list(info.aliases),
            "installed": installed,
            "versions": versions,
            "install": f'pip install "unimp[{info.extra}]"',
            "devices": [],
        }
        if installed and not args.no_devices:
            try:
                module = registry.get_backend(name)
                row["devices"] = module.device_info()
            except Exception as e:  # a broken framework install must not hide the others
                row["error"] = f"{type(e).__name__}: {e}"
        rows.append(row)
    if args.json:
        print(json.dumps({"unimp": unimp.__version__, "backends": rows}, indent=2))
        return 0
    print(f"unimp {unimp.__version__}")
    for row in rows:
        if row["installed"]:
            versions = ", ".join(f"{k} {v}" for k, v in row["versions"].items())
            print(f"  {row['backend']:<11} installed   {versions}")
        else:
            print(f"  {row['backend']:<11} not installed   ({row['install']})")
        for dev in row["devices"]:
            halves = ", ".join(d for d in ("float16", "bfloat16") if dev.get(d)) or "none"
            print(
                f"      {dev['device']:<22} half dtypes: {halves:<18} recommended: {dev.get('recommended')}"
            )
        if "error" in row:
            print(f"      cannot load: {row['error']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="unimp",
        description="One mixed-precision recipe for PyTorch, TensorFlow/Keras and JAX.",
    )
    parser.add_argument("--version", action="version", version=f"unimp {unimp.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    info = sub.add_parser("info", help="installed frameworks, devices and their half dtypes")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    info.add_argument(
        "--no-devices", action="store_true", help="do not import frameworks to list devices"
    )
    info.set_defaults(func=_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except (UsageError, ValueError, ImportError, FileNotFoundError) as e:
        print(f"unimp {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
