"""How the FFI calls are lowered, and partitioned when XLA shards them.

Each of the four calls (forward and backward, with and without weight) is a
`jax.experimental.custom_partitioning` function around `jax.ffi.ffi_call`. On one device, and
inside a fully manual `shard_map`, custom_partitioning inlines the plain custom call. When XLA
partitions the program over several devices (an automatic mesh, or an explicit one whose types
the primitives carry), its partitioning callback runs the call per shard:

- rows (every axis but the last) keep whatever sharding they have: no gather of x, y, dy or dx;
- the normalized (last) axis, when sharded over mesh axes H that divide it evenly, stays split
  (tensor-parallel activations): each device runs `_hidden`'s jnp math on its slice of every
  row, with one all-reduce over H of a float or two per row (the sums of squares forward; the
  dot products backward, with the sums of squares beside them when rstd is taken from x), never
  the activations. The weight is resharded to follow x's last axis (a replicated weight is
  sliced, not moved) and its gradient comes back split the same way. A last axis that does not
  divide evenly over H is gathered instead, and so is then the weight;
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

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rmsnorm_ffi import _hidden
from rmsnorm_ffi._math import acc_dtype

FORWARD_TARGET = "rmsnorm_fwd"
BACKWARD_TARGET = "rmsnorm_bwd"
RESIDUAL_TARGET = "rmsnorm_residual_fwd"


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


def _forward_call(x, weight, eps: float, typed: bool = True, residual=None, offset: float = 0.0):
    """``(y, rstd)``; with a residual, the fused ``(y, h, rstd)`` of ``h = x + residual``."""
    x_like = _struct(x, x.shape, x.dtype, typed)
    rows = _struct(x, x.shape[:-1], acc_dtype(x.dtype), typed)
    if residual is None:
        call = jax.ffi.ffi_call(FORWARD_TARGET, (x_like, rows))
        args = (x,)
    else:
        call = jax.ffi.ffi_call(RESIDUAL_TARGET, (x_like, x_like, rows))
        args = (x, residual)
    args += () if weight is None else (weight,)
    out = call(
        *args,
        eps=np.float32(eps),
        has_weight=weight is not None,
        row_len=np.int64(x.shape[-1]),
        **_offset_attrs(offset),
    )
    return tuple(out)


def _backward_call(x, weight, rstd, dy, eps, typed: bool = True, offset: float = 0.0, dh=None):
    """``(dx, dweight)``. With ``eps`` (not None), ``rstd`` is the forward's of x with that eps
    (as the VJP passes it), and on CPU the call takes it itself from x and eps instead of
    reading it: the same bits, from rows the backward reads anyway. Then nothing in a program
    that only wants gradients reads the forward's results, and XLA drops the forward call. On
    CUDA the kernels read ``rstd``. With ``dh`` (x's shape and dtype), dx is the norm's
    gradient plus dh, rounded once (the fused residual add's backward)."""
    results = [_struct(x, x.shape, x.dtype, typed)]
    if weight is not None:
        results.append(_struct(weight, weight.shape, weight.dtype, typed))
    call = jax.ffi.ffi_call(BACKWARD_TARGET, tuple(results))
    attrs = dict(has_weight=weight is not None, row_len=np.int64(x.shape[-1]), **_offset_attrs(offset))
    if dh is not None:
        attrs["has_dh"] = True
    w = () if weight is None else (weight,)
    extra = () if dh is None else (dh,)

    # The weight and dh travel after (x, rstd, dy), which platform_dependent takes positionally.
    def given(x, rstd, dy, *rest):
        return tuple(call(x, *rest[: len(w)], rstd, dy, *rest[len(w):], **attrs))

    if eps is None:
        out = given(x, rstd, dy, *w, *extra)
    else:

        def from_x(x, rstd, dy, *rest):
            return tuple(call(x, *rest[: len(w)], dy, *rest[len(w):], eps=np.float32(eps), **attrs))

        out = jax.lax.platform_dependent(x, rstd, dy, *w, *extra, cpu=from_x, default=given)
    return (out[0], None) if weight is None else (out[0], out[1])


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
    (`_hidden`'s per-shard math); () when each device holds whole rows. A last axis that does
    not divide evenly over its devices gives () too: it is gathered (XLA would pad it, and
    padding inside a row would have to be masked out of every sum; not done)."""
    axes = _axes(_spec(x_shape.sharding.spec, len(x_shape.shape))[-1])
    shards = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
    if shards == 1 or x_shape.shape[-1] % shards:
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


def _forward_shardings(mesh, arg_shapes, residual: bool = False):
    """Operands x, [residual], [weight]; results y, [h], rstd. The last axis of x-like values
    and of the weight is sharded over the hidden axes (see `_hidden_axes`) or whole."""
    rows = _row_spec(arg_shapes[0])
    hidden = _entry(_hidden_axes(mesh, arg_shapes[0]))
    x_like = 1 + residual
    args = [_named(mesh, *rows, hidden)] * x_like
    if len(arg_shapes) > x_like:
        args.append(_named(mesh, *rows[: _weight_batch(arg_shapes[x_like])], hidden))
    return tuple(args), (_named(mesh, *rows, hidden),) * x_like + (_named(mesh, *rows),)


def _backward_has(arg_shapes, has_dh: bool) -> bool:
    """Whether a backward's operands (x, [weight], rstd, dy, [dh]) include a weight."""
    return len(arg_shapes) == 4 + has_dh


def _backward_shardings(mesh, arg_shapes, has_dh: bool = False):
    has_weight = _backward_has(arg_shapes, has_dh)
    rows = _row_spec(arg_shapes[0])
    hidden = _entry(_hidden_axes(mesh, arg_shapes[0]))
    x_sharding, rows_sharding = _named(mesh, *rows, hidden), _named(mesh, *rows)
    results = [x_sharding]
    if has_weight:
        k = _weight_batch(arg_shapes[1])
        w_sharding = _named(mesh, *rows[:k], hidden)
        args = [x_sharding, w_sharding, rows_sharding, x_sharding]
        if hidden is not None:
            # dweight stays split like x's last axis (summed, not scattered, over the rows).
            results.append(w_sharding)
        else:
            scattered = _scattered_axes(arg_shapes[1], _summed_axes(mesh, rows, k))
            results.append(_named(mesh, *rows[:k], scattered or None))
    else:
        args = [x_sharding, rows_sharding, x_sharding]
    args += [x_sharding] * has_dh
    return tuple(args), tuple(results)


def _shardy_rule(value_types, n_weight_batch: int | None, kind: str, has_dh: bool = False):
    """One factor per row dimension (r0, r1, ...), ``n`` for x's last axis and a factor of its
    own, ``m``, for the weight's (and dweight's): a sharded weight (FSDP, or along a model axis)
    then does not propagate its sharding into x, y or dy through this op. Neither must be
    replicated: a sharded ``n`` runs the hidden-axis path (the partition callback gathers it
    only when it does not divide evenly), and the callback reshards the weight to what it
    needs (its last axis split like x's, or whole), so a weight already split like x's last
    axis arrives without moving."""
    rank = len(value_types[0].shape)
    rows = tuple(f"r{i}" for i in range(rank - 1))
    x, r = ArrayMapping(*rows, "n"), ArrayMapping(*rows)
    w = None if n_weight_batch is None else ArrayMapping(*rows[:n_weight_batch], "m")
    if kind == "backward":
        operands = ((x, r, x) if w is None else (x, w, r, x)) + (x,) * has_dh
        results = (x,) if w is None else (x, w)
    else:
        x_like = (x, x) if kind == "residual" else (x,)
        operands = x_like if w is None else (*x_like, w)
        results = (*x_like, r)
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


def _masked(mask, x, rstd, dy, dh=None):
    """Padding rows set to zero in x, rstd, dy and dh: they then add nothing to the weight
    gradient (even with eps=0, where the padding's rstd would be inf) and their dx is zero."""
    if mask is None:
        return x, rstd, dy, dh
    keep = mask[..., None]
    return (
        jnp.where(keep, x, jnp.zeros((), x.dtype)),
        jnp.where(mask, rstd, jnp.zeros((), rstd.dtype)),
        jnp.where(keep, dy, jnp.zeros((), dy.dtype)),
        None if dh is None else jnp.where(keep, dh, jnp.zeros((), dh.dtype)),
    )


# ---------------------------------------------------------------------------------------------
# The four partitioned calls


def _per_shard_forward(eps, residual: bool, offset: float = 0.0, hidden: tuple = (), n: int = 0):
    """The forward one device runs on its shard: the Rust call on whole rows, or with `hidden`
    (the mesh axes that split the rows, `n` their global length) `_hidden.forward`."""
    if hidden:
        if residual:
            return lambda x, res, *w: _hidden.forward(x, w[0] if w else None, eps, offset, hidden, n, residual=res)
        return lambda x, *w: _hidden.forward(x, w[0] if w else None, eps, offset, hidden, n)
    if residual:
        return lambda x, res, *w: _forward_call(
            x, w[0] if w else None, eps, typed=False, residual=res, offset=offset
        )
    return lambda x, *w: _forward_call(x, w[0] if w else None, eps, typed=False, offset=offset)


def _forward_partition(eps, residual, offset, mesh, arg_shapes, result_shape):
    args, results = _forward_shardings(mesh, arg_shapes, residual)
    x = arg_shapes[0]
    per_shard = _per_shard_forward(eps, residual, offset, _hidden_axes(mesh, x), x.shape[-1])
    return mesh, per_shard, results, args


def _per_shard_backward(mesh, arg_shapes, eps, offset: float = 0.0, has_dh: bool = False):
    """The backward one device runs on its shard: the call on its rows (padding masked), then
    the weight gradient summed (or reduce-scattered) over the mesh axes that shard the rows.
    When the rows themselves are split (`_hidden_axes`), `_hidden.backward` instead, its
    weight gradient summed over the row axes and left split like x's last axis."""
    has_weight = _backward_has(arg_shapes, has_dh)
    rows = _row_spec(arg_shapes[0])
    x_global = arg_shapes[0].shape
    hidden = _hidden_axes(mesh, arg_shapes[0])
    if has_weight:
        summed = _summed_axes(mesh, rows, _weight_batch(arg_shapes[1]))
        scattered = _scattered_axes(arg_shapes[1], summed)
    else:
        summed = scattered = ()

    def run(*operands):
        dh = operands[-1] if has_dh else None
        operands = operands[: len(operands) - has_dh]
        x, weight, rstd, dy = operands if has_weight else (operands[0], None, *operands[1:])
        mask = _row_mask(mesh, x_global, rows, x)
        x, rstd, dy, dh = _masked(mask, x, rstd, dy, dh)
        # Padding rows have a masked rstd, which x (zero there) and eps=0 would not give.
        if hidden:
            dx, dw = _hidden.backward(
                x, weight, rstd, dy, eps if mask is None else None, offset, hidden, x_global[-1], summed, dh
            )
            return (dx,) if dw is None else (dx, dw)
        dx, dw = _backward_call(
            x, weight, rstd, dy, eps if mask is None else None, typed=False, offset=offset, dh=dh
        )
        if not has_weight:
            return (dx,)
        if scattered:
            rest = tuple(a for a in summed if a not in scattered)
            if rest:
                dw = jax.lax.psum(dw, rest)
            dw = jax.lax.psum_scatter(dw, scattered, scatter_dimension=dw.ndim - 1, tiled=True)
        elif summed:
            dw = jax.lax.psum(dw, summed)
        return dx, dw

    return run


def _backward_partition(eps, offset, has_dh, mesh, arg_shapes, result_shape):
    args, results = _backward_shardings(mesh, arg_shapes, has_dh)
    return mesh, _per_shard_backward(mesh, arg_shapes, eps, offset, has_dh), results, args


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


def explicit_forward(operands, eps, out_avals, residual: bool = False, offset: float = 0.0):
    shapes = [jax.typeof(o) for o in operands]
    mesh = shapes[0].sharding.mesh
    shardings = _forward_shardings(mesh, shapes, residual)
    per_shard = _per_shard_forward(eps, residual, offset, _hidden_axes(mesh, shapes[0]), shapes[0].shape[-1])
    return _typed_like(_shard_mapped(per_shard, operands, shardings), out_avals)


def explicit_backward(operands, eps, out_avals, offset: float = 0.0, has_dh: bool = False):
    shapes = [jax.typeof(o) for o in operands]
    mesh = shapes[0].sharding.mesh
    per_shard = _per_shard_backward(mesh, shapes, eps, offset, has_dh)
    outs = _shard_mapped(per_shard, operands, _backward_shardings(mesh, shapes, has_dh))
    return _typed_like(outs, out_avals)


def _typed_like(values, avals):
    """`values` resharded to the shardings of `avals` where they differ."""
    out = []
    for v, aval in zip(values, avals):
        if jax.typeof(v).sharding.spec != aval.sharding.spec:
            v = jax.sharding.reshard(v, aval.sharding)
        out.append(v)
    return tuple(out)


def _make_forward(has_weight: bool, residual: bool):
    # custom_partitioning takes positional operands and static arguments: one function per
    # operand list.
    if residual and has_weight:

        def forward(x, res, weight, eps, residual, offset):
            return _forward_call(x, weight, eps, residual=res, offset=offset)

    elif residual:

        def forward(x, res, eps, residual, offset):
            return _forward_call(x, None, eps, residual=res)

    elif has_weight:

        def forward(x, weight, eps, residual, offset):
            return _forward_call(x, weight, eps, offset=offset)

    else:

        def forward(x, eps, residual, offset):
            return _forward_call(x, None, eps)

    operands = 1 + residual + has_weight
    weight_index = 1 + residual
    kind = "residual" if residual else "forward"
    fn = custom_partitioning(forward, static_argnums=(operands, operands + 1, operands + 2))
    fn.def_partition(
        partition=_forward_partition,
        infer_sharding_from_operands=lambda eps, residual, offset, mesh, arg_shapes, result_shape: _forward_shardings(
            mesh, arg_shapes, residual
        )[1],
        sharding_rule=lambda eps, residual, offset, mesh, value_types, result_types: _shardy_rule(
            value_types, len(value_types[weight_index].shape) - 1 if has_weight else None, kind
        ),
    )
    return lambda *args, eps, offset=0.0: fn(*args, eps, residual, offset)


def _make_backward(has_weight: bool, has_dh: bool):
    operands = 3 + has_weight + has_dh

    def backward(*args):
        values, (eps, offset, _) = args[:operands], args[operands:]
        dh = values[-1] if has_dh else None
        values = values[: operands - has_dh]
        x, weight, rstd, dy = values if has_weight else (values[0], None, *values[1:])
        dx, dw = _backward_call(x, weight, rstd, dy, eps, offset=offset, dh=dh)
        return (dx, dw) if has_weight else (dx,)

    fn = custom_partitioning(backward, static_argnums=(operands, operands + 1, operands + 2))
    fn.def_partition(
        partition=_backward_partition,
        infer_sharding_from_operands=lambda eps, offset, has_dh, mesh, arg_shapes, result_shape: _backward_shardings(
            mesh, arg_shapes, has_dh
        )[1],
        sharding_rule=lambda eps, offset, has_dh, mesh, value_types, result_types: _shardy_rule(
            value_types, len(value_types[1].shape) - 1 if has_weight else None, "backward", has_dh
        ),
    )
    return fn


@functools.cache
def partitioned_forward(has_weight: bool, residual: bool = False):
    """``f(x, [residual], [weight], eps=...) -> (y, [h], rstd)``, partitioned as the module
    docstring says."""
    return _make_forward(has_weight, residual)


@functools.cache
def partitioned_backward(has_weight: bool, has_dh: bool = False):
    """``f(x, [weight], rstd, dy, [dh], eps=..., offset=...) -> (dx, [dweight])``, partitioned
    as the module docstring says (``eps``, ``dh``: see `_backward_call`)."""
    fn = _make_backward(has_weight, has_dh)
    return lambda *args, eps, offset=0.0: fn(*args, eps, offset, has_dh)
