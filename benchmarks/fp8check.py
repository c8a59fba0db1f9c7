"""FP8 native-path check: per backend, one float8 Dense layer run on its native float8 GEMM path
and on the emulated reference, with the same weights, inputs and output gradients on the chosen
device, step after step; PASS when the scaling states (scale, scale_inv, amax history of the
input, kernel and gradient) are equal bit for bit, as the issue asks: "with a float8-capable
GPU, the native paths run the same recipe (scales equal the emulated reference on the same
maxima)". The weights are not updated and the output gradient is given, so the maxima are the
same in both runs whatever the GEMMs round; the GEMM outputs' largest difference is reported.

On a device with float8 units the check also FAILs when the native path did not run a float8
GEMM: torch's ``torch._scaled_mm`` not called, or no cuBLASLt float8 custom call
(``__cublas$lt$matmul$f8``, XLA's ``kCublasLtMatmulF8CallTarget``; or a Triton GEMM fusion on
float8 operands) in the optimized HLO of JAX's step or Keras's GEMM. Elsewhere (a
CPU) that part is reported, not checked: the native paths run emulated there.

    python -m benchmarks.fp8check --device cuda      (one PASS / FAIL line per backend)
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks import _harness as h
from unimp import fp8

STEPS = 4
N_IN, N_OUT, ROWS = 512, 256, 128  # K and N multiples of 16; large enough for XLA to rewrite
F8_CALL = "__cublas$lt$matmul$f8"
#: the recipes' delayed scaling (fp8-delayed) with a short window, so the steps roll it
CONFIG = fp8.DelayedScaling(amax_history_len=2)


def _data(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(step)
    x = (rng.standard_normal((ROWS, N_IN)) * 2.0 ** (step - 1)).astype(np.float32)
    g = (rng.standard_normal((ROWS, N_OUT)) * 2.0 ** (2 * step)).astype(np.float32)
    return x, g


def _weights() -> np.ndarray:
    return (np.random.default_rng(7).standard_normal((N_IN, N_OUT)) / 16).astype(np.float32)


def _torch(native: bool, device: str | None) -> tuple[list, dict]:
    import torch

    from benchmarks._kit_torch import device_of
    from unimp.backends.torch import fp8 as tfp8

    dev = device_of(device)
    calls = []
    real = torch._scaled_mm

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    layer = tfp8.FP8Dense(N_IN, N_OUT, bias=False, device=dev, config=CONFIG, native=native, name="check")
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(_weights().T, device=dev))
    out = []
    torch._scaled_mm = counting
    try:
        for step in range(STEPS):
            x, g = _data(step)
            xt = torch.tensor(x, device=dev, requires_grad=True)
            y = layer(xt)
            y.backward(torch.tensor(g, device=dev))
            states = {n: tfp8.fp8_state_to_numpy(layer.fp8_state(n)) for n in fp8.LAYER_TENSORS}
            out.append(([y.detach().cpu().numpy(), xt.grad.cpu().numpy(), layer.weight.grad.cpu().numpy().T], states))
            layer.weight.grad = None
    finally:
        torch._scaled_mm = real
    units = tfp8._has_float8_units(dev)
    return out, {"float8_units": units, "float8_gemm": bool(calls), "how": "torch._scaled_mm calls"}


def _tensorflow(native: bool, device: str | None) -> tuple[list, dict]:
    import tensorflow as tf

    from benchmarks._kit_tensorflow import device_of
    from unimp.backends.tensorflow import fp8 as tfp8

    placed = device_of(device)
    with tf.device(placed) if placed else _null():
        layer = tfp8.FP8Dense(N_OUT, use_bias=False, config=CONFIG, native=native, name="check")
        layer.build((None, N_IN))
        layer.kernel.assign(_weights())

        @tf.function
        def fwd_bwd(x: tf.Tensor, g: tf.Tensor) -> Any:
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = layer(x, training=True)
            dx, dw = tape.gradient(y, [x, layer.kernel.value], output_gradients=g)
            return y, dx, dw

        out = []
        for step in range(STEPS):
            x, g = _data(step)
            y, dx, dw = fwd_bwd(tf.constant(x), tf.constant(g))
            states = {n: tfp8.fp8_state_to_numpy(layer.fp8_state(n)) for n in fp8.LAYER_TENSORS}
            out.append(([y.numpy(), dx.numpy(), dw.numpy()], states))
        a = tf.cast(tf.constant(_data(0)[0]), tf.dtypes.experimental.float8_e4m3fn)
        b = tf.cast(tf.constant(_weights()), tf.dtypes.experimental.float8_e4m3fn)
        hlo = tfp8._xla_matmul.experimental_get_compiler_ir(a, b, False, False)(stage="optimized_hlo")
    return out, {"float8_units": tfp8.native_fp8_supported(), "float8_gemm": _float8_gemm(hlo),
                 "how": "cuBLASLt float8 call in the optimized HLO of the GEMM"}


def _jax(native: bool, device: str | None) -> tuple[list, dict]:
    import jax

    from benchmarks._kit_jax import device_of
    from unimp.backends.jax import fp8 as jfp8

    dev = device_of(device)
    dn = (((1,), (0,)), ((), ()))
    with jax.default_device(dev):
        states = tuple(jfp8.fp8_initial_state(CONFIG) for _ in range(3))

        def apply(w: Any, st: Any, x: Any, g: Any) -> Any:
            def f(x_: Any, w_: Any, s_: Any) -> Any:
                return jfp8.fp8_dot_general(CONFIG, *s_, native=native, name="check")(x_, w_, dn)

            y, vjp = jax.vjp(f, x, w, st)
            return (y, *vjp(g))

        step_fn = jax.jit(apply)
        w = jax.device_put(_weights(), dev)
        out = []
        for step in range(STEPS):
            x, g = (jax.device_put(v, dev) for v in _data(step))
            y, dx, dw, states = step_fn(w, states, x, g)
            out.append(([np.asarray(y), np.asarray(dx), np.asarray(dw)],
                        {n: jfp8.fp8_state_to_numpy(s) for n, s in zip(fp8.LAYER_TENSORS, states, strict=True)}))
        hlo = step_fn.lower(w, states, x, g).compile().as_text()
    return out, {"float8_units": jfp8.native_fp8_supported(dev), "float8_gemm": _float8_gemm(hlo),
                 "how": "cuBLASLt float8 calls in the compiled step's HLO"}


def _float8_gemm(hlo: str) -> bool:
    """Whether XLA's optimized HLO runs a float8 GEMM: the cuBLASLt float8 call, or a Triton
    GEMM fusion where float8 values are in play (newer XLA may pick Triton for a float8 dot)."""
    return F8_CALL in hlo or ("__triton_gemm" in hlo and "f8e" in hlo)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


RUNNERS = {"torch": _torch, "tensorflow": _tensorflow, "jax": _jax}


def worker(cfg: dict) -> dict:
    backend = cfg["backend"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp8.FP8EmulationWarning)
        warnings.simplefilter("error", fp8.FP8NativeFallbackWarning)  # 512 x 256 must run native
        ref, _ = RUNNERS[backend](False, cfg["device"])
        got, info = RUNNERS[backend](True, cfg["device"])
    unequal = [f"step {s} {n}.{f}" for s, ((_, rs), (_, gs)) in enumerate(zip(ref, got, strict=True))
               for n in rs for f in fp8.STATE_FIELDS
               if not np.array_equal(np.asarray(getattr(rs[n], f)).view(np.uint32),
                                     np.asarray(getattr(gs[n], f)).view(np.uint32))]
    diffs = [float(np.max(np.abs(b.astype(np.float64) - a)) / max(float(np.max(np.abs(a))), 1e-30))
             for (ra, _), (ga, _) in zip(ref, got, strict=True) for a, b in zip(ra, ga, strict=True)]
    gemm_ok = info["float8_gemm"] or not info["float8_units"]
    return {"backend": backend, "steps": STEPS, "states_equal": not unequal, "unequal": unequal[:6],
            "max_rel_gemm_diff": max(diffs), **info, "pass": not unequal and gemm_ok}


def line(backend: str, res: dict) -> str:
    """The PASS / FAIL line of one backend's result."""
    if "error" in res:
        return f"FAIL {backend}: error: {res['error'][-300:]}"
    gemm = (f"{'a' if res['float8_gemm'] else 'NO'} float8 GEMM ran ({res['how']})" if res["float8_units"]
            else "no float8 units here: the native path ran emulated")
    scales = ("scales equal the emulated reference" if res["states_equal"]
              else f"scales differ from the emulated reference: {', '.join(res['unequal'])}")
    return (f"{'PASS' if res['pass'] else 'FAIL'} {backend}: {scales} ({res['steps']} steps, input/kernel/"
            f"grad); {gemm}; largest GEMM difference {res['max_rel_gemm_diff']:.2g} of the largest output")


def main(argv: Sequence[str] | None = None) -> dict:
    p = h.parser(__doc__.splitlines()[0])
    args = h.parse(p, argv)
    if h.served_as_worker(args, worker):
        return {}
    # each backend's line goes out as its worker ends, so a run cut short keeps the others'
    results = h.run_backends("fp8check", args, {}, summary=lambda res: line(res.get("backend", "?"), res))
    lines = [line(b, r) for b, r in results.items()]
    rows = [[b, x.split(" ", 1)[0], x.split(": ", 1)[1]] for b, x in zip(results, lines, strict=True)]
    table = h.markdown_table(["backend", "result", "scales, float8 GEMM, GEMM difference"], rows)
    payload = {"title": "FP8 native paths against the emulated reference", "machine": h.machine(),
               "settings": {"device": args.device or "framework default", "layer": f"{N_IN} -> {N_OUT}",
                            "rows": ROWS, "steps": STEPS},
               "results": results}
    h.write(args.out, "fp8check", payload, table)
    print("\n".join(lines))
    return payload


if __name__ == "__main__":
    main()
