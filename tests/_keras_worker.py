"""One Keras backend's side of tests/test_keras_backends.py, run in a process of its own
(Keras's backend is fixed per process): ``KERAS_BACKEND=jax python tests/_keras_worker.py CASE``
prints one JSON object. The test compares the backends' objects with each other and with the
NumPy reference."""

from __future__ import annotations

import json
import pathlib
import sys
import tempfile
import warnings

import keras
import numpy as np
from keras import ops

from unimp.keras import LossScaleOptimizer
from unimp.loss_scale import DynamicLossScale

BACKEND = keras.backend.backend()

#: per step: a gradient multiplier (inf / nan plant an overflow), then 0 = clean
EVENTS = [1.0, 1.0, np.inf, 1.0, 1.0, 1.0, np.nan, np.inf, 1.0, 1.0, 1.0, 1.0, 1.0]
RULES = {
    "keras": DynamicLossScale.preset("keras", init_scale=2.0**4, growth_interval=2),
    "hysteresis": DynamicLossScale(
        init_scale=2.0**6, growth_interval=3, hysteresis=2, min_scale=4.0, max_scale=2.0**7
    ),
}


def _np(x) -> np.ndarray:
    return np.asarray(ops.convert_to_numpy(x))


def _record(opt, w) -> dict:
    return {
        "scale": float(_np(opt.dynamic_scale.value)),
        "iterations": int(_np(opt.iterations.value)),
        "w": _np(w.value).tolist(),
    }


def _grads(i: int, scale) -> list:
    g = np.array([0.5, -0.25, 0.125], np.float32) * np.float32(EVENTS[i])
    return [ops.convert_to_tensor(g) * ops.cast(scale, "float32")]


def rule() -> dict:
    """unimp's optimizer in a custom loop, stateful apply; Keras's own beside it on the keras
    preset. Returns per step the scale, iterations and weights."""
    out = {}
    for name, cfg in RULES.items():
        rows = []
        opts = [("unimp", LossScaleOptimizer(keras.optimizers.Adam(0.1), loss_scale=cfg))]
        if name == "keras" and BACKEND != "jax":  # on JAX, Keras's own is stateless only
            opts.append(
                ("keras", keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.1), 2.0**4, 2))
            )
        for who, opt in opts:
            w = keras.Variable(np.array([1.0, 2.0, 3.0], np.float32))
            opt.build([w])
            rows = []
            for i in range(len(EVENTS)):
                opt.apply(_grads(i, opt.dynamic_scale.value), [w])
                rows.append(_record(opt, w))
            out[f"{name}/{who}"] = rows
    return out


def stateless() -> dict:
    """The same as :func:`rule`'s keras preset through ``stateless_apply`` (as Keras's JAX
    trainer calls it), unimp's class and Keras's."""
    out = {}
    for who, opt in (
        ("unimp", LossScaleOptimizer(keras.optimizers.Adam(0.1), initial_scale=2.0**4, dynamic_growth_steps=2)),
        ("keras", keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.1), 2.0**4, 2)),
    ):
        w = keras.Variable(np.array([1.0, 2.0, 3.0], np.float32))
        opt.build([w])
        ov = [v.value for v in opt.variables]
        tv = [w.value]
        rows = []
        scale_at = [v.path for v in opt.variables].index(opt.dynamic_scale.path)
        iter_at = [v.path for v in opt.variables].index(opt.iterations.path)
        step = opt.stateless_apply
        if BACKEND == "jax":  # as Keras's JAX trainer runs it (eagerly, Keras's lax.cond
            import jax  # compiles its branches and ours runs op by op: rounding may differ)

            step = jax.jit(step)
        for i in range(len(EVENTS)):
            tv, ov = step(ov, _grads(i, ov[scale_at]), tv)
            rows.append({"scale": float(_np(ov[scale_at])), "iterations": int(_np(ov[iter_at])), "w": _np(tv[0]).tolist()})
        out[who] = rows
    return out


def _data(n: int = 64, features: int = 8, classes: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype(np.float32)
    y = rng.integers(0, classes, size=n).astype(np.int32)
    return x, y


def _mlp(weights_seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(weights_seed)
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu", name="fc1"),
            keras.layers.Dense(4, name="fc2", dtype="float32"),
        ]
    )


def _attention() -> keras.Model:
    keras.utils.set_random_seed(0)
    x = keras.Input((4, 8))
    y = keras.layers.LayerNormalization(name="ln")(x)
    y = keras.layers.Add()([x, keras.layers.MultiHeadAttention(2, 4, name="mha")(y, y)])
    y = keras.layers.GlobalAveragePooling1D()(y)
    return keras.Model(x, keras.layers.Dense(4, name="head", dtype="float32")(y))


def _set_weights(model: keras.Model, seed: int = 1) -> None:
    """The same initial weights on every backend: drawn by NumPy, not by the backend's RNG."""
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(scale=0.3, size=w.shape).astype(np.float32) for w in model.get_weights()])


def losses32() -> dict:
    """Per-step float32 losses over 50 steps of SGD, the MLP and an attention model, the same
    weights and batches on every backend."""
    keras.config.set_dtype_policy("float32")
    out = {}
    for name, make, shape in (("mlp", _mlp, (8,)), ("attention", _attention, (4, 8))):
        model = make()
        _set_weights(model)
        model.compile(
            optimizer=keras.optimizers.SGD(0.05),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        x, y = _data(n=16 * 50, features=int(np.prod(shape)))
        x = x.reshape((-1, *shape))
        out[name] = [
            float(np.asarray(model.train_on_batch(x[i * 16 : (i + 1) * 16], y[i * 16 : (i + 1) * 16])))
            for i in range(50)
        ]
    return out


def fit16() -> dict:
    """``mixed_float16`` ``model.fit`` with a batch whose float16 backward overflows (a large
    input, finite loss) at step 5: per-step scale and iterations, from a callback that reads
    them after each batch."""
    keras.config.set_dtype_policy("mixed_float16")
    model = _mlp()
    _set_weights(model)
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=2.0**15, dynamic_growth_steps=4)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data(n=16 * 12)
    x[16 * 5 : 16 * 6] *= 3000.0  # forward finite in float16, the scaled backward is not
    rows = []
    compiles = _compile_counter()

    class Read(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if BACKEND == "jax":  # Keras's JAX trainer holds the state until asked
                self.model.jax_state_sync()
            rows.append(
                {
                    "scale": float(_np(opt.dynamic_scale.value)),
                    "iterations": int(_np(opt.iterations.value)),
                    "total_skips": int(_np(opt.total_skips.value)),
                    "loss": float(np.asarray(logs["loss"])),
                    "compilations": compiles["n"],
                }
            )

    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[Read()])
    out = {"rows": rows, "state": opt.state_dict()}
    if BACKEND == "jax":  # what reaches the host from Keras's jitted step (as benchmarks.syncs)
        import jax

        from benchmarks._kit_jax import HOST_PRIMITIVES, _primitives

        state = tuple(
            [v.value for v in vs]
            for vs in (model.trainable_variables, model.non_trainable_variables, opt.variables, model.metrics_variables)
        )
        jaxpr = jax.make_jaxpr(model.train_step)(state, (x[:16], y[:16]))
        out["host_primitives"] = sorted({n for n in _primitives(jaxpr.jaxpr) if any(h in n for h in HOST_PRIMITIVES)})
        out["primitives"] = len(_primitives(jaxpr.jaxpr))
    return out


