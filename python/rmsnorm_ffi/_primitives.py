"""The norms as four JAX primitives that own every transformation rule.

Each primitive computes either norm: its ``norm`` parameter ("rms" or "layer") is the
`norm` attribute of the Rust targets. The RMS norm's per-row statistics are ``(rstd,)``,
LayerNorm's ``(mean, rstd)`` (`_math.stats_names`), and LayerNorm may have a bias
(``has_bias``), which travels after the weight. Below, "rstd" stands for the statistics.

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
# Operand layouts


def _form(params, residual: bool = False) -> _partitioning.Form:
    """The operands of a call of these `params` (see `_partitioning.Form`)."""
    return _partitioning.Form(
        norm=params.get("norm", "rms"),
        has_weight=params["has_weight"],
        has_bias=params.get("has_bias", False),
        residual=residual,
        has_dh=params.get("has_dh", False),
    )


def _tangent_layout(form) -> tuple:
    """``rmsnorm_tangent``'s operands: the primals (x, [weight], [bias], *stats), then the
    tangents of x and of each parameter."""
    return ("x", *form.params, *form.stats, "tx", *("t" + p for p in form.params))


def _roles(values, layout) -> dict:
    return dict(zip(layout, values))


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


def _present(*values) -> tuple:
    return tuple(v for v in values if v is not None)


def _norm_params(norm: str, bias) -> dict:
    """The norm's parameters: none for the RMS norm, so its jaxprs read as they always did."""
    return {} if norm == "rms" else {"norm": norm, "has_bias": bias is not None}


def forward(x, weight, eps: float, offset: float = 0.0, bias=None, norm: str = "rms"):
    """``(y, *stats)``; the weight applied is ``offset + weight``."""
    args = _present(x, weight, bias)
    return tuple(
        forward_p.bind(*_aligned(*args), eps=eps, has_weight=weight is not None, offset=offset, **_norm_params(norm, bias))
    )


def residual_forward(x, residual, weight, eps: float, offset: float = 0.0, bias=None, norm: str = "rms"):
    """``(y, h, *stats)``."""
    args = _present(x, residual, weight, bias)
    return tuple(
        residual_p.bind(*_aligned(*args), eps=eps, has_weight=weight is not None, offset=offset, **_norm_params(norm, bias))
    )


def backward(x, weight, stats, dy, eps=None, offset: float = 0.0, dh=None, norm: str = "rms", bias=None):
    """``(dx, dweight, dbias)`` (None for a parameter the call has not; ``bias`` only shapes
    dbias). ``eps`` (from the VJP): ``stats`` are the forward's of x with this eps, which lets
    the CPU take them from x (`_partitioning`). ``dh``: added to dx before it is rounded (the
    fused residual's backward)."""
    args = (x, *_present(weight, bias), *stats, dy, *_present(dh))
    out = backward_p.bind(
        *_aligned(*args), has_weight=weight is not None, eps=eps, offset=offset, has_dh=dh is not None,
        **_norm_params(norm, bias),
    )
    out = list(out)
    dx = out.pop(0)
    dw = out.pop(0) if weight is not None else None
    db = out.pop(0) if bias is not None else None
    return dx, dw, db


def _tangent(x, weight, bias, stats, tx, tw, tb, eps, offset=0.0, residual=False, norm="rms"):
    """``(ty, *tstats)``; with ``residual``, ``(ty, th, *tstats)`` where ``th`` is ``tx`` passed
    through, so that the transpose receives h's cotangent with y's and fuses the two."""
    args = (x, *_present(weight, bias), *stats, tx, *(t for p, t in ((weight, tw), (bias, tb)) if p is not None))
    return tuple(
        tangent_p.bind(
            *_aligned(*args), has_weight=weight is not None, eps=eps, offset=offset, residual=residual,
            **_norm_params(norm, bias),
        )
    )


# ---------------------------------------------------------------------------------------------
# Abstract evaluation


def _without_last(aval):
    sharding = aval.sharding
    spec = tuple(sharding.spec)[: aval.ndim] + (None,) * max(0, aval.ndim - len(sharding.spec))
    return NamedSharding(sharding.mesh, P(*spec[:-1]))


def _stat_avals(x, norm: str) -> list:
    stat = x.update(shape=x.shape[:-1], dtype=_math.acc_dtype(x.dtype), sharding=_without_last(x))
    return [stat] * len(_math.stats_names(norm))


def _forward_abstract(*avals, eps, has_weight, offset=0.0, norm="rms", has_bias=False):
    x = avals[0]
    return [x.update(weak_type=False), *_stat_avals(x, norm)]


