"""Data for ``unimp compare``: scikit-learn's digits by default, or a user's ``.npz``."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

__all__ = ["Dataset", "batches", "load_dataset"]

_MAX_CLASSES = 100_000


@dataclass(frozen=True)
class Dataset:
    """Images as float32 NHWC in [0, 1] and int32 labels, split into train and test.

    Attributes:
        x_train: float32, shape (n_train, height, width, channels).
        y_train: int32, shape (n_train,), values in [0, num_classes).
        x_test, y_test: the held-out split, same dtypes.
        num_classes: number of classes.
        name: where the data came from.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    name: str

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.x_train.shape[1:])  # type: ignore[return-value]

    @property
    def num_features(self) -> int:
        return int(np.prod(self.image_shape))


def _as_images(x: np.ndarray, source: str) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim >= 2 and 0 in x.shape[1:]:  # a model with no input features trains on nothing
        raise ValueError(f"{source}: 'x' has no features per example (shape {x.shape}); give each example at least one value.")
    if np.iscomplexobj(x):  # the cast to float32 would drop the imaginary part, silently
        raise ValueError(f"{source}: 'x' is complex ({x.dtype}); give real values (e.g. np.abs(x) or the real and imaginary parts as features).")
    if x.ndim == 2:  # flat features: a square image if possible, else 1 x n
        n = x.shape[1]
        side = int(round(n**0.5))
        x = x.reshape(len(x), side, side, 1) if side * side == n else x.reshape(len(x), 1, n, 1)
    elif x.ndim == 3:
        x = x[..., None]
    elif x.ndim != 4:
        raise ValueError(
            f"{source}: 'x' must have 2 to 4 dimensions (N, ...), got shape {x.shape}."
        )
    if not np.issubdtype(x.dtype, np.number):
        raise ValueError(f"{source}: 'x' must be numeric, got dtype {x.dtype}.")
    if not np.issubdtype(x.dtype, np.floating) or np.isfinite(x).all():
        with np.errstate(over="ignore"):
            x32 = x.astype(np.float32)
        if not np.isfinite(x32).all():  # finite float64 values past float32's largest
            big = float(np.abs(x.astype(np.float64)).max())
            raise ValueError(
                f"{source}: 'x' holds values beyond float32's range (largest magnitude {big:.3g}, "
                "float32's 3.4e38); rescale the data first."
            )
        x = x32
    else:
        raise ValueError(f"{source}: 'x' contains NaN or inf; clean the data first.")
    hi = float(x.max()) if x.size else 1.0
    return x / hi if hi > 1.0 else x