def check() -> dict:
    """``LossScaleCheck`` in ``fit`` with ``max_consecutive_skips=2`` and every batch
    overflowing from the fourth on: where ``fit`` stops, and with what."""
    from unimp.keras import LossScaleCheck
    from unimp.loss_scale import LossScaleError

    keras.config.set_dtype_policy("mixed_float16")
    model = _mlp()
    _set_weights(model)
    cfg = DynamicLossScale(init_scale=2.0**15, max_consecutive_skips=2)
    model.compile(
        optimizer=LossScaleOptimizer(keras.optimizers.SGD(0.01), loss_scale=cfg),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x, y = _data(n=16 * 10)
    x[16 * 3 :] = np.inf
    seen = []

    class Count(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(batch)

    try:
        model.fit(x, y, batch_size=16, shuffle=False, verbose=0, callbacks=[Count(), LossScaleCheck()])
    except LossScaleError as e:
        return {"raised": type(e).__name__, "message": str(e), "batches": len(seen)}
    return {"raised": None, "batches": len(seen)}


def misuse() -> dict:
    """What breaks drop-in use or leaves things half-changed: per check, what happened."""
    out = {}

    def two():
        a, b = keras.Variable(np.ones(2, np.float32)), keras.Variable(np.ones(1, np.float32))
        opt = LossScaleOptimizer(keras.optimizers.Adam(0.1), loss_scale=8.0)
        opt.build([a, b])
        return opt, a, b

    def values(opt, *vs):
        return [_np(v.value).tolist() for v in (*vs, *opt.inner_optimizer.variables)]

    # a subset of the built variables, in another order (Keras's optimizers take it)
    opt, a, b = two()
    opt.apply([ops.ones((1,)) * 8.0], [b])
    out["subset"] = [_np(a.value).tolist(), _np(b.value).tolist()]
    # a failing inner step (a gradient of the wrong shape) changes nothing
    opt, a, b = two()
    before = values(opt, a, b)
    try:
        opt.apply([ops.ones((3,)), ops.ones((1,))], [a, b])
        out["failed_apply"] = "no error"
    except Exception:
        out["failed_apply"] = values(opt, a, b) == before
    # a state saved under another config is refused (a compiled step has the config built in)
    other = LossScaleOptimizer(keras.optimizers.Adam(0.1), loss_scale=DynamicLossScale(growth_interval=1))
    other.build([keras.Variable(np.ones(2, np.float32))])
    try:
        opt.load_state_dict(other.state_dict())
        out["other_config"] = "loaded"
    except ValueError as e:
        out["other_config"] = str(e)
    if BACKEND != "tensorflow":
        opt, a, b = two()
        ov, tv = [v.value for v in opt.variables], [a.value, b.value]
        try:
            opt.stateless_apply(ov, [ops.ones((2,))], tv)
            out["stateless_count"] = "no error"
        except ValueError as e:
            out["stateless_count"] = str(e)
        same = opt.stateless_apply(ov, [], tv)
        out["stateless_empty"] = same[0] is tv or [_np(x).tolist() for x in same[0]] == [[1.0, 1.0], [1.0]]
    if BACKEND == "jax":  # scale_loss inside the user's jax.jit leaves no tracer in the optimizer
        import jax

        opt, a, b = two()
        jax.jit(lambda x: opt.scale_loss(x))(np.float32(1.0))
        out["jit_scale_loss"] = float(_np(opt.scale_loss(1.0)))
    return out


def _compile_counter() -> dict:
    """JAX: a dict whose ``"n"`` counts XLA compilations from now on (as benchmarks.syncs)."""
    compiles = {"n": 0}
    if BACKEND == "jax":
        import jax
        from jax._src import dispatch

        def listen(event: str, duration: float, **kw) -> None:
            if event == dispatch.BACKEND_COMPILE_EVENT:
                compiles["n"] += 1

        jax.monitoring.register_event_duration_secs_listener(listen)
    return compiles


def syncs() -> dict:
    """torch: host reads per step of the Keras trainer's train_step, unimp's optimizer and
    Keras's own (counted as benchmarks.syncs counts torch's)."""
    import torch

    from benchmarks._kit_torch import count_host_reads

    keras.config.set_dtype_policy("mixed_float16")
    x, y = _data(n=16)
    out = {}
    for who, make in (
        ("unimp", lambda: LossScaleOptimizer(keras.optimizers.Adam(1e-3))),
        ("keras", lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3))),
    ):
        model = _mlp()
        model.compile(optimizer=make(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.train_on_batch(x, y)  # builds
        batch = (torch.as_tensor(x), torch.as_tensor(y))
        with count_host_reads() as counts:
            for _ in range(5):
                model.train_step(batch)
        out[who] = sum(counts.values()) / 5
    return out


#: step16: per step, the loss weight: 3e4 overflows the float16 backward (a finite loss),
#: inf the loss itself (a forward overflow)
STEP_WEIGHTS = [1.0, 1.0, 1.0, 3e4, 1.0, 1.0, np.inf, 1.0, 1.0, 1.0, 1.0, 1.0]
STEP_RULE = DynamicLossScale.preset("keras", init_scale=2.0**12, growth_interval=3)


def _bn_model(mp):
    """fc1 -> BatchNormalization -> head, built under ``mp``'s policy with NumPy weights and
    prepared; and a loss of ``(x, y, weight)`` batches (weight 3e4 overflows the float16
    backward, inf the loss)."""
    keras.utils.set_random_seed(0)
    with mp.autocast():
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(16, activation="relu", name="fc1"),
                keras.layers.BatchNormalization(name="bn"),
                keras.layers.Dense(4, name="head"),
            ]
        )
    _set_weights(model)
    mp.prepare(model)
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def loss_fn(m, batch):
        x, y, w = batch
        return ce(y, m(x, training=True)) * w

    return model, loss_fn


