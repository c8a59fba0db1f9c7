"""The environment variables unimp reads or sets, in one table: the documentation's table is
generated from :data:`VARIABLES`, and a test checks that every variable the library's code
names is here.

Example:
    >>> VARIABLES["UNIMP_FP8_NATIVE"].values
    '"1": on; anything else, or unset: off'
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["VARIABLES", "Variable"]


class Variable(NamedTuple):
    """One environment variable: who reads (or sets) it, its values, and what it does."""

    used_by: str
    values: str
    effect: str


#: Every environment variable the library reads or sets, by name.
VARIABLES: dict[str, Variable] = {
    "UNIMP_FP8_NATIVE": Variable(
        "float8 layers built with `native=None` (the default: the layers `mp.prepare` swaps in) in "
        "torch, TensorFlow and JAX (`unimp.fp8.NATIVE_ENV`)",
        '"1": on; anything else, or unset: off',
        "runs the float8 GEMMs natively (torch `_scaled_mm`, XLA's cuBLASLt rewrite) where the "
        "device has float8 units, emulated elsewhere with a warning; read when a layer is built",
    ),
    "KERAS_BACKEND": Variable(
        'Keras itself, and `unimp.registry.keras_engine()` (`backend="keras"`) before Keras is '
        "imported; `unimp compare` sets it for each keras-* worker, and `unimp compare`, `trace` "
        "and `audit` set it to tensorflow in their own process",
        '"tensorflow", "jax" or "torch"',
        "the engine Keras runs on, fixed per process: which `MixedPrecision` `backend=\"keras\"` binds",
    ),
    "KERAS_HOME": Variable(
        "`unimp.registry.keras_engine()` when neither Keras nor `KERAS_BACKEND` names the engine",
        "a directory (default `~/.keras`)",
        "where `keras.json`'s `backend` is read from",
    ),
    "TF_ENABLE_ONEDNN_OPTS": Variable(
        "TensorFlow itself; `unimp compare` reads it for its note on TensorFlow's float16 speed on a CPU",
        '"0": oneDNN off; unset or "1": on',
        "TensorFlow's oneDNN kernels, whose float16 steps on a CPU can be many times slower "
        "(compare notes it when TensorFlow's steps run over 5x the others')",
    ),
    "TF_CPP_MIN_LOG_LEVEL": Variable(
        "the `unimp` command line (set to 2 unless already set); importing unimp sets nothing",
        '"0" to "3"',
        "keeps TensorFlow's C++ start-up log out of the commands' output",
    ),
}
