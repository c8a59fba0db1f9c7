"""The user's own model and data for ``unimp compare``: ``--model FILE.py:FUNCTION`` and
``--data FILE.py:FUNCTION``.

A model function takes no arguments and returns a new model, initialized from the framework's
global seed (``unimp compare`` sets it from ``--seed`` before each call):

* a ``torch.nn.Module`` runs in torch;
* a Keras model (``keras.Model``) runs in Keras on its TensorFlow backend (``tensorflow``), and
  on Keras's own trainer on each Keras backend when asked (``keras-tensorflow``, ``keras-jax``,
  ``keras-torch``; :mod:`unimp.compare.runner_keras`);
* a flax module (``flax.linen.Module``) runs in JAX, its parameters from ``module.init``.

The model maps a batch of ``x`` to one row of outputs per example: class logits for
``--loss sparse_categorical_crossentropy`` (the default), predictions of ``y``'s shape for
``--loss mse``. It is built once before any training, and one forward pass on two training
examples checks that its outputs fit the data, so a mistake fails at once with one line.

A data function takes no arguments and returns ``(x_train, y_train, x_test, y_test)``: arrays
with the examples along axis 0; ``x`` is given to the model as float32, as it is shaped;
``y`` holds class indices (``sparse_categorical_crossentropy``) or float targets (``mse``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "KERAS_ENGINES",
    "LOSSES",
    "UnsupportedModel",
    "UserFileError",
    "check_outputs",
    "is_reference",
    "load_data",
    "load_function",
    "model_framework",
    "seed_frameworks",
    "user_model",
    "user_model_backends",
]

#: The losses ``--loss`` takes: Keras's names, as Keras's ``compile(loss=...)`` spells them.
LOSSES = ("sparse_categorical_crossentropy", "mse")

#: ``--backends`` names of Keras's own trainer on each Keras backend (a worker process each,
#: :mod:`unimp.compare.runner_keras`) -> the framework Keras runs on.
KERAS_ENGINES = {"keras-tensorflow": "tensorflow", "keras-jax": "jax", "keras-torch": "torch"}

#: The backends a model of each framework runs on (the first ones by default; a Keras model
#: also on Keras's own trainer on each Keras backend, asked for by name).
_BACKENDS = {"torch": ("torch",), "keras": ("tensorflow",), "flax": ("jax",)}
_ALSO = {"keras": tuple(KERAS_ENGINES)}


class UnsupportedModel(ValueError):
    """A model of a framework unimp runs, in a form ``unimp compare`` does not (a runner's
    ``probe`` raises it with the reason and the fix; it reaches the user as it is)."""


class UserFileError(ValueError):
    """The user's file could not be imported: the CLI prints :attr:`details` (the file's own
    traceback) before its one line."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


def is_reference(value: str) -> bool:
    """Whether ``value`` names a function in a file (``FILE.py:FUNCTION``)."""
    path, sep, name = value.rpartition(":")
    return bool(sep) and path.endswith(".py") and bool(name)


def load_function(reference: str, option: str) -> Callable[[], Any]:
    """The function ``FILE.py:FUNCTION`` names, its file imported as a module of its own (the
    file's folder first on ``sys.path`` while it imports, as ``python FILE.py`` has it).

    Raises:
        FileNotFoundError: the file does not exist.
        UserFileError: the file raised while it was imported (its traceback in ``details``).
        ValueError: a malformed reference, no such function, or not callable.
    """
    path, _, name = reference.rpartition(":")
    if not is_reference(reference):
        raise ValueError(f"{option} {reference!r}: give FILE.py:FUNCTION, e.g. {option} my_model.py:build.")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{option} {reference!r}: file {path!r} does not exist.")
    module_name = f"unimp_user_{abs(hash(os.path.abspath(path)))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{option} {reference!r}: {path!r} cannot be imported as a Python file.")
    module = importlib.util.module_from_spec(spec)
    folder = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        details = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        raise UserFileError(
            f"{option} {reference!r}: importing {path} raised {type(e).__name__}: {e} (its "
            "traceback is above); fix the file, or run it with python to see the error alone.",
            details,
        ) from None
    finally:
        if sys.path and sys.path[0] == folder:
            del sys.path[0]
    fn = getattr(module, name, None)
    if fn is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ValueError(
            f"{option} {reference!r}: {path} has no function {name!r}"
            + (f"; it has {', '.join(public)}." if public else ".")
        )
    if not callable(fn):
        raise ValueError(f"{option} {reference!r}: {name!r} is a {type(fn).__name__}, not a function.")
    return fn


