"""How a half-precision parameter takes its update: rounded to nearest, Kahan-compensated, or
stochastically rounded. The rule is written once over an array namespace, as the loss-scale
rule is; :class:`NumpyOps` is its reference, and each backend's ``optimizer.py`` has an
``UpdateOps`` with the same names on its own tensors.

Pure bfloat16 training (bfloat16 parameters, no float32 master weights) rounds every update
into the parameter. With round to nearest a bfloat16 weight cannot take a step below half its
spacing (2**-8 at 1.0): a weight of 1.0 given 1,000 steps of -1e-3 stays exactly 1.0. Two
known fixes, each from one framework until now:

* ``"kahan"``: Kahan-compensated summation (the ``optimi`` optimizers for torch). A
  compensation buffer ``c`` in the parameter's dtype (2 bytes per bfloat16 parameter) keeps
  what rounding lost; each update adds it back: ``y = delta + c``, ``p' = round(p + y)``,
  ``c' = round(y - (p' - p))``, computed in float32 and rounded once each.
* ``"stochastic"``: stochastic rounding (torchao's ``bf16_stochastic_round``): ``p + delta``
  in float32 is rounded down or up to a bfloat16 neighbour with probabilities given by its
  distance to each, so the rounding is unbiased on average. The random bits come from a
  counter-based hash of ``(seed, step, parameter index, element index)`` (:func:`random_bits`)
  in int32 arithmetic every framework computes the same way, so one seed gives the same bits,
  hence the same parameters, in torch, TensorFlow and JAX; no generator state, no host sync.

Both take the update ``delta`` in float32 (the inner optimizer's, computed from the half
parameter as in :mod:`unimp.backends` for pure half precision) and leave the rest of the
optimizer as the framework keeps it.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from unimp.dtypes import canonical_dtype

__all__ = [
    "UPDATE_MODES",
    "NumpyOps",
    "apply_update",
    "check_seed",
    "check_update_mode",
    "check_update_state",
    "random_bits",
    "step_seed",
    "stochastic_round",
    "update_half",
]

#: The ways a half-precision parameter takes its update (a policy's ``update`` field).
UPDATE_MODES = ("nearest", "kahan", "stochastic")

# lowbias32, a 32-bit integer hash (Chris Wellons, "hash-prospector": x ^= x >> 16;
# x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16), in int32 two's complement
_M1 = 0x7FEB352D
_M2 = 0x846CA68B - (1 << 32)
#: The low 16 bits of a float32: what rounding to bfloat16 drops.
_LOW16 = 0xFFFF
_HIGH16 = -0x10000  # 0xFFFF0000 as int32


def check_seed(seed: Any, what: str) -> int:
    """A stochastic-rounding seed checked: any integer (Python, NumPy), its low 32 bits used
    by :func:`random_bits`; one rule for every backend's ``half_update`` and the step option.

    Raises:
        TypeError: a bool, float or anything else, naming ``what``.
    """
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"{what} must be an integer (e.g. 0), got {seed!r}.")
    return int(seed)


def step_seed(held_mode: str, held_seed: int, started: bool, mode: str, seed: int, fix: str) -> int:
    """The seed an optimizer that already applies a rule (``held_mode``, ``held_seed``; one
    ``mp.prepare`` installed with seed 0) runs under a train step asking for ``mode`` and
    ``seed``: the step's seed until the optimizer has stepped (``started``), then its own.
    One rule for every backend's ``train_step``.

    Raises:
        ValueError: another mode (``fix`` names the plain optimizer to pass instead), or another
            seed after the optimizer has stepped.
    """
    if held_mode != mode:
        raise ValueError(
            f"the optimizer applies update={held_mode!r}, the recipe's policy says update={mode!r}: "
            f"give the step {fix}, or a recipe with update={held_mode!r}."
        )
    if mode != "nearest" and held_seed != seed and started:
        raise ValueError(
            f"the optimizer has stepped with rounding seed {held_seed}; the step asks for "
            f"rounding_seed={seed}: pass rounding_seed={held_seed} to keep its random bits."
        )
    return seed if mode != "nearest" else held_seed


def check_update_mode(mode: Any, param_dtype: str | None = None) -> str:
    """``mode`` checked (case and surrounding spaces ignored): one of :data:`UPDATE_MODES`;
    ``"stochastic"`` needs bfloat16 parameters (it rounds float32 to its top 16 bits).

    Raises:
        ValueError: an unknown mode, or stochastic rounding for another dtype (named).
    """
    if isinstance(mode, str):
        mode = mode.strip().lower()  # "Kahan", " stochastic": as policy strings are read
    if mode not in UPDATE_MODES:
        raise ValueError(f"update must be one of {UPDATE_MODES}, got {mode!r}.")
    if param_dtype is not None:
        param_dtype = canonical_dtype(param_dtype)
    if mode == "stochastic" and param_dtype is not None and param_dtype != "bfloat16":
        raise ValueError(
            f"update='stochastic' rounds float32 to bfloat16 (its top 16 bits); the parameters are "
            f"{param_dtype}: use update='kahan' for them, or bfloat16 parameters."
        )
    return mode


class NumpyOps:
    """The array namespace of the reference: NumPy float32 / int32 arrays, ml_dtypes bfloat16.

    A backend provides the same names on its own tensors (``unimp/backends/*/optimizer.py``).
    """

    where = staticmethod(np.where)
    isfinite = staticmethod(np.isfinite)

    @staticmethod
    def f32(x: Any) -> Any:
        return np.asarray(x, np.float32)

    @staticmethod
    def i32(x: Any) -> Any:
        return np.asarray(x, np.int32)

    @staticmethod
    def to_dtype(x: Any, dtype: str) -> Any:
        import ml_dtypes

        return np.asarray(x).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype))

    @staticmethod
    def bits(x: Any) -> Any:
        """A float32 array's bit patterns as int32 (a view: exact)."""
        return np.asarray(x, np.float32).view(np.int32)

    @staticmethod
    def from_bits(b: Any) -> Any:
        return np.asarray(b, np.int32).view(np.float32)

    @staticmethod
    def iota(shape: tuple[int, ...]) -> Any:
        """Each element's index in row-major order, int32, of ``shape``."""
        return np.arange(math.prod(shape), dtype=np.int32).reshape(shape)

    @staticmethod
    def xor(a: Any, b: Any) -> Any:
        return np.bitwise_xor(np.asarray(a, np.int32), np.asarray(b, np.int32))

    @staticmethod
    def and_(a: Any, b: Any) -> Any:
        return np.bitwise_and(np.asarray(a, np.int32), np.asarray(b, np.int32))

    @staticmethod
    def shr(x: Any, k: int) -> Any:
        """Logical right shift of int32 (zeros in from the left)."""
        return np.bitwise_and(np.right_shift(np.asarray(x, np.int32), k), np.int32((1 << (32 - k)) - 1))

    @staticmethod
    def add(a: Any, b: Any) -> Any:
        with np.errstate(over="ignore"):
            return np.add(np.asarray(a, np.int32), np.asarray(b, np.int32), dtype=np.int32)

    @staticmethod
    def mul(a: Any, b: Any) -> Any:
        """int32 multiplication modulo 2**32 (two's complement wrap-around)."""
        with np.errstate(over="ignore"):
            return np.multiply(np.asarray(a, np.int32), np.asarray(b, np.int32), dtype=np.int32)


def _mix(ops: Any, x: Any) -> Any:
    """lowbias32 over int32 arrays (see the module's constants)."""
    x = ops.xor(x, ops.shr(x, 16))
    x = ops.mul(x, ops.i32(_M1))
    x = ops.xor(x, ops.shr(x, 15))
    x = ops.mul(x, ops.i32(_M2))
    return ops.xor(x, ops.shr(x, 16))


def random_bits(ops: Any, seed: Any, step: Any, index: Any, shape: tuple[int, ...]) -> Any:
    """32 random bits per element (int32 of ``shape``), a pure function of ``(seed, step,
    index, element index)``: ``mix(mix(mix(mix(seed) ^ step) ^ index) ^ element)`` with
    ``mix`` lowbias32. ``seed``, ``step`` and ``index`` are int32 scalars (a device counter in
    a compiled step is fine); the same in every framework, bit for bit."""
    seed, step, index = (_int32(x, n) for x, n in ((seed, "seed"), (step, "step"), (index, "index")))
    key = _mix(ops, ops.xor(_mix(ops, ops.xor(_mix(ops, ops.i32(seed)), ops.i32(step))), ops.i32(index)))
    return _mix(ops, ops.xor(ops.iota(shape), key))


def _int32(x: Any, name: str) -> Any:
    """A host integer as the int32 with its low 32 bits (every framework alike: 2**31 is
    -2**31, 2**40 is 0); an array is taken as it is (an int32 device counter). Raises
    ``TypeError`` for a float or bool, which frameworks truncate or refuse differently."""
    if isinstance(x, (bool, np.bool_)) or isinstance(x, (float, np.floating)):
        raise TypeError(f"random_bits: {name} must be an integer, got {x!r}.")
    if isinstance(x, (int, np.integer)):
        return ((int(x) + 2**31) % 2**32) - 2**31
    return x


def stochastic_round(ops: Any, x: Any, bits: Any) -> Any:
    """float32 ``x`` rounded to bfloat16 stochastically: the 16 bits bfloat16 drops, read as a
    fraction of its spacing, round up with that probability (``(bits(x) + r) & 0xFFFF0000``
    for 16 random bits ``r`` from ``bits``, on the magnitude, so negatives round the same
    way). inf and NaN are kept; a value past bfloat16's largest may round to inf, as round to
    nearest does. Returns a bfloat16 array (the conversion is exact)."""
    x = ops.f32(x)
    r = ops.and_(bits, ops.i32(_LOW16))
    up = ops.from_bits(ops.and_(ops.add(ops.bits(x), r), ops.i32(_HIGH16)))
    return ops.to_dtype(ops.where(ops.isfinite(x), up, x), "bfloat16")


def apply_update(
    ops: Any,
    mode: str,
    param: Any,
    delta: Any,
    compensation: Any = None,
    bits: Any = None,
) -> tuple[Any, Any]:
    """A half parameter after its update ``delta``, by ``mode`` (:data:`UPDATE_MODES`).

    Args:
        ops: the array namespace (:class:`NumpyOps` or a backend's ``UpdateOps``).
        mode: ``"nearest"`` (``round(p + delta)``), ``"kahan"`` or ``"stochastic"`` (see the
            module docstring).
        param: the parameter, in its half dtype.
        delta: the update to add, float32, ``param``'s shape (``-lr * g`` for SGD).
        compensation: ``"kahan"``: the compensation buffer, ``param``'s dtype and shape.
        bits: ``"stochastic"``: :func:`random_bits` for this parameter and step.

    Returns:
        ``(new_param, new_compensation)``, ``new_param`` in ``param``'s dtype;
        ``new_compensation`` is None except for ``"kahan"``.

    Raises:
        ValueError: an unknown mode, or a mode's buffer missing.
    """
    dtype = canonical_dtype(param.dtype)
    wide = ops.f32(param)
    if mode == "nearest":
        return ops.to_dtype(wide + ops.f32(delta), dtype), None
    if mode == "kahan":
        if compensation is None:
            raise ValueError("update='kahan' needs the parameter's compensation buffer.")
        y = ops.f32(delta) + ops.f32(compensation)
        new = ops.to_dtype(wide + y, dtype)
        return new, ops.to_dtype(y - (ops.f32(new) - wide), dtype)
    if mode == "stochastic":
        if bits is None:
            raise ValueError("update='stochastic' needs the parameter's random bits (random_bits).")
        check_update_mode(mode, dtype)
        return stochastic_round(ops, wide + ops.f32(delta), bits), None
    check_update_mode(mode)
    raise AssertionError("unreachable")


def update_half(
    ops: Any,
    mode: str,
    param: Any,
    target: Any,
    compensation: Any = None,
    *,
    seed: Any = 0,
    step: Any = 0,
    index: Any = 0,
) -> tuple[Any, Any]:
    """One half parameter's update as every backend's optimizer wrapper applies it.

    The inner optimizer runs in float32 on a float32 copy of the half parameter (its state as
    it keeps it), and its float32 result ``target`` is what the parameter would become with
    float32 master weights. The update is ``delta = target - param`` in float32 (exact
    wherever ``target`` is within a factor of two of ``param``), applied by ``mode``
    (:func:`apply_update`); stochastic rounding draws :func:`random_bits` ``(seed, step,
    index)``, where ``step`` counts the parameter's applied updates before this one (0 on the
    first) and ``index`` is its position in the optimizer's parameter list.

    Args:
        ops: the array namespace (:class:`NumpyOps` or a backend's ``UpdateOps``).
        mode: one of :data:`UPDATE_MODES`.
        param: the parameter, bfloat16 or float16.
        target: float32, ``param``'s shape: the inner optimizer's float32 result.
        compensation: ``"kahan"``: the compensation buffer (``param``'s dtype and shape).
        seed, step, index: int32 scalars (host integers or device counters).

    Returns:
        ``(new_param, new_compensation)`` as :func:`apply_update`.
    """
    delta = ops.f32(target) - ops.f32(param)
    bits = random_bits(ops, seed, step, index, tuple(param.shape)) if mode == "stochastic" else None
    return apply_update(ops, mode, param, delta, compensation, bits)


def check_update_state(state: Any, mode: str | None = None, count: int | None = None) -> dict[str, Any]:
    """A portable update-rule state checked: what each backend's ``export_update_state``
    writes and ``import_update_state`` reads, so a run can continue in another framework.

    ``{"update": mode, "seed": int, "params": [entry or None, ...]}``, one entry per parameter
    in the rule's index order (the optimizer's parameter list; ``None`` for a parameter the
    rule does not touch: float32, or not stepped yet), each ``{"step": int, "compensation":
    float32 NumPy array or None}``: the parameter's applied updates (stochastic rounding's
    counter) and its Kahan compensation buffer, in the parameter's own layout (a framework
    that lays a weight out transposed, Keras's ``Dense`` kernel against torch's ``Linear``,
    needs the buffer transposed too, and stochastic rounding then draws other bits per
    element).

    Args:
        state: the dict.
        mode: the importing rule's mode, which must be the state's.
        count: the number of parameters the importing optimizer has, which must be the state's.

    Returns:
        The state with NumPy float32 compensation arrays and int steps.

    Raises:
        ValueError: not such a dict, another mode or parameter count (named).
    """
    if not isinstance(state, dict) or set(state) != {"update", "seed", "params"}:
        raise ValueError(
            "an update-rule state is a dict with 'update', 'seed' and 'params' (what "
            f"export_update_state writes), got {type(state).__name__} "
            f"{sorted(state) if isinstance(state, dict) else ''}."
        )
    state = {**state, "update": check_update_mode(state["update"])}
    if mode is not None and state["update"] != mode:
        raise ValueError(
            f"the state is of update={state['update']!r}; this optimizer applies update={mode!r}."
        )
    seed = state["seed"]
    try:
        seed = check_seed(seed, "the state's seed")
    except TypeError as e:
        raise ValueError(str(e)) from None
    params = state["params"]
    if not isinstance(params, (list, tuple)):
        raise ValueError(f"the state's 'params' must be a list, got {type(params).__name__}.")
    if count is not None and len(params) != count:
        raise ValueError(
            f"the state has {len(params)} parameters, this optimizer {count}: export and import "
            "the same model's parameters, in the same order."
        )
    out = []
    for i, entry in enumerate(params):
        if entry is None:
            out.append(None)
            continue
        if not isinstance(entry, dict) or set(entry) != {"step", "compensation"}:
            raise ValueError(f"the state's params[{i}] must be None or {{'step', 'compensation'}}, got {entry!r}.")
        step = entry["step"]
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 0 <= step < 2**31:
            raise ValueError(
                f"the state's params[{i}]['step'] must be an integer in [0, 2**31) (every backend "
                f"counts in int32), got {step!r}."
            )
        comp = entry["compensation"]
        out.append({
            "step": int(step),
            "compensation": None if comp is None else np.asarray(comp, np.float32),
        })
    return {"update": state["update"], "seed": int(seed), "params": out}
