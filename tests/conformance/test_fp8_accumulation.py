"""Float8 scaling under gradient accumulation, the same in every framework: ``l0 -> a -> l2``
(only ``a`` float8, the first and last layers stay out by the recipe's default), one window of
``grad_accum_steps=3`` micro-batches of 3, 1 and 2 times ones. The convention
(:func:`unimp.fp8.window_merge`): every micro-batch quantizes with the state the window started
from, and the window takes ONE scaling step, on the largest amax of its micro-batches (each
micro-batch's own; a gradient's is the micro-batch's own output gradient, not 1/k of it).

Before, torch recorded 1/k of each output gradient and every backend pushed one history entry
per micro-batch: the gradient scale after one window was 343393.3 in torch and 114688 in Keras
and JAX, the input history [2, 1, 3, 0] (three entries; the right one is [3, 0, 0, 0])."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
from conftest import require_backend

import unimp
from unimp import fp8
from unimp.fp8.recipe import FP8Recipe

CONFIG = fp8.DelayedScaling(amax_history_len=4)
RECIPE = dataclasses.replace(unimp.get_recipe("fp8-delayed"), fp8=FP8Recipe(CONFIG))
W = {"l0": np.full((2, 2), 0.5, np.float32), "a": np.full((2, 2), 0.5, np.float32),
     "l2": np.full((2, 1), 0.5, np.float32)}
WINDOW = [np.full((1, 2), c, np.float32) for c in (3.0, 1.0, 2.0)]
LR = 0.1


def _torch():
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l0, self.a, self.l2 = (torch.nn.Linear(i, o, bias=False) for i, o in ((2, 2), (2, 2), (2, 1)))

        def forward(self, x):
            return self.l2(self.a(self.l0(x)))

    net = Net()
    with torch.no_grad():
        for n, w in W.items():
            getattr(net, n).weight.copy_(torch.from_numpy(w.T.copy()))
    mp = unimp.mixed_precision(RECIPE, backend="torch", device="cpu")
    net, opt = mp.prepare(net, torch.optim.SGD(net.parameters(), lr=LR))
    step = mp.train_step(net, opt, lambda m, b: m(b).float().sum(), grad_accum_steps=3)

    def run():
        step([torch.from_numpy(m) for m in WINDOW])
        st = {t: mp_state(net.a.fp8_state(t)) for t in fp8.LAYER_TENSORS}
        return st, net.a.weight.detach().numpy().T.copy()

    def mp_state(s):
        return fp8.FP8State(*(np.array(v.detach().numpy(), np.float32) for v in (s.scale, s.scale_inv, s.amax_history)))

    return run


def _tensorflow():
    import keras
    import tensorflow as tf

    mp = unimp.mixed_precision(RECIPE, backend="tensorflow")
    with mp.autocast():
        model = keras.Sequential([keras.Input((2,))] + [
            keras.layers.Dense(W[n].shape[1], use_bias=False, name=n) for n in W])
    for n, w in W.items():
        model.get_layer(n).kernel.assign(w)
    mp.prepare(model)
    step = mp.train_step(model, keras.optimizers.SGD(LR),
                         lambda m, b: tf.reduce_sum(tf.cast(m(b, training=True), tf.float32)),
                         grad_accum_steps=3)
    a = model.get_layer("a")

    def run():
        step(WINDOW)
        st = {t: fp8.FP8State(*(np.asarray(getattr(a, f"{t}_{f}").numpy(), np.float32) for f in fp8.STATE_FIELDS))
              for t in fp8.LAYER_TENSORS}
        return st, a.kernel.numpy().copy()

    return run


def _jax():
    import jax
    import jax.numpy as jnp
    import optax

    mp = unimp.mixed_precision(RECIPE, backend="jax")
    mp.fp8_layers(list(W))
    c = mp.policy.compute_dtype

    def forward(p, x, st):
        h = mp.fp8_matmul(st, "a", x.astype(c) @ p["l0"].astype(c), p["a"])
        return (h.astype(c) @ p["l2"].astype(c)).astype(jnp.float32).sum()

    def loss_fn(p, st, b):  # the states after the step are the "gradients" of the states
        new = jax.grad(lambda s: forward(jax.lax.stop_gradient(p), b, s))(st)
        return forward(p, b, st), new

    step = mp.train_step(loss_fn, optax.sgd(LR), {k: jnp.asarray(v) for k, v in W.items()},
                         model_state=mp.fp8_states(), grad_accum_steps=3)

    def run():
        step([jnp.asarray(m) for m in WINDOW])
        st = dict(zip(fp8.LAYER_TENSORS, (mp_state(s) for s in step.model_state["a"]), strict=True))
        return st, np.asarray(step.params["a"])

    def mp_state(s):
        return fp8.FP8State(*(np.asarray(getattr(s, f), np.float32) for f in fp8.STATE_FIELDS))

    return run


def test_a_window_takes_one_scaling_step_on_its_largest_amax(backend):
    require_backend(backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp8.FP8EmulationWarning)
        run = {"torch": _torch, "tensorflow": _tensorflow, "jax": _jax}[backend]()
        states, w = run()
        # the window's largest amax: the input 3 (of 3, 1, 2), the weight 0.5, the output
        # gradient of sum(out) through l2 (0.5 everywhere) in every micro-batch: 0.5, not 0.5/3
        initial = fp8.FP8State.initial(CONFIG)
        for tensor, amax, role in (("input", 3.0, "forward"), ("kernel", 0.5, "forward"), ("grad", 0.5, "backward")):
            want = fp8.step(CONFIG, initial, amax, role)[1]
            got = states[tensor]
            assert got.amax_history.tolist() == [amax, 0.0, 0.0, 0.0], tensor
            assert (float(got.scale), float(got.scale_inv)) == (float(want.scale), float(want.scale_inv)), tensor
        assert float(states["grad"].scale) == 114688.0  # 57344 / 0.5: the own gradient's amax
        # every micro-batch quantized with the initial scale 1, exact here: each micro-batch's
        # gradient of a is c * 0.5 * ... = c / 2 * [1, 1] x [1, 1]; the mean 1 is applied once
        np.testing.assert_array_equal(w, np.full((2, 2), np.float32(0.4)))
        # the second window: one more history entry per tensor, the rule run once on it from
        # the state the first window left (the bfloat16 layers around `a` differ by framework,
        # so its input amax is read from the state, not written here)
        first = states
        states, _ = run()
        for tensor, role in (("input", "forward"), ("kernel", "forward"), ("grad", "backward")):
            hist = states[tensor].amax_history
            assert hist[1:].tolist() == first[tensor].amax_history[:3].tolist(), tensor
            want = fp8.step(CONFIG, first[tensor], hist[0], role)[1]
            assert float(states[tensor].scale) == float(want.scale), tensor
