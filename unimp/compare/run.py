"""Runs one recipe in every requested framework and collects the per-step data."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import math
import os
import platform
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import unimp
from unimp import registry
from unimp.compare.audit import (
    MAX_STEPS,
    TARGETS,
    audit_stats,
    initial_scale,
    parse_plant,
    plant_form,
)
from unimp.compare.audit_block import thresholds as block_thresholds
from unimp.compare.data import Dataset, batches, load_dataset
from unimp.compare.models import MODELS, hidden_size, init_weights
from unimp.compare.report import cross_framework_difference, disagreements
from unimp.compare.threads import MAX_THREADS, check_threads, threads
from unimp.compare.user import KERAS_ENGINES, LOSSES, is_reference, load_data, user_model_backends
from unimp.dtypes import keras_policy_name
from unimp.loss_scale import DynamicLossScale, StaticLossScale
from unimp.recipe import BLOCK_RECIPES, Recipe, get_recipe

__all__ = [
    "CompareConfig",
    "RunSpec",
    "device_for",
    "run_audit",
    "run_compare",
    "test_metrics",
    "refuse_user_model",
    "run_recipes",
    "trace_diff",
    "train_loop",
    "validate",
    "validate_recipes",
]

OPTIMIZERS = ("adam", "sgd")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class CompareConfig:
    """Options of ``unimp compare`` (see ``unimp compare --help``)."""

    recipe: str = "mixed_float16"
    backends: tuple[str, ...] | None = None
    model: str = "mlp"
    data: str = "digits"
    epochs: int = 10
    batch_size: int = 32
    lr: float = 1e-3
    optimizer: str = "adam"
    seed: int = 0
    device: str = "auto"
    baseline: bool = False
    dropout: float = 0.2
    loss_scale: str | None = None
    log_dir: str | None = None
    threads: int | None = None
    loss: str = "sparse_categorical_crossentropy"


@dataclass
class RunSpec:
    """What a framework runner gets: everything already in NumPy, identical for each.

    Attributes:
        recipe: the recipe to train with.
        model: ``mlp``, ``cnn`` or ``vit`` (see :mod:`unimp.compare.models`), or the user's
            ``FILE.py:FUNCTION`` (:mod:`unimp.compare.user`).
        weights: initial float32 weights.
        batches: ``{"x", "y", "mask"}`` per step.
        x_test, y_test: held-out data for the accuracy.
        num_classes: model outputs.
        optimizer: ``adam`` or ``sgd``; lr: learning rate.
        device: ``cpu`` or ``cuda``.
        progress: called after each step with the step index.
        loss: ``sparse_categorical_crossentropy`` or ``mse`` (:data:`unimp.compare.user.LOSSES`).
        seed: the seed a user's model is built with.
        stats_every: tensor statistics every k steps (``train_step(stats_every=k)``); the
            runs then hold ``stats``: ``{step: StepStats.to_dict()}``.
        stats_formats: block formats whose quantization error the statistics take
            (``train_step(stats_formats=...)``; ``unimp audit --to mxfp8``).
        trace: record the dtype trace of the first step (``mp.trace``) in ``trace``.
        log: a step-log path (``train_step(log=...)``, ``docs/steplog.md``), closed after
            the run.
        threads: the CPU threads a runner in a process of its own sets there
            (``keras-*``: :func:`unimp.compare.threads.threads` at the worker's start); None
            keeps the framework's own. The in-process runners run under ``threads`` instead.
    """

    recipe: Recipe
    model: str
    weights: dict[str, np.ndarray]
    batches: list[dict[str, np.ndarray]]
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    optimizer: str
    lr: float
    device: str
    progress: Callable[[int], None] = field(default=lambda i: None)
    stats_every: int | None = None
    stats_formats: tuple[str, ...] = ()
    trace: bool = False
    log: str | None = None
    loss: str = "sparse_categorical_crossentropy"
    seed: int = 0
    threads: int | None = None

    @property
    def user_model(self) -> bool:
        """The model is the user's (``--model FILE.py:FUNCTION``): built by the runner from that
        function, taking ``x`` alone (no dropout mask)."""
        return is_reference(self.model)

    def step_options(self) -> dict[str, Any]:
        """Keyword arguments of every backend's ``train_step`` for this run."""
        out: dict[str, Any] = {} if self.stats_every is None else {"stats_every": self.stats_every}
        if self.stats_formats:
            out["stats_formats"] = list(self.stats_formats)
        if self.log is not None:
            out.update(log=self.log, log_every=50)
        return out


def label_file(label: str) -> str:
    """A run's label as a file name: ``torch``, ``torch-float32`` for a baseline run."""
    return label.replace(" (", "-").replace(")", "").replace(" ", "-")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a run of :func:`run_compare`: the framework (``label``, set by the run)
    and the step it stopped at, for a one-line message."""

    def __init__(self, step: int, label: str | None = None) -> None:
        super().__init__(step, label)
        self.step, self.label = step, label


def test_metrics(out: np.ndarray, y: np.ndarray, loss: str) -> dict[str, float | None]:
    """The held-out figures of a run from the model's float32 outputs ``out`` on the test
    examples: ``test_accuracy`` (argmax against the labels; None for ``mse``) and
    ``test_loss`` (the mean squared error for ``mse``, else None)."""
    out = np.asarray(out, np.float32)
    if loss == "mse":
        with np.errstate(over="ignore", invalid="ignore"):
            return {"test_accuracy": None, "test_loss": float(np.mean((out - y) ** 2))}
    return {"test_accuracy": float((out.argmax(1) == y).mean()), "test_loss": None}


def train_loop(
    step: Callable[[Any], Any], spec: RunSpec, convert: Callable[[dict], Any]
) -> dict[str, list]:
    """Runs ``step`` over ``spec.batches`` and records each StepResult.

    Each step's time includes reading its loss back (so the step has finished on the device).
    The process's resident memory (RSS) is read before the first step and after each one: its
    largest growth is a memory figure every framework has, on any device (on a GPU it counts
    host memory only; the device's own peak is reported beside it where the framework has one).

    Returns:
        Per-step lists: ``loss``, ``scale``, ``applied``, ``loss_finite``, ``grads_finite``,
        ``step_time`` (seconds); and ``rss_growth_bytes`` (int).
    """
    import time

    import psutil

    proc = psutil.Process()
    out: dict[str, Any] = {
        k: [] for k in ("loss", "scale", "applied", "loss_finite", "grads_finite", "step_time")
    }
    rss0 = peak = proc.memory_info().rss
    error = None
    try:
        for i, b in enumerate(spec.batches):
            batch = convert(b)
            t0 = time.perf_counter()
            r = step(batch)
            loss = r.loss
            out["step_time"].append(time.perf_counter() - t0)
            peak = max(peak, proc.memory_info().rss)
            out["loss"].append(loss)
            for name in ("scale", "applied", "loss_finite", "grads_finite"):
                out[name].append(getattr(r, name))
            if spec.stats_every is not None and r.stats is not None:  # read back every k steps
                out.setdefault("stats", {})[str(i)] = r.stats.to_dict()
            spec.progress(i)
    except KeyboardInterrupt as e:  # Ctrl-C: the CLI says where, in one line
        error = e
        raise Interrupted(len(out["loss"])) from None  # the step that was running
    except BaseException as e:
        error = e
        raise
    finally:
        if spec.log is not None:
            step.close(error)  # the step log's last records and its end line: how it ended
    out["rss_growth_bytes"] = int(peak - rss0)
    return out


def _resolve_backends(names: tuple[str, ...] | None) -> list[str]:
    if names is None:
        found = registry.available_backends()
        if not found:
            raise ImportError(
                'no framework is installed: pip install "unimp[all-cpu]" (or unimp[torch], ...)'
            )
        return found
    out = []
    for n in names:
        if registry.backend_info(n) is registry.KERAS:  # "keras" in a process set to JAX / torch
            n = f"keras-{registry.keras_engine()}" if n == "keras" else n
        if n in KERAS_ENGINES:  # Keras's own trainer on one of its backends, in a worker
            framework = KERAS_ENGINES[n]
            if framework not in registry.available_backends():
                info = registry.backend_info(framework)
                raise ImportError(f'{n} needs {framework}: pip install "unimp[{info.extra}]"')
            if n not in out:
                out.append(n)
            continue
        info = registry.backend_info(n)  # ValueError naming valid names for unknown ones
        if info.name not in registry.available_backends():
            raise ImportError(
                f'backend {info.name!r} is not installed: pip install "unimp[{info.extra}]"'
            )
        if info.name not in out:
            out.append(info.name)
    return out


def keras_refusal(recipe: Recipe) -> str | None:
    """Why Keras's own trainer (``keras-*``) cannot run ``recipe``, or None: Keras has a
    dtype policy for float32 parameters with half compute, or one dtype, and each per-layer
    override is a policy a built layer can take (the model's parameter dtype)."""
    p = recipe.policy
    if keras_policy_name(p.param_dtype, p.compute_dtype) is None:
        return (
            f"Keras has no dtype policy for param {p.param_dtype} / compute {p.compute_dtype}; "
            "use float32 parameters (mixed_float16, mixed_bfloat16) or one dtype"
        )
    for pattern, o in p.overrides:  # the rule unimp.keras.overrides applies in the worker
        if o.param_dtype != p.param_dtype or keras_policy_name(o.param_dtype, o.compute_dtype) is None:
            return (
                f"override {pattern!r} ({o}) is no Keras policy for a built layer: its "
                f"variables stay {p.param_dtype}; give the override a dtype ('float32', ...)"
            )
    return None


def _runner(backend: str, task: str | None = None) -> Callable[[RunSpec], dict[str, Any]]:
    """The function that runs a spec on ``backend`` (a Keras engine runs in a worker, which runs
    ``task`` there, ``"module:function"``, instead of Keras's trainer when given)."""
    # runners are found by name (each imports this module): runner_<backend>, and runner_keras
    # for every Keras engine, told which one
    keras = backend in KERAS_ENGINES
    runner = importlib.import_module(f"unimp.compare.runner_{'keras' if keras else backend}")
    return functools.partial(runner.run, engine=backend, task=task) if keras else runner.run


def parse_loss_scale(spec: str) -> Any:
    """``--loss-scale``: ``none``, ``dynamic`` (unimp's defaults), ``static:N`` or a framework's
    preset name, read by :meth:`unimp.DynamicLossScale.preset` (its names and aliases).

    Returns:
        What :func:`unimp.get_recipe`'s ``loss_scale=`` takes.

    Raises:
        ValueError: anything else, listing the accepted forms.
    """
    s = spec.strip().lower()
    if s in ("none", "dynamic"):
        return s
    if s.startswith("static:"):
        try:
            value = float(s.split(":", 1)[1])
        except ValueError:
            raise ValueError(
                f"--loss-scale {spec!r}: static:N needs a number, e.g. static:1024."
            ) from None
        try:
            return StaticLossScale(value)
        except ValueError as e:
            raise ValueError(f"--loss-scale {spec!r}: {e}") from None
    try:
        return DynamicLossScale.preset(spec)
    except ValueError as e:
        raise ValueError(
            f"--loss-scale {spec!r}: use none, dynamic, static:N (e.g. static:1024) or a "
            f"framework's dynamic preset ({e})"
        ) from None


def refuse_user_model(model: str, command: str) -> None:
    """``unimp trace`` and ``unimp audit`` run the built-in models; a user's
    ``FILE.py:FUNCTION`` is refused before anything is built or imported.

    Raises:
        ValueError: ``model`` names a user's file, naming ``unimp compare`` (its report holds
            the trace diff of the user's model) as the fix.
    """
    from unimp.compare.user import is_reference

    if is_reference(model):
        raise ValueError(
            f"--model {model}: {command} runs the built-in models (mlp, cnn, vit); for your own "
            "model use unimp compare --model FILE.py:FUNCTION (its report holds the trace diff "
            "of every framework it runs)."
        )


def validate(cfg: CompareConfig) -> tuple[Recipe, list[str], Dataset]:
    """Checks every option before anything runs or is written.

    Raises:
        ValueError, ImportError, FileNotFoundError: with a message that names the fix.
    """
    if cfg.loss_scale is None:
        recipe = get_recipe(cfg.recipe)
    else:
        recipe = get_recipe(cfg.recipe, loss_scale=parse_loss_scale(cfg.loss_scale))
    if recipe.policy.param_dtype == "float16" and not recipe.loss_scale.unity:
        raise ValueError(
            f"--recipe {cfg.recipe} keeps float16 parameters, whose float16 gradients cannot be "
            f"unscaled safely while the loss is scaled ({recipe.loss_scale.kind} loss scale): add "
            "--loss-scale none (or static:1), or use --recipe mixed_float16 (float32 parameters)."
        )
    user = is_reference(cfg.model)
    if not user and cfg.model not in MODELS:
        raise ValueError(
            f"unknown --model {cfg.model!r}; choose one of {', '.join(MODELS)}, or your own "
            "model as FILE.py:FUNCTION."
        )
    if cfg.loss not in LOSSES:
        raise ValueError(f"unknown --loss {cfg.loss!r}; choose one of {', '.join(LOSSES)}.")
    if cfg.loss != "sparse_categorical_crossentropy" and not user:
        raise ValueError(
            f"--loss {cfg.loss}: unimp's models ({', '.join(MODELS)}) classify; give your own "
            "model with --model FILE.py:FUNCTION (and its data with --data FILE.py:FUNCTION)."
        )
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(
            f"unknown --optimizer {cfg.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}."
        )
    if cfg.device not in DEVICES:
        raise ValueError(f"unknown --device {cfg.device!r}; choose one of {', '.join(DEVICES)}.")
    if cfg.epochs < 1:
        raise ValueError(f"--epochs must be >= 1, got {cfg.epochs}.")
    if not (math.isfinite(cfg.lr) and cfg.lr > 0):
        raise ValueError(f"--lr must be a positive number, got {cfg.lr}.")
    if not 0 <= cfg.dropout < 1:
        raise ValueError(f"--dropout must be in [0, 1), got {cfg.dropout}.")
    if cfg.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {cfg.seed}.")
    if cfg.threads is not None and cfg.threads != 0:
        try:
            check_threads(cfg.threads)
        except ValueError:
            raise ValueError(
                f"--threads must be 0 (each framework's own) or an integer from 1 to "
                f"{MAX_THREADS}, got {cfg.threads!r}."
            ) from None
    # the data before the backends: resolving a backend imports its framework (seconds each),
    # and a missing file should fail at once (it took 39 s)
    if is_reference(cfg.data):
        x_train, y_train, x_test, y_test = load_data(cfg.data, cfg.loss)
        classes = 0 if cfg.loss == "mse" else int(max(y_train.max(), y_test.max())) + 1
        ds = Dataset(x_train, y_train, x_test, y_test, classes, os.path.basename(cfg.data))
    elif cfg.loss == "mse":
        raise ValueError("--loss mse needs real-valued targets: give them with --data FILE.py:FUNCTION.")
    else:
        ds = load_dataset(cfg.data, seed=cfg.seed, num_classes=10 if cfg.data == "digits" else None)
    if not user and is_reference(cfg.data) and ds.x_train.ndim not in (2, 3, 4):
        raise ValueError(
            f"--data {cfg.data}: unimp's models take images (N, H, W[, C]) or features (N, F); "
            f"x_train has shape {ds.x_train.shape}: give your own model with --model FILE.py:FUNCTION."
        )
    if cfg.batch_size < 1 or cfg.batch_size > len(ds.x_train):
        raise ValueError(
            f"--batch-size must be in [1, {len(ds.x_train)}] for this data, got {cfg.batch_size}."
        )
    if user:  # the model's own framework decides where it runs (it is built once, checked here)
        backends = user_model_backends(cfg, ds, lambda bs: _threads_for(cfg, bs))
    else:
        backends = _resolve_backends(cfg.backends)
    for b in backends:  # a device or cast mode a backend cannot use fails here, before any trains
        if b in KERAS_ENGINES:
            why = keras_refusal(recipe)
            if why:
                raise ValueError(f"--recipe {cfg.recipe} on {b}: {why}.")
            device_for(b, cfg.device)
            continue
        why = registry.cast_mode_refusal(recipe, b)
        if why:
            raise ValueError(
                f"--recipe {cfg.recipe}: {why}; compare it with --backends torch, or run "
                f"--recipe '{recipe.policy}' (the same dtypes, each framework casting its own way)."
            )
        device_for(b, cfg.device)
    return recipe, backends, ds


def validate_recipes(cfg: CompareConfig, recipes: tuple[str, ...]) -> list[tuple[Recipe, list[str], Dataset]]:
    """:func:`validate` for each of several recipes (``--recipes``), all before any runs.

    Raises:
        ValueError: no recipe, a recipe named twice, or any option :func:`validate` refuses
            for one of them (the message names the recipe).
    """
    names = [r.strip() for r in recipes]
    if not names or any(not n for n in names):
        raise ValueError("--recipes takes comma-separated recipe names, e.g. float32,mixed_float16,mixed_bfloat16.")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--recipes names {', '.join(twice)} twice; give each recipe once.")
    out = []
    for name in names:
        try:
            out.append(validate(dataclasses.replace(cfg, recipe=name)))
        except (ValueError, ImportError, FileNotFoundError) as e:
            raise type(e)(f"--recipes {name}: {e}") from None
    return out


def _threads_for(cfg: CompareConfig, backends: list[str]) -> Any:
    """The ``--threads`` context of a run on ``backends``: one thread per framework on a CPU
    unless asked otherwise (the benchmarks' choice: with a thread per core, torch on a shared
    CPU ran 20-50x slower than JAX, and the step-time row compared the machine's load, not the
    frameworks); yields ``{backend: what was set}``."""
    n = cfg.threads
    if n is None:
        n = 1 if all(device_for(b, cfg.device).startswith("cpu") for b in backends) else 0
    return contextlib.nullcontext({}) if n == 0 or not backends else threads(backends, n)


def device_for(backend: str, wanted: str) -> str:
    backend = KERAS_ENGINES.get(backend, backend)  # Keras's engines: the framework it runs on
    module = registry.get_backend(backend)
    info = module.device_info()
    devices = [d["device"] for d in info]
    has_gpu = any(d.get("kind") == "gpu" for d in info)
    if wanted == "auto":
        return "cuda" if has_gpu else "cpu"
    if wanted == "cuda" and not has_gpu:
        raise ValueError(
            f"--device cuda: {backend} sees no GPU (devices: {', '.join(devices)}); use --device cpu or auto."
        )
    return wanted


#: the file name compare's re-emitted warnings carry (the CLI prints them without it)
WARNING_SOURCE = "unimp compare"


@contextlib.contextmanager
def framework_warnings(label: str) -> Any:
    """Collects the warnings one framework's run raises and re-emits each once, its message
    prefixed with the run's label (``"torch: ..."``) and attributed to :data:`WARNING_SOURCE`:
    raised inside compare they pointed at the ``unimp`` script's last line, and the same text
    from two frameworks (a ``HalfOptimizerStateWarning``) was shown once for both.

    Yields:
        The list the run's unique warnings go into, as ``"Category: message"`` strings (the
        report keeps them per run).
    """
    seen: list[str] = []
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield seen
    finally:  # a run that raised still shows what it warned of
        for w in caught:
            text = f"{w.category.__name__}: {w.message}"
            if text not in seen:
                seen.append(text)
                warnings.warn_explicit(f"{label}: {w.message}", w.category, WARNING_SOURCE, 0)


def run_compare(
    cfg: CompareConfig,
    progress_factory: Callable[[str, int], Any] | None = None,
    block_reference: bool = True,
) -> dict[str, Any]:
    """Trains the same model, weights and batches with the recipe in every backend.

    Args:
        cfg: the options.
        progress_factory: ``(label, total_steps) -> context manager with .advance()``;
            ``None`` for no progress display.
        block_reference: with a block-scaled recipe, also train the same recipe without its
            block-scaled layers (bfloat16) for the report's accuracy difference, as an FP8
            recipe's float8 section does.

    Returns:
        The report dict (what ``report.json`` holds).
    """
    recipe, backends, ds = validate(cfg)
    devices = {b: device_for(b, cfg.device) for b in backends}
    user = is_reference(cfg.model)
    weights = {} if user else init_weights(cfg.model, ds.image_shape, ds.num_classes, cfg.seed)
    steps = batches(
        ds,
        batch_size=cfg.batch_size,
        epochs=cfg.epochs,
        seed=cfg.seed,
        dropout=0.0 if user else cfg.dropout,  # a user's model drops out by itself
        hidden=1 if user else hidden_size(cfg.model, ds.image_shape),
    )

    thread_info: dict[str, str] = {}  # what --threads set, per backend (below)

    def one(backend: str, rec: Recipe, label: str) -> dict[str, Any]:
        runner = _runner(backend)
        spec = RunSpec(
            rec,
            cfg.model,
            weights,
            steps,
            ds.x_test,
            ds.y_test,
            ds.num_classes,
            cfg.optimizer,
            cfg.lr,
            devices[backend],
            # statistics at the first and the last step, for the report's per-layer table
            stats_every=max(1, len(steps) - 1),
            trace=True,
            log=None if cfg.log_dir is None else os.path.join(cfg.log_dir, f"{label_file(label)}.jsonl"),
            loss=cfg.loss,
            seed=cfg.seed,
            threads=int(set_to) if (set_to := thread_info.get(backend, "")).isdigit() else None,
        )
        with framework_warnings(label) as seen:
            try:
                if progress_factory is None:
                    run = runner(spec)
                else:
                    with progress_factory(label, len(steps)) as bar:
                        spec.progress = lambda i: bar.advance()
                        run = runner(spec)
            except Interrupted as e:
                raise Interrupted(e.step, label) from None
            except KeyboardInterrupt:  # before the first step (building the model, compiling)
                raise Interrupted(0, label) from None
        run["warnings"] = seen
        return run

    with contextlib.ExitStack() as stack:
        thread_info = stack.enter_context(_threads_for(cfg, backends))
        runs = {b: one(b, recipe, b) for b in backends}
        report: dict[str, Any] = {
            "unimp": unimp.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "recipe_name": cfg.recipe,
            "recipe": recipe.to_dict(),
            "recipe_description": recipe.describe(),
            "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.__dict__.items()},
            "data": ds.name,
            "steps": len(steps),
            "runs": runs,
            "cross_framework_max_rel_loss_diff": cross_framework_difference(runs),
            "cross_framework_disagreements": disagreements(runs),
            "threads": thread_info,
        }
        if cfg.baseline:
            f32 = get_recipe("float32")
            base = {b: one(b, f32, f"{b} (float32)") for b in backends}
            report["baseline"] = base
            report["baseline_deviation"] = {
                b: max(
                    (
                        abs(x - y) / max(abs(y), 1e-12)
                        for x, y in zip(runs[b]["loss"], base[b]["loss"], strict=True)
                        if math.isfinite(x) and math.isfinite(y)
                    ),
                    default=float("nan"),
                )
                for b in backends
            }
        if recipe.fp8 is not None:  # float8 against the same recipe without it (bfloat16)
            from unimp.compare.fp8_scales import fp8_section

            plain = recipe.replace(fp8=None)
            bf16 = {b: one(b, plain, f"{b} ({plain.policy.compute_dtype})") for b in backends}
            report["fp8"] = fp8_section(runs, bf16)
        if recipe.block is not None:  # the block-scaled layers against the same run without them
            from unimp.compare.block_report import block_section

            plain = recipe.replace(block=None)
            bf16 = ({b: one(b, plain, f"{b} ({plain.policy.compute_dtype})") for b in backends}
                    if block_reference else {})
            report["block"] = block_section(runs, bf16, recipe.block)
        _add_trace_diff(report)
        report["layer_stats"] = {b: layer_stats(run) for b, run in runs.items()}
        return report


def run_recipes(
    cfg: CompareConfig,
    recipes: tuple[str, ...],
    progress_factory: Callable[[str, int], Any] | None = None,
) -> dict[str, Any]:
    """Several recipes in one run (``unimp compare --recipes``): :func:`run_compare` once per
    recipe, with the same model, initial weights, batches and options, so that a user picks the
    recipe that suits their model.

    Args:
        cfg: the options (``cfg.recipe`` is ignored).
        recipes: recipe names or files, in the order the report lists them.
        progress_factory: as :func:`run_compare`'s; the labels are ``"<backend> <recipe>"``.

    Returns:
        ``{"recipes": {name: run_compare's report}, "rows": [...]}``: the rows are
        :func:`unimp.compare.report.recipe_rows`, one per (framework, recipe).

    Raises:
        ValueError, ImportError, FileNotFoundError: as :func:`validate_recipes`, before any
            framework runs.
    """
    from unimp.compare.report import recipe_rows

    validate_recipes(cfg, recipes)
    names = [r.strip() for r in recipes]
    reports = {}
    for name in names:
        factory = None
        if progress_factory is not None:

            def factory(label: str, total: int, name: str = name) -> Any:
                return progress_factory(f"{label} {name}", total)

        # each recipe's step logs in a folder of its own (<log-dir>/<recipe>/<backend>.jsonl)
        log_dir = None if cfg.log_dir is None else os.path.join(cfg.log_dir, label_file(os.path.basename(name)))
        if log_dir is not None:
            os.makedirs(log_dir, exist_ok=True)
        one = dataclasses.replace(cfg, recipe=name, log_dir=log_dir)
        # (a block-scaled recipe's bfloat16 reference is a row of its own where it is listed)
        reports[name] = run_compare(one, progress_factory=factory, block_reference=False)
    out: dict[str, Any] = {"recipes": reports}
    out["rows"] = recipe_rows(out)
    return out


def run_audit(
    cfg: Any,
    *,
    to: str,
    steps: int = 5,
    plant: str | None = None,
    underflow_tolerance: float = 0.01,
    progress_factory: Any = None,
    log_dir: str | None = None,
) -> dict[str, Any]:
    """Runs ``steps`` float32 steps of the compare model in every backend with statistics on
    every step, at ``to``'s initial loss scale, and reads them
    (:func:`unimp.compare.audit.audit_stats`): ``unimp audit``.

    Args:
        cfg: a :class:`CompareConfig` (model, data, batch size, optimizer, lr,
            seed, device, backends; its recipe and loss scale are replaced).
        to: ``float16``, ``bfloat16``, or a block recipe's format (``mxfp8``, ``fp8-block``,
            ``nvfp4``, ``mxfp4``: the statistics then take its quantization error,
            :mod:`unimp.compare.audit_block`).
        steps: audited steps, >= 1.
        plant: ``LAYER=FACTOR``: multiply one layer's initial weights (a planted fault).
        underflow_tolerance: see :func:`unimp.compare.audit.audit_stats`.
        progress_factory: as :func:`run_compare`'s.
        log_dir: a folder for each backend's step log (``<backend>.jsonl``, with the
            statistics of every step), or None.

    Returns:
        ``{"target", "scale", "model", "data", "steps", "plant", "findings": {backend: [Finding
        dicts]}, "clean": {backend: bool}}``, and for a block format ``"thresholds"``
        (:func:`unimp.compare.audit_block.thresholds`).

    Raises:
        ValueError, ImportError: any bad option, before anything runs.
    """
    from unimp.compare.models import weight_layer
    from unimp.stats import StepStats

    if to not in TARGETS:
        raise ValueError(f"--to {to!r}: choose one of {', '.join(TARGETS)}.")
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise ValueError(
            f"--steps must be an int in [1, {MAX_STEPS}], got {steps!r}: the audit reads the "
            "first steps of a run (the batches are built up front)."
        )
    if not (0 <= underflow_tolerance < 1):
        raise ValueError(f"--underflow-tolerance must be in [0, 1), got {underflow_tolerance}.")
    if plant is not None:  # its form first: refused at once, before the data and frameworks
        plant_form(plant)
    refuse_user_model(cfg.model, "unimp audit")
    scale = initial_scale(to)
    loss_scale = "none" if scale == 1.0 else StaticLossScale(scale)
    _, backends, ds = validate(dataclasses.replace(cfg, recipe="float32", loss_scale=None))
    recipe = get_recipe("float32", loss_scale=loss_scale)
    weights = init_weights(cfg.model, ds.image_shape, ds.num_classes, cfg.seed)
    planted = None
    if plant is not None:
        layer, factor = parse_plant(plant, cfg.model, list(weights))
        weights = {
            k: (v * np.float32(factor) if weight_layer(k) == layer else v) for k, v in weights.items()
        }
        planted = {"layer": layer, "factor": factor}
    if log_dir is not None:  # every option checked: the folder may be made now
        if os.path.exists(log_dir) and not os.path.isdir(log_dir):
            raise ValueError(f"--log-dir {log_dir!r} exists and is not a folder; pick another path")
        try:
            os.makedirs(log_dir, exist_ok=True)
        except OSError as e:  # as compare says it: the option, the reason, the fix
            raise ValueError(f"--log-dir {log_dir!r} cannot be created ({e.strerror or e}); "
                             "pick a folder you can write") from None
    per_epoch = max(1, len(ds.x_train) // cfg.batch_size)
    data = batches(
        ds, batch_size=cfg.batch_size, epochs=math.ceil(steps / per_epoch), seed=cfg.seed,
        dropout=cfg.dropout, hidden=hidden_size(cfg.model, ds.image_shape),
    )[:steps]  # fmt: skip
    findings: dict[str, list[dict[str, Any]]] = {}
    for b in backends:
        # a Keras engine's worker runs unimp's step with statistics (Keras's trainer takes none)
        runner = _runner(b, task="unimp.compare.keras_step:stats_task")
        spec = RunSpec(
            recipe, cfg.model, weights, data, ds.x_test, ds.y_test, ds.num_classes,
            cfg.optimizer, cfg.lr, device_for(b, cfg.device), stats_every=1,
            stats_formats=(BLOCK_RECIPES[to],) if to in BLOCK_RECIPES else (),
            log=None if log_dir is None else os.path.join(log_dir, f"{b}.jsonl"),
        )  # fmt: skip
        if progress_factory is None:
            run = runner(spec)
        else:
            with progress_factory(f"{b} (float32, stats)", len(data)) as bar:
                spec.progress = lambda i: bar.advance()
                run = runner(spec)
        stats = [StepStats.from_dict(run["stats"][k]) for k in sorted(run["stats"], key=int)]
        findings[b] = [
            f.to_dict() for f in audit_stats(stats, to, underflow_tolerance=underflow_tolerance)
        ]
    return {
        "target": to,
        "scale": scale,
        "model": cfg.model,
        "data": ds.name,
        "steps": len(data),
        "plant": planted,
        "underflow_tolerance": underflow_tolerance,
        "findings": findings,
        "clean": {b: not fs for b, fs in findings.items()},
        **({"thresholds": block_thresholds(to, underflow_tolerance)} if to in BLOCK_RECIPES else {}),
    }


def layer_stats(run: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per top-level layer, at the first and the last step with statistics: the gradients'
    largest magnitude and float16 headroom and flush share (at the step's loss scale), and the
    activations' largest magnitude and float16 headroom (the layer's tensors taken together).

    Returns:
        ``{"first" | "last": {"step": int, "layers": {layer: {...}}}}`` (empty without stats).
    """
    from unimp.stats import StepStats, top_layer

    stats = run.get("stats") or {}
    if not stats:
        return {}
    keys = sorted(stats, key=int)
    out = {}
    for label, key in (("first", keys[0]), ("last", keys[-1])):
        st = StepStats.from_dict(stats[key])
        layers: dict[str, dict[str, Any]] = {}
        for kind, tensors in (("grad", st.gradients), ("act", st.activations)):
            for name, t in tensors.items():
                d = layers.setdefault(top_layer(name), {})
                amax, size = d.get(f"{kind}_amax", 0.0), d.get(f"{kind}_size", 0)
                d[f"{kind}_amax"] = max(amax, t.amax) if math.isfinite(t.amax) else t.amax
                d[f"{kind}_size"] = size + t.size
                d[f"{kind}_flush"] = d.get(f"{kind}_flush", 0) + t.counts["float16_flush"]
                d[f"{kind}_overflow"] = d.get(f"{kind}_overflow", 0) + t.counts["float16_overflow"]
                room = t.headroom("float16")
                d[f"{kind}_headroom"] = min(d.get(f"{kind}_headroom", math.inf), room)
        out[label] = {"step": int(key), "layers": layers}
    return out


def trace_diff(traces: dict[str, Any], reference: dict[str, Any] | None = None) -> list[Any]:
    """:func:`unimp.trace.diff` of the forward passes (:class:`unimp.trace.Trace` by label),
    with each backend's ``NOTES``: a list of :class:`unimp.trace.DiffRow`."""
    from unimp.compare.keras_trace import NOTES
    from unimp.trace import diff

    notes = {}
    for label, t in {**traces, **(reference or {})}.items():
        if t.framework in KERAS_ENGINES:  # Keras's reasons and its engine's
            notes[label] = NOTES[t.framework]
        else:
            notes[label] = importlib.import_module(f"unimp.backends.{t.framework}.trace").NOTES
    if len(traces) == 1 and reference:  # one framework: what it runs against float32
        return diff({**traces, **reference}, notes=notes)
    return diff(traces, reference=reference, notes=notes) if len(traces) > 1 else []


def _add_trace_diff(report: dict[str, Any]) -> None:
    """The dtype-trace diff of the runs' first steps (beside the first float32 baseline run),
    and each run's trace reduced to its summary (the records would make report.json large)."""
    from unimp.trace import Trace

    def take(runs: dict[str, Any]) -> dict[str, Trace]:
        out = {}
        for name, run in runs.items():
            if run.get("trace") is not None:
                t = Trace.from_dict(run["trace"])
                run["trace"] = t.summary()
                out[name] = t
        return out

    traces = take(report["runs"])
    base = take(report.get("baseline", {}))
    reference = {f"float32 ({k})": v for k, v in list(base.items())[:1]}
    rows = trace_diff(traces, reference) if len(traces) > 1 else []
    report["trace_diff"] = [r.to_dict() for r in rows]
    report["trace_diff_text"] = [str(r) for r in rows]
