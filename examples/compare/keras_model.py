"""Your own Keras model in ``unimp compare``: a small MLP with LayerNormalization for the digits.

    unimp compare --model examples/compare/keras_model.py:build --recipes float32,mixed_float16

``build`` returns a new Keras model; ``unimp compare`` seeds Keras before each call and builds
it under the recipe's dtype policy, so layers made here take the recipe's compute dtype. The
model takes a batch ``x`` as the data holds it (the digits: float32 (N, 8, 8, 1)) and returns
class logits (no softmax: the loss takes logits).
"""

import keras


def build() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Flatten(),
            keras.layers.Dense(128, name="l1"),
            keras.layers.LayerNormalization(name="norm"),
            keras.layers.ReLU(),
            keras.layers.Dense(10, name="l2"),
        ]
    )


if __name__ == "__main__":  # a model file for unimp compare, not a script: --help says so
    import argparse

    argparse.ArgumentParser(
        usage=f"unimp compare --model {__file__}:build [--recipes ...]",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    ).parse_args()
