"""unimp on torch.distributed: gloo, 2 processes on the CPU (torch.multiprocessing spawn).

One spawn runs every DDP scenario (each rank saves its results); the tests below assert on
them, so the ~5 s process start is paid once. Every collective has a bounded timeout.
"""


import datetime
import os
import socket
import time
import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist

import unimp
import unimp.backends.torch as ubt
import unimp.distributed.torch  # noqa: F401
from unimp.distributed import fp16_mean
from unimp.loss_scale import DynamicLossScale, simulate

pytestmark = pytest.mark.backend("torch")

WORLD = 2
TIMEOUT_S = 90


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(target, out_dir, *args, timeout=TIMEOUT_S):
    port = _free_port()
    ctx = torch.multiprocessing.start_processes(
        _entry, args=(target, port, str(out_dir), args), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"distributed workers did not finish in {timeout} s")
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


def _entry(rank, target, port, out_dir, args):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        result = target(rank, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- scenarios (in workers)

INIT = 65536.0


def _recipe(init=INIT, **kw):
    return unimp.get_recipe("mixed_float16", loss_scale=DynamicLossScale(init_scale=init, **kw))


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(2, 1)


def _batch(rank):
    """Rank 0 sees ones, rank 1 twos (the Horovod report's inputs)."""
    return torch.full((4, 2), float(rank + 1)), torch.zeros(4, 1)


def _mse(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x).float(), y)


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _poison_after_allreduce(rank_to_poison, calls_to_poison):
    """A DDP comm hook: the usual mean all-reduce, then an inf written into one rank's LOCAL
    result on the given calls (a non-finite value that exists on one replica only, as with
    sharded gradients)."""
    calls = {"n": 0}

    def hook(state, bucket):
        buf = bucket.buffer()
        buf.div_(dist.get_world_size())
        fut = dist.all_reduce(buf, async_op=True).get_future()

        def done(f):
            out = f.value()[0]
            if dist.get_rank() == rank_to_poison and calls["n"] in calls_to_poison:
                out.view(-1)[0] = float("inf")
            calls["n"] += 1
            return out

        return fut.then(done)

    return hook


def _train(rank, recipe, hook=None, steps=2, process_group=None, optimizer="sgd", batches=None):
    from torch.nn.parallel import DistributedDataParallel as DDP

    mp = unimp.mixed_precision(recipe, backend="torch", device="cpu")
    model = DDP(mp.prepare(_model()))
    if hook is not None:
        model.register_comm_hook(None, hook)
    opt = (torch.optim.SGD(model.parameters(), lr=0.01) if optimizer == "sgd"
           else torch.optim.Adam(model.parameters(), lr=0.01))
    step = mp.train_step(model, opt, _mse)
    if process_group is not None:
        step.scaler = ubt.GradScaler(mp.loss_scale, device="cpu", process_group=process_group)
    out = {"params0": _params(model), "steps": []}
    for i in range(steps):
        r = step(_batch(rank) if batches is None else batches[i])
        out["steps"].append({
            "applied": r.applied, "grads_finite": r.grads_finite, "scale_used": r.scale,
            "scale_after": step.scaler.get_scale(), "state": step.scaler.state.to_dict(),
            "params": _params(model),
        })
    return out