def load_dataset(
    data: str = "digits",
    *,
    num_classes: int | None = None,
    test_fraction: float = 0.2,
    seed: int = 0,
) -> Dataset:
    """Loads the comparison data.

    Args:
        data: ``"digits"`` (the 1,797 8x8 handwritten digits shipped inside scikit-learn, no
            download) or a path to an ``.npz`` holding ``x`` (N, ...) and ``y`` (N,) integer
            labels, e.g. MNIST.
        num_classes: the model's number of outputs; labels must lie in ``[0, num_classes)``.
            Default: ``max(y) + 1``.
        test_fraction: share of the examples held out for test accuracy, in (0, 1).
        seed: seed of the train/test split.

    Raises:
        FileNotFoundError: the ``.npz`` does not exist.
        ValueError: a malformed file (missing keys, wrong shapes, non-integer or out-of-range
            labels), naming the fix.
        ImportError: scikit-learn is missing for ``digits`` (names the extra).
    """
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}.")
    if data == "digits":
        try:
            from sklearn.datasets import load_digits
        except ImportError:
            raise ImportError(
                'the digits data set comes with scikit-learn: pip install "unimp[compare]"'
            ) from None
        d = load_digits()
        x, y, name = (
            d.images.astype(np.float32) / 16.0,
            d.target,
            "digits (scikit-learn, 1797 8x8 images)",
        )
    else:
        path = os.fspath(data)
        if not path.endswith(".npz"):
            raise ValueError(
                f"--data must be 'digits' or a path to an .npz file with 'x' and 'y', got {path!r}."
            )
        if not os.path.exists(path):
            raise FileNotFoundError(f"data file {path!r} does not exist.")
        import zipfile

        if not zipfile.is_zipfile(path):  # np.load would read it as a pickle and talk of allow_pickle
            raise ValueError(
                f"{path}: not an .npz archive (an .npz is a zip of .npy arrays); write one with "
                "numpy.savez(path, x=images, y=labels)."
            )
        try:
            with np.load(path, allow_pickle=False) as f:
                keys = set(f.files)
                if not {"x", "y"} <= keys:
                    raise ValueError(f"{path}: needs arrays 'x' and 'y', found {sorted(keys)}.")
                x, y = f["x"], f["y"]
        except (OSError, EOFError) as e:  # zipfile errors are OSError / BadZipFile subclasses
            raise ValueError(f"{path}: not a readable .npz file ({e}).") from None
        except Exception as e:
            if isinstance(e, ValueError) and str(e).startswith(path):
                raise
            raise ValueError(
                f"{path}: not a readable .npz file ({type(e).__name__}: {e})."
            ) from None
        name = os.path.basename(path)
    x = _as_images(x, name)
    y = np.asarray(y)
    if y.ndim != 1 or len(y) != len(x):
        raise ValueError(f"{name}: 'y' must have shape ({len(x)},), got {y.shape}.")
    if not np.issubdtype(y.dtype, np.integer):
        if np.issubdtype(y.dtype, np.floating) and np.all(np.mod(y, 1) == 0):
            y = y.astype(np.int64)
        else:
            raise ValueError(
                f"{name}: labels 'y' must be integers (class indices), got dtype {y.dtype}."
            )
    if len(y) < 10:
        raise ValueError(f"{name}: needs at least 10 examples, got {len(y)}.")
    classes = int(y.max()) + 1 if num_classes is None else num_classes
    if classes > _MAX_CLASSES:
        raise ValueError(
            f"{name}: the largest label is {int(y.max())}, which would give a model with "
            f"{classes} outputs; labels must be class indices 0 .. C-1 (at most {_MAX_CLASSES} classes)."
        )
    if y.min() < 0 or y.max() >= classes:
        raise ValueError(
            f"{name}: labels must lie in [0, {classes}) for a model with {classes} outputs, "
            f"got [{int(y.min())}, {int(y.max())}]."
        )
    y = y.astype(np.int32)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(x))
    n_test = max(1, int(round(len(x) * test_fraction)))
    test, train = order[:n_test], order[n_test:]
    return Dataset(x[train], y[train], x[test], y[test], classes, name)


def batches(
    ds: Dataset, *, batch_size: int, epochs: int, seed: int, dropout: float, hidden: int
) -> list[dict[str, np.ndarray]]:
    """The training batches, from one NumPy shuffle per epoch, with the dropout masks drawn in
    NumPy so every framework drops the same units.

    Returns:
        A list of ``{"x": float32 (B, H, W, C), "y": int32 (B,), "mask": float32 (B, hidden)}``;
        ``mask`` holds 0 or ``1/(1-dropout)`` (inverted dropout). The last partial batch of
        an epoch is dropped so every step has the same shape (no recompilation).
    """
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}.")
    if batch_size > len(ds.x_train):
        raise ValueError(
            f"--batch-size {batch_size} is larger than the {len(ds.x_train)} training examples."
        )
    if not 0 <= dropout < 1:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}.")
    rng = np.random.default_rng(seed + 1)
    out = []
    n = len(ds.x_train)
    for _ in range(epochs):
        order = rng.permutation(n)
        for start in range(0, n - batch_size + 1, batch_size):
            idx = order[start : start + batch_size]
            if dropout > 0:
                keep = rng.random((batch_size, hidden)) >= dropout
                mask = keep.astype(np.float32) / np.float32(1 - dropout)
            else:
                mask = np.ones((batch_size, hidden), np.float32)
            out.append({"x": ds.x_train[idx], "y": ds.y_train[idx], "mask": mask})
    return out
