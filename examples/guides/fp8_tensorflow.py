"""FP8 in Keras (TensorFlow): the `fp8-delayed` recipe puts an emulated float8 matmul into the middle Dense.

An FP8 recipe selects Dense layers (the first and the last stay out by default) and
`mp.prepare` gives each selected `keras.layers.Dense` unimp's float8 matmul and its float32
scaling states (`input_scale`, `kernel_scale`, `grad_scale`, ...) as variables. Every step
quantizes the input, the kernel and the output gradient with delayed scaling, the same rule in
every framework. Float8 is emulated unless `UNIMP_FP8_NATIVE=1` on a GPU with float8 units.

    python examples/guides/fp8_tensorflow.py
"""

from __future__ import annotations

import argparse

if __name__ == "__main__":  # --help answers before TensorFlow is imported (seconds)
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()

import os  # noqa: E402

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # TensorFlow's graph optimizer logs an error on float8 types: harmless

import keras  # noqa: E402
import numpy as np  # noqa: E402

import unimp  # noqa: E402


def main() -> dict:
    keras.utils.set_random_seed(0)
    mp = unimp.mixed_precision("fp8-delayed", backend="tensorflow")
    print(f"recipe: {mp.recipe.describe()}")
    with mp.autocast():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu", name="l1"),
                                  keras.layers.Dense(32, activation="relu", name="l2"),
                                  keras.layers.Dense(4, name="l3")])
    print(f"float8 layers: {mp.fp8_layers(model)}")        # ('l2',): l1 and l3 stay bfloat16
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model, opt = mp.prepare(model, keras.optimizers.Adam(1e-3))

    step = mp.train_step(model, opt, lambda m, b: ce(b[1], m(b[0], training=True)))
    rng = np.random.default_rng(0)
    l2 = model.get_layer("l2")
    for i in range(3):
        r = step((rng.normal(size=(16, 8)).astype("float32"), rng.integers(0, 4, 16)))
        scales = {t: float(getattr(l2, f"{t}_scale").numpy()) for t in ("input", "kernel", "grad")}
        print(f"step {i}: loss {float(r.loss):.4f}, l2's float8 scales {scales}")
    return {"layers": mp.fp8_layers(model), "model": model, "scales": scales}


if __name__ == "__main__":
    main()