def step16() -> dict:
    """unimp's custom-loop ``train_step`` under ``mixed_float16;head:float32`` with
    ``backend="keras"`` (the TensorFlow backend's traced step on TensorFlow, unimp.keras's on
    JAX and torch), a BatchNormalization layer, the same weights and batches on every backend:
    per step the result's fields, ``iterations``, a weight and the BN moving mean; JAX's
    compilations after the first step; torch's host reads per step."""
    import unimp

    mp = unimp.mixed_precision("mixed_float16;head:float32", backend="keras", loss_scale=STEP_RULE)
    model, loss_fn = _bn_model(mp)

    step = mp.train_step(model, keras.optimizers.SGD(0.05), loss_fn)
    x, y = _data(n=16 * len(STEP_WEIGHTS))
    batches = [
        (x[16 * i : 16 * (i + 1)], y[16 * i : 16 * (i + 1)], np.float32(w))
        for i, w in enumerate(STEP_WEIGHTS)
    ]
    compiles = _compile_counter()
    rows, after_first = [], None
    for i, b in enumerate(batches):
        r = step(b)
        rows.append(
            {
                **{k: getattr(r, k) for k in ("loss", "scale", "applied", "loss_finite", "grads_finite", "total_skips")},
                "iterations": int(_np(step.optimizer.iterations.value)),
                "w": _np(model.get_layer("fc1").kernel.value).ravel()[:4].tolist(),
                "bn_mean": _np(model.get_layer("bn").moving_mean.value).ravel()[:4].tolist(),
            }
        )
        if i == 0:
            after_first = compiles["n"]
    out = {
        "rows": rows,
        "compilations_after_first": compiles["n"] - after_first,
        "policies": {layer.name: layer.dtype_policy.name for layer in model.layers},
        "output_dtype": keras.backend.standardize_dtype(model(x[:2]).dtype),
        "class": f"{type(mp).__module__}.{type(mp).__name__}",
    }
    if BACKEND == "torch":
        import torch

        from benchmarks._kit_torch import count_host_reads

        tb = [(torch.as_tensor(a), torch.as_tensor(c), torch.as_tensor(w)) for a, c, w in batches[:4]]
        with count_host_reads() as counts:
            for b in tb:
                step(b)
        out["host_reads_per_step"] = sum(counts.values()) / len(tb)
        with torch.no_grad():  # an evaluation loop's block around the call: the step still trains
            out["applied_under_no_grad"] = bool(step(tb[0]).applied)
    return out


def step_options() -> dict:
    """The same step with the options every backend takes: two micro-batches per step, a
    clip at norm 0.5, skipped steps counted in ``iterations`` and a step log; the second
    micro-batch of step 3 overflows the float16 backward."""
    import tempfile

    import unimp

    mp = unimp.mixed_precision("mixed_float16", backend="keras", loss_scale=STEP_RULE)
    with mp.autocast():
        model = _mlp()
    _set_weights(model)
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def loss_fn(m, batch):
        x, y, w = batch
        return ce(y, m(x)) * w

    log = pathlib.Path(tempfile.mkdtemp()) / "steps.jsonl"
    step = mp.train_step(
        model, keras.optimizers.SGD(0.05), loss_fn, grad_accum_steps=2, max_grad_norm=0.5,
        schedule_counts="attempted", log=str(log), log_every=3,
    )  # fmt: skip
    x, y = _data(n=8 * 16)
    rows = []
    for i in range(8):
        micro = [
            (x[8 * (2 * i + j) : 8 * (2 * i + j + 1)], y[8 * (2 * i + j) : 8 * (2 * i + j + 1)],
             np.float32(3e4 if (i, j) == (3, 1) else 1.0))
            for j in range(2)
        ]  # fmt: skip
        r = step(micro)
        rows.append(
            {
                **{k: getattr(r, k) for k in ("loss", "scale", "applied", "grad_norm", "total_skips")},
                "iterations": int(_np(step.optimizer.iterations.value)),
            }
        )
    step.close()
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    return {"rows": rows, "log_steps": [rec["step"] for rec in lines if "step" in rec]}


def stats16() -> dict:
    """``stats_every=2`` and a step log under ``mixed_float16`` with a BN layer, the float16
    backward overflowing at step 2 (a statistics step): per step the statistics (``to_dict``,
    or None) and the first non-finite tensor; the log's records."""
    import tempfile

    import unimp
    from unimp.stats import first_nonfinite

    mp = unimp.mixed_precision("mixed_float16", backend="keras", loss_scale=STEP_RULE)
    model, loss_fn = _bn_model(mp)

    log = pathlib.Path(tempfile.mkdtemp()) / "steps.jsonl"
    step = mp.train_step(model, keras.optimizers.SGD(0.05), loss_fn, stats_every=2, log=str(log), log_every=1)
    x, y = _data(n=16 * 4)
    rows = []
    for i, w in enumerate((1.0, 1.0, 3e4, 1.0)):
        r = step((x[16 * i : 16 * (i + 1)], y[16 * i : 16 * (i + 1)], np.float32(w)))
        st = None if r.stats is None else r.stats.to_dict()
        rows.append({"applied": r.applied, "stats": st, "first": None if st is None else first_nonfinite(st)})
    step.close()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return {"rows": rows, "log": [rec for rec in records if "step" in rec]}


