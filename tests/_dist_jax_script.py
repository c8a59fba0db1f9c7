"""Run by tests/test_distributed_jax.py in a fresh process: XLA_FLAGS must be set before jax
is imported. Prints one JSON line of the results the tests check."""

import dataclasses
import json
import os
import sys
import warnings

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
sys.path.insert(0, os.environ.get("UNIMP_WORKTREE", "."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import unimp  # noqa: E402
from unimp.backends import jax as ujax  # noqa: E402
from unimp.loss_scale import DynamicLossScale  # noqa: E402

N = len(jax.devices())
mesh = jax.make_mesh((N,), ("d",))
recipe = unimp.Recipe("mixed_float16", loss_scale=DynamicLossScale(init_scale=65536.0))
mp = unimp.mixed_precision(recipe, backend="jax")
out = {"devices": N}


@jax.custom_vjp
def poison(x, factor):
    return x


def _fwd(x, factor):
    return x, factor


def _bwd(factor, g):
    return g * factor, jnp.zeros_like(factor)


poison.defvjp(_fwd, _bwd)


def per_device(a):
    """The N device-local copies of a (replicated or sharded) array, as lists."""
    return [np.asarray(s.data).tolist() for s in a.addressable_shards]


# 1. sharded params (ZeRO/FSDP style): each replica's local gradient shard is its own; inject
#    inf into replica 1's shard only (after the reduce-scatter): every replica must skip.
def loss_fn(params, batch):
    w = poison(params["w"], batch["f"][0])  # local shard [1]; factor inf on replica 1 only
    full = jax.lax.all_gather(w, "d", tiled=True)  # [N]
    return jnp.sum(full * jnp.mean(batch["x"], axis=0))


step = mp.train_step(loss_fn, optax.sgd(1.0), {"w": jnp.zeros(N)}, axis_name="d")
fn = jax.jit(
    jax.shard_map(
        step.replica_step,
        mesh=mesh,
        in_specs=({"w": P("d")}, P(), P(), P("d")),
        out_specs=({"w": P("d")}, P(), P(), P()),
    )
)
put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))  # noqa: E731
x = np.arange(N * N, dtype=np.float32).reshape(N, N) + 1
params = {"w": put(jnp.zeros(N), "d")}
opt_state = put(step.opt_state)
ls = put(step.loss_scale)
bad = np.ones(N, np.float32)
bad[1] = np.inf
for name, f in (("bad", bad), ("clean", np.ones(N, np.float32))):
    params, opt_state, ls, raw = fn(params, opt_state, ls, {"x": put(x, "d"), "f": put(f, "d")})
    r = unimp.StepResult(raw, jax.device_get, ls.config)
    out[f"sharded_{name}"] = {
        "applied": bool(r.applied),
        "grads_finite": bool(r.grads_finite),
        "scale_next": per_device(ls.loss_scale),
        "w": np.asarray(params["w"]).tolist(),
    }
out["sharded_expected_w"] = (-x.mean(axis=0)).tolist()

# 1b. clipping with sharded params: the global norm sums the local shards' squares
clip = mp.train_step(loss_fn, optax.sgd(1.0), {"w": jnp.zeros(N)}, axis_name="d", max_grad_norm=1.0)
cfn = jax.jit(
    jax.shard_map(
        clip.replica_step,
        mesh=mesh,
        in_specs=({"w": P("d")}, P(), P(), P("d")),
        out_specs=({"w": P("d")}, P(), P(), P()),
    )
)
cp, _, cls, craw = cfn(
    {"w": put(jnp.zeros(N), "d")}, put(clip.opt_state), put(clip.loss_scale),
    {"x": put(x, "d"), "f": put(np.ones(N, np.float32), "d")},
)
out["sharded_clip"] = {
    "grad_norm": float(craw["grad_norm"]),
    "w": np.asarray(cp["w"]).tolist(),
}

# 2. data parallel with a mesh: replicated params; the inf comes from replica 1's data.
def dp_loss(params, batch):
    return jnp.mean(batch @ params["w"])


