"""Keras 3 on whichever backend ``KERAS_BACKEND`` selects (TensorFlow, JAX or torch): the pieces
of unimp written against ``keras.ops`` only.

* ``optimizer``: :class:`LossScaleOptimizer`, unimp's loss-scale rule in a Keras optimizer
  (``model.fit``, custom loops, Keras's stateless step on JAX), and :class:`KerasOps`, the
  rule's array namespace over ``keras.ops``, and :class:`LossScaleCheck`, the ``fit`` callback
  acting on the config's ``max_consecutive_skips`` and ``floor_action``.

On Keras's TensorFlow backend, :mod:`unimp.backends.tensorflow` is the whole backend
(``tf.distribute``, Horovod, the train step, statistics, trace, float8); this package is what
runs on every Keras backend. Importing it imports Keras (and the backend Keras selects).

This ``__init__`` only re-exports; import the public names from here.
"""

from unimp.keras.optimizer import KerasOps, LossScaleCheck, LossScaleOptimizer

__all__ = ["KerasOps", "LossScaleCheck", "LossScaleOptimizer"]
