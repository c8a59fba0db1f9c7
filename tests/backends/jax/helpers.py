"""Helpers shared by the jax backend's test files (models, losses, batches, bitwise checks)."""




import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

HALF = ["float16", "bfloat16"]


RECIPE = {"float16": "mixed_float16", "bfloat16": "mixed_bfloat16"}


def bits(x):
    """The raw bytes of an array, for bitwise comparisons (-0.0 != 0.0, NaN payloads)."""
    return np.asarray(x).tobytes()


def tree_bits(tree):
    return [bits(x) for x in jax.tree_util.tree_leaves(tree)]


class LinenMLP(nn.Module):
    dtype: object = jnp.float32
    param_dtype: object = jnp.float32

    @nn.compact
    def __call__(self, x, train=False):
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        x = nn.relu(nn.Dense(16, **kw)(x))
        x = nn.Dropout(0.2, deterministic=not train)(x)
        x = nn.BatchNorm(use_running_average=not train, **kw)(x)
        return nn.Dense(10, **kw)(x)


def _xent(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _affine_loss(params, batch):
    return jnp.sum(params["w"] * batch) + params["b"]
