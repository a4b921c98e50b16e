"""How the FFI calls are lowered, and partitioned when XLA shards them.

Each of the four calls (forward and backward, with and without weight) is a
`jax.experimental.custom_partitioning` function around `jax.ffi.ffi_call`. On one device, and
inside a fully manual `shard_map`, custom_partitioning inlines the plain custom call. When XLA
partitions the program over several devices (an automatic mesh, or an explicit one whose types
the primitives carry), its partitioning callback runs the call per shard:

- rows (every axis but the last) keep whatever sharding they have: no gather of x, y, dy or dx;
- the normalized (last) axis, when sharded over mesh axes H that divide it evenly, stays split
  (tensor-parallel activations): each device runs the targets' split passes on its slice of
  every row (`_split`: a sums pass, an all-reduce over H of a few floats per row, never the
  activations, and an apply pass; the RMS norm's one all-reduce forward and backward,
  LayerNorm's two forward and one backward). On CUDA, whose kernels take whole rows, split
  rows run as `_hidden`'s jnp (the same all-reduces). The weight (and bias) is resharded to follow x's
  last axis (a replicated weight is sliced, not moved) and its gradient comes back split the
  same way. A last axis that does not divide evenly over H is gathered instead, and so is
  then the weight;
- otherwise each device holds whole rows and runs the Rust call on them, the weight whole;
- the weight gradient is summed over the mesh axes that shard the rows (not over axes that
  only replicate them, and not over the axes of a batched weight's own batch dimensions); when
  the weight itself is sharded along those axes (FSDP) and the rows are whole, the sum is a
  reduce-scatter (with a split last axis, an all-reduce of each device's slice);
- rows that do not divide evenly over their devices are padded by XLA; the backward masks the
  padding so that it never reaches the weight gradient.

The Shardy rule names one factor per row dimension, ``n`` for x's last axis and ``m`` for the
weight's, none of them required to be replicated (the callback decides what to gather); GSPMD
gets the same shardings from `infer_sharding_from_operands`."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rmsnorm_ffi import _hidden, _native, _split
from rmsnorm_ffi._math import acc_dtype, stats_names

FORWARD_TARGET = "rmsnorm_fwd"
BACKWARD_TARGET = "rmsnorm_bwd"
RESIDUAL_TARGET = "rmsnorm_residual_fwd"
# The `norm` attribute's values (src/handlers/contract.rs, `Norm`).
_NORM_VALUES = {name: d["value"] for name, d in _native.contract()["norms"].items()}


@dataclasses.dataclass(frozen=True)
class Form:
    """Which operands a call has, and which norm it computes (static: one partitioned function
    per form). Operand orders: forward ``(x, [residual], [weight], [bias])`` ->
    ``(y, [h], *stats)``; backward ``(x, [weight], [bias], *stats, dy, [dh])`` ->
    ``(dx, [dweight], [dbias])`` (the bias only shapes its gradient: the Rust call does not
    read it). ``stats`` are the norm's per-row statistics (`stats_names`)."""

    norm: str = "rms"
    has_weight: bool = False
    has_bias: bool = False
    residual: bool = False
    has_dh: bool = False

    @property
    def stats(self) -> tuple:
        return stats_names(self.norm)

    @property
    def params(self) -> tuple:
        """The weight-shaped operands, in order."""
        return ("w",) * self.has_weight + ("b",) * self.has_bias

    def forward_layout(self) -> tuple:
        return ("x",) + ("res",) * self.residual + self.params

    def backward_layout(self) -> tuple:
        return ("x", *self.params, *self.stats, "dy") + ("dh",) * self.has_dh

    def attrs(self) -> dict:
        """The norm's attributes: none for the RMS norm (the form every call had before
        LayerNorm, so exported programs keep their bytes)."""
        if self.norm == "rms":
            return {}
        return {"norm": np.int64(_NORM_VALUES[self.norm]), "has_bias": self.has_bias}


def _struct(like, shape, dtype, typed: bool):
    """A result spec, typed like the operand `like` (its sharding, when it has one) if `typed`,
    so that the inlined call's result keeps the operand's sharding type under an explicit mesh.
    Per-shard code (`typed=False`) gets plain specs: there, a result typed with the caller's
    explicit mesh would put sharding annotations into psum's reduction body, which XLA
    rejects ("Unsupported reduction computation", seen on jax 0.12)."""
    sharding = getattr(jax.typeof(like), "sharding", None)
    if typed and sharding is not None and not sharding.mesh.empty:
        sharding = NamedSharding(sharding.mesh, P(*_spec(sharding.spec, like.ndim)[: len(shape)]))
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    return jax.ShapeDtypeStruct(shape, dtype)