def refusals() -> dict:
    """What unimp.keras refuses on this engine, each message; and a step whose loss_fn raises
    leaves the model, the optimizer and the loss scale as they were."""
    import unimp

    out = {}

    def said(f) -> str:
        try:
            f()
        except (ValueError, TypeError, NotImplementedError) as e:
            return f"{type(e).__name__}: {e}"
        return "accepted"

    other = "torch" if BACKEND == "jax" else "jax"
    out["other_engine"] = said(lambda: unimp.mixed_precision("mixed_float16", backend=f"keras-{other}"))
    out["fp8"] = said(lambda: unimp.mixed_precision("fp8-delayed", backend="keras"))
    # float32 carries matmul_precision="highest": the engine's own switch, for the block
    from unimp.keras.precision import current_matmul_precision

    f32 = unimp.mixed_precision("float32", backend="keras")
    with f32.autocast():
        inside = current_matmul_precision()
    out["float32"] = {"backend": f32.backend, "inside": inside, "after": current_matmul_precision()}
    # the dtype trace: JAX's jaxpr, torch's dispatcher (the step run once and put back);
    # layers named from the model down
    mp16 = unimp.mixed_precision("mixed_float16", backend="keras")
    with mp16.autocast():
        traced = _mlp()
    ce0 = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    tstep = mp16.train_step(traced, "sgd", lambda m, b: ce0(b[1], m(b[0])))
    x0, y0 = _data(n=4)
    held = [_np(v.value).tolist() for v in tstep._variables()]
    tr = mp16.trace(tstep, (x0, y0))
    out["trace"] = {
        "framework": tr.framework,
        "matmuls": sorted({(r.layer, r.phase, r.compute) for r in tr if r.op == "matmul"}),
        "phases": sorted({r.phase for r in tr}),
        "put_back": held == [_np(v.value).tolist() for v in tstep._variables()] and tstep.calls == 0,
    }
    mp = unimp.mixed_precision("mixed_float16", backend="keras")
    with mp.autocast():
        model = _mlp()
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    good = mp.train_step(model, keras.optimizers.SGD(0.1), lambda m, b: ce(b[1], m(b[0])))
    x, y = _data(n=16)
    good((x, y))
    # a loss_fn that fails after the forward pass ran: an integer loss
    bad = mp.train_step(model, good.optimizer, lambda m, b: ops.cast(ops.sum(m(b[0])), "int32"))
    before = [_np(v.value).tolist() for v in (*model.variables, *good.optimizer.variables)]
    out["integer_loss"] = said(lambda: bad((x, y)))
    after = [_np(v.value).tolist() for v in (*model.variables, *good.optimizer.variables)]
    out["unchanged"] = before == after
    if BACKEND == "torch":
        out["no_gradient"] = said(lambda: mp.train_step(model, good.optimizer, lambda m, b: ops.stop_gradient(ce(b[1], m(b[0]))))((x, y)))
    out["tuple_loss"] = said(lambda: mp.train_step(model, good.optimizer, lambda m, b: (ce(b[1], m(b[0])), 1.0))((x, y)))
    # a recipe's overrides are not skipped on a model another recipe prepared; its policies
    # differ: refused, and warned
    other = unimp.mixed_precision("mixed_bfloat16;fc2:float32", backend="keras")
    with mp.autocast():
        prepared = _mlp()
    mp.prepare(prepared)
    out["other_recipe"] = said(lambda: other.train_step(prepared, "sgd", lambda m, b: ce(b[1], m(b[0]))))
    fresh = _mlp()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        other.train_step(fresh, "sgd", lambda m, b: ce(b[1], m(b[0])))
    out["built_outside_warned"] = any("outside mp.autocast()" in str(w.message) for w in seen)
    # an activity regularizer's loss reaches loss_fn through model.losses (JAX's scope too)
    keras.utils.set_random_seed(0)
    with mp.autocast():
        reg = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.ActivityRegularization(l1=1.0)])

    def with_reg(m, b):
        return ops.mean(ops.square(ops.cast(m(b[0], training=True), "float32"))) + sum(m.losses)

    eager = float(_np(with_reg(reg, (x, y))))
    out["regularized"] = [eager, mp.train_step(reg, keras.optimizers.SGD(0.0), with_reg)((x, y)).loss]
    # a metric made outside the model, updated in loss_fn: JAX refuses, torch counts
    seen_loss = keras.metrics.Mean()

    def counted(m, b):
        loss = ce(b[1], m(b[0]))
        seen_loss.update_state(loss)
        return loss

    out["foreign_metric"] = said(lambda: mp.train_step(model, good.optimizer, counted)((x, y)))
    # a layer frozen after the step was built: refused on every engine
    model.get_layer("fc1").trainable = False
    out["frozen_later"] = said(lambda: good((x, y)))
    model.get_layer("fc1").trainable = True
    return out


#: per step a loss multiplier: 1e36 makes the scaled loss inf (a gradient overflow, the loss
#: finite), inf the loss itself
FP8_WEIGHTS = [1.0, 1.0, 1.0, 1e36, 1.0, 1.0, np.inf, 1.0, 1.0, 1.0, 1.0, 1.0]


def _fp8_states(layer) -> dict:
    from unimp import fp8

    return {t: [_np(getattr(layer, f"{t}_{f}").value).ravel().tolist() for f in fp8.STATE_FIELDS]
            for t in fp8.LAYER_TENSORS}


