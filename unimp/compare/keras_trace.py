"""The dtype traces of Keras's engines (``keras-tensorflow``, ``keras-jax``, ``keras-torch``) in
``unimp trace`` and ``unimp compare``: named after the engine, and explained where Keras or
the engine picks an op's dtype (as each backend's ``trace.NOTES``). Framework-free; the traces
are recorded in Keras workers (:mod:`unimp.compare.keras_step`)."""

from __future__ import annotations

import dataclasses

from unimp.trace import KERAS_NOTES, Trace

__all__ = ["NOTES", "engine_trace"]

#: ``{engine: {op or layer: (dtype, why)}}``: why an op runs in a dtype on each Keras engine
#: (:func:`unimp.trace.diff` shows a note where the op ran in its dtype): Keras's choices, and
#: the engine's own (keras/src/backend/torch/numpy.py ``matmul`` and nn.py ``log_softmax``
#: compute float16 in float32 on the CPU; ``jnp.sum`` on JAX).
NOTES: dict[str, dict[str, tuple[str, str]]] = {
    "keras-tensorflow": KERAS_NOTES,
    "keras-jax": {
        **KERAS_NOTES,
        "reduce_sum": ("float32", "jnp.sum accumulates half-precision inputs in float32"),
    },
    "keras-torch": {
        **KERAS_NOTES,
        "matmul": ("float32", "Keras's torch backend computes float16 matmuls in float32 on the CPU"),
        "log_softmax": ("float32", "Keras's torch backend computes float16 log_softmax in float32 on the CPU"),
    },
}


def engine_trace(found: Trace, engine: str) -> Trace:
    """``found`` (a Keras step's trace) with every record's ``framework`` the engine's name:
    Keras on TensorFlow is traced by the TensorFlow backend, whose records say ``tensorflow``.

    Args:
        found: the trace.
        engine: a key of :data:`NOTES`.
    """
    return Trace([dataclasses.replace(r, framework=engine) for r in found], engine, found.recipe)
