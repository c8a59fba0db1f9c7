"""torch backend, ``scaling``: the GradScaler's misuse named at run time, in one line that names
the fix (issue 30 item 3), and nothing stepped by the call that is refused. Seed 000's loop as
written (``loss.backward(); optimizer.step(); policy.scale(loss).backward(); policy.step()``) and
the silent variants of its mistakes."""

import pytest
import torch

import unimp
import unimp.backends.torch as ut


def _seed_000():
    """Seed 000's model, optimizer and loss, with one batch of its shapes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(512, 10)
    )
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(16, 784, generator=g), torch.randint(0, 10, (16,), generator=g))
    return model, torch.optim.Adam(model.parameters()), torch.nn.CrossEntropyLoss(), batch


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


def test_the_seeds_loop_as_written_is_named_at_its_first_mistake():
    model, optimizer, criterion, (images, labels) = _seed_000()
    policy = ut.GradScaler(device="cpu")
    optimizer.zero_grad()
    outputs = model(images)
    loss = criterion(outputs, labels)
    loss.backward()
    optimizer.step()
    with pytest.raises(RuntimeError) as e:
        policy.scale(loss).backward()
    msg = str(e.value)
    assert msg.startswith("Trying to backward through the graph a second time")  # autograd's, kept
    assert "call only scaler.scale(loss).backward() (it replaces loss.backward())" in msg
    assert "\n" not in msg
    with pytest.raises(TypeError, match=r"got no optimizer: call scaler.step\(optimizer\), then scaler.update\(\)"):
        policy.step()


def test_stepping_the_optimizer_on_scaled_gradients_is_refused_before_the_step():
    model, optimizer, criterion, (images, labels) = _seed_000()
    scaler = ut.GradScaler(device="cpu")
    before = _weights(model)
    scaler.scale(criterion(model(images), labels)).backward()
    with pytest.raises(RuntimeError, match=r"still multiplied by the loss scale \(65536\).*scaler.step\(optimizer\)"):
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not optimizer.state  # Adam took no step
    scaler.step(optimizer)  # the right call, then the loop goes on
    scaler.update()
    optimizer.step()  # nothing pending after update(): stepping by hand is the user's call


@pytest.mark.parametrize("how", ["step", "unscale_", "update_only"])
@pytest.mark.parametrize("make", [lambda: ut.GradScaler(device="cpu"), lambda: torch.amp.GradScaler("cpu")], ids=["unimp", "torch.amp"])
def test_the_loops_torch_amp_allows_still_run(how, make):
    model, optimizer, criterion, (images, labels) = _seed_000()
    scaler = make()
    for _ in range(3):
        optimizer.zero_grad()
        scaler.scale(criterion(model(images), labels)).backward()
        if how == "step":
            scaler.step(optimizer)
        elif how == "unscale_":  # unscaled, then stepped (and clipped) by hand
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        scaler.update(None if how != "update_only" else 1024.0)
    scaler.scale(criterion(model(images), labels))  # scaled, never backpropagated: nothing pending
    optimizer.step()
    assert scaler.get_scale() == (65536.0 if how != "update_only" else 1024.0)


def test_a_second_step_before_update_names_update():
    model, optimizer, criterion, (images, labels) = _seed_000()
    scaler = ut.GradScaler(device="cpu")
    scaler.scale(criterion(model(images), labels)).backward()
    scaler.step(optimizer)
    with pytest.raises(RuntimeError, match=r"call scaler.update\(\) once per iteration"):
        scaler.step(optimizer)


def test_the_freed_graph_check_never_unpacks_saved_tensors():
    # saved-tensor hooks (CPU offloading, checkpointing): reading a saved tensor would run the
    # unpack hook (a copy); the check reads the stored tensor only
    model, _, criterion, (images, labels) = _seed_000()
    calls = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: calls.append(1) or t):
        loss = criterion(model(images), labels)
    scaler = ut.GradScaler(device="cpu")
    scaled = scaler.scale(loss)
    assert calls == []
    scaled.backward()
    assert calls  # the backward pass itself unpacks them


def test_unimps_own_steps_are_not_the_users_optimizer_step():
    # a user's scaler with a scaled backward pending does not stop unimp's train step (its
    # guarded optimizer.step is unimp's call, not the user's)
    model, optimizer, criterion, (images, labels) = _seed_000()
    users = ut.GradScaler(device="cpu")
    users.scale(criterion(model(images), labels)).backward()  # left pending
    mp = ut.MixedPrecision(unimp.get_recipe("mixed_float16"), device="cpu")
    other, opt, _, _ = _seed_000()
    step = mp.train_step(other, opt, lambda m, b: criterion(m(b[0]), b[1]))
    assert step((images, labels)).applied
    with pytest.raises(RuntimeError, match="still multiplied"):  # the user's own call still is
        optimizer.step()


def test_optimizers_the_scaled_loss_does_not_reach_are_stepped_as_torch_amp_steps_them():
    # the breaker's cases, each run by torch.amp's GradScaler too: another model's optimizer
    # stepped while a scaled backward is pending; two scalers interleaved, each unscale_-then-
    # step; a wrapper optimizer stepping the one that was unscaled through it
    for make in (lambda: ut.GradScaler(device="cpu"), lambda: torch.amp.GradScaler("cpu")):
        a, opt_a, criterion, (images, labels) = _seed_000()
        b, opt_b, _, _ = _seed_000()
        s = make()
        s.scale(criterion(a(images), labels)).backward()
        criterion(b(images), labels).backward()  # plain, unscaled
        opt_b.step()  # b's gradients are not the scaled loss's
        s.step(opt_a)
        s.update()
        s1, s2 = make(), make()
        opt_a.zero_grad()
        opt_b.zero_grad()
        s1.scale(criterion(a(images), labels)).backward()
        s2.scale(criterion(b(images), labels)).backward()
        s2.unscale_(opt_b)
        opt_b.step()
        s1.unscale_(opt_a)
        opt_a.step()
        s1.update()
        s2.update()

    class Wrapper(torch.optim.Optimizer):
        def __init__(self, base):
            self.base = base
            super().__init__(base.param_groups, {})

        def step(self, closure=None):
            return self.base.step()

    model, opt, criterion, (images, labels) = _seed_000()
    look = Wrapper(opt)
    s = ut.GradScaler(device="cpu")
    s.scale(criterion(model(images), labels)).backward()
    s.unscale_(look)
    look.step()  # the base optimizer's parameters were unscaled through the wrapper
    s.update()


def test_an_optimizer_like_object_is_stepped():
    # torch.amp steps anything with param_groups and step(); only a missing optimizer is refused
    model, opt, criterion, (images, labels) = _seed_000()

    class Duck:
        def __init__(self, inner):
            self.inner = inner
            self.param_groups = inner.param_groups
            self.state = inner.state

        def step(self, *a, **k):
            return self.inner.step(*a, **k)

    s = ut.GradScaler(device="cpu")
    s.scale(criterion(model(images), labels)).backward()
    s.step(Duck(opt))
    s.update()
    assert opt.state  # Adam stepped
    ut.GradScaler(device="cpu", enabled=False).step(Duck(opt))