def fp8() -> dict:
    """An FP8 recipe through ``mp.prepare`` with ``backend="keras"`` (the TensorFlow backend's
    float8 layers on TensorFlow, unimp.keras's on JAX and torch):

    * ``window``: ``l0 -> a -> l2`` (only ``a`` float8), one window of ``grad_accum_steps=3``
      micro-batches of 3, 1 and 2 times ones (tests/conformance/test_fp8_accumulation.py's);
    * ``skips``: float8 ``fc1`` and ``mid`` with a dynamic loss scale (FP8 recipes compute in
      bfloat16), the :data:`FP8_WEIGHTS` batches (the scaled loss overflows at step 3, the
      loss is inf at step 6): per step the result and the states; JAX's compilations after
      the first step; torch's host reads per step;
    * ``fit``: two epochs of ``model.fit`` through ``prepare(model, "sgd", loss=...)``.
    """
    import dataclasses

    import unimp
    from unimp import fp8 as _fp8
    from unimp.fp8.recipe import FP8Recipe

    warnings.simplefilter("ignore", _fp8.FP8EmulationWarning)
    out = {}
    config = _fp8.DelayedScaling(amax_history_len=4)
    recipe = dataclasses.replace(unimp.get_recipe("fp8-delayed"), fp8=FP8Recipe(config))
    mp = unimp.mixed_precision(recipe, backend="keras")
    w = {"l0": np.full((2, 2), 0.5, np.float32), "a": np.full((2, 2), 0.5, np.float32),
         "l2": np.full((2, 1), 0.5, np.float32)}
    with mp.autocast():
        model = keras.Sequential([keras.Input((2,))] + [
            keras.layers.Dense(v.shape[1], use_bias=False, name=n) for n, v in w.items()])
    for n, v in w.items():
        model.get_layer(n).kernel.assign(v)
    out["selected"] = list(mp.fp8_layers(model))
    mp.prepare(model)
    step = mp.train_step(model, keras.optimizers.SGD(0.1),
                         lambda m, b: ops.sum(ops.cast(m(b, training=True), "float32")), grad_accum_steps=3)
    step([np.full((1, 2), c, np.float32) for c in (3.0, 1.0, 2.0)])
    a = model.get_layer("a")
    out["window"] = {"states": _fp8_states(a), "kernel": _np(a.kernel.value).tolist()}

    # a float8 layer loss_fn does not call keeps its states bit for bit (on JAX its states'
    # "gradients" are 0; unimp.keras.fp8.keep_unrun), while the others step
    every = dataclasses.replace(recipe, fp8=FP8Recipe(config, exclude_first_last=False))
    mpu = unimp.mixed_precision(every, backend="keras")
    with mpu.autocast():
        three = keras.Sequential([keras.Input((2,))] + [keras.layers.Dense(2, name=n) for n in ("p", "q", "r")])
    mpu.prepare(three)
    unrun = mpu.train_step(three, keras.optimizers.SGD(0.1), lambda m, b: ops.sum(ops.cast(
        m.get_layer("r")(m.get_layer("p")(b, training=True), training=True), "float32")))
    unrun(np.ones((4, 2), np.float32))
    out["unrun"] = {n: _fp8_states(three.get_layer(n)) for n in ("p", "q")}

    # float8 fc1 / mid (bfloat16 around them) with a dynamic loss scale, the FP8_WEIGHTS batches
    mixed = dataclasses.replace(recipe, fp8=FP8Recipe(config, exclude=("head",), exclude_first_last=False))
    mp16 = unimp.mixed_precision(mixed, backend="keras", loss_scale=STEP_RULE)
    keras.utils.set_random_seed(0)
    with mp16.autocast():
        net = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="fc1"),
                                keras.layers.Dense(16, activation="relu", name="mid"),
                                keras.layers.Dense(4, name="head")])
    _set_weights(net)
    mp16.prepare(net)
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step16 = mp16.train_step(net, keras.optimizers.SGD(0.05),
                             lambda m, b: ce(b[1], m(b[0], training=True)) * b[2])
    x, y = _data(n=16 * len(FP8_WEIGHTS))
    batches = [(x[16 * i : 16 * (i + 1)], y[16 * i : 16 * (i + 1)], np.float32(c))
               for i, c in enumerate(FP8_WEIGHTS)]
    compiles = _compile_counter()
    rows, after_first = [], None
    for i, b in enumerate(batches):
        r = step16(b)
        rows.append({"applied": r.applied, "scale": r.scale, "loss": r.loss,
                     "states": {n: _fp8_states(net.get_layer(n)) for n in ("fc1", "mid")},
                     "w": _np(net.get_layer("mid").kernel.value).ravel()[:4].tolist()})
        if i == 0:
            after_first = compiles["n"]
    out["skips"] = {"rows": rows, "selected": list(mp16.fp8_layers(net)),
                    "compilations_after_first": compiles["n"] - after_first}
    if BACKEND == "torch":
        import torch

        from benchmarks._kit_torch import count_host_reads

        tb = [tuple(torch.as_tensor(v) for v in b) for b in batches[:4]]
        with count_host_reads() as counts:
            for b in tb:
                step16(b)
        out["skips"]["host_reads_per_step"] = sum(counts.values()) / len(tb)

    # model.fit through prepare: Keras's own trainer, unimp's optimizer
    mpf = unimp.mixed_precision(mixed, backend="keras", loss_scale=STEP_RULE)
    keras.utils.set_random_seed(0)
    with mpf.autocast():
        fnet = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="fc1"),
                                 keras.layers.Dense(4, name="head")])
    _set_weights(fnet)
    mpf.prepare(fnet, keras.optimizers.SGD(0.05), loss=ce)
    before = _fp8_states(fnet.get_layer("fc1"))
    hist = fnet.fit(x[:64], y[:64], batch_size=16, epochs=2, verbose=0, shuffle=False)
    out["fit"] = {"before": before, "after": _fp8_states(fnet.get_layer("fc1")),
                  "loss": [float(v) for v in hist.history["loss"]]}
    # Keras's loaders: a bad state is refused and changes nothing; save_weights then
    # load_weights into a prepared model loads the kernels and biases, the states kept
    weights = fnet.get_weights()
    fc1 = fnet.get_layer("fc1")
    bad = fc1.get_weights()
    bad[[v.name for v in fc1.weights].index("grad_scale")] = np.float32(-5.0)
    refused = "accepted"
    try:
        fc1.set_weights(bad)
    except ValueError as e:
        refused = str(e)
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "fp8.weights.h5"
        fnet.save_weights(path)
        with mpf.autocast():
            again = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="fc1"),
                                      keras.layers.Dense(4, name="head")])
        unimp.mixed_precision(mixed, backend="keras").prepare(again)
        again.load_weights(path)
    # what the breaker found (tests/test_keras_backends.py says what each must give)
    def said(f) -> str:
        try:
            f()
        except ValueError as e:
            return str(e)
        return "accepted"

    every = dataclasses.replace(recipe, fp8=FP8Recipe(config, exclude_first_last=False))
    mpt = unimp.mixed_precision(every, backend="keras")
    with mpt.autocast():
        td = keras.Sequential([keras.Input((5, 8)), keras.layers.TimeDistributed(keras.layers.Dense(4, name="td")),
                               keras.layers.Flatten(), keras.layers.Dense(2, name="o")])
    mpt.prepare(td, "sgd", loss="mse")
    out["time_distributed"] = said(lambda: td.train_on_batch(np.ones((4, 5, 8), np.float32), np.ones((4, 2), np.float32)))
    mpb = unimp.mixed_precision(every, backend="keras")
    with mpb.autocast():
        ab = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="a"), keras.layers.Dense(4, name="b")])
    _set_weights(ab)
    mpb.prepare(ab, keras.optimizers.SGD(0.1), loss="mse")
    good = ab.get_weights()
    bad = list(good)
    bad[[v.path.endswith("b/input_scale") for v in ab.weights].index(True)] = np.float32(-3.0)
    out["model_set_weights"] = {
        "said": said(lambda: ab.set_weights(bad)),
        "unchanged": all(np.array_equal(a, b) for a, b in zip(good, ab.get_weights(), strict=True)),
    }
    # no activation between a (bfloat16 output) and b: b's input amax is a bfloat16 value on
    # every engine (on JAX, XLA would otherwise drop the rounding inside jit)
    ab.train_on_batch(np.random.default_rng(1).normal(size=(16, 8)).astype(np.float32) * 3,
                      np.zeros((16, 4), np.float32))
    out["bf16_input"] = _fp8_states(ab.get_layer("b"))["input"]
    mpl = unimp.mixed_precision(every, backend="keras")
    with mpl.autocast():
        one = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, name="a")])
    out["prepare_accumulation"] = said(lambda: mpl.prepare(one, keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), loss="mse"))
    out["prepare_accumulation_unchanged"] = [v.name for v in one.weights] == ["kernel", "bias"]

    # Keras's own gradient accumulation would merge the states by their maximum: refused
    acc = LossScaleOptimizer(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2))
    try:
        acc.build(fnet.trainable_variables)
        out["inner_accumulation"] = "accepted"
    except ValueError as e:
        out["inner_accumulation"] = str(e)
    out["loaders"] = {
        "refused": refused,
        "unchanged": all(np.array_equal(a, b) for a, b in zip(weights, fnet.get_weights(), strict=True)),
        # Keras's Dense saves its kernel and bias only: those load, the states stay initial
        "round_trip": all(np.array_equal(_np(a.value), _np(b.value)) for a, b in zip(fnet.weights, again.weights, strict=True)
                          if not getattr(a, "overwrite_with_gradient", False) and "_scale" not in a.name and "amax" not in a.name),
        "states_kept": _fp8_states(again.get_layer("fc1")) == before,
    }
    return out


