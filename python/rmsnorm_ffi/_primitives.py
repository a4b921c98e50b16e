"""The RMS norm as three JAX primitives that own every transformation rule.

- ``rmsnorm_fwd``: ``(x, [weight]) -> (y, rstd)``, lowered to the Rust forward.
- ``rmsnorm_bwd``: ``(x, [weight], rstd, dy) -> (dx, [dweight])``, lowered to the fused Rust
  backward. Its ``eps`` is None from `rms_norm_bwd` (any rstd); the VJP sets it, promising that
  rstd is the forward's of x with that eps: the CPU call then takes rstd from x itself, so XLA
  drops a forward whose y nothing reads (a gradient-only program).
- ``rmsnorm_residual_fwd``: ``(x, residual, [weight]) -> (y, h, rstd)`` with ``h = x + residual``
  rounded to x's dtype and ``(y, rstd)`` the forward of ``h``: one fused Rust pass. Its JVP is
  ``th = tx + tresidual`` and the forward's tangent at ``h``, so its reverse mode is the same
  fused backward (at ``h``), the gradients of y and h both flowing into x and the residual.
- ``rmsnorm_tangent``: ``(x, [weight], rstd, tx, [tw]) -> (ty, trstd)``, the forward's tangent,
  linear in ``(tx, tw)``. Evaluated forwards it is jnp math; its **transpose is the fused Rust
  backward**, so `grad` (JAX's linearize-then-transpose) runs one ``rmsnorm_bwd`` per norm.

Rules, each for all three:

- abstract evaluation carries the types: y like x, rstd like x without its last axis, dweight
  like the weight, with their shardings (explicit meshes) and varying manual axes (`shard_map`);
- batching folds mapped axes into rows: one call per op whatever the vmap nesting; a mapped
  weight becomes a batched weight ``(*batch, n)`` (still one call), and so does an unmapped one
  whenever per-example weight gradients are needed (`vmap(grad)` must not sum them);
- JVP: the forward's is ``rmsnorm_tangent``; the backward's and the tangent's are jnp math
  (`_math`), so higher orders work while first-order reverse mode stays on Rust;
- lowering: `_partitioning` (custom_partitioning around `ffi_call`), which partitions per shard.

The weight's batch dimensions ``wb`` are a prefix of x's leading dimensions (what the Rust
handlers accept). Operands of one call are first cast to the same varying manual axes, so a
weight replicated across `shard_map` shards gets the sum of the shards' gradients by the
transpose of that cast.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rmsnorm_ffi import _math, _partitioning

forward_p = Primitive("rmsnorm_fwd")
backward_p = Primitive("rmsnorm_bwd")
tangent_p = Primitive("rmsnorm_tangent")
residual_p = Primitive("rmsnorm_residual_fwd")
for _p in (forward_p, backward_p, tangent_p, residual_p):
    _p.multiple_results = True


# ---------------------------------------------------------------------------------------------
# Binding: operands on the same varying manual axes


def _vma(value) -> frozenset:
    """The manual mesh axes (inside `shard_map`) along which `value` varies."""
    aval = jax.typeof(value)
    mat = getattr(aval, "mat", None)  # jax >= 0.10: ShapedArray.mat.varying
    varying = getattr(mat, "varying", None) if mat is not None else getattr(aval, "vma", None)
    return frozenset(varying or ())


def _aligned(*values):
    """`values` cast to vary along the union of their varying manual axes."""
    axes = frozenset().union(*(_vma(v) for v in values))
    out = []
    for v in values:
        missing = tuple(sorted(axes - _vma(v)))
        out.append(jax.lax.pcast(v, missing, to="varying") if missing else v)
    return out


def forward(x, weight, eps: float, offset: float = 0.0):
    """``(y, rstd)``; the weight applied is ``offset + weight``."""
    args = (x,) if weight is None else (x, weight)
    return tuple(forward_p.bind(*_aligned(*args), eps=eps, has_weight=weight is not None, offset=offset))


def residual_forward(x, residual, weight, eps: float, offset: float = 0.0):
    """``(y, h, rstd)``."""
    args = (x, residual) if weight is None else (x, residual, weight)
    return tuple(residual_p.bind(*_aligned(*args), eps=eps, has_weight=weight is not None, offset=offset))


def backward(x, weight, rstd, dy, eps=None, offset: float = 0.0, dh=None):
    """``(dx, dweight)``; dweight is None without weight. ``eps`` (from the VJP): ``rstd`` is
    the forward's of x with this eps, which lets the CPU take it from x (`_partitioning`).
    ``dh``: added to dx before it is rounded (the fused residual's backward)."""
    args = (x, rstd, dy) if weight is None else (x, weight, rstd, dy)
    args += () if dh is None else (dh,)
    out = backward_p.bind(
        *_aligned(*args), has_weight=weight is not None, eps=eps, offset=offset, has_dh=dh is not None
    )
    return (out[0], None) if weight is None else (out[0], out[1])


def _tangent(x, weight, rstd, tx, tw, eps, offset=0.0, residual=False):
    """``(ty, trstd)``; with ``residual``, ``(ty, th, trstd)`` where ``th`` is ``tx`` passed
    through, so that the transpose receives h's cotangent with y's and fuses the two."""
    args = (x, rstd, tx) if weight is None else (x, weight, rstd, tx, tw)
    return tuple(
        tangent_p.bind(
            *_aligned(*args), has_weight=weight is not None, eps=eps, offset=offset, residual=residual
        )
    )


def _split(args, has_weight: bool, names: str, has_dh: bool = False):
    """Operands by role: `names` is the operand order with a weight ("xwrd"), the weight-like
    letters being dropped when there is none (and "h", dh, when the call has none)."""
    order = names if has_weight else names.replace("w", "").replace("v", "")
    order = order if has_dh else order.replace("h", "")
    found = dict(zip(order, args))
    return [found.get(c) for c in names]


# ---------------------------------------------------------------------------------------------
# Abstract evaluation


def _without_last(aval):
    sharding = aval.sharding
    spec = tuple(sharding.spec)[: aval.ndim] + (None,) * max(0, aval.ndim - len(sharding.spec))
    return NamedSharding(sharding.mesh, P(*spec[:-1]))


def _forward_abstract(*avals, eps, has_weight, offset=0.0):
    x = avals[0]
    rstd = x.update(shape=x.shape[:-1], dtype=_math.acc_dtype(x.dtype), sharding=_without_last(x))
    return [x.update(weak_type=False), rstd]


def _residual_abstract(*avals, eps, has_weight, offset=0.0):
    y, rstd = _forward_abstract(avals[0], *avals[2:], eps=eps, has_weight=has_weight)
    return [y, y, rstd]


def _backward_abstract(*avals, has_weight, eps, offset=0.0, has_dh=False):
    x, w, _, _, _ = _split(avals, has_weight, "xwrdh", has_dh)
    out = [x.update(weak_type=False)]
    if has_weight:
        # Typed like the weight, on the operands' varying axes.
        out.append(w.update(weak_type=False))
    return out


def _tangent_abstract(*avals, has_weight, eps, offset=0.0, residual=False):
    x, _, rstd, tx, _ = _split(avals, has_weight, "xwrtv")
    ty = x.update(weak_type=False)
    return [ty, tx.update(weak_type=False), rstd] if residual else [ty, rstd]


forward_p.def_abstract_eval(_forward_abstract)
backward_p.def_abstract_eval(_backward_abstract)
tangent_p.def_abstract_eval(_tangent_abstract)
residual_p.def_abstract_eval(_residual_abstract)


# ---------------------------------------------------------------------------------------------
# Evaluation and lowering


def _apply(prim):
    """Eager evaluation: the primitive compiled alone, as JAX's own primitives are."""
    from jax._src import dispatch

    return lambda *args, **params: dispatch.apply_primitive(prim, *args, **params)


def _forward_lowered(*args, eps, has_weight, offset):
    if _partitioning.is_explicit(jax.typeof(args[0])):
        avals = _forward_abstract(*map(jax.typeof, args), eps=eps, has_weight=has_weight)
        return _partitioning.explicit_forward(args, eps, avals, offset=offset)
    return _partitioning.partitioned_forward(has_weight)(*args, eps=eps, offset=offset)


def _residual_lowered(*args, eps, has_weight, offset):
    if _partitioning.is_explicit(jax.typeof(args[0])):
        avals = _residual_abstract(*map(jax.typeof, args), eps=eps, has_weight=has_weight)
        return _partitioning.explicit_forward(args, eps, avals, residual=True, offset=offset)
    return _partitioning.partitioned_forward(has_weight, residual=True)(*args, eps=eps, offset=offset)


def _backward_lowered(*args, has_weight, eps, offset, has_dh):
    if _partitioning.is_explicit(jax.typeof(args[0])):
        avals = _backward_abstract(*map(jax.typeof, args), has_weight=has_weight, eps=eps, has_dh=has_dh)
        return _partitioning.explicit_backward(args, eps, avals, offset=offset, has_dh=has_dh)
    return _partitioning.partitioned_backward(has_weight, has_dh)(*args, eps=eps, offset=offset)


def _tangent_math(*args, has_weight, eps, offset, residual):
    x, w, rstd, tx, tw = _split(args, has_weight, "xwrtv")
    ty, trstd = _math.tangent(x, w, rstd, tx, tw, offset)
    return [ty, tx, trstd] if residual else [ty, trstd]


def _checked(rule):
    """A lowering that first refuses what cannot be exported (see `_check_exportable`)."""

    def lower(ctx, *args, **params):
        _check_exportable(ctx)
        return rule(ctx, *args, **params)

    return lower


def _check_exportable(ctx) -> None:
    """`jax.export` cannot serialize custom_partitioning's callback, which a call partitioned
    by XLA over several devices needs: say so, rather than JAX's "host_callbacks" error."""
    params = getattr(ctx.module_context, "lowering_parameters", None)
    if not getattr(params, "for_export", False):
        return
    if _partitioning.is_explicit(ctx.avals_in[0]):
        return  # lowered as a shard_map, which jax.export serializes
    axis_context = ctx.module_context.axis_context
    manual = set(getattr(axis_context, "manual_axes", ()) or ())
    mesh = getattr(axis_context, "mesh", None)
    if mesh is not None and manual and manual == set(mesh.axis_names):
        return  # fully manual (shard_map): the call is inlined per device
    devices = getattr(axis_context, "device_assignment", None)
    count = len(devices) if devices is not None else getattr(axis_context, "num_devices", 1)
    if count and count > 1:
        raise ValueError(
            f"rmsnorm_ffi: cannot jax.export a program that XLA partitions rms_norm in over "
            f"{count} devices: its partitioning rule is a jax.experimental.custom_partitioning "
            "callback, which jax.export cannot serialize. Shard it on an explicit mesh instead "
            "(jax.make_mesh's default axis type; that lowering exports), call rms_norm inside "
            "jax.shard_map over all mesh axes, or export for one device."
        )


for _p in (forward_p, backward_p, tangent_p, residual_p):
    _p.def_impl(_apply(_p))
mlir.register_lowering(forward_p, _checked(mlir.lower_fun(_forward_lowered, multiple_results=True)))
mlir.register_lowering(backward_p, _checked(mlir.lower_fun(_backward_lowered, multiple_results=True)))
mlir.register_lowering(tangent_p, mlir.lower_fun(_tangent_math, multiple_results=True))
mlir.register_lowering(residual_p, _checked(mlir.lower_fun(_residual_lowered, multiple_results=True)))

try:
    # Lowering a custom_partitioning call needs the devices (jax's cuDNN attention and
    # TransformerEngine register their primitives the same way).
    from jax._src import dispatch as _dispatch

    _dispatch.prim_requires_devices_during_lowering.update({forward_p, backward_p, residual_p})
except (ImportError, AttributeError):  # pragma: no cover - older/newer private layout
    pass


# ---------------------------------------------------------------------------------------------
# Batching: mapped axes folded into rows


def _to_front(value, dim, size, batch_spec=None):
    """`value` with its batch axis first; broadcast along a new first axis if not mapped, that
    axis sharded like `batch_spec` (the x operand's batch axis, under an explicit mesh)."""
    if dim is not None:
        return jnp.moveaxis(value, dim, 0)
    shape = (size, *value.shape)
    sharding = jax.typeof(value).sharding
    if batch_spec is None or sharding.mesh.empty:
        return jnp.broadcast_to(value, shape)
    spec = tuple(sharding.spec) + (None,) * (value.ndim - len(sharding.spec))
    return jnp.broadcast_to(value, shape, out_sharding=NamedSharding(sharding.mesh, P(batch_spec, *spec)))


def _batch_spec(value):
    """The sharding (a spec entry) of `value`'s first axis under an explicit mesh, else None."""
    sharding = jax.typeof(value).sharding
    return None if sharding.mesh.empty or not sharding.spec else sharding.spec[0]


def _fold(args, dims, roles: str, weight_batched_out: bool):
    """Operands for one call over the folded batch. `roles` names each operand: x-like ('x') or weight-like ('w'). A weight broadcast
    along the batch is sharded like x's batch axis, so its gradient is too."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    weights = [(a, d) for a, d, r in zip(args, dims, roles) if r == "w"]
    batch_weight = bool(weights) and (
        weight_batched_out
        or any(d is not None for _, d in weights)
        or any(a.ndim > 1 for a, _ in weights)  # a batched weight's prefix must stay x's
    )
    rows = [_to_front(a, d, size) if r == "x" else None for a, d, r in zip(args, dims, roles)]
    spec = next((_batch_spec(a) for a, d, r in zip(args, dims, roles) if r == "x" and d is not None), None)
    out = []
    for a, d, r, row in zip(args, dims, roles, rows):
        if r == "x":
            out.append(row)
        elif batch_weight:
            out.append(_to_front(a, d, size, spec))
        else:
            out.append(a)
    return out


def _forward_batch(args, dims, **params):
    roles = "xw" if params["has_weight"] else "x"
    folded = _fold(args, dims, roles, weight_batched_out=False)
    return forward_p.bind(*folded, **params), [0, 0]


def _residual_batch(args, dims, **params):
    folded = _fold(args, dims, "xxw" if params["has_weight"] else "xx", weight_batched_out=False)
    return residual_p.bind(*folded, **params), [0, 0, 0]


def _backward_batch(args, dims, **params):
    # Per-example weight gradients: the weight is batched whenever anything is.
    roles = ("xwxx" if params["has_weight"] else "xxx") + "x" * params["has_dh"]
    folded = _fold(args, dims, roles, weight_batched_out=True)
    out = backward_p.bind(*folded, **params)
    return out, [0] * len(out)


def _tangent_batch(args, dims, **params):
    roles = "xwxxw" if params["has_weight"] else "xxx"
    folded = _fold(args, dims, roles, weight_batched_out=False)
    out = tangent_p.bind(*folded, **params)
    return out, [0] * len(out)


batching.primitive_batchers[forward_p] = _forward_batch
batching.primitive_batchers[backward_p] = _backward_batch
batching.primitive_batchers[tangent_p] = _tangent_batch
batching.primitive_batchers[residual_p] = _residual_batch


# ---------------------------------------------------------------------------------------------
# Differentiation


def _instantiate(tangent):
    return ad.instantiate_zeros(tangent) if type(tangent) is ad.Zero else tangent


def _forward_jvp(primals, tangents, *, eps, has_weight, offset):
    x, w = primals if has_weight else (primals[0], None)
    y, rstd = forward(x, w, eps, offset)
    tx = _instantiate(tangents[0])
    tw = _instantiate(tangents[1]) if has_weight else None
    ty, trstd = _tangent(x, w, rstd, tx, tw, eps, offset)
    return (y, rstd), (ty, trstd)


def _residual_jvp(primals, tangents, *, eps, has_weight, offset):
    x, res, w = primals if has_weight else (*primals, None)
    y, h, rstd = residual_forward(x, res, w, eps, offset)
    tx, tres = tangents[0], tangents[1]
    if type(tx) is ad.Zero and type(tres) is ad.Zero:
        th = jnp.zeros(h.shape, h.dtype)
    else:
        th = _instantiate(tx) if type(tres) is ad.Zero else (
            _instantiate(tres) if type(tx) is ad.Zero else tx + tres)
    tw = _instantiate(tangents[2]) if has_weight else None
    # h's tangent passes through the tangent primitive, so reverse mode hands its cotangent to
    # the same transpose as y's: one backward call, dx rounded once.
    ty, th, trstd = _tangent(h, w, rstd, th, tw, eps, offset, residual=True)
    return (y, h, rstd), (ty, th, trstd)


def _tangent_transpose(cts, *args, has_weight, eps, offset, residual):
    x, w, rstd, tx, tw = _split(args, has_weight, "xwrtv")
    if residual:
        ct_y, ct_h, ct_rstd = cts
        ct_h = None if type(ct_h) is ad.Zero else ct_h
    else:
        (ct_y, ct_rstd), ct_h = cts, None
    for primal in (x, w, rstd):
        if ad.is_undefined_primal(primal):
            raise NotImplementedError("rmsnorm_tangent is linear in its tangents only")
    want_x = ad.is_undefined_primal(tx)
    want_w = has_weight and ad.is_undefined_primal(tw)
    none = [None] * len(args)
    if type(ct_y) is ad.Zero and type(ct_rstd) is ad.Zero and ct_h is None:
        return none
    if type(ct_y) is ad.Zero:
        ct_y = jnp.zeros(x.shape, x.dtype)
    dx, dw = backward(x, w, rstd, ct_y, eps, offset, dh=ct_h)  # the fused Rust backward
    if type(ct_rstd) is not ad.Zero:
        dx = dx + _math.rstd_cotangent(x, rstd, ct_rstd)
    out = [None, None, None, dx if want_x else None, dw if want_w else None]
    return out if has_weight else [out[0], out[2], out[3]]


def _math_jvp(prim, math):
    """A JVP whose primal is `prim` itself and whose tangent is jnp `math` under `jax.jvp`."""

    def jvp(primals, tangents, **params):
        out = prim.bind(*primals, **params)
        tangents = [
            jnp.zeros(p.shape, p.dtype) if type(t) is ad.Zero else t for p, t in zip(primals, tangents)
        ]
        _, out_tangents = jax.jvp(lambda *a: list(math(*a, **params)), list(primals), tangents)
        return out, out_tangents

    return jvp


def _backward_math(*args, has_weight, eps, offset, has_dh):
    x, w, rstd, dy, dh = _split(args, has_weight, "xwrdh", has_dh)
    dx, dw = _math.backward(x, w, rstd, dy, offset, dh)
    return [dx] if w is None else [dx, dw]


ad.primitive_jvps[forward_p] = _forward_jvp
ad.primitive_jvps[residual_p] = _residual_jvp
ad.primitive_jvps[backward_p] = _math_jvp(backward_p, _backward_math)
ad.primitive_jvps[tangent_p] = _math_jvp(tangent_p, _tangent_math)
ad.primitive_transposes[tangent_p] = _tangent_transpose
