"""torch block-scaled linear layers: :mod:`unimp.blockscale_linear`'s rule (MXFP8, block FP8,
NVFP4, MXFP4) on torch tensors, as a custom-gradient matmul (:func:`block_scaled_matmul`, an
``autograd.Function``) and :class:`BlockScaledLinear`, an ``nn.Linear`` running it. Emulated:
the operands are quantized and dequantized to float32 and multiplied in float32; the result is
cast to the input's dtype (the compute dtype).
"""

from __future__ import annotations

from typing import Any

import torch

from unimp import blockscale_linear as _bl
from unimp.backends.torch.fp8 import FP8Ops
from unimp.backends.torch.optimizer import UpdateOps
from unimp.fp8 import layer_flag, layer_size, refuse_non_float


class BlockOps(FP8Ops):
    """:mod:`unimp.blockscale_linear`'s namespace over torch tensors on one device: the FP8
    rule's ``FP8Ops`` plus ``matmul`` and ``transpose``; :meth:`on` gives one per device."""

    @staticmethod
    def on(device: Any) -> BlockOps:
        """The namespace for ``device``, made once per device and kept."""
        device = torch.device(device)
        if device not in _OPS:
            _OPS[device] = BlockOps(device)
        return _OPS[device]

    @staticmethod
    def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.matmul(a, b)

    @staticmethod
    def transpose(a: torch.Tensor) -> torch.Tensor:
        return a.t().contiguous()


_OPS: dict[torch.device, BlockOps] = {}


class _BlockScaledMatmul(torch.autograd.Function):
    """``y = x @ W`` by :func:`unimp.blockscale_linear.linear_forward`, its gradients by
    :func:`~unimp.blockscale_linear.linear_backward`; the columnwise copies are kept from the
    forward pass."""

    @staticmethod
    def forward(ctx, x, w, rule, layout, seed, step):  # type: ignore[override]
        ops = BlockOps.on(x.device)
        x2 = x.reshape(-1, x.shape[-1])
        y, saved = _bl.linear_forward(ops, x2, w, rule, layout)
        ctx.save_for_backward(*saved)
        ctx.rule, ctx.layout, ctx.seed, ctx.step = rule, layout, seed, step
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, w.dtype
        return y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        # outside autocast, as the forward's GEMM ran (torch.amp.custom_bwd's rule)
        with torch.autocast(g.device.type, enabled=False):
            ops = BlockOps.on(g.device)
            g2 = g.reshape(-1, g.shape[-1])
            bits = None
            if ctx.rule.stochastic("gradient"):
                bits = _bl.gradient_bits(UpdateOps(g.device), ctx.seed, ctx.step, *g2.shape)
            dx, dw = _bl.linear_backward(ops, _bl.Saved(*ctx.saved_tensors), g2, ctx.rule, ctx.layout, bits)
        return dx.reshape(ctx.x_shape).to(ctx.x_dtype), dw.to(ctx.w_dtype), None, None, None, None


def block_scaled_matmul(x: torch.Tensor, w: torch.Tensor, rule: Any, layout: str = "in_out",
                        seed: int = 0, step: Any = 0) -> torch.Tensor:
    """``x @ W`` as an emulated block-scaled GEMM, differentiable: the forward, input-gradient
    and weight-gradient GEMMs quantize their operands along their reduction axes
    (:data:`unimp.blockscale_linear.GEMMS`) by ``rule``.

    Args:
        x: floating tensor ``(..., K)`` (the compute dtype); the product of its leading
            dimensions and ``K`` multiples of the rule's blocks
            (:func:`unimp.blockscale_linear.check_linear_shapes`).
        w: floating tensor, ``(K, N)`` with ``layout="in_out"``, ``(N, K)`` with ``"out_in"``
            (``nn.Linear.weight``).
        rule: a :class:`unimp.blockscale_linear.BlockLinearRule` or its name (``"mxfp8"``,
            ``"fp8_block"``, ``"nvfp4"``, ``"mxfp4"``).
        layout: ``"in_out"`` or ``"out_in"``.
        seed, step: the stochastic rounding's bits for rules that round gradients so
            (:func:`unimp.blockscale_linear.gradient_bits`): ints or int32 tensors.

    Returns:
        ``(..., N)`` in ``x``'s dtype; ``x``'s gradient in its dtype, ``w``'s in its dtype.
        Where no gradient is taken (``torch.no_grad``, or neither operand requires one) only
        the forward GEMM runs, and the batch rows need not split into blocks.

    Raises:
        TypeError: a non-floating ``x`` or ``w``; ValueError: an unknown rule or layout, or
            sizes that do not split into the rule's blocks.
    """
    rule = _bl.block_linear_rule(rule)
    for name, t in (("x", x), ("w", w)):
        if not t.is_floating_point():
            refuse_non_float(t.dtype, f"block_scaled_matmul {name}", "cast it to a float dtype (x.float())")
    if not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):  # inference: no backward
        y, _ = _bl.linear_forward(BlockOps.on(x.device), x.detach().reshape(-1, x.shape[-1]), w.detach(), rule,
                                  layout, backward=False)
        return y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)
    return _BlockScaledMatmul.apply(x, w, rule, layout, seed, step)


