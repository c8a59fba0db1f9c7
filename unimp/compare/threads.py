"""``unimp compare --threads N``: the CPU threads each framework runs its ops on.

On a shared or busy CPU, torch's OpenMP pool can be an order of magnitude slower with as
many threads as cores than with one (its workers wait on cores other processes hold): on a
loaded 2-core machine the seeds' MLP took 58 ms a step with 2 threads against 6 ms with 1.
TensorFlow's and JAX's pools degrade far less. Setting the same count for every framework
makes the "median step ms" row comparable there.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator

#: The most threads ``--threads`` takes. Beyond the cores, threads only wait on each other (the
#: point of the flag is fewer), and the largest machines have under 1024 logical CPUs (two
#: 192-core, 2-way SMT EPYCs: 768). Far larger counts fail inside the frameworks, half-way
#: through setting them: with 10**6, starting TensorFlow after torch raised MemoryError (or
#: the process died once its ops ran); past 2**31 - 1 torch says "Overflow when unpacking long".
MAX_THREADS = 1024


def check_threads(n: object) -> int:
    """``n`` checked as a ``--threads`` count.

    Args:
        n: the count given.

    Returns:
        ``n``, an int in ``[1, MAX_THREADS]``.

    Raises:
        ValueError: ``n`` is not an integer (a bool is not) in ``[1, MAX_THREADS]``.
    """
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_THREADS:
        raise ValueError(
            f"--threads must be an integer >= 1 and <= {MAX_THREADS}, got {n!r}."
        )
    return n


@contextlib.contextmanager
def threads(backends: Iterable[str], n: int) -> Iterator[dict[str, str]]:
    """Runs the block with the CPU intra-op threads of each framework in ``backends`` at ``n``.

    torch's count is restored on exit (it is process-wide, and ``run_compare`` may run inside a
    user's process), and also when setting a later framework's fails; TensorFlow's cannot be
    changed back once its runtime has started.

    * torch: ``torch.set_num_threads(n)`` (the OpenMP pool; process-wide).
    * tensorflow: ``tf.config.threading.set_intra_op_parallelism_threads(n)`` and the same for
      inter-op; TensorFlow takes them only before its runtime starts, so in a process where it
      already ran they stay as they are, with a warning.
    * jax: XLA:CPU has no thread setting (jax-ml/jax#1539: its Eigen pool is sized to the
      machine), so JAX keeps its own; said in the result and the report.
    * ``keras-tensorflow`` / ``keras-torch``: ``n``, set by the engine's worker process when
      it starts (``RunSpec.threads``, the same calls as above); ``keras-jax`` as ``jax``.

    Args:
        backends: backend names (``torch``, ``tensorflow``, ``jax``, ``keras-*``).
        n: threads, in ``[1, MAX_THREADS]`` (1024: more than any machine's logical CPUs).

    Yields:
        ``{backend: what was set}``, e.g. ``{"torch": "1", "jax": "framework default (...)"}``;
        the report keeps it.

    Raises:
        ValueError: ``n`` is not an integer in ``[1, MAX_THREADS]``; nothing is changed.
    """
    check_threads(n)
    out: dict[str, str] = {}
    restore = None
    try:  # the settings too: torch's is undone when a later framework's fails
        for b in backends:
            if b == "torch":
                import torch

                if restore is None:  # the count before this block, even if torch is listed twice
                    restore = torch.get_num_threads()
                torch.set_num_threads(n)
                out[b] = str(torch.get_num_threads())
            elif b == "tensorflow":
                import tensorflow as tf

                held = (
                    tf.config.threading.get_intra_op_parallelism_threads(),
                    tf.config.threading.get_inter_op_parallelism_threads(),
                )
                if held == (n, n):  # set before (compare's check of a user's Keras model)
                    out[b] = str(n)
                    continue
                try:
                    tf.config.threading.set_intra_op_parallelism_threads(n)
                    tf.config.threading.set_inter_op_parallelism_threads(n)
                    out[b] = str(n)
                except RuntimeError:  # "... cannot be modified after initialization"
                    warnings.warn(
                        f"--threads {n}: TensorFlow already started in this process, so its "
                        "thread pools keep their size; run unimp compare in a fresh process to "
                        "set them.",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                    out[b] = "framework default (TensorFlow had already started)"
            elif b == "jax" or b == "keras-jax":
                out[b] = "framework default (XLA:CPU has no thread setting)"
            elif b.startswith("keras-"):  # set in the engine's worker process, at its start
                out[b] = str(n)
        yield out
    finally:
        if restore is not None:
            import torch

            torch.set_num_threads(restore)