def _half_steps(opt, low: float, high: float, steps: int, stateless: bool, alone: bool = False) -> dict:
    """``steps`` updates of a bfloat16 (2, 3) variable from ``linspace(low, high)`` and a float32
    one beside it (not with ``alone``), gradients ``0.1 * (i + 1)`` and -0.2, by ``apply`` or
    ``stateless_apply``: the bfloat16 weights at the start and after each step, as float32, and
    the float32 ones."""
    w = keras.Variable(np.linspace(low, high, 6, dtype=np.float32).reshape(2, 3), dtype="bfloat16")
    b = keras.Variable(np.full((3,), 0.5, np.float32))
    variables = [w] if alone else [w, b]
    opt.build(variables)
    start, seen = _np(ops.cast(w.value, "float32")).ravel().tolist(), []
    for i in range(steps):
        g = [ops.convert_to_tensor(np.full((2, 3), 0.1 * (i + 1), np.float32), dtype="bfloat16"),
             ops.convert_to_tensor(np.full((3,), -0.2, np.float32))][: len(variables)]
        if stateless:
            new_w, new_o = opt.stateless_apply([v.value for v in opt.variables], g, [v.value for v in variables])
            for v, x in zip([*variables, *opt.variables], [*new_w, *new_o], strict=True):
                v.assign(x)
        else:
            opt.apply(g, variables)
        seen.append(_np(ops.cast(w.value, "float32")).ravel().tolist())
    return {"start": start, "w": seen, "b": _np(b.value).tolist()}


HALF_OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(1e-2),
    "adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.5),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "rmsprop": lambda: keras.optimizers.RMSprop(1e-2),
    "lamb": lambda: keras.optimizers.Lamb(1e-2, weight_decay=0.1),  # reads the variable (norms)
}


def half() -> dict:
    """bfloat16 variables (a float32 one beside them) updated by unimp's optimizer with no loss
    scale: per step the bfloat16 weights (as float32), for each of :data:`HALF_OPTIMIZERS`,
    through ``apply`` and (JAX, torch) ``stateless_apply``; on TensorFlow also the TensorFlow
    backend's optimizer (``"<name>/tf_backend"``); on every engine Keras's own optimizer alone
    (``"adam/keras"``), which computes in bfloat16."""

    def run(opt, stateless: bool = False, alone: bool = False) -> dict:
        return _half_steps(opt, -1.0, 1.0, 4, stateless, alone)

    out = {name: run(LossScaleOptimizer(make(), loss_scale="none")) for name, make in HALF_OPTIMIZERS.items()}
    out["adam/keras"] = run(keras.optimizers.Adam(1e-2))
    # only half variables: the weight decay of none is left to Keras (Keras-torch's _foreach
    # decay refuses an empty list)
    out["adamw/alone"] = run(LossScaleOptimizer(HALF_OPTIMIZERS["adamw"](), loss_scale="none"), alone=True)
    if BACKEND == "tensorflow":
        from unimp.backends.tensorflow import LossScaleOptimizer as TFLossScaleOptimizer

        for name, make in HALF_OPTIMIZERS.items():
            out[f"{name}/tf_backend"] = run(TFLossScaleOptimizer(make(), loss_scale="none"))
        out["adamw/alone/tf_backend"] = run(TFLossScaleOptimizer(HALF_OPTIMIZERS["adamw"](), loss_scale="none"), alone=True)
    else:
        for name, make in HALF_OPTIMIZERS.items():
            out[f"{name}/stateless"] = run(LossScaleOptimizer(make(), loss_scale="none"), stateless=True)
    return out