class BlockScaledLinear(torch.nn.Linear):
    """``nn.Linear`` whose matmul is an emulated block-scaled GEMM (:func:`block_scaled_matmul`
    with the weight in its ``(out, in)`` layout); the bias is added in the output dtype.

    Under autocast the input is cast to the autocast dtype, as autocast runs a linear, and the
    GEMM runs outside it (float32 products of the dequantized values). A rule that rounds
    gradients stochastically (``nvfp4``) takes its bits from ``seed`` and the layer's own
    step counter (``block_step``, an int32 buffer advanced by every training-mode call).

    Args:
        in_features, out_features, bias, device, dtype: as ``nn.Linear``.
        rule: a :class:`unimp.blockscale_linear.BlockLinearRule` or its name.
        seed: the stochastic rounding's seed (an int).

    Raises:
        TypeError: a size that is not an int, ``bias`` not True or False.
        ValueError: a size below 1, an unknown rule; at call time, sizes that do not split into
            the rule's blocks (the fix named).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: Any = None,
                 dtype: Any = None, rule: Any = "mxfp8", seed: int = 0) -> None:
        in_features = layer_size(in_features, "in_features", "BlockScaledLinear")
        out_features = layer_size(out_features, "out_features", "BlockScaledLinear")
        bias = layer_flag(bias, "bias", "BlockScaledLinear")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.rule = _bl.block_linear_rule(rule)
        self.seed = int(seed)
        self.register_buffer("block_step", torch.zeros((), dtype=torch.int32, device=self.weight.device))

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, rule: Any, seed: int = 0) -> BlockScaledLinear:
        """A BlockScaledLinear sharing ``linear``'s ``weight`` and ``bias`` Parameters (the same
        objects, so an optimizer built on the model keeps updating them) and its training flag."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                  rule=rule, seed=seed)
        new.weight, new.bias = linear.weight, linear.bias
        new.block_step = torch.zeros((), dtype=torch.int32, device=linear.weight.device)
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point():  # nn.Linear refuses it too
            refuse_non_float(x.dtype, "BlockScaledLinear", "cast the input to a float dtype (x.float())")
        device_type = x.device.type
        step = self.block_step.clone()
        if self.training:
            with torch.no_grad():
                self.block_step.add_(1)
        if torch.is_autocast_enabled(device_type):
            x = x.to(torch.get_autocast_dtype(device_type))
            with torch.autocast(device_type, enabled=False):
                y = block_scaled_matmul(x, self.weight, self.rule, "out_in", self.seed, step)
        else:
            y = block_scaled_matmul(x, self.weight, self.rule, "out_in", self.seed, step)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rule={self.rule.name!r}"


def block_swap(model: torch.nn.Module, recipe: Any) -> tuple[str, ...]:
    """Replaces the ``nn.Linear`` modules ``recipe`` (an
    :class:`unimp.blockscale_recipe.BlockRecipe`) selects by :class:`BlockScaledLinear` sharing
    their Parameters, in place, and returns the selected paths (the FP8 recipes' selection:
    first and last Linear out by default; a module reachable at several paths is refused, as
    :func:`unimp.backends.torch.fp8.fp8_select` refuses it). Layers already block-scaled are
    kept.

    Raises:
        ValueError: a selected module shared by several paths, or selected layers whose
            in / out features do not split into the rule's blocks (all named, with the fix);
            nothing is swapped.
    """
    from unimp.backends.torch.fp8 import fp8_select

    selected = fp8_select(model, recipe)
    modules = dict(model.named_modules())
    _bl.check_layer_sizes(recipe.rule, [(p, modules[p].in_features, modules[p].out_features)
                                        for p in selected if isinstance(modules[p], torch.nn.Linear)])
    done = []
    for path in selected:
        layer = modules[path]
        if isinstance(layer, BlockScaledLinear):
            done.append(path)
        elif isinstance(layer, torch.nn.Linear):
            parent, _, attr = path.rpartition(".")
            new = BlockScaledLinear.from_linear(layer, recipe.rule, recipe.seed)
            setattr(modules[parent] if parent else model, attr, new)
            done.append(path)
    return tuple(done)