dp = mp.train_step(dp_loss, optax.sgd(0.5), {"w": jnp.zeros(N)}, axis_name="d", mesh=mesh)
one = mp.train_step(dp_loss, optax.sgd(0.5), {"w": jnp.zeros(N)})
xb = x.copy()
xb[1, 0] = np.inf  # replica 1's row
r = dp(xb)
out["dp_bad"] = {
    "applied": bool(r.applied),
    "scale_used": float(r.scale),
    "scale_next": per_device(dp.loss_scale.loss_scale),
    "w": per_device(dp.params["w"]),
}
r, r1 = dp(x), one(x)
out["dp_clean"] = {
    "applied": bool(r.applied),
    "w": per_device(dp.params["w"]),
    "single_device_w": np.asarray(one.params["w"]).tolist(),
    "loss": float(r.loss),
    "single_device_loss": float(r1.loss),
    "traces": dp.traces,
}
dp(x)
out["dp_clean"]["traces_after_3"] = dp.traces
dpc = mp.train_step(dp_loss, optax.sgd(1.0), {"w": jnp.zeros(N)}, axis_name="d", mesh=mesh, max_grad_norm=1.0)
r = dpc(x)
out["dp_clip"] = {"grad_norm": float(r.grad_norm), "w": per_device(dpc.params["w"])}

# 3. optax loss_scaling under shard_map: per-replica gradients, inf on replica 1 only.
opt = ujax.loss_scaling(optax.sgd(1.0), DynamicLossScale(init_scale=65536.0), axis_name="d")


def opt_step(params, state, g):
    updates, state = opt.update(g, state, params)
    return optax.apply_updates(params, updates), state


ofn = jax.jit(jax.shard_map(opt_step, mesh=mesh, in_specs=(P("d"), P(), P("d")), out_specs=(P("d"), P())))
op = put(jnp.ones(N), "d")
ostate = put(opt.init(jnp.ones(1)))
g = np.full(N, 65536.0, np.float32)
g[1] = np.inf
op, ostate = ofn(op, ostate, put(g, "d"))
out["optax_bad"] = {
    "params": np.asarray(op).tolist(),
    "scale_next": per_device(ujax.get_loss_scale(ostate).loss_scale),
    "skips": int(ujax.get_loss_scale(ostate).state.total_skips),
}
op, ostate = ofn(op, ostate, put(np.full(N, 32768.0, np.float32), "d"))
out["optax_clean"] = {"params": np.asarray(op).tolist()}

# 5. modes where JAX does not track variance (pmap, vmap, shard_map(check_vma=False)): the step
#    averages the gradients itself; inf from replica 1 only, then a clean step.
def poisoned_loss(params, batch):
    return jnp.mean(batch["x"] @ poison(params, batch["f"][0]))


modes = {}
ms = mp.train_step(poisoned_loss, optax.sgd(1.0), jnp.zeros(N), axis_name="d")
xs = x.reshape(N, 1, N)
fs = np.stack([bad, np.ones(N, np.float32)])[:, :, None]  # [step, replica, 1]
mappers = {
    "check_vma_false": lambda f: jax.jit(
        jax.shard_map(f, mesh=mesh, in_specs=(P(), P(), P(), P("d")), out_specs=P(), check_vma=False)
    ),
    "pmap": lambda f: jax.pmap(f, in_axes=(None, None, None, 0), axis_name="d"),
    "vmap": lambda f: jax.vmap(f, in_axes=(None, None, None, 0), axis_name="d"),
}
for mode, mapper in mappers.items():
    fn5 = mapper(ms.replica_step)
    state = (ms.params, ms.opt_state, ms.loss_scale)
    rows = []
    for f in fs:
        if mode == "check_vma_false":
            b = {"x": put(x, "d"), "f": put(f[:, 0], "d")}
        else:
            b = {"x": xs, "f": f}
        p5, o5, l5, raw = fn5(*state, b)
        if mode != "check_vma_false":  # per-replica copies: check they agree, keep replica 0
            rows.append({"w": np.asarray(p5).tolist(), "scale": np.asarray(l5.loss_scale).tolist()})
            state = jax.tree_util.tree_map(lambda a: a[0], (p5, o5, l5))
        else:
            rows.append({"w": per_device(p5), "scale": per_device(l5.loss_scale)})
            state = (p5, o5, l5)
    modes[mode] = rows
out["modes"] = modes
out["modes_expected_w"] = (-x.mean(axis=0)).tolist()

# 4. replicas that start with different scales: re-synced from replica 0, with a warning.
good = dp.loss_scale
devices = list(mesh.devices.flat)
local = [jax.device_put(jnp.float32(1024.0 if i == 1 else 65536.0), d) for i, d in enumerate(devices)]
skewed_scale = jax.make_array_from_single_device_arrays((), NamedSharding(mesh, P()), local)
dp._loss_scale = ujax.LossScale(good.config, dataclasses.replace(good.state, scale=skewed_scale))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    r = dp(x)
    jax.block_until_ready(dp.params)
    jax.effects_barrier()