def update_rules() -> dict:
    """The policy's ``update`` rules on bfloat16 variables (a float32 one beside them): per rule
    (``nearest``, ``kahan``, ``stochastic``, seed 7) six steps of plain SGD (float32 arithmetic
    only: an optimizer's bfloat16 state, Adam's moments or SGD's momentum, is computed with each
    engine's own bfloat16 arithmetic, where torch multiplies by a Python scalar in float32 and
    XLA keeps intermediates in float32, so the compensation buffers can differ by engine in the
    last bit) whose updates are below half a bfloat16 spacing for some weights,
    the weights per step and the exported update state, through unimp.keras's
    optimizer (``apply``; on JAX and torch ``stateless_apply`` too, ``"<rule>/stateless"``) and
    on TensorFlow the TensorFlow backend's (``"<rule>/tf_backend"``); and the rule ``mp.prepare``
    gives on this engine for ``bf16-kahan``."""
    import unimp

    def run(opt, stateless: bool = False) -> list:
        return _half_steps(opt, 0.5, 2.0, 6, stateless)["w"]

    def exported(opt) -> dict:
        from unimp.keras.optimizer import export_update_state

        state = export_update_state(opt)
        return {**state, "params": [None if e is None else {
            "step": e["step"], "compensation": None if e["compensation"] is None else e["compensation"].ravel().tolist(),
        } for e in state["params"]]}

    out = {}
    for mode in ("nearest", "kahan", "stochastic"):
        opt = LossScaleOptimizer(keras.optimizers.SGD(0.01), loss_scale="none", update=mode, seed=7)
        out[mode] = run(opt)
        if mode != "nearest":  # the portable state (unimp.rounding.check_update_state's format)
            out[f"{mode}/export"] = exported(opt)
        if BACKEND == "tensorflow":
            from unimp.backends.tensorflow import LossScaleOptimizer as TFLossScaleOptimizer

            tf_opt = TFLossScaleOptimizer(keras.optimizers.SGD(0.01), loss_scale="none", update=mode, seed=7)
            out[f"{mode}/tf_backend"] = run(tf_opt)
            if mode != "nearest":
                out[f"{mode}/tf_backend/export"] = exported(tf_opt)
        else:
            out[f"{mode}/stateless"] = run(
                LossScaleOptimizer(keras.optimizers.SGD(0.01), loss_scale="none", update=mode, seed=7), stateless=True)
    # import_update_state: a fresh optimizer given the exported state (and the same weights and
    # iterations) continues as the one it came from
    from unimp.keras import export_update_state, half_update, import_update_state

    def pair() -> tuple:
        w = keras.Variable(np.linspace(0.5, 2, 6, dtype=np.float32).reshape(2, 3), dtype="bfloat16")
        opt = half_update(keras.optimizers.SGD(0.01), "kahan", seed=3)
        opt.build([w])
        return w, opt

    g = [ops.convert_to_tensor(np.full((2, 3), 0.37, np.float32), dtype="bfloat16")]
    (w1, o1), (w2, o2) = pair(), pair()
    for _ in range(3):
        o1.apply(g, [w1])
    w2.assign(w1.value)
    o2.inner_optimizer.iterations.assign(o1.inner_optimizer.iterations.value)
    import_update_state(o2, export_update_state(o1))
    for _ in range(3):
        o1.apply(g, [w1])
        o2.apply(g, [w2])
    out["import_continues"] = bool(np.array_equal(_np(ops.cast(w1.value, "float32")), _np(ops.cast(w2.value, "float32"))))
    try:
        import_update_state(o2, {**export_update_state(o1), "update": "stochastic"})
        out["import_other_mode"] = "accepted"
    except ValueError as e:
        out["import_other_mode"] = str(e)

    mp = unimp.mixed_precision("bf16-kahan", backend="keras")
    with mp.autocast():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    _, opt = mp.prepare(model, "adam")
    out["prepared"] = {"update": opt.update_mode, "kernel": keras.backend.standardize_dtype(model.layers[0].kernel.dtype)}
    return out



#: block(): the block-scaled layer's operands, drawn as
#: tests/conformance/test_blockscale_linear_conformance.py draws them, so that every GEMM's
#: float32 sums are exact (quantized values of at most 6 significant bits over a few binades,
#: K, N, M <= 256) and no engine's summation order can change a bit
BLOCK_SHAPE, BLOCK_SEED = (128, 128, 256), 3