def _residual_abstract(*avals, eps, has_weight, offset=0.0, norm="rms", has_bias=False):
    y, *stats = _forward_abstract(avals[0], eps=eps, has_weight=has_weight, norm=norm)
    return [y, y, *stats]


def _backward_abstract(*avals, has_weight, eps, offset=0.0, has_dh=False, norm="rms", has_bias=False):
    form = _form(dict(has_weight=has_weight, has_dh=has_dh, norm=norm, has_bias=has_bias))
    o = _roles(avals, form.backward_layout())
    # The gradients typed like their parameters, on the operands' varying axes.
    return [o["x"].update(weak_type=False), *(o[p].update(weak_type=False) for p in form.params)]


def _tangent_abstract(*avals, has_weight, eps, offset=0.0, residual=False, norm="rms", has_bias=False):
    form = _form(dict(has_weight=has_weight, norm=norm, has_bias=has_bias))
    o = _roles(avals, _tangent_layout(form))
    ty = o["x"].update(weak_type=False)
    stats = [o[s] for s in form.stats]
    return [ty, o["tx"].update(weak_type=False), *stats] if residual else [ty, *stats]


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


def _forward_lowered(*args, eps, has_weight, offset, norm="rms", has_bias=False, residual=False):
    form = _form(dict(has_weight=has_weight, norm=norm, has_bias=has_bias), residual=residual)
    abstract = _residual_abstract if residual else _forward_abstract
    if _partitioning.is_explicit(jax.typeof(args[0])):
        avals = abstract(*map(jax.typeof, args), eps=eps, has_weight=has_weight, norm=norm)
        return _partitioning.explicit_forward(args, eps, avals, form, offset=offset)
    return _partitioning.partitioned_forward(form)(*args, eps=eps, offset=offset)


def _residual_lowered(*args, **params):
    return _forward_lowered(*args, **params, residual=True)


def _backward_lowered(*args, has_weight, eps, offset, has_dh, norm="rms", has_bias=False):
    form = _form(dict(has_weight=has_weight, has_dh=has_dh, norm=norm, has_bias=has_bias))
    if _partitioning.is_explicit(jax.typeof(args[0])):
        avals = _backward_abstract(
            *map(jax.typeof, args), has_weight=has_weight, eps=eps, has_dh=has_dh, norm=norm, has_bias=has_bias
        )
        return _partitioning.explicit_backward(args, eps, avals, form, offset=offset)
    return _partitioning.partitioned_backward(form)(*args, eps=eps, offset=offset)


def _tangent_math(*args, has_weight, eps, offset, residual, norm="rms", has_bias=False):
    form = _form(dict(has_weight=has_weight, norm=norm, has_bias=has_bias))
    o = _roles(args, _tangent_layout(form))
    if norm == "rms":
        tstats = _math.tangent(o["x"], o.get("w"), o["rstd"], o["tx"], o.get("tw"), offset)
    else:
        tstats = _math.layer_tangent(
            o["x"], o.get("w"), o.get("b"), o["mean"], o["rstd"], o["tx"], o.get("tw"), o.get("tb"), offset
        )
    ty, *stats = tstats
    return [ty, o["tx"], *stats] if residual else [ty, *stats]


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
    """Operands for one call over the folded batch. `roles` names each operand: x-like ('x') or
    weight-like ('w'). A weight broadcast along the batch is sharded like x's batch axis, so
    its gradient is too."""
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


def _kinds(layout) -> str:
    """Each operand of a layout as `_fold` takes it: weight-like ('w': the parameters and their
    tangents) or x-like ('x': everything with rows)."""
    return "".join("w" if role in ("w", "b", "tw", "tb") else "x" for role in layout)


def _batcher(prim, layout_of, weight_batched_out: bool):
    def batch(args, dims, **params):
        folded = _fold(args, dims, _kinds(layout_of(params)), weight_batched_out)
        out = prim.bind(*folded, **params)
        return out, [0] * len(out)

    return batch


batching.primitive_batchers[forward_p] = _batcher(forward_p, lambda p: _form(p).forward_layout(), False)
batching.primitive_batchers[residual_p] = _batcher(residual_p, lambda p: _form(p, residual=True).forward_layout(), False)
# Per-example weight gradients: the weight is batched whenever anything is.
batching.primitive_batchers[backward_p] = _batcher(backward_p, lambda p: _form(p).backward_layout(), True)
batching.primitive_batchers[tangent_p] = _batcher(tangent_p, lambda p: _tangent_layout(_form(p)), False)