def _compiled(rank):
    """The same DDP run eagerly and with ``train_step(compile=True)``, an inf planted after the
    all-reduce on rank 1 at the third call (a compiled one: the first call runs eagerly)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for compile in (False, True):
        mp = unimp.mixed_precision(_recipe(), backend="torch", device="cpu")
        model = DDP(mp.prepare(_model()))
        model.register_comm_hook(None, _poison_after_allreduce(1, {2}))
        step = mp.train_step(model, torch.optim.SGD(model.parameters(), lr=0.01), _mse, compile=compile)
        rows = []
        for _ in range(5):
            r = step(_batch(rank))
            rows.append({"applied": bool(r.applied), "scale": float(r.scale), "params": _params(model)})
        out["compiled" if compile else "eager"] = rows
    return out


def scenarios(rank):
    """Every DDP scenario, run in order on both ranks; an exception is recorded, not raised."""
    results = {}

    def run(name, fn):
        try:
            results[name] = fn()
        except Exception as e:  # the parent reports it in the matching test
            results[name] = {"error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()}
        dist.barrier()

    hook = _poison_after_allreduce(1, {0})
    run("inject", lambda: _train(rank, _recipe(), hook=hook))
    run("inject_adam", lambda: _train(rank, _recipe(), hook=_poison_after_allreduce(1, {0}), optimizer="adam"))
    run("inject_local_only", lambda: _train(rank, _recipe(), hook=_poison_after_allreduce(1, {0}),
                                            process_group=False))
    run("clean_ddp", lambda: _train(rank, _recipe(init=1024.0, growth_interval=2), steps=3))
    run("wire_overflow", lambda: _train(rank, _recipe(init=2.0**20), hook=unimp.distributed.torch.fp16_mean_hook))
    run("hook_values", lambda: _hook_values(rank))
    run("mismatch", lambda: _mismatch(rank))
    run("fsdp2", lambda: _fsdp2(rank))
    run("fsdp2_local_only", lambda: _fsdp2(rank, process_group=False))
    run("fsdp2_fp16_reduce", lambda: _fsdp2(rank, fp16_reduce=True, poison=False))
    run("reduce_grads", lambda: _reduce_grads(rank))
    run("reduce_overflow", lambda: _train(
        rank, unimp.Recipe("p=f32,c=f16,o=f32,reduce=f16", loss_scale=DynamicLossScale(init_scale=2.0**20)),
        hook=unimp.distributed.torch.reduce_hook("float16")))
    run("compiled", lambda: _compiled(rank))
    run("fsdp2_policy", lambda: _fsdp2(rank, poison=False, mpp=unimp.distributed.torch.fsdp_mixed_precision(
        "p=f32,c=bf16,o=f32,reduce=f32")))
    return results


def _reduce_grads(rank):
    """The averaged gradient of a Linear(5, 1) on per-rank random data, after DDP's all-reduce:
    DDP's default, and reduce_hook in float32, float16 and bfloat16; and each rank's own
    (single-process) gradient, for the bound."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from unimp.distributed.torch import reduce_hook

    gen = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(8, 5, generator=gen), torch.randn(8, 1, generator=gen)
    out = {}
    for name in ("default", "float32", "float16", "bfloat16"):
        m = torch.nn.Linear(5, 1)
        with torch.no_grad():
            m.weight.copy_(torch.linspace(-1, 1, 5)[None])
            m.bias.zero_()
        if name == "default":
            local = torch.nn.functional.mse_loss(m(x), y)
            out["local"] = [g.clone() for g in torch.autograd.grad(local, list(m.parameters()))]
        ddp = DDP(m)
        if name != "default":
            ddp.register_comm_hook(None, reduce_hook(name))
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        out[name] = [p.grad.detach().clone() for p in m.parameters()]
    return out


def _fsdp_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))


def _fsdp_batch(rank):
    return torch.full((2, 4), float(rank + 1))


def _fsdp2(rank, process_group=None, fp16_reduce=False, poison=True, mpp=None):
    """FSDP2 fully_shard (gloo, CPU): each rank holds a SHARD of each gradient; an inf in rank
    1's shard exists on rank 1 only, and the scaler's reduction makes both ranks skip."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if fp16_reduce:
        mpp = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16)
    kw = {"mp_policy": mpp} if mpp is not None else {}
    model = _fsdp_model()
    for m in model:
        fully_shard(m, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sc = ubt.GradScaler(DynamicLossScale(init_scale=INIT), device="cpu", process_group=process_group)

    def full():
        return [p.full_tensor().detach().clone() for p in model.parameters()]

    out = {"params0": full(), "steps": [], "grad_type": None}
    for i in range(2):
        loss = model(_fsdp_batch(rank)).sum()
        sc.scale(loss).backward()
        w = model[0].weight.grad
        out["grad_type"] = type(w).__name__
        out["grad_dtype"] = str(w.dtype)
        if poison and i == 0 and rank == 1:
            with torch.no_grad():
                w.to_local().view(-1)[0] = float("inf")
        skips = int(sc.state.total_skips)
        sc.step(opt)
        sc.update()
        applied = int(sc.state.total_skips) == skips
        opt.zero_grad(set_to_none=True)
        out["steps"].append({"applied": bool(applied), "scale_after": sc.get_scale(),
                             "state": sc.state.to_dict(), "params": full()})
    return out


class _Dot(torch.nn.Module):
    """``(p * x).sum()``: the gradient of ``p`` is ``x``."""

    def __init__(self):
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return (self.p * x).sum()


def _hook_values(rank):
    """p.grad after DDP's all-reduce with each float16 hook, for per-rank gradients g."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from unimp.distributed.torch import fp16_gather_mean_hook, fp16_mean_hook

    cases = {"40000": (40000.0, 40000.0), "tiny": (2.0**-24, 2.0**-24), "70000_10000": (70000.0, 10000.0)}
    hooks = {"predivide": fp16_mean_hook, "float32": fp16_gather_mean_hook, "torch": fp16_compress_hook}
    out = {}
    for cname, gs in cases.items():
        for hname, hook in hooks.items():
            m = _Dot()
            ddp = DDP(m)
            ddp.register_comm_hook(None, hook)
            ddp(torch.tensor([gs[rank]])).backward()  # through DDP's forward: the reducer runs
            out[(cname, hname)] = float(m.p.grad.item())
    return out