def _offset_attrs(offset: float) -> dict:
    """The scale offset as the calls take it: no attribute for 0 (the weight itself, the form
    every call had before the attribute existed, so exported programs keep their bytes)."""
    return {"scale_offset": np.float32(offset)} if offset else {}


def _forward_call(x, weight, eps: float, typed: bool = True, residual=None, offset: float = 0.0,
                  bias=None, norm: str = "rms"):
    """``(y, *stats)``; with a residual, the fused ``(y, h, *stats)`` of ``h = x + residual``."""
    x_like = _struct(x, x.shape, x.dtype, typed)
    rows = _struct(x, x.shape[:-1], acc_dtype(x.dtype), typed)
    stats = (rows,) * len(stats_names(norm))
    if residual is None:
        call = jax.ffi.ffi_call(FORWARD_TARGET, (x_like, *stats))
        args = (x,)
    else:
        call = jax.ffi.ffi_call(RESIDUAL_TARGET, (x_like, x_like, *stats))
        args = (x, residual)
    args += tuple(p for p in (weight, bias) if p is not None)
    form = Form(norm, weight is not None, bias is not None)
    out = call(
        *args,
        eps=np.float32(eps),
        has_weight=weight is not None,
        row_len=np.int64(x.shape[-1]),
        **_offset_attrs(offset),
        **form.attrs(),
    )
    return tuple(out)


def _backward_call(x, weight, stats, dy, eps, typed: bool = True, offset: float = 0.0, dh=None,
                   norm: str = "rms", bias=None):
    """``(dx, dweight, dbias)`` (None for those the call has not). With ``eps`` (not None),
    ``stats`` are the forward's of x with that eps (as the VJP passes them), and on CPU the call
    takes them itself from x and eps instead of reading them: the same bits, from rows the
    backward reads anyway. Then nothing in a program that only wants gradients reads the
    forward's results, and XLA drops the forward call. On CUDA the kernels read them. With
    ``dh`` (x's shape and dtype), dx is the norm's gradient plus dh, rounded once (the fused
    residual add's backward). ``bias`` only shapes dbias."""
    results = [_struct(x, x.shape, x.dtype, typed)]
    params = [p for p in (weight, bias) if p is not None]
    results += [_struct(p, p.shape, p.dtype, typed) for p in params]
    call = jax.ffi.ffi_call(BACKWARD_TARGET, tuple(results))
    form = Form(norm, weight is not None, bias is not None)
    attrs = dict(has_weight=weight is not None, row_len=np.int64(x.shape[-1]), **_offset_attrs(offset))
    attrs.update(form.attrs())
    if dh is not None:
        attrs["has_dh"] = True
    w = () if weight is None else (weight,)
    extra = () if dh is None else (dh,)
    k = len(stats)

    # platform_dependent takes its operands positionally: (x, dy, *stats, *w, *extra).
    def given(x, dy, *rest):
        return tuple(call(x, *rest[k: k + len(w)], *rest[:k], dy, *rest[k + len(w):], **attrs))

    if eps is None:
        out = given(x, dy, *stats, *w, *extra)
    else:

        def from_x(x, dy, *rest):
            return tuple(call(x, *rest[k: k + len(w)], dy, *rest[k + len(w):], eps=np.float32(eps), **attrs))

        out = jax.lax.platform_dependent(x, dy, *stats, *w, *extra, cpu=from_x, default=given)
    dx, rest = out[0], list(out[1:])
    dw = rest.pop(0) if weight is not None else None
    db = rest.pop(0) if bias is not None else None
    return dx, dw, db


# ---------------------------------------------------------------------------------------------
# Shardings


def _spec(spec, ndim: int) -> tuple:
    """A partition spec as a tuple of exactly `ndim` entries (None where unsharded)."""
    entries = tuple(spec)[:ndim]
    return entries + (None,) * (ndim - len(entries))