def model_framework(model: Any) -> str | None:
    """``"torch"``, ``"keras"`` or ``"flax"`` for a model of that framework, found from its type
    against the frameworks already imported (nothing is imported here); None otherwise."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(model, torch.nn.Module):
        return "torch"
    keras = sys.modules.get("keras")
    if keras is not None and isinstance(model, keras.Model):
        return "keras"
    linen = sys.modules.get("flax.linen")
    if linen is not None and isinstance(model, linen.Module):
        return "flax"
    return None


def seed_frameworks(seed: int) -> None:
    """Seeds the global generators of the frameworks already imported (torch, Keras), so that
    a model function builds the same initial weights on every call (flax's come from
    ``module.init``'s key)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)
    keras = sys.modules.get("keras")
    if keras is not None:
        keras.utils.set_random_seed(seed)


def user_model(reference: str, seed: int) -> tuple[Any, str]:
    """A new model from ``--model FILE.py:FUNCTION``, built after :func:`seed_frameworks`, and
    its framework (:func:`model_framework`).

    Raises:
        FileNotFoundError, UserFileError, ValueError: as :func:`load_function`; the function
            raised, or returned something else than a model of a framework unimp runs.
    """
    return _build(load_function(reference, "--model"), reference, seed)


def _build(fn: Callable[[], Any], reference: str, seed: int) -> tuple[Any, str]:
    seed_frameworks(seed)
    try:
        model = fn()
    except Exception as e:
        details = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        raise UserFileError(f"--model {reference}: the function raised {type(e).__name__}: {e}.", details) from None
    framework = model_framework(model)
    if framework is None:
        raise ValueError(
            f"--model {reference}: returned a {type(model).__module__}.{type(model).__qualname__}; "
            "return a torch.nn.Module, a Keras model or a flax.linen.Module."
        )
    return model, framework


#: The module a model function's file imports for each backend its model may run on.
_IMPORTS = (("torch", "torch"), ("tensorflow", "keras"), ("jax", "flax.linen"))


def user_model_backends(cfg: Any, ds: Any, threads_for: Callable[[list[str]], Any]) -> list[str]:
    """The backends ``--model FILE.py:FUNCTION`` runs on: its framework's (``cfg.backends``,
    where given, must name only those), after building the model once and checking one forward
    pass on two training examples against the data and the loss (:func:`check_outputs`).

    Args:
        cfg: the :class:`unimp.compare.run.CompareConfig`.
        ds: the :class:`unimp.compare.data.Dataset`.
        threads_for: ``backends -> context manager`` setting the CPU threads the run will use
            (``--threads``), entered around the build and the forward pass: TensorFlow takes
            its thread count only before its runtime starts, and building a Keras model
            starts it.

    Raises:
        FileNotFoundError, UserFileError, ValueError: as :func:`user_model`, a backend the model
            cannot run on, or outputs that do not fit the data.
    """
    from unimp import registry

    fn = load_function(cfg.model, "--model")
    imported = [b for b, module in _IMPORTS if module in sys.modules]  # the file imported them
    with threads_for(imported):
        model, framework = _build(fn, cfg.model, cfg.seed)
        out = _probe(model, framework, ds, cfg)
    allowed = _BACKENDS[framework]
    possible = (*allowed, *_ALSO.get(framework, ()))
    if cfg.backends is not None:
        # Keras's engines are names of compare's, not the registry's
        asked = [n if n in possible or n in KERAS_ENGINES else registry.backend_info(n).name for n in cfg.backends]
        other = [b for b in asked if b not in possible]
        if other:
            raise ValueError(
                f"--model {cfg.model} is a {framework} model, which runs on {', '.join(possible)} "
                f"only, not {', '.join(other)}; give --backends {','.join(possible)} (or leave it out)."
            )
        allowed = tuple(dict.fromkeys(asked))
    labels = ds.y_train if cfg.loss == "mse" else np.concatenate([ds.y_train, ds.y_test])
    check_outputs(out, labels, cfg.loss, cfg.model)  # the test labels too: they must fit the logits
    return list(allowed)


def _probe(model: Any, framework: str, ds: Any, cfg: Any) -> Any:
    """One forward pass of ``model`` on two training examples (its framework's runner's
    ``probe``), as a NumPy array."""
    import importlib

    runner = importlib.import_module(f"unimp.compare.runner_{_BACKENDS[framework][0]}")
    try:
        return runner.probe(model, ds.x_train[:2], cfg.seed)
    except UnsupportedModel as e:
        raise ValueError(f"--model {cfg.model}: {e}") from None
    except Exception as e:
        raise ValueError(
            f"--model {cfg.model}: a forward pass on x of shape {ds.x_train.shape[1:]} per example "
            f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; make the "
            "model take the data's x."
        ) from None


def check_outputs(out: Any, y: np.ndarray, loss: str, reference: str) -> int | None:
    """Checks one forward pass's outputs (``out``, a NumPy array for two examples) against the
    targets ``y`` and the loss; returns the number of classes (None for ``mse``).

    Raises:
        ValueError: outputs that do not fit the data, naming both shapes and the fix.
    """
    out = np.asarray(out)
    if loss == "mse":
        want = (len(out), *y.shape[1:])  # the probe's examples (two, or the one there is)
        if out.shape != want:
            raise ValueError(
                f"--model {reference}: outputs of shape {out.shape[1:]} per example, but 'y' has "
                f"{y.shape[1:]} per example; make the model's outputs match y for --loss mse."
            )
        return None
    classes = int(y.max()) + 1 if y.size else 0
    if out.ndim != 2 or out.shape[1] < classes:
        raise ValueError(
            f"--model {reference}: outputs of shape {out.shape[1:]} per example, but the labels "
            f"need {classes} class logits (labels 0 .. {classes - 1}); end the model with a "
            f"{classes}-unit output layer (no softmax: the loss takes logits)."
        )
    return int(out.shape[1])


def load_data(reference: str, loss: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``--data FILE.py:FUNCTION``: its four arrays, checked and converted (``x`` float32;
    ``y`` int32 class indices, or float32 targets for ``mse``).

    Raises:
        FileNotFoundError, UserFileError, ValueError: as :func:`load_function`; the function
            raised or returned something else than four arrays of matching lengths, naming it.
    """
    fn = load_function(reference, "--data")
    try:
        got = fn()
    except Exception as e:
        details = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        raise UserFileError(f"--data {reference}: the function raised {type(e).__name__}: {e}.", details) from None
    if not (isinstance(got, (tuple, list)) and len(got) == 4):
        raise ValueError(
            f"--data {reference}: must return (x_train, y_train, x_test, y_test), got "
            f"{type(got).__name__}{f' of {len(got)}' if isinstance(got, (tuple, list)) else ''}."
        )
    arrays = [np.asarray(a) for a in got]
    names = ("x_train", "y_train", "x_test", "y_test")
    for a, n in zip(arrays, names, strict=True):
        if a.ndim == 0 or not np.issubdtype(a.dtype, np.number) or np.iscomplexobj(a):
            raise ValueError(f"--data {reference}: {n} must be a real numeric array with examples along axis 0, got {a.dtype} {a.shape}.")
        if np.issubdtype(a.dtype, np.floating) and not np.isfinite(a).all():
            raise ValueError(f"--data {reference}: {n} contains NaN or inf; clean the data first.")
    for xs, ys, split in ((arrays[0], arrays[1], "train"), (arrays[2], arrays[3], "test")):
        if len(xs) != len(ys) or len(xs) == 0:
            raise ValueError(
                f"--data {reference}: x_{split} has {len(xs)} examples and y_{split} {len(ys)}; "
                "give both the same number, at least one."
            )
    x_train, y_train, x_test, y_test = arrays
    for a, n in zip(arrays, names, strict=True):
        if (n.startswith("x") or loss == "mse") and np.issubdtype(a.dtype, np.floating):
            with np.errstate(over="ignore"):
                if not np.isfinite(a.astype(np.float32)).all():  # finite float64 past float32's range
                    raise ValueError(
                        f"--data {reference}: {n} holds values beyond float32's range (largest "
                        f"magnitude {float(np.abs(a).max()):.3g}, float32's 3.4e38); rescale it first."
                    )
    if loss == "mse":
        return x_train.astype(np.float32), y_train.astype(np.float32), x_test.astype(np.float32), y_test.astype(np.float32)
    for y, n in ((y_train, "y_train"), (y_test, "y_test")):
        if y.ndim != 1 or not np.all(np.mod(y, 1) == 0) or y.min() < 0 or y.max() >= 2**31:
            raise ValueError(
                f"--data {reference}: {n} must be class indices 0 .. C-1 of shape (N,) for "
                f"--loss sparse_categorical_crossentropy (use --loss mse for real-valued targets), "
                f"got {y.dtype} {y.shape}."
            )
    return x_train.astype(np.float32), y_train.astype(np.int32), x_test.astype(np.float32), y_test.astype(np.int32)