def _mismatch(rank):
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    mp = unimp.mixed_precision(_recipe(), backend="torch", device="cpu")
    model = DDP(mp.prepare(_model()))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = mp.train_step(model, opt, _mse)
    if rank == 1:  # a checkpoint loaded on rank 1 only
        sd = step.scaler.state_dict()
        sd["state"]["scale"] = 1024.0
        step.load_state_dict(sd)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = step(_batch(rank))
    out = {
        "warned": [str(w.message) for w in caught if issubclass(w.category, unimp.ReplicaDesyncWarning)],
        "applied": r.applied,
        "scale_used": r.scale,
        "params": _params(model),
    }
    return out


# --------------------------------------------------------------------------- tests (parent)


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    return _spawn(scenarios, tmp_path_factory.mktemp("ddp"), timeout=TIMEOUT_S)


def _get(results, name):
    per_rank = [r[name] for r in results]
    for rank, r in enumerate(per_rank):
        if isinstance(r, dict) and "error" in r:
            pytest.fail(f"rank {rank} failed in {name!r}: {r['error']}\n{r['tb']}")
    return per_rank


def _bitwise_equal(a, b):
    return all(x.dtype == y.dtype and torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["inject", "inject_adam"])
def test_inf_on_one_replica_after_allreduce_skips_on_both(ddp_results, name):
    r0, r1 = _get(ddp_results, name)
    for r in (r0, r1):
        first = r["steps"][0]
        assert first["applied"] is False and first["grads_finite"] is False
        assert first["scale_used"] == 65536.0
        assert first["scale_after"] == 32768.0
        assert _bitwise_equal(first["params"], r["params0"])  # skipped: untouched
    assert _bitwise_equal(r0["steps"][0]["params"], r1["steps"][0]["params"])
    # the next clean step applies the same update on both
    assert r0["steps"][1]["applied"] is True and r1["steps"][1]["applied"] is True
    assert r0["steps"][1]["scale_used"] == 32768.0
    assert not _bitwise_equal(r0["steps"][1]["params"], r0["params0"])
    assert _bitwise_equal(r0["steps"][1]["params"], r1["steps"][1]["params"])
    assert r0["steps"][1]["state"] == r1["steps"][1]["state"]


@pytest.mark.slow
def test_without_reduction_the_replicas_drift(ddp_results):
    """The control: process_group=False (no reduction) lets rank 0 apply and rank 1 skip."""
    r0, r1 = _get(ddp_results, "inject_local_only")
    assert r0["steps"][0]["applied"] is True and r1["steps"][0]["applied"] is False
    assert r0["steps"][0]["scale_after"] == 65536.0 and r1["steps"][0]["scale_after"] == 32768.0
    assert not _bitwise_equal(r0["steps"][0]["params"], r1["steps"][0]["params"])