def block_inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(x (M, K), kernel (K, N), output gradient (M, N))``, float32."""

    def operand(shape, seed):
        rng = np.random.default_rng(seed)
        a = (rng.choice([-1.0, 1.0], shape) * rng.uniform(0.25, 2.0, shape)).astype(np.float32)
        a.flat[100] = -2.625  # the tensor's amax: NVFP4's global scale 2688 / 2.625 = 1024
        a.reshape(-1)[:32] = 0.0  # a zero block
        a.reshape(-1)[40] = -0.0
        return a

    m, k, n = BLOCK_SHAPE
    return operand((m, k), 0), operand((k, n), 1), operand((m, n), 2)


def digest(a) -> str:
    """A float32 array's shape and bits, hashed (the test compares the reference's)."""
    import hashlib

    a = np.ascontiguousarray(np.asarray(a, np.float32))
    return f"{a.shape}:{hashlib.sha256(a.tobytes()).hexdigest()[:16]}"


def _block_grads(layer, x, g, calls: int = 2) -> list[list[str]]:
    """y, dx and dW (the kernel's gradient) of ``calls`` training calls of ``layer`` for the
    output gradient ``g``, by the engine's own autodiff, digested; the layer's counter advanced
    by each (JAX: one jitted VJP of the stateless call, the counter written back)."""
    out = []
    if BACKEND == "jax":
        import jax

        @jax.jit
        def run(tv, nv, a, c):
            y, vjp, nv2 = jax.vjp(lambda t, a_: layer.stateless_call(t, nv, a_, training=True), tv, a, has_aux=True)
            dt, da = vjp(c)
            return y, da, dt[0], nv2

    for _ in range(calls):
        if BACKEND == "jax":
            y, dx, dw, nv2 = run([v.value for v in layer.trainable_variables],
                                 [v.value for v in layer.non_trainable_variables], x, g)
            for v, new in zip(layer.non_trainable_variables, nv2, strict=True):
                v.assign(new)
        elif BACKEND == "torch":
            import torch

            xt = torch.tensor(x, requires_grad=True)
            layer.kernel.value.grad = None
            y = layer(xt, training=True)
            y.backward(torch.tensor(g))
            dx, dw = xt.grad, layer.kernel.value.grad
        else:
            import tensorflow as tf

            xt = tf.constant(x)
            with tf.GradientTape() as tape:
                tape.watch(xt)
                y = layer(xt, training=True)
            dx, dw = tape.gradient(y, [xt, layer.kernel.value], output_gradients=tf.constant(g))
        out.append([digest(_np(t)) for t in (y, dx, dw)])
    return out


#: block(): per step a loss multiplier: 1e36 makes the scaled loss inf (a gradient overflow),
#: inf the loss itself
BLOCK_WEIGHTS = [1.0, 1.0, 1e36, 1.0, np.inf, 1.0]


def block() -> dict:
    """Block-scaled recipes through ``mp.prepare`` with ``backend="keras"`` (the TensorFlow
    backend's swap on TensorFlow, unimp.keras.blockscale's on JAX and torch):

    * ``layer``: per rule, a float32 Dense (no bias) the recipe swaps, y / dx / dW of two
      training calls (the stochastic rounding's steps 0 and 1) on :func:`block_inputs`, digested;
      on TensorFlow also the TensorFlow backend's ``BlockScaledDense``; nvfp4's inference on
      37 rows;
    * ``lora``: prepare refusing a selected Dense with LoRA, the model left alone;
    * ``skips``: nvfp4 in the middle two of four Dense layers (bfloat16 around them) with a
      dynamic loss scale over the :data:`BLOCK_WEIGHTS` batches: per step the result, the
      counters and a kernel; JAX's compilations after the first step; torch's host reads;
    * ``fit``: mxfp8's ``model.fit`` through ``prepare(model, SGD, loss=...)``: JAX's
      compilations per batch, the counters after, torch's host reads in Keras's step; then ``save_weights`` / ``load_weights`` into a model prepared
      again, and a ``.keras`` file loaded as the plain model.
    """
    import unimp
    from unimp import blockscale_linear as bl
    from unimp.blockscale_recipe import BlockRecipe

    out = {"layer": {}}
    x, w, g = block_inputs()
    m, k, n = BLOCK_SHAPE
    for rule in bl.BLOCK_LINEAR_RULES:
        recipe = unimp.get_recipe("float32", block=BlockRecipe(rule, seed=BLOCK_SEED, exclude_first_last=False))
        mp = unimp.mixed_precision(recipe, backend="keras")
        with mp.autocast():
            model = keras.Sequential([keras.Input((k,)), keras.layers.Dense(n, use_bias=False, name="b")])
        model.get_layer("b").kernel.assign(w)
        mp.prepare(model)
        layer = model.get_layer("b")
        got = {"selected": list(mp.fp8_layers(model)),
               "steps": _block_grads(layer, x, g),
               "counter": int(_np(layer.block_step.value))}
        if rule == "nvfp4":  # inference: the forward GEMM alone, on 37 rows (no block of any rule)
            got["inference"] = digest(model.predict(x[:37], batch_size=37, verbose=0))
        if BACKEND == "tensorflow":
            from unimp.backends.tensorflow import BlockScaledDense

            own = BlockScaledDense(n, use_bias=False, rule=rule, seed=BLOCK_SEED, dtype="float32")
            own.build((None, k))
            own.kernel.assign(w)
            got["tf_backend"] = _block_grads(own, x, g)
        out["layer"][rule] = got

    # nvfp4 (stochastically rounded gradients: the counters matter) with a dynamic loss scale
    nvfp4 = unimp.get_recipe("nvfp4")
    mp = unimp.mixed_precision(nvfp4, backend="keras", loss_scale=STEP_RULE)

    def four():
        with mp.autocast():
            net = keras.Sequential([keras.Input((32,)), *(keras.layers.Dense(32, activation="relu", name=f"fc{i}")
                                                          for i in (1, 2, 3)), keras.layers.Dense(4, name="head")])
        _set_weights(net)
        return net

    lora = four()
    lora.get_layer("fc2").enable_lora(2)
    try:
        mp.prepare(lora)
        out["lora"] = "accepted"
    except ValueError as e:
        out["lora"] = str(e)
    out["lora_unchanged"] = not any(hasattr(layer, "block_step") for layer in lora.layers)
    net = four()
    before = list(mp.fp8_layers(net))
    mp.prepare(net)
    swapped = [layer.name for layer in net.layers if hasattr(layer, "block_step")]
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step = mp.train_step(net, keras.optimizers.SGD(0.05), lambda m_, b: ce(b[1], m_(b[0], training=True)) * b[2])
    xs, ys = _data(n=32 * len(BLOCK_WEIGHTS), features=32)
    batches = [(xs[32 * i : 32 * (i + 1)], ys[32 * i : 32 * (i + 1)], np.float32(c)) for i, c in enumerate(BLOCK_WEIGHTS)]
    compiles = _compile_counter()
    rows, after_first = [], None
    for i, b in enumerate(batches):
        r = step(b)
        rows.append({"applied": r.applied, "scale": r.scale, "loss": r.loss,
                     "counters": [int(_np(net.get_layer(p).block_step.value)) for p in swapped],
                     "w": _np(net.get_layer("fc2").kernel.value).ravel()[:4].tolist()})
        if i == 0:
            after_first = compiles["n"]
    out["skips"] = {"rows": rows, "selected": before, "after": list(mp.fp8_layers(net)), "swapped": swapped,
                    "compilations_after_first": compiles["n"] - after_first}
    if BACKEND == "torch":
        import torch

        from benchmarks._kit_torch import count_host_reads

        tb = [tuple(torch.as_tensor(v) for v in b) for b in batches[:4]]
        with count_host_reads() as counts:
            for b in tb:
                step(b)
        out["skips"]["host_reads_per_step"] = sum(counts.values()) / len(tb)

    # model.fit through prepare (mxfp8): Keras's own trainer, unimp's optimizer (no loss scale)
    mpf = unimp.mixed_precision("mxfp8", backend="keras")
    fnet = four()
    mpf.prepare(fnet, keras.optimizers.SGD(0.05), loss=ce)
    fit_rows = []

    class Read(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            fit_rows.append(compiles["n"])

    hist = fnet.fit(xs, ys, batch_size=32, epochs=1, verbose=0, shuffle=False, callbacks=[Read()])
    if BACKEND == "jax":
        fnet.jax_state_sync()
    out["fit"] = {"compilations": fit_rows, "loss": [float(v) for v in hist.history["loss"]],
                  "counters": [int(_np(fnet.get_layer(p).block_step.value)) for p in swapped]}
    if BACKEND == "torch":  # Keras's own train step, as fit runs it
        with count_host_reads() as counts:
            for b in tb[:3]:
                fnet.train_step(b[:2])
        out["fit"]["host_reads_per_step"] = sum(counts.values()) / 3
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "block.weights.h5"
        fnet.save_weights(path)
        again = four()
        unimp.mixed_precision("mxfp8", backend="keras").prepare(again)
        again.load_weights(path)
        fnet.save(pathlib.Path(tmp) / "block.keras")
        plain = keras.models.load_model(pathlib.Path(tmp) / "block.keras", compile=False)
    kernels = [v for v in fnet.weights if "block_step" not in v.path]
    out["loaders"] = {
        "kernels": all(np.array_equal(_np(a.value), _np(b.value)) for a, b in zip(
            kernels, [v for v in again.weights if "block_step" not in v.path], strict=True)),
        "counters_kept": [int(_np(again.get_layer(p).block_step.value)) for p in swapped],
        "plain": [type(layer).__name__ for layer in plain.layers],
        "plain_kernels": all(np.array_equal(_np(a.value), _np(b.value)) for a, b in zip(kernels, plain.weights, strict=True)),
    }
    return out

if __name__ == "__main__":
    print(json.dumps({"backend": BACKEND, **{case: globals()[case]() for case in sys.argv[1:]}}))
