"""Data-parallel mixed precision in JAX with shard_map: replicas agree on every skip.

Run on one host (CPU devices faked for a try-out):
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python examples/distributed/jax_shard_map.py
On GPUs/TPUs just run it: the mesh spans jax.devices(). Multi-host: start it on every host with
JAX_COORDINATOR_ADDRESS=host0:1234 NUM_PROCESSES=2 PROCESS_ID=<0 or 1>; after
jax.distributed.initialize() the mesh spans all hosts' devices. Here every process draws the
same global batch (same seed); with real data, give the step a global jax.Array built from each
process's part with jax.make_array_from_process_local_data.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import unimp  # noqa: E402


def main(steps: int = 3) -> None:
    if "JAX_COORDINATOR_ADDRESS" in os.environ:  # multi-host: the same script on every host
        jax.distributed.initialize(
            num_processes=int(os.environ["NUM_PROCESSES"]), process_id=int(os.environ["PROCESS_ID"])
        )  # on SLURM / Cloud TPU, jax.distributed.initialize() finds all three by itself
    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("data",))
    mp = unimp.mixed_precision("mixed_float16", backend="jax")

    def loss_fn(params, batch):  # the local mean loss; the step averages it over replicas
        x, y = mp.cast_to_compute(batch)
        pred = mp.apply(lambda p, x: jnp.tanh(x @ p["w1"]) @ p["w2"])(params, x)
        return jnp.mean((pred.astype(jnp.float32) - y) ** 2)

    key1, key2 = jax.random.split(jax.random.key(0))
    params = {"w1": jax.random.normal(key1, (8, 16)) * 0.3, "w2": jax.random.normal(key2, (16, 1)) * 0.3}
    step = mp.train_step(loss_fn, optax.adam(1e-2), params, axis_name="data", mesh=mesh, max_grad_norm=1.0)
    rng = np.random.default_rng(0)
    for i in range(steps):
        x = rng.normal(size=(8 * n, 8)).astype("float32")  # the global batch, split over devices
        r = step((x, x[:, :1] ** 2))
        print(f"step {i}: loss {r.loss:.4f} scale {r.scale:.0f} applied {r.applied} on {n} devices")
    print("compilations", step.traces)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    main(args.steps)