@pytest.mark.slow
def test_ddp_train_step_matches_single_process_full_batch(ddp_results):
    r0, r1 = _get(ddp_results, "clean_ddp")
    mp = unimp.mixed_precision(_recipe(init=1024.0, growth_interval=2), backend="torch", device="cpu")
    model = mp.prepare(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = mp.train_step(model, opt, _mse)
    full = (torch.cat([_batch(0)[0], _batch(1)[0]]), torch.cat([_batch(0)[1], _batch(1)[1]]))
    expected = simulate(DynamicLossScale(init_scale=1024.0, growth_interval=2), [True] * 3)
    for i in range(3):
        step(full)
        for r in (r0, r1):
            assert r["steps"][i]["applied"] is True
            assert r["steps"][i]["state"] == expected[i].to_dict()
            for a, b in zip(r["steps"][i]["params"], model.parameters(), strict=True):
                torch.testing.assert_close(a, b.detach(), rtol=1e-3, atol=1e-4)
        assert _bitwise_equal(r0["steps"][i]["params"], r1["steps"][i]["params"])


@pytest.mark.slow
def test_a_compiled_ddp_step_skips_on_every_replica_as_the_eager_one(ddp_results):
    # DDP's forward and the comm hook break the compiled graph (torch's and the user's code);
    # the step's values do not change: the inf on rank 1 after the all-reduce skips call 2 on
    # both replicas, the scale backs off once, and every parameter equals the eager run's
    r0, r1 = _get(ddp_results, "compiled")
    for r in (r0, r1):
        assert [s["applied"] for s in r["compiled"]] == [True, True, False, True, True]
        assert [s["scale"] for s in r["compiled"]] == [s["scale"] for s in r["eager"]] == [INIT] * 3 + [INIT / 2] * 2
        for c, e in zip(r["compiled"], r["eager"], strict=True):
            assert _bitwise_equal(c["params"], e["params"])
    assert _bitwise_equal(r0["compiled"][-1]["params"], r1["compiled"][-1]["params"])


@pytest.mark.slow
def test_overflow_on_the_float16_wire_skips_on_every_replica(ddp_results):
    r0, r1 = _get(ddp_results, "wire_overflow")
    for r in (r0, r1):
        assert r["steps"][0]["applied"] is False
        assert r["steps"][0]["scale_after"] == 2.0**19
        assert _bitwise_equal(r["steps"][0]["params"], r["params0"])
    assert _bitwise_equal(r0["steps"][1]["params"], r1["steps"][1]["params"])


@pytest.mark.parametrize(
    "case, hook, expected",
    [
        ("40000", "predivide", 40000.0),
        ("40000", "float32", 40000.0),
        ("tiny", "float32", 2.0**-24),   # accumulating in float32 keeps the smallest subnormal
        ("tiny", "predivide", 0.0),      # predividing: 2**-25 rounds (ties to even) to 0
        ("70000_10000", "predivide", 40000.0),  # the mean fits although 70000 does not
        ("70000_10000", "float32", float("inf")),  # a local value above 65504 is inf on the wire
        ("70000_10000", "torch", float("inf")),  # torch's fp16_compress_hook casts first
    ],
)
@pytest.mark.slow
def test_float16_comm_hooks_right_values(ddp_results, case, hook, expected):
    r0, r1 = _get(ddp_results, "hook_values")
    assert r0[(case, hook)] == expected
    assert r1[(case, hook)] == expected


@pytest.mark.slow
@pytest.mark.parametrize("case", ["40000", "tiny", "70000_10000"])
@pytest.mark.parametrize("hook, mode", [("predivide", "predivide"), ("float32", "float32")])
def test_comm_hooks_match_the_numpy_rule(ddp_results, case, hook, mode):
    values = {"40000": (40000.0, 40000.0), "tiny": (2.0**-24, 2.0**-24), "70000_10000": (70000.0, 10000.0)}[case]
    ref = fp16_mean([np.float32(v) for v in values], mode)
    got = _get(ddp_results, "hook_values")[0][(case, hook)]
    assert np.float16(got).tobytes() == ref.tobytes()


@pytest.mark.slow
def test_different_scales_across_ranks_resync_from_rank_0_with_a_warning(ddp_results):
    r0, r1 = _get(ddp_results, "mismatch")
    for r in (r0, r1):
        assert len(r["warned"]) == 1 and "scale in [1024, 65536]" in r["warned"][0]
        assert r["applied"] is True and r["scale_used"] == 65536.0  # rank 0's state on both
    assert _bitwise_equal(r0["params"], r1["params"])


def test_fp16_mean_reference_values():
    assert float(fp16_mean([np.float16(40000)] * 2)) == 40000.0
    assert float(fp16_mean([np.float16(40000)] * 2, "float32")) == 40000.0
    assert float(fp16_mean([np.float16(2**-24)] * 2, "float32")) == 2.0**-24
    assert float(fp16_mean([np.float16(2**-24)] * 2)) == 0.0
    # predividing in float16 itself flushes too: 2**-24 / 2 rounds to 0 in float16
    assert float(np.float16(2**-24) / np.float16(2)) == 0.0
    with np.errstate(over="ignore"):
        assert np.isinf(np.float16(40000) + np.float16(40000))  # summing first overflows


@pytest.mark.parametrize("bad, match", [([], "at least one"), ([np.zeros(2), np.zeros(3)], "same shape")])
def test_fp16_mean_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        fp16_mean(bad)


def test_fp16_mean_bad_mode():
    with pytest.raises(ValueError, match="predivide"):
        fp16_mean([1.0], "sum")


def test_process_group_type_is_checked():
    with pytest.raises(TypeError, match="ProcessGroup"):
        ubt.GradScaler("dynamic", device="cpu", process_group="world")


def test_single_process_scaler_does_not_reduce():
    sc = ubt.GradScaler("dynamic", device="cpu")
    assert sc._group() is None


@pytest.mark.slow
def test_fsdp2_fully_shard_inf_in_one_shard_skips_on_both(ddp_results):
    r0, r1 = _get(ddp_results, "fsdp2")
    assert r0["grad_type"] == "DTensor"  # sharded gradients
    for r in (r0, r1):
        assert r["steps"][0]["applied"] is False
        assert r["steps"][0]["scale_after"] == 32768.0
        assert _bitwise_equal(r["steps"][0]["params"], r["params0"])
        assert r["steps"][1]["applied"] is True
    assert _bitwise_equal(r0["steps"][1]["params"], r1["steps"][1]["params"])
    assert r0["steps"][1]["state"] == r1["steps"][1]["state"]
    # the applied step is the full-batch mean update, unscaled correctly
    model = _fsdp_model()
    loss = (model(_fsdp_batch(0)).sum() + model(_fsdp_batch(1)).sum()) / 2
    loss.backward()
    with torch.no_grad():
        expected = [p - 0.01 * p.grad for p in model.parameters()]
    for a, b in zip(r0["steps"][1]["params"], expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_fsdp2_float16_reduce_scatter_overflow_skips_on_both(ddp_results):
    """FSDP2 with a float16 param/reduce dtype keeps the sharded gradients float32 (so no
    float16 gradient reaches the scaler, unlike FSDP1's keep_low_precision_grads); the scaled
    gradients overflow in the float16 backward / reduce-scatter at 65536 and both ranks skip."""
    r0, r1 = _get(ddp_results, "fsdp2_fp16_reduce")
    assert r0["grad_dtype"] == "torch.float32"
    for r in (r0, r1):
        assert r["steps"][0]["applied"] is False
        assert r["steps"][0]["scale_after"] == 32768.0
        assert _bitwise_equal(r["steps"][0]["params"], r["params0"])
    assert _bitwise_equal(r0["steps"][1]["params"], r1["steps"][1]["params"])
    assert r0["steps"][1]["state"] == r1["steps"][1]["state"]


@pytest.mark.slow
def test_fsdp2_dtensor_already_reduces_found_inf_over_its_mesh(ddp_results):
    """Found while writing this: with FSDP2 the gradients are DTensors, and torch's DTensor
    dispatch reduces the found_inf of ``_amp_foreach_non_finite_check_and_unscale_`` over the
    mesh itself (``found_inf_reduce_handler``), so even process_group=False agrees. unimp's
    reduction still matters for the non-finite-loss flag, DDP and non-DTensor sharding."""
    r0, r1 = _get(ddp_results, "fsdp2_local_only")
    for r in (r0, r1):
        assert [s["applied"] for s in r["steps"]] == [False, True]
        assert r["steps"][0]["scale_after"] == 32768.0
    assert _bitwise_equal(r0["steps"][1]["params"], r1["steps"][1]["params"])


@pytest.mark.slow
def test_torchrun_ddp_example(tmp_path):
    """examples/distributed/torch_ddp.py under torchrun (2 ranks, gloo): the replicas end equal."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(root / "examples" / "distributed" / "torch_ddp.py"), "--steps", "4", "--fp16-wire"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "replicas identical (loss-scale state and parameters): True" in proc.stdout


def test_fp16_mean_doctests_and_no_framework_import():
    import doctest
    import subprocess
    import sys

    import unimp.distributed as ud

    result = doctest.testmod(ud)
    assert result.failed == 0 and result.attempted > 0
    code = "import sys, unimp.distributed; print(sorted(m for m in ('torch', 'tensorflow', 'jax') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.stdout.strip() == "[]", out.stderr


# --------------------------------------------------------------------------- reduce_dtype (issue 17)


@pytest.mark.slow
def test_float32_reduce_hook_is_bitwise_ddps_default(ddp_results):
    for r in _get(ddp_results, "reduce_grads"):
        assert _bitwise_equal(r["float32"], r["default"])


@pytest.mark.slow
@pytest.mark.parametrize("dtype,unit", [("float16", 2.0**-11), ("bfloat16", 2.0**-8)])
def test_half_reduce_hook_stays_within_the_computed_bound(ddp_results, dtype, unit):
    # Bound: each rank's share g_r / 2 (exact: a power of two) is rounded to the reduce dtype
    # (relative error <= u, the unit roundoff) and the sum of the 2 shares once more, so
    # |fl(sum) - sum| <= gamma_2 * sum |g_r / 2|, gamma_n = n u / (1 - n u) (Higham, eq. 4.4);
    # the default float32 mean is within 1e-6 relative of the exact one.
    r0, r1 = _get(ddp_results, "reduce_grads")
    for i in range(2):
        shares = [r0["local"][i].double() / 2, r1["local"][i].double() / 2]
        exact = shares[0] + shares[1]
        size = shares[0].abs() + shares[1].abs()
        bound = 2 * unit / (1 - 2 * unit) * size + 1e-6 * size
        got = r0[dtype][i].double()
        assert bool(((got - exact).abs() <= bound).all()), (got - exact, bound)
        assert torch.equal(r0[dtype][i], r1[dtype][i])  # the same on both ranks
        assert r0[dtype][i].dtype == torch.float32  # cast back to the gradient's dtype
    assert not _bitwise_equal(r0["bfloat16"], r0["default"])  # the reduce ran in bfloat16


@pytest.mark.slow
def test_float16_reduce_overflow_skips_on_every_replica(ddp_results):
    # 2**20 x the local gradients: above 65504 on the float16 wire, inf on both ranks
    r0, r1 = _get(ddp_results, "reduce_overflow")
    for r in (r0, r1):
        assert r["steps"][0]["applied"] is False and r["steps"][0]["grads_finite"] is False
        assert r["steps"][0]["scale_after"] == 2.0**19
        assert _bitwise_equal(r["steps"][0]["params"], r["params0"])
    assert _bitwise_equal(r0["steps"][1]["params"], r1["steps"][1]["params"])


@pytest.mark.slow
def test_fsdp2_policy_from_the_recipe_reduces_in_its_reduce_dtype(ddp_results):
    for r in _get(ddp_results, "fsdp2_policy"):
        assert r["grad_dtype"] == "torch.float32"  # reduce_dtype float32; compute bfloat16
        assert all(s["applied"] for s in r["steps"])


def test_fsdp_mixed_precision_maps_the_policy():
    from unimp.distributed.torch import fsdp_mixed_precision

    mpp = fsdp_mixed_precision("p=f32,c=bf16,o=f32,reduce=f32")
    assert (mpp.param_dtype, mpp.reduce_dtype, mpp.output_dtype) == (
        torch.bfloat16, torch.float32, torch.float32)
    # no reduce_dtype: the stored param dtype, never the half compute dtype
    assert fsdp_mixed_precision("mixed_float16").reduce_dtype == torch.float32


def test_reduce_hook_needs_a_reduce_dtype():
    from unimp.distributed.torch import reduce_hook

    with pytest.raises(ValueError, match="reduce_dtype"):
        reduce_hook(unimp.get_policy("mixed_bfloat16"))
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        reduce_hook("int8")