out["desync"] = {
    "warned": sorted({type(w.message).__name__ for w in caught}),
    "scale_used": float(r.scale),
    "scale_next": per_device(dp.loss_scale.loss_scale),
    "w_equal": len({json.dumps(v) for v in per_device(dp.params["w"])}) == 1,
}
# 6. a portable state_dict resumes a mesh step (loaded once, replicated on every device)
saved = dp.state_dict()
saved["state"]["scale"] = 4096.0
dp.load_state_dict(saved)
r = dp(x)
out["resume"] = {"scale_used": float(r.scale), "scale_next": per_device(dp.loss_scale.loss_scale)}
# 7. model state (flax batch_stats) under a mesh: replicated when reduced over the axis; a
# per-replica state is refused with a message naming the fix
import flax.linen as nn  # noqa: E402


def _bn_step(axis):
    bn = nn.BatchNorm(use_running_average=False, momentum=0.5, axis_name=axis)
    stats = {"mean": jnp.zeros(1), "var": jnp.ones(1)}
    params = {"scale": jnp.ones(1), "bias": jnp.zeros(1)}

    def loss_fn(p, s, xb):
        o, upd = bn.apply({"params": p, "batch_stats": s}, xb, mutable=["batch_stats"])
        return jnp.mean(o), upd["batch_stats"]

    f32 = unimp.mixed_precision("float32", backend="jax")
    return f32.train_step(loss_fn, optax.sgd(0.0), params, model_state=stats, axis_name="d", mesh=mesh)


xs = jnp.arange(2.0 * N).reshape(2 * N, 1)  # replica i holds [2i, 2i + 1]
step = _bn_step("d")
step(xs)
out["model_state_mesh"] = {"mean": float(step.model_state["mean"][0]), "total_mean": float(jnp.mean(xs))}
try:
    _bn_step(None)(xs)
    out["model_state_mesh"]["per_replica"] = "no error"
except ValueError as e:
    out["model_state_mesh"]["per_replica"] = str(e)
# 8. reduce_dtype (issue 17): the mean gradient of replicated params all-reduced in float32,
#    float16 or bfloat16, under a mesh (variance tracked) and under shard_map(check_vma=False);
#    and a float16 reduce that overflows (4 replicas x 65536 x 4 > 65504) skips on every replica.
rng = np.random.default_rng(17)
rx = rng.normal(0, 1, (8, 5)).astype(np.float32)
ry = rng.normal(0, 1, (8,)).astype(np.float32)


def reg_loss(p, b):
    return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)


def _reduce_run(reduce_dtype, check_vma=True):
    pol = unimp.Policy(reduce_dtype=reduce_dtype)
    rmp = unimp.mixed_precision(unimp.Recipe(pol), backend="jax")
    init = {"w": np.zeros(5, np.float32), "b": np.float32(0.0)}
    if check_vma:
        st = rmp.train_step(reg_loss, optax.sgd(1.0), init, axis_name="d", mesh=mesh)
        st({"x": rx, "y": ry})
        return [per_device(st.params["w"]), per_device(st.params["b"])]
    st = rmp.train_step(reg_loss, optax.sgd(1.0), init, axis_name="d")
    f = jax.jit(jax.shard_map(st.replica_step, mesh=mesh, in_specs=(P(), P(), P(), P("d")),
                              out_specs=P(), check_vma=False))
    params, _, _, _ = f(st.params, st.opt_state, st.loss_scale, {"x": put(rx, "d"), "y": put(ry, "d")})
    return [per_device(params["w"]), per_device(params["b"])]


out["reduce"] = {
    "data": {"x": rx.tolist(), "y": ry.tolist()},
    "vma": {str(d): _reduce_run(d) for d in (None, "float32", "float16", "bfloat16")},
    "no_vma": {str(d): _reduce_run(d, False) for d in (None, "float32", "float16", "bfloat16")},
}
ov = unimp.mixed_precision(
    unimp.Recipe("params=float32,compute=float16,output=float32,reduce=float16",
                 loss_scale=DynamicLossScale(init_scale=65536.0)), backend="jax")
ovs = ov.train_step(lambda p, b: jnp.mean(b @ p["w"]), optax.sgd(1.0), {"w": jnp.zeros(N)},
                    axis_name="d", mesh=mesh)
r = ovs(np.full((N, N), 4.0, np.float32))  # each replica's share of the scaled gradient: 65536
out["reduce_overflow"] = {
    "applied": bool(r.applied), "grads_finite": bool(r.grads_finite),
    "scale_next": per_device(ovs.loss_scale.loss_scale), "w": per_device(ovs.params["w"]),
}
print(json.dumps(out))