def _axes(entry) -> tuple:
    """The mesh axes of one spec entry, in order."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _row_spec(x_shape) -> tuple:
    """The sharding of x's row dimensions, from the operand's sharding."""
    return _spec(x_shape.sharding.spec, len(x_shape.shape))[:-1]


def _named(mesh, *entries) -> NamedSharding:
    return NamedSharding(mesh, P(*entries))


def _hidden_axes(mesh, x_shape) -> tuple:
    """The mesh axes that shard x's last (normalized) axis, when the rows are split over them
    (`_split`'s passes); () when each device holds whole rows. A last axis that does not divide
    evenly over its devices gives () too: it is gathered (XLA would pad it, and padding inside
    a row would have to be masked out of every sum; not done), and so does an empty one."""
    axes = _axes(_spec(x_shape.sharding.spec, len(x_shape.shape))[-1])
    shards = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
    n = x_shape.shape[-1]
    if shards == 1 or n == 0 or n % shards:
        return ()
    return axes


def _entry(axes: tuple):
    """A spec entry for `axes`: None, one axis name, or a tuple of them."""
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _weight_batch(weight_shape) -> int:
    """How many batch dimensions a (vmapped) weight carries before its last axis."""
    return len(weight_shape.shape) - 1


def _summed_axes(mesh, rows: tuple, k: int) -> tuple:
    """The mesh axes over which the weight gradient must be summed: those that shard the rows
    beyond a batched weight's own `k` batch dimensions (an axis of size 1 needs no sum)."""
    return tuple(a for entry in rows[k:] for a in _axes(entry) if mesh.shape[a] > 1)


def _scattered_axes(weight_shape, summed: tuple) -> tuple:
    """The weight's own sharding of its last axis, when every axis of it is also summed over
    (FSDP): the gradient is then reduce-scattered along those axes, else ()."""
    axes = _axes(_spec(weight_shape.sharding.spec, len(weight_shape.shape))[-1])
    return axes if axes and set(axes) <= set(summed) else ()


def _param_shardings(mesh, arg_shapes, layout: tuple, rows: tuple, hidden) -> dict:
    """The shardings of the weight-shaped operands ("w", "b") of an operand `layout`: their batch
    dimensions like x's rows, their last axis like x's (`hidden`) or whole."""
    return {
        role: _named(mesh, *rows[: _weight_batch(shape)], hidden)
        for role, shape in zip(layout, arg_shapes)
        if role in ("w", "b")
    }


def _forward_shardings(mesh, arg_shapes, form: Form):
    """Operands x, [residual], [weight], [bias]; results y, [h], *stats. The last axis of x-like
    values and of the weight and bias is sharded over the hidden axes (see `_hidden_axes`) or
    whole."""
    rows = _row_spec(arg_shapes[0])
    hidden = _entry(_hidden_axes(mesh, arg_shapes[0]))
    x_sharding = _named(mesh, *rows, hidden)
    layout = form.forward_layout()
    params = _param_shardings(mesh, arg_shapes, layout, rows, hidden)
    args = tuple(params.get(role, x_sharding) for role in layout)
    x_like = 1 + form.residual
    return args, (x_sharding,) * x_like + (_named(mesh, *rows),) * len(form.stats)


def _backward_shardings(mesh, arg_shapes, form: Form):
    """Operands as `Form.backward_layout`; results dx, [dweight], [dbias], each gradient
    sharded like its parameter's batch dimensions and last axis (split like x's), or, with
    whole rows, reduce-scattered where the parameter is sharded along the axes summed over."""
    rows = _row_spec(arg_shapes[0])
    hidden = _entry(_hidden_axes(mesh, arg_shapes[0]))
    x_sharding, rows_sharding = _named(mesh, *rows, hidden), _named(mesh, *rows)
    layout = form.backward_layout()
    params = _param_shardings(mesh, arg_shapes, layout, rows, hidden)
    args = tuple(params.get(role, rows_sharding if role in form.stats else x_sharding) for role in layout)
    results = [x_sharding]
    for role, shape in zip(layout, arg_shapes):
        if role not in params:
            continue
        if hidden is not None:
            # The gradient stays split like x's last axis (summed, not scattered, over the rows).
            results.append(params[role])
        else:
            k = _weight_batch(shape)
            scattered = _scattered_axes(shape, _summed_axes(mesh, rows, k))
            results.append(_named(mesh, *rows[:k], scattered or None))
    return args, tuple(results)


def _shardy_rule(value_types, form: Form, kind: str):
    """One factor per row dimension (r0, r1, ...), ``n`` for x's last axis and a factor of its
    own for the weight's (``m``) and the bias's (``c``), and their gradients': a sharded weight
    (FSDP, or along a model axis) then does not propagate its sharding into x, y or dy through
    this op. Neither must be replicated: a sharded ``n`` runs the hidden-axis path (the
    partition callback gathers it only when it does not divide evenly), and the callback
    reshards the weight to what it needs (its last axis split like x's, or whole), so a weight
    already split like x's last axis arrives without moving."""
    rank = len(value_types[0].shape)
    rows = tuple(f"r{i}" for i in range(rank - 1))
    x, r = ArrayMapping(*rows, "n"), ArrayMapping(*rows)
    layout = form.backward_layout() if kind == "backward" else form.forward_layout()
    factor = {"w": "m", "b": "c"}
    mappings = {
        role: ArrayMapping(*rows[: len(shape.shape) - 1], factor[role])
        for role, shape in zip(layout, value_types)
        if role in factor
    }
    operands = tuple(mappings.get(role, r if role in form.stats else x) for role in layout)
    if kind == "backward":
        results = (x, *(mappings[p] for p in form.params))
    else:
        results = (x,) * (1 + form.residual) + (r,) * len(form.stats)
    return SdyShardingRule(operands, results)


# ---------------------------------------------------------------------------------------------
# Padding: rows that do not divide evenly over their devices


def _row_mask(mesh, x_global_shape, rows: tuple, x_local):
    """A boolean array of the local row shape, False on rows that XLA added as padding, or None
    when every row dimension divides evenly over its devices."""
    mask = None
    local_rows = x_local.shape[:-1]
    for dim, (entry, size) in enumerate(zip(rows, x_global_shape[:-1])):
        axes = _axes(entry)
        shards = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
        if size % shards == 0:
            continue
        start = jax.lax.axis_index(axes) * local_rows[dim]
        index = jax.lax.broadcasted_iota(jnp.int32, local_rows, dim) + start
        valid = index < size
        mask = valid if mask is None else mask & valid
    return mask


def _masked(mask, x, stats: tuple, dy, dh=None):
    """Padding rows set to zero in x, the statistics, dy and dh: they then add nothing to the
    weight and bias gradients (even with eps=0, where the padding's rstd would be inf) and
    their dx is zero."""
    if mask is None:
        return x, stats, dy, dh
    keep = mask[..., None]
    return (
        jnp.where(keep, x, jnp.zeros((), x.dtype)),
        tuple(jnp.where(mask, s, jnp.zeros((), s.dtype)) for s in stats),
        jnp.where(keep, dy, jnp.zeros((), dy.dtype)),
        None if dh is None else jnp.where(keep, dh, jnp.zeros((), dh.dtype)),
    )


# ---------------------------------------------------------------------------------------------
# The four partitioned calls


def _on_split_rows(kernels, jnp_rows, operands: dict):
    """`kernels(**operands)` (the split passes, CPU only), or on another platform
    `jnp_rows(**operands)` (`_hidden`): chosen when lowering for the platform."""
    names = tuple(operands)

    def call(fn):
        return lambda *values: fn(**dict(zip(names, values)))

    return jax.lax.platform_dependent(*operands.values(), cpu=call(kernels), default=call(jnp_rows))


def _per_shard_forward(eps, form: Form, offset: float = 0.0, hidden: tuple = (), n: int = 0):
    """The forward one device runs on its shard: the Rust call on whole rows, or with `hidden`
    (the mesh axes that split the rows, `n` their global length) the split passes."""
    layout = form.forward_layout()

    def kernels(x, w=None, b=None, res=None):
        return _split.forward(x, w, b, eps, _offset_attrs(offset), form.attrs(), form.norm, hidden, n, residual=res)

    def jnp_rows(x, w=None, b=None, res=None):
        if form.norm == "layer":
            return _hidden.layer_forward(x, w, b, eps, offset, hidden, n, residual=res)
        return _hidden.forward(x, w, eps, offset, hidden, n, residual=res)

    def run(*operands):
        o = dict(zip(layout, operands))
        if hidden:
            return _on_split_rows(kernels, jnp_rows, o)
        return _forward_call(
            o["x"], o.get("w"), eps, typed=False, residual=o.get("res"), offset=offset, bias=o.get("b"),
            norm=form.norm,
        )

    return run


def _forward_partition(eps, offset, form, mesh, arg_shapes, result_shape):
    args, results = _forward_shardings(mesh, arg_shapes, form)
    x = arg_shapes[0]
    per_shard = _per_shard_forward(eps, form, offset, _hidden_axes(mesh, x), x.shape[-1])
    return mesh, per_shard, results, args


def _per_shard_backward(mesh, arg_shapes, eps, form: Form, offset: float = 0.0):
    """The backward one device runs on its shard: the call on its rows (padding masked), then
    the weight and bias gradients summed (or reduce-scattered) over the mesh axes that shard
    the rows. When the rows themselves are split (`_hidden_axes`), the split passes instead,
    the gradients summed over the row axes and left split like x's last axis."""
    layout = form.backward_layout()
    rows = _row_spec(arg_shapes[0])
    x_global = arg_shapes[0].shape
    hidden = _hidden_axes(mesh, arg_shapes[0])
    reductions = {}
    for role, shape in zip(layout, arg_shapes):
        if role in ("w", "b"):
            summed = _summed_axes(mesh, rows, _weight_batch(shape))
            reductions[role] = (summed, _scattered_axes(shape, summed))

    def reduce(role, grad):
        summed, scattered = reductions[role]
        if hidden:
            return grad  # the split passes summed it over the row axes
        if scattered:
            rest = tuple(a for a in summed if a not in scattered)
            if rest:
                grad = jax.lax.psum(grad, rest)
            return jax.lax.psum_scatter(grad, scattered, scatter_dimension=grad.ndim - 1, tiled=True)
        return jax.lax.psum(grad, summed) if summed else grad

    def run(*operands):
        o = dict(zip(layout, operands))
        x, stats, dy, dh = o["x"], tuple(o[s] for s in form.stats), o["dy"], o.get("dh")
        mask = _row_mask(mesh, x_global, rows, x)
        x, stats, dy, dh = _masked(mask, x, stats, dy, dh)
        # Padding rows have masked statistics, which x (zero there) and eps would not give.
        eps_ = eps if mask is None else None
        if hidden:
            row_axes = {role: summed for role, (summed, _) in reductions.items()}

            def kernels(x, dy, w=None, b=None, dh=None, **stats):
                dx, dw, db = _split.backward(
                    x, w, b, tuple(stats[s] for s in form.stats), dy, eps_, _offset_attrs(offset), form.attrs(),
                    form.norm, hidden, x_global[-1], row_axes, dh,
                )
                return tuple(g for g in (dx, dw, db) if g is not None)

            def jnp_rows(x, dy, w=None, b=None, dh=None, rstd=None, mean=None):
                if form.norm == "layer":
                    dx, dw, db = _hidden.layer_backward(
                        x, w, b, mean, rstd, dy, offset, hidden, x_global[-1], row_axes, dh
                    )
                else:
                    dx, dw = _hidden.backward(x, w, rstd, dy, eps_, offset, hidden, x_global[-1], row_axes.get("w", ()), dh)
                    db = None
                return tuple(g for g in (dx, dw, db) if g is not None)

            present = dict(x=x, dy=dy, w=o.get("w"), b=o.get("b"), dh=dh, **dict(zip(form.stats, stats)))
            out = _on_split_rows(kernels, jnp_rows, {k: v for k, v in present.items() if v is not None})
            dx, rest = out[0], list(out[1:])
            dw = rest.pop(0) if "w" in o else None
            db = rest.pop(0) if "b" in o else None
        else:
            dx, dw, db = _backward_call(
                x, o.get("w"), stats, dy, eps_, typed=False, offset=offset, dh=dh, norm=form.norm, bias=o.get("b")
            )
        grads = {"w": dw, "b": db}
        return (dx, *(reduce(p, grads[p]) for p in form.params))

    return run


def _backward_partition(eps, offset, form, mesh, arg_shapes, result_shape):
    args, results = _backward_shardings(mesh, arg_shapes, form)
    return mesh, _per_shard_backward(mesh, arg_shapes, eps, form, offset), results, args


# ---------------------------------------------------------------------------------------------
# Explicit meshes: the shardings are in the types, so the calls are lowered as a shard_map


def is_explicit(aval) -> bool:
    """Whether `aval` is typed on a mesh whose axes are all Explicit: its sharding is then
    known when lowering, and a `shard_map` runs the calls per shard. (A custom_partitioning
    callback would work too, but jax 0.12 then puts sharding annotations into psum's reduction
    body, which XLA rejects; and a shard_map can be exported.)"""
    mesh = aval.sharding.mesh
    explicit = jax.sharding.AxisType.Explicit
    return not mesh.empty and all(t == explicit for t in mesh.axis_types)


def _shard_mapped(per_shard, operands, shardings):
    """`per_shard` run on each device's shard of `operands`, under `shard_map` with the specs
    of `shardings` = (argument shardings, result shardings)."""
    args, results = shardings
    mesh = jax.typeof(operands[0]).sharding.mesh
    # An explicit mesh wants the operands resharded first (a gathered last axis or weight).
    # (NamedShardings rather than specs: lowering may run outside the mesh context, as
    # `jax.jit(f).lower(...)` after `with jax.set_mesh(...)` has ended.)
    operands = [jax.sharding.reshard(o, s) if jax.typeof(o).sharding.spec != s.spec else o for o, s in zip(operands, args)]
    return jax.shard_map(
        per_shard,
        mesh=mesh,
        in_specs=tuple(s.spec for s in args),
        out_specs=tuple(s.spec for s in results),
        check_vma=False,  # the FFI results are per shard by construction
    )(*operands)


def explicit_forward(operands, eps, out_avals, form: Form, offset: float = 0.0):
    shapes = [jax.typeof(o) for o in operands]
    mesh = shapes[0].sharding.mesh
    shardings = _forward_shardings(mesh, shapes, form)
    hidden = _hidden_axes(mesh, shapes[0])
    per_shard = _per_shard_forward(eps, form, offset, hidden, shapes[0].shape[-1])
    return _typed_like(_shard_mapped(per_shard, operands, shardings), out_avals)


def explicit_backward(operands, eps, out_avals, form: Form, offset: float = 0.0):
    shapes = [jax.typeof(o) for o in operands]
    mesh = shapes[0].sharding.mesh
    per_shard = _per_shard_backward(mesh, shapes, eps, form, offset)
    outs = _shard_mapped(per_shard, operands, _backward_shardings(mesh, shapes, form))
    return _typed_like(outs, out_avals)


def _typed_like(values, avals):
    """`values` resharded to the shardings of `avals` where they differ."""
    out = []
    for v, aval in zip(values, avals):
        if jax.typeof(v).sharding.spec != aval.sharding.spec:
            v = jax.sharding.reshard(v, aval.sharding)
        out.append(v)
    return tuple(out)


def _make_forward(form: Form):
    operands = len(form.forward_layout())

    def forward(*args):
        o = dict(zip(form.forward_layout(), args[:operands]))
        eps, offset, _ = args[operands:]
        return _forward_call(
            o["x"], o.get("w"), eps, residual=o.get("res"), offset=offset, bias=o.get("b"), norm=form.norm
        )

    # custom_partitioning takes positional operands and static arguments: one function per form.
    fn = custom_partitioning(forward, static_argnums=(operands, operands + 1, operands + 2))
    fn.def_partition(
        partition=_forward_partition,
        infer_sharding_from_operands=lambda eps, offset, form, mesh, arg_shapes, result_shape: _forward_shardings(
            mesh, arg_shapes, form
        )[1],
        sharding_rule=lambda eps, offset, form, mesh, value_types, result_types: _shardy_rule(
            value_types, form, "forward"
        ),
    )
    return lambda *args, eps, offset=0.0: fn(*args, eps, offset, form)


def _make_backward(form: Form):
    operands = len(form.backward_layout())

    def backward(*args):
        o = dict(zip(form.backward_layout(), args[:operands]))
        eps, offset, _ = args[operands:]
        dx, dw, db = _backward_call(
            o["x"], o.get("w"), tuple(o[s] for s in form.stats), o["dy"], eps, offset=offset, dh=o.get("dh"),
            norm=form.norm, bias=o.get("b"),
        )
        return (dx, *({"w": dw, "b": db}[p] for p in form.params))

    fn = custom_partitioning(backward, static_argnums=(operands, operands + 1, operands + 2))
    fn.def_partition(
        partition=_backward_partition,
        infer_sharding_from_operands=lambda eps, offset, form, mesh, arg_shapes, result_shape: _backward_shardings(
            mesh, arg_shapes, form
        )[1],
        sharding_rule=lambda eps, offset, form, mesh, value_types, result_types: _shardy_rule(
            value_types, form, "backward"
        ),
    )
    return lambda *args, eps, offset=0.0: fn(*args, eps, offset, form)


@functools.cache
def partitioned_forward(form: Form):
    """``f(x, [residual], [weight], [bias], eps=..., offset=...) -> (y, [h], *stats)``,
    partitioned as the module docstring says."""
    return _make_forward(form)


@functools.cache
def partitioned_backward(form: Form):
    """``f(x, [weight], [bias], *stats, dy, [dh], eps=..., offset=...) -> (dx, [dweight],
    [dbias])``, partitioned as the module docstring says (``eps``, ``dh``: see
    `_backward_call`)."""
    return _make_backward(form)