# ---------------------------------------------------------------------------------------------
# Differentiation


def _instantiate(tangent):
    return ad.instantiate_zeros(tangent) if type(tangent) is ad.Zero else tangent


def _forward_jvp(primals, tangents, *, eps, has_weight, offset, norm="rms", has_bias=False, residual=False):
    form = _form(dict(has_weight=has_weight, norm=norm, has_bias=has_bias), residual=residual)
    o, t = _roles(primals, form.forward_layout()), _roles(tangents, form.forward_layout())
    w, b = o.get("w"), o.get("b")
    tw = _instantiate(t["w"]) if has_weight else None
    tb = _instantiate(t["b"]) if has_bias else None
    if not residual:
        y, *stats = forward(o["x"], w, eps, offset, b, norm)
        ty, *tstats = _tangent(o["x"], w, b, stats, _instantiate(t["x"]), tw, tb, eps, offset, norm=norm)
        return (y, *stats), (ty, *tstats)
    y, h, *stats = residual_forward(o["x"], o["res"], w, eps, offset, b, norm)
    tx, tres = t["x"], t["res"]
    if type(tx) is ad.Zero and type(tres) is ad.Zero:
        th = jnp.zeros(h.shape, h.dtype)
    else:
        th = _instantiate(tx) if type(tres) is ad.Zero else (
            _instantiate(tres) if type(tx) is ad.Zero else tx + tres)
    # h's tangent passes through the tangent primitive, so reverse mode hands its cotangent to
    # the same transpose as y's: one backward call, dx rounded once.
    ty, th, *tstats = _tangent(h, w, b, stats, th, tw, tb, eps, offset, residual=True, norm=norm)
    return (y, h, *stats), (ty, th, *tstats)


def _residual_jvp(primals, tangents, **params):
    return _forward_jvp(primals, tangents, **params, residual=True)


def _tangent_transpose(cts, *args, has_weight, eps, offset, residual, norm="rms", has_bias=False):
    form = _form(dict(has_weight=has_weight, norm=norm, has_bias=has_bias))
    layout = _tangent_layout(form)
    o = _roles(args, layout)
    if residual:
        ct_y, ct_h, *ct_stats = cts
        ct_h = None if type(ct_h) is ad.Zero else ct_h
    else:
        (ct_y, *ct_stats), ct_h = cts, None
    ct_stats = [None if type(c) is ad.Zero else c for c in ct_stats]
    for role in ("x", *form.params, *form.stats):
        if ad.is_undefined_primal(o[role]):
            raise NotImplementedError("rmsnorm_tangent is linear in its tangents only")
    none = [None] * len(args)
    if type(ct_y) is ad.Zero and all(c is None for c in ct_stats) and ct_h is None:
        return none
    x, stats = o["x"], tuple(o[s] for s in form.stats)
    if type(ct_y) is ad.Zero:
        ct_y = jnp.zeros(x.shape, x.dtype)
    # The fused Rust backward.
    dx, dw, db = backward(x, o.get("w"), stats, ct_y, eps, offset, dh=ct_h, norm=norm, bias=o.get("b"))
    if any(c is not None for c in ct_stats):
        dx = dx + _math.stats_cotangent(norm, x, stats, tuple(ct_stats))
    grads = {"tx": dx, "tw": dw, "tb": db}
    return [grads[role] if role in grads and ad.is_undefined_primal(o[role]) else None for role in layout]


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


def _backward_math(*args, has_weight, eps, offset, has_dh, norm="rms", has_bias=False):
    form = _form(dict(has_weight=has_weight, has_dh=has_dh, norm=norm, has_bias=has_bias))
    o = _roles(args, form.backward_layout())
    if norm == "rms":
        dx, dw = _math.backward(o["x"], o.get("w"), o["rstd"], o["dy"], offset, o.get("dh"))
        db = None
    else:
        dx, dw, db = _math.layer_backward(
            o["x"], o.get("w"), o.get("b"), o["mean"], o["rstd"], o["dy"], offset, o.get("dh")
        )
    return [dx, *({"w": dw, "b": db}[p] for p in form.params)]


ad.primitive_jvps[forward_p] = _forward_jvp
ad.primitive_jvps[residual_p] = _residual_jvp
ad.primitive_jvps[backward_p] = _math_jvp(backward_p, _backward_math)
ad.primitive_jvps[tangent_p] = _math_jvp(tangent_p, _tangent_math)
ad.primitive_transposes[tangent_p] = _tangent_transpose
