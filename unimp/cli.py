"""The ``unimp`` command: ``info``, ``compare``, ``trace``, ``audit`` and ``explain``."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import warnings
from collections.abc import Sequence
from typing import Any, NoReturn

import unimp
from unimp import registry
from unimp._stderr import native_stderr_filtered as _native_stderr_filtered
from unimp.compare.commands import UsageError, backends_arg
from unimp.dtypes import float8_line
from unimp.loss_scale import LossScaleError
from unimp.loss_scale.presets import PRESETS
from unimp.precision import describe_matmul_precision


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
                row["matmul_precision"] = module.current_matmul_precision()
                row["float8"] = float8_line(row["devices"], name)
            except Exception as e:  # a broken framework install must not hide the others
                row["error"] = f"{type(e).__name__}: {e}"
        rows.append(row)
    keras_row = _keras_info()
    if args.json:
        print(json.dumps({"unimp": unimp.__version__, "backends": rows, "keras": keras_row}, indent=2))
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
            if "matmul_precision" in row:
                text = describe_matmul_precision(row["backend"], row["matmul_precision"], dev["device"])
                print(f"      {'':<22} float32 matmul precision: {text}")
        if row["devices"]:
            print(f"      {float8_line(row['devices'], row['backend'])}")
        if "error" in row:
            print(f"      cannot load: {row['error']}")
    if keras_row["version"] is not None:
        print(
            f"  keras       {keras_row['version']} on {keras_row['engine']} (KERAS_BACKEND or "
            f"keras.json): backend=\"keras\" binds {keras_row['binds']}"
        )
    return 0


def _keras_info() -> dict[str, Any]:
    """Keras's version and the engine this process would run it on (read as Keras reads it,
    without importing Keras), and what ``backend="keras"`` binds there."""
    import importlib.metadata

    try:
        version = importlib.metadata.version("keras")
    except importlib.metadata.PackageNotFoundError:
        version = None
    engine = registry.keras_engine()
    binds = "unimp.backends.tensorflow" if engine == "tensorflow" else "unimp.keras"
    return {"version": version, "engine": engine, "binds": binds}


def _g(x: float | None, none: str = "none") -> str:
    return none if x is None else f"{x:g}"


#: ``explain --scalers`` prints one mark per step and simulates every native scaler step by step
MAX_EXPLAIN_STEPS = 10_000


def _explain(args: argparse.Namespace) -> int:
    from unimp.compare.explain import explain_recipe, scaler_sequence, scaler_table
    from unimp.recipe import get_recipe

    if args.block_format is not None:
        if args.recipe is not None or args.scalers or args.fp8:
            raise UsageError(
                "explain --block-format compares the block-scaled presets on their own: drop the "
                "recipe, --scalers and --fp8, or run them without --block-format"
            )
        return _explain_block_format(args)
    if args.values is not None:
        raise UsageError("--values goes with --block-format (e.g. --block-format all --values 449,3,0.001,0)")
    if args.fp8:
        if args.recipe is not None or args.scalers:
            raise UsageError(
                "explain --fp8 compares the float8 scaling presets on their own: drop the recipe "
                "and --scalers, or run them without --fp8"
            )
        return _explain_fp8(args)
    if args.recipe is None:
        raise UsageError("explain needs a recipe name (or --fp8, or --block-format PRESET[,PRESET...])")
    recipe = get_recipe(args.recipe)
    if not 1 <= args.steps <= MAX_EXPLAIN_STEPS:
        raise UsageError(
            f"--steps must be in [1, {MAX_EXPLAIN_STEPS}] (every step is printed), got {args.steps}"
        )
    if not 0 <= args.overflow_rate <= 1:
        raise UsageError(f"--overflow-rate must be in [0, 1], got {args.overflow_rate}")
    if args.growth_interval is not None and args.growth_interval < 1:
        raise UsageError(f"--growth-interval must be >= 1, got {args.growth_interval}")
    out: dict[str, Any] = {"recipe": recipe.to_dict(), "frameworks": dict(explain_recipe(recipe))}
    if args.scalers:
        if args.burst < 0:
            raise UsageError(f"--burst must be >= 0, got {args.burst}")
        flags = scaler_sequence(args.steps, args.overflow_rate, args.seed, args.burst)
        out["scalers"] = scaler_table(
            flags, growth_interval=args.growth_interval, recipe=(args.recipe, recipe.loss_scale)
        )
        out["scalers"]["flags"] = flags
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{args.recipe}: {recipe.describe()}")
    for framework, lines in explain_recipe(recipe):
        print(f"\n{framework}:")
        for line in lines:
            print(f"  - {line}")
    if args.scalers:
        table = out["scalers"]
        marks = "".join("." if f else "X" for f in flags)
        print(
            f"\nNative dynamic scalers on the same {args.steps} steps ('.' clean, 'X' overflow):\n  {marks}"
        )
        if args.growth_interval is not None:
            print(
                f"  (growth intervals shortened to {args.growth_interval}, flax {args.growth_interval + 1}, "
                f"for this demo: the frameworks' own 2000 would not show in {args.steps} steps)"
            )
        from tabulate import tabulate  # columns that stay aligned whatever a value's length

        rows = []
        for name, row in table["scalers"].items():
            cfg = row["config"]
            stop = "" if row["stops_at"] is None else f"step {row['stops_at']}"
            if cfg["kind"] != "dynamic":  # the recipe's own row: a static scale, or none
                rule = f"static {cfg['scale']:g}" if cfg["kind"] == "static" else "no loss scaling"
                rows.append([name, row["native"], rule, "", "", "", "", f"{row['scale'][-1]:g}", stop])
                continue
            rows.append([
                name, row["native"], f"{cfg['init_scale']:g}", cfg["growth_interval"],
                _g(cfg["min_scale"], "2**-126"), _g(cfg["max_scale"]), cfg.get("hysteresis", 1),
                f"{row['scale'][-1]:g}", stop,
            ])  # fmt: skip
        headers = ["scaler", "native", "init", "interval", "min", "max", "hysteresis", "final", "stops at"]
        text = tabulate(rows, headers, tablefmt="simple", disable_numparse=True)
        print("\n".join("  " + line for line in text.splitlines()))
        print("Differences (scale index 0 is the initial scale):")
        for line in table["differences"]:
            print(f"  - {line}")
    return 0


def _explain_block_format(args: argparse.Namespace) -> int:
    from unimp.compare.explain_blockscale import (
        block_format_table,
        parse_block_values,
        parse_presets,
    )

    try:
        presets = parse_presets(args.block_format)
        blocks = None if args.values is None else {"--values": parse_block_values(args.values)}
    except ValueError as e:
        raise UsageError(str(e)) from None
    table = block_format_table(presets, blocks)
    if args.json:  # standard JSON: non-finite numbers null, named in "nonfinite"
        from unimp.compare.report import strict_json

        print(json.dumps(strict_json(table), indent=2, allow_nan=False))
        return 0
    from tabulate import tabulate

    print(
        "Block-scaled presets on one block each (values repeated to fill every preset's block; "
        f"'*' where a value differs from {presets[0]}):"
    )
    for block in table["blocks"]:
        n = len(block["values"])
        rows = [["input", ""] + [f"{v:.4g}" for v in block["values"]]]
        for name in presets:
            row = block["presets"][name]
            cells = [f"{v:.4g}" + ("*" if d else "") for v, d in zip(row["values"], row["differs"], strict=True)]
            rows.append([name, f"{row['scale']:.4g}"] + cells)
        text = tabulate(rows, ["", "scale"] + [f"x{i + 1}" for i in range(n)], tablefmt="simple", disable_numparse=True)
        print(f"\nblock {block['name']!r}:")
        print("\n".join("  " + line for line in text.splitlines()))
        for line in block["differences"]:
            print(f"  - {line}")
    print("\nPresets:")
    for name, p in table["presets"].items():
        print(f"  - {name} ({p['implementation']}): {p['element']}, {p['scale']}; from {p['source']}")
        if p["notes"]:
            print(f"      {p['notes']}")
    return 0


def _explain_fp8(args: argparse.Namespace) -> int:
    from unimp.compare.explain_fp8 import DEFAULT_AMAXES, fp8_table, parse_amaxes

    try:
        amaxes = list(DEFAULT_AMAXES) if args.amaxes is None else parse_amaxes(args.amaxes)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not 1 <= args.history_len <= 1024:
        raise UsageError(f"--history-len must be in [1, 1024], got {args.history_len}")
    table = fp8_table(amaxes, args.history_len)
    if args.json:  # standard JSON, as report.json: non-finite numbers null, named in "nonfinite"
        from unimp.compare.report import strict_json

        print(json.dumps(strict_json(table), indent=2, allow_nan=False))
        return 0
    print(f"FP8 scale used at each step ({table['format']}, delayed presets with L={args.history_len}):")
    print("  " + f"{'step':<28}" + "".join(f"{i + 1:>10}" for i in range(len(amaxes))))
    print("  " + f"{'amax':<28}" + "".join(f"{a:>10.4g}" for a in amaxes))
    for name, row in table["presets"].items():
        print("  " + f"{name:<28}" + "".join(f"{s:>10.4g}" for s in row["scale"]))
    print("Rules:")
    for name, row in table["presets"].items():
        print(f"  - {name} ({row['native']}): {row['rule']}")
    print("Differences:")
    for line in table["differences"]:
        print(f"  - {line}")
    return 0


def _check_out_dir(out_dir: str, given: str) -> None:
    """Fails before any training when the report could not be written to ``out_dir``."""
    if os.path.exists(out_dir):
        if not os.path.isdir(out_dir):
            raise UsageError(f"--out {given!r} exists and is not a folder; pick another path")
        for name in ("report.json", "report.md", "report.png"):
            if os.path.isdir(os.path.join(out_dir, name)):
                raise UsageError(f"--out {given!r} holds a folder named {name}; pick another --out")
        probe = out_dir
    else:
        probe = os.path.dirname(out_dir)
        while probe and not os.path.exists(probe):
            probe = os.path.dirname(probe)
        if not os.path.isdir(probe):
            raise UsageError(f"--out {given!r} cannot be created: {probe!r} is not a folder")
    if not os.access(probe, os.W_OK):
        raise UsageError(f"--out {given!r} is not writable; pick another path")
    # os.access says yes for root under /proc and on read-only mounts: write a probe file for
    # real, and remove it and any folder made for it, so nothing is left behind
    missing = []
    path = out_dir
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    try:
        os.makedirs(out_dir, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=out_dir, prefix=".unimp-write-check-")
        os.close(fd)
        os.remove(name)
    except OSError as e:
        raise UsageError(
            f"--out {given!r} cannot be written ({e.strerror or e}); pick another path"
        ) from None
    finally:
        for folder in missing:  # deepest first
            with contextlib.suppress(OSError):
                os.rmdir(folder)


def _compare(args: argparse.Namespace) -> int:
    from unimp.compare.report import COLUMNS, RECIPE_COLUMNS, summary_rows, write_report
    from unimp.compare.run import (
        WARNING_SOURCE,
        CompareConfig,
        Interrupted,
        run_compare,
        run_recipes,
        validate,
        validate_recipes,
    )

    out_dir = os.path.abspath(args.out)
    _check_out_dir(out_dir, args.out)
    recipes = None
    if args.recipes is not None:
        if args.recipe is not None:
            raise UsageError("give --recipe NAME or --recipes A,B,C, not both")
        recipes = tuple(args.recipes.split(","))
    recipe = args.recipe or "mixed_float16"
    cfg = CompareConfig(
        recipe=recipe,
        backends=backends_arg(args.backends),
        model=args.model,
        data=args.data,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        optimizer=args.optimizer,
        seed=args.seed,
        device=args.device,
        baseline=args.baseline,
        dropout=args.dropout,
        loss_scale=args.loss_scale,
        log_dir=None if args.log_dir is None else os.path.abspath(args.log_dir),
        threads=args.threads,
        loss=args.loss,
    )
    # every bad option fails here, before any framework runs or anything is written
    if recipes is None:
        validate(cfg)
    else:
        validate_recipes(cfg, recipes)
    _log_dir(args.log_dir)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    console = Console(stderr=True)
    progress = Progress(
        TextColumn("{task.description:<22}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=args.quiet,
    )

    class _Bar:
        def __init__(self, label: str, total: int):
            self.task = progress.add_task(label, total=total)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def advance(self):
            progress.advance(self.task)

    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
        if filename != WARNING_SOURCE:
            return shown(message, category, filename, lineno, file, line)
        console.print(f"warning: {category.__name__}: {message}", markup=False, highlight=False, soft_wrap=True)

    warnings.showwarning = show
    try:
        with progress:
            if recipes is None:
                report = run_compare(cfg, progress_factory=_Bar)
            else:
                report = run_recipes(cfg, recipes, progress_factory=_Bar)
    except Interrupted as e:  # Ctrl-C: one line, not the traceback of whatever was running
        logs = "; the step logs in --log-dir end there" if args.log_dir else ""
        print(
            f"unimp compare: interrupted at {e.label} step {e.step}; nothing written to --out{logs}",
            file=sys.stderr,
        )
        return 130
    finally:
        warnings.showwarning = shown
    try:
        written = write_report(report, out_dir)
    except OSError as e:  # the folder changed during training: name the user's path, not ours
        raise UsageError(
            f"--out {args.out!r}: could not write the report ({e.strerror or e})"
        ) from None
    if recipes is not None:  # one row per (framework, recipe)
        # the terminal's table: short headers, no cross-framework difference and no memory note
        # (report.md has them), the audit's headline as lines below it: it fits 80 columns
        short = {"final loss": "loss", "test acc": "test", "skipped": "skips", "final scale": "scale",
                 "median step ms": "ms/step", "memory MB": "MB"}  # fmt: skip
        keep = [i for i, c in enumerate(RECIPE_COLUMNS) if c in ("backend", "recipe", *short)]
        table = Table(title=f"unimp compare: {', '.join(report['recipes'])}")
        for i in keep:
            col = RECIPE_COLUMNS[i]
            table.add_column(short.get(col, col), justify="right" if i in range(2, 8) else "left", no_wrap=True)
        for row in report["rows"]:
            table.add_row(*(row[i].split(" (")[0] if RECIPE_COLUMNS[i] == "memory MB" else row[i] for i in keep))
        Console().print(table)
        misfits = [f"  {row[0]} {row[1]}: {row[-1]}" for row in report["rows"] if row[-1] not in ("-", "none", "n/a")]
        print("layers that do not fit the recipe's compute dtype (unimp audit explains each):")
        print("\n".join(misfits) if misfits else "  none")
        print("wrote " + ", ".join(written))
        return 0
    # one column per backend, one row per figure: fits a narrow terminal
    rows = summary_rows(report)
    title = recipe if args.loss_scale is None else f"{recipe}, --loss-scale {args.loss_scale}"
    table = Table(title=f"unimp compare: {title}")
    table.add_column("")
    for row in rows:
        table.add_column(row[0], justify="right")
    for i, col in enumerate(COLUMNS[1:], start=1):
        table.add_row(col, *(row[i] for row in rows))
    Console().print(table)
    slow = _onednn_note(report)
    if slow:
        print(slow)
    if "fp8" in report:
        from unimp.compare.fp8_scales import fp8_terminal_lines

        print("\n".join(fp8_terminal_lines(report["fp8"], args.model)))
    if "block" in report:
        from unimp.compare.block_report import block_terminal_lines

        print("\n".join(block_terminal_lines(report["block"])))
    if report.get("trace_diff_text"):
        print("where the frameworks' dtypes differ (first step, forward pass):")
        print("\n".join(f"  {row}" for row in report["trace_diff_text"]))
    print("wrote " + ", ".join(written))
    return 0


def _onednn_note(report: dict) -> str | None:
    """A line under compare's table when TensorFlow's float16 steps on a CPU took over 5x the
    fastest other framework's with oneDNN on: measured on a CPU with AVX512-FP16, 52 ms a
    step against 1.4 ms with ``TF_ENABLE_ONEDNN_OPTS=0`` (docs/getting-started.md)."""
    from unimp.policy import get_policy

    if os.environ.get("TF_ENABLE_ONEDNN_OPTS") == "0" or get_policy(report["recipe"]["policy"]).compute_dtype != "float16":
        return None
    median = {b: statistics.median(r["step_time"]) for b, r in report["runs"].items() if r.get("step_time")}
    tf = [b for b in median if b in ("tensorflow", "keras-tensorflow") and str(report["runs"][b]["device"]).startswith("cpu")]
    others = [t for b, t in median.items() if b not in tf]
    if not tf or not others or max(median[b] for b in tf) < 5 * min(others):
        return None
    return ("note: TensorFlow's float16 steps ran over 5x slower than the other frameworks' here: TensorFlow's "
            "oneDNN float16 kernels on a CPU can be; TF_ENABLE_ONEDNN_OPTS=0 turns them off "
            "(docs/getting-started.md).")


def _log_dir(value: str | None) -> str | None:
    """``--log-dir``: the folder, made if missing (after every other option was checked)."""
    if value is None:
        return None
    if os.path.exists(value) and not os.path.isdir(value):
        raise UsageError(f"--log-dir {value!r} exists and is not a folder; pick another path")
    try:
        os.makedirs(value, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--log-dir {value!r} cannot be created ({e.strerror or e})") from None
    return os.path.abspath(value)


def _trace(args: argparse.Namespace) -> int:
    from unimp.compare.commands import trace_command

    return trace_command(args)


def _audit(args: argparse.Namespace) -> int:
    from unimp.compare.commands import audit_command

    return audit_command(args)


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (``unimp compare: error: argument --epochs: ...``),
    exit code 2, as every other user mistake; ``--help`` still prints the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
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

    cmp_ = sub.add_parser("compare", help="train one recipe in every framework and compare them")
    cmp_.add_argument(
        "--recipe",
        default=None,
        help="any recipe name or a .toml/.json recipe file (default: mixed_float16)",
    )
    cmp_.add_argument(
        "--recipes",
        default=None,
        help="several recipes, comma-separated (e.g. float32,mixed_float16,mixed_bfloat16): one "
        "run each with the same weights and batches, one report row per framework and recipe",
    )
    cmp_.add_argument(
        "--backends",
        default=None,
        help="comma-separated (default: every installed framework); also keras-tensorflow, "
        "keras-jax, keras-torch: Keras's own trainer on that Keras backend, in a worker process",
    )
    cmp_.add_argument(
        "--model",
        default="mlp",
        help="mlp (the seeds' model), cnn, vit, or your own: FILE.py:FUNCTION returning a torch "
        "nn.Module, a Keras model or a flax linen module (runs in its framework)",
    )
    cmp_.add_argument(
        "--data",
        default="digits",
        help="'digits' (ships with scikit-learn), an .npz with x and y, or FILE.py:FUNCTION "
        "returning (x_train, y_train, x_test, y_test)",
    )
    cmp_.add_argument(
        "--loss",
        default="sparse_categorical_crossentropy",
        help="sparse_categorical_crossentropy (class indices; the default) or mse (real-valued "
        "targets, your own model and data)",
    )
    cmp_.add_argument("--epochs", type=int, default=10)
    cmp_.add_argument("--batch-size", type=int, default=32)
    cmp_.add_argument("--lr", type=float, default=1e-3)
    cmp_.add_argument("--optimizer", default="adam", help="adam or sgd")
    cmp_.add_argument("--seed", type=int, default=0)
    cmp_.add_argument("--device", default="auto", help="auto, cpu or cuda")
    cmp_.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch and TensorFlow, 1 to 1024, or 0 for each framework's own "
        "(default: 1 when every framework runs on the CPU, so that step times compare the "
        "frameworks, not the machine's load; each framework's own on a GPU)",
    )
    cmp_.add_argument(
        "--dropout", type=float, default=0.2, help="dropout rate; masks are drawn once in NumPy"
    )
    cmp_.add_argument(
        "--baseline", action="store_true", help="also run float32 and report the deviation"
    )
    cmp_.add_argument(
        "--out", default="unimp-report", help="folder for report.json, report.md, report.png"
    )
    cmp_.add_argument(
        "--loss-scale",
        default=None,
        help="override the recipe's loss scale: none, dynamic, static:N or a framework's or "
        f"trainer's preset ({', '.join(PRESETS)})",
    )
    cmp_.add_argument(
        "--log-dir",
        default=None,
        help="write each framework's step log (<backend>.jsonl, for unimp doctor) into this folder",
    )
    cmp_.add_argument("--quiet", action="store_true", help="no progress bars")
    cmp_.set_defaults(func=_compare)

    tr = sub.add_parser(
        "trace", help="which ops of one training step ran in which dtype, per framework"
    )
    tr.add_argument("recipe", help="any recipe name or a .toml/.json recipe file")
    tr.add_argument("--model", default="mlp", help="mlp (the seeds' model), cnn or vit")
    tr.add_argument(
        "--backends",
        default=None,
        help="comma-separated (default: every installed framework); also keras-tensorflow, "
        "keras-jax, keras-torch: unimp's Keras step on that Keras backend, in a worker process",
    )
    tr.add_argument("--data", default="digits", help="'digits' or an .npz with x and y")
    tr.add_argument("--batch-size", type=int, default=32)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--device", default="auto", help="auto, cpu or cuda")
    tr.add_argument(
        "--loss-scale", default=None, help="override the recipe's loss scale (as compare)"
    )
    tr.add_argument(
        "--diff",
        action="store_true",
        help="list only where the frameworks differ, beside a float32 run of the first backend",
    )
    tr.add_argument("--json", action="store_true", help="every record as JSON, for tools")
    tr.set_defaults(func=_trace)

    doc = sub.add_parser(
        "doctor", help="what went wrong in a run, from its step logs (any framework), and fixes"
    )
    doc.add_argument(
        "logs",
        nargs="+",
        metavar="LOG",
        help="step logs (JSON Lines, unimp.steplog/1: write one with train_step(..., log=PATH) "
        "or unimp compare --log-dir DIR); several logs of one run are compared",
    )
    doc.add_argument("--json", action="store_true", help="the diagnosis as JSON, for tools")

    def _doctor(args: argparse.Namespace) -> int:
        from unimp.doctor import doctor_command

        return doctor_command(args)

    doc.set_defaults(func=_doctor)

    aud = sub.add_parser(
        "audit", help="float32 steps with statistics: which layers would overflow or underflow"
    )
    aud.add_argument(
        "--to",
        required=True,
        help="what to audit for: a half dtype (float16, bfloat16) or a block recipe's format "
        "(mxfp8, fp8-block, nvfp4, mxfp4: each tensor's share rounding to 0 and relative MSE)",
    )
    aud.add_argument("--model", default="mlp", help="mlp (the seeds' model), cnn or vit")
    aud.add_argument("--data", default="digits", help="'digits' or an .npz with x and y")
    aud.add_argument("--steps", type=int, default=5, help="float32 steps audited")
    aud.add_argument(
        "--backends",
        default=None,
        help="comma-separated (default: every installed framework); also keras-tensorflow, "
        "keras-jax, keras-torch: unimp's Keras step on that Keras backend, in a worker process",
    )
    aud.add_argument("--batch-size", type=int, default=32)
    aud.add_argument("--lr", type=float, default=1e-3)
    aud.add_argument("--optimizer", default="adam", help="adam or sgd")
    aud.add_argument("--seed", type=int, default=0)
    aud.add_argument("--device", default="auto", help="auto, cpu or cuda")
    aud.add_argument(
        "--plant",
        default=None,
        metavar="LAYER=FACTOR",
        help="multiply one layer's initial weights (a planted fault), e.g. l1=1e5",
    )
    aud.add_argument(
        "--underflow-tolerance",
        type=float,
        default=0.01,
        help="flag a tensor when more than this share of it would flush to zero (default 0.01; "
        "for a block format, the least share named)",
    )
    aud.add_argument(
        "--log-dir",
        default=None,
        help="write each framework's step log (<backend>.jsonl, for unimp doctor) into this folder",
    )
    aud.add_argument("--json", action="store_true", help="the findings as JSON, for tools")
    aud.set_defaults(func=_audit)

    exp = sub.add_parser("explain", help="how a recipe maps onto each framework's native objects")
    exp.add_argument("recipe", nargs="?", help="any recipe name or a .toml/.json recipe file")
    exp.add_argument(
        "--fp8", action="store_true", help="where the float8 scaling presets differ, step by step"
    )
    exp.add_argument(
        "--amaxes",
        help="with --fp8: comma-separated per-step maxima (0, inf, nan ok; --amaxes=... when the first starts with '-')",
    )
    exp.add_argument("--history-len", type=int, default=3, help="with --fp8: delayed window L")
    exp.add_argument(
        "--block-format",
        metavar="PRESET[,PRESET...]",
        help="where the block-scaled presets (MXFP8, MXFP4, NVFP4, block FP8) differ, element by "
        "element, on a zero block, an inf, a NaN, a maximum above 448 and a tiny block; 'all' "
        "for every preset; the first is the baseline",
    )
    exp.add_argument(
        "--values",
        help="with --block-format: one block's values instead (1, 2, 4, 8, 16 or 32, comma-separated; "
        "--values=... when the first starts with '-')",
    )
    exp.add_argument(
        "--scalers", action="store_true", help="simulate each framework's native scaler"
    )
    exp.add_argument("--steps", type=int, default=60, help="steps simulated with --scalers")
    exp.add_argument("--overflow-rate", type=float, default=0.1, help="share of overflowing steps")
    exp.add_argument(
        "--growth-interval",
        type=int,
        default=10,
        help="interval used for every scaler so growth shows in a short run (flax: +1)",
    )
    exp.add_argument(
        "--burst", type=int, default=24, help="overflows in a row mid-sequence (shows the floors)"
    )
    exp.add_argument("--seed", type=int, default=0)
    exp.add_argument("--json", action="store_true")
    exp.set_defaults(func=_explain)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # the command line only: keep TensorFlow's C++ start-up log out of the output (importing
    # unimp as a library sets nothing)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the command's own parser: "unimp trace: ...; see unimp trace --help"
        commands = next(
            (a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {}
        )
        commands.get(getattr(args, "command", None), parser).error(
            f"unrecognized arguments: {' '.join(extra)}"
        )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if args.command in ("compare", "trace", "audit") and "keras" not in sys.modules:
        # the names pin the engine: `tensorflow` (`keras-tensorflow`) runs unimp's Keras step on
        # TensorFlow in this process, `keras-jax` / `keras-torch` in workers of their own; a
        # KERAS_BACKEND=jax exported for the user's own Keras code would refuse the first
        os.environ["KERAS_BACKEND"] = "tensorflow"
    try:
        with _native_stderr_filtered():
            return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C in any other command (compare says where it stopped)
        print(f"unimp {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `unimp explain ... | head -1`: the reader left, a quiet exit
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (UsageError, ValueError, ImportError, OSError, LossScaleError) as e:
        # user mistakes and stuck runs: one line naming the fix, no traceback (but the user's
        # own file's, where importing or calling it raised: unimp.compare.user)
        details = getattr(e, "details", "")
        if details:
            print(details.rstrip(), file=sys.stderr)
        print(f"unimp {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
