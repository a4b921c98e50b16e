"""`batched_ffi_op`: a registered FFI target as a JAX op that batches and shards like jnp.

Most custom calls are row-wise or elementwise: their operands and results share leading batch
axes (every row is computed alone), and a few operands (a weight, a table) are whole on every
call. For that shape of op the rules are always the same, and this module writes them once,
with the machinery the RMS norm uses (`_partitioning`, `_primitives`):

- input checks: operand count, batch shapes that agree, results that keep the batch axes;
- `vmap`: the mapped axis becomes one more leading batch axis, so a vmapped op is still one
  call (an unbatched operand that is itself mapped cannot be folded in: that case runs one call
  per element, under `jax.lax.map`);
- sharding: under an automatic mesh a `custom_partitioning` call whose Shardy rule shares one
  factor per batch axis between every batched operand and result, and asks for the core axes
  and the unbatched operands to be replicated; under an explicit mesh a `shard_map` over the
  batch axes. Either way each device runs the call on its own rows: no all-gather of a batched
  operand or result (a sharded core axis or unbatched operand is gathered, as it must be).

It knows nothing of derivatives: wrap the op in `jax.custom_vjp` for those.

In-place updates: ``input_output_aliases={operand: result}`` makes a result the operand's
buffer (XLA's aliasing, as in `jax.ffi.ffi_call`): under `jit` with the operand donated, XLA
updates it without a copy; kept, XLA copies it first. The Rust side declares the same pair
(`InPlace<operand>` result, `AliasedArg` argument), and a mismatch is a clear error.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule, custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rmsnorm_ffi import _partitioning, _primitives

batched_p = Primitive("batched_ffi_call")
batched_p.multiple_results = True


class _Op:
    """What a primitive binding needs to know of one op (hashable: bound as a parameter)."""

    def __init__(self, target: str, results: Callable, core_ndims: tuple, aliases: tuple = ()):
        self.target, self.results, self.core_ndims = target, results, core_ndims
        # ((operand, result), ...): results that are their operand's buffer.
        self.aliases = aliases

    def batched(self) -> list[int]:
        return [i for i, c in enumerate(self.core_ndims) if c is not None]

    def batch_ndim(self, avals) -> int:
        first = self.batched()[0]
        return len(avals[first].shape) - self.core_ndims[first]

    def result_structs(self, avals, attrs: dict) -> list[jax.ShapeDtypeStruct]:
        """The call's results for operands of `avals` (plain shapes and dtypes)."""
        plain = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
        out = self.results(*plain, **attrs)
        out = [out] if isinstance(out, jax.ShapeDtypeStruct) else list(out)
        for r in out:
            if not isinstance(r, jax.ShapeDtypeStruct):
                raise TypeError(f"{self.target}: results(...) must return jax.ShapeDtypeStruct values, got {r!r}")
        return out

    def __repr__(self) -> str:
        return f"batched_ffi_op({self.target!r})"


def batched_ffi_op(
    target: str, results: Callable, *, core_ndims: Sequence[int | None],
    input_output_aliases: dict[int, int] | None = None,
) -> Callable:
    """A JAX op calling the registered FFI target ``target``.

    - ``results(*operands, **attrs)``: the call's results for operands of the given shapes
      (``jax.ShapeDtypeStruct`` values, full shapes), one struct or a sequence of them. Each
      result starts with the operands' batch axes.
    - ``core_ndims``: for each operand, how many trailing axes make one item of the op (0:
      elementwise, 1: a row, 2: a matrix), or ``None`` for an unbatched operand (a weight),
      passed whole to every call. Every batched operand starts with the same batch axes.

    - ``input_output_aliases``: ``{operand index: result index}``, results updated in place
      over a batched operand of the same shape and dtype (the bundle takes them as
      ``InPlace<operand>``/``AliasedArg``). Donate the operand under ``jit``
      (``donate_argnums``) for an update without a copy.

    The op is ``op(*operands, **attrs)``; ``attrs`` become the call's attributes (use NumPy
    scalars for their types, e.g. ``np.float32(2.0)``, as with ``jax.ffi.ffi_call``). It works
    under ``jit``, ``vmap`` (one call), automatic and explicit meshes (rows per device, no
    gathers of batched operands). Bad operands raise ``ValueError``/``TypeError`` naming them.
    """
    if not isinstance(target, str) or not target:
        raise TypeError(f"target: expected the name of a registered FFI target, got {target!r}")
    if not callable(results):
        raise TypeError(f"results: expected a function of the operands returning ShapeDtypeStructs, got {results!r}")
    core = tuple(core_ndims)
    for i, c in enumerate(core):
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 0):
            raise ValueError(f"core_ndims[{i}]: expected an int >= 0 or None (unbatched), got {c!r}")
    if all(c is None for c in core):
        raise ValueError("core_ndims: at least one operand must be batched (an int), got only None")
    aliases = _check_aliases(input_output_aliases, core)
    op = _Op(target, results, core, aliases)

    def call(*operands, **attrs):
        if len(operands) != len(core):
            raise TypeError(f"{target}: expected {len(core)} operands (core_ndims has {len(core)}), got {len(operands)}")
        operands = [jax.numpy.asarray(o) for o in operands]
        batch = None
        for i in op.batched():
            if operands[i].ndim < core[i]:
                raise ValueError(f"{target}: operand {i} has shape {operands[i].shape}, fewer than its {core[i]} core axes")
            shape = operands[i].shape[: operands[i].ndim - core[i]]
            if batch is None:
                batch, first = shape, i
            elif shape != batch:
                raise ValueError(
                    f"{target}: operand {i} has batch shape {shape} but operand {first} has {batch}: batched "
                    "operands must share their leading batch axes"
                )
        frozen = tuple(sorted(attrs.items()))
        structs = op.result_structs([jax.typeof(o) for o in operands], attrs)
        for k, r in enumerate(structs):
            if tuple(r.shape[: len(batch)]) != tuple(batch):
                raise ValueError(
                    f"{target}: result {k} has shape {r.shape}, which does not start with the batch shape {batch}"
                )
        for i, k in aliases:
            if k >= len(structs):
                raise ValueError(f"{target}: input_output_aliases maps operand {i} to result {k}, but there are "
                                 f"{len(structs)} results")
            if (tuple(structs[k].shape), structs[k].dtype) != (operands[i].shape, operands[i].dtype):
                raise ValueError(
                    f"{target}: result {k} is operand {i} updated in place (input_output_aliases), so it must have "
                    f"its shape and dtype {operands[i].shape} {operands[i].dtype}, got {tuple(structs[k].shape)} "
                    f"{structs[k].dtype}"
                )
        return _bind(op, frozen, operands)

    call.__name__ = call.__qualname__ = target
    call.__doc__ = f"The FFI target {target!r} as a batched JAX op (rmsnorm_ffi.batched_ffi_op)."
    return call


def _check_aliases(aliases, core: tuple) -> tuple:
    """``input_output_aliases`` as sorted ``(operand, result)`` pairs, checked."""
    if aliases is None:
        return ()
    if not isinstance(aliases, dict):
        raise TypeError(f"input_output_aliases: expected a dict {{operand index: result index}}, got {aliases!r}")
    pairs = []
    for i, k in aliases.items():
        for what, v in (("operand", i), ("result", k)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise TypeError(f"input_output_aliases: expected int indices >= 0, got {what} {v!r}")
        if i >= len(core):
            raise ValueError(f"input_output_aliases: operand {i} does not exist (core_ndims has {len(core)} operands)")
        if core[i] is None:
            raise ValueError(
                f"input_output_aliases: operand {i} is unbatched (core_ndims None); only a batched operand can be "
                "updated in place, as its result keeps the batch axes"
            )
        pairs.append((i, k))
    results = [k for _, k in pairs]
    if len(set(results)) != len(results):
        raise ValueError(f"input_output_aliases: a result aliases two operands: {aliases!r}")
    return tuple(sorted(pairs))


def _bind(op: _Op, attrs: tuple, operands):
    out = batched_p.bind(*_primitives._aligned(*operands), op=op, attrs=attrs)
    return out[0] if len(out) == 1 else tuple(out)


# ---------------------------------------------------------------------------------------------
# Abstract evaluation: results typed like the first batched operand's batch axes


def _abstract(*avals, op: _Op, attrs: tuple):
    first = avals[op.batched()[0]]
    nb = op.batch_ndim(avals)
    sharding = first.sharding
    batch_spec = _partitioning._spec(sharding.spec, first.ndim)[:nb]
    out = []
    for r in op.result_structs(avals, dict(attrs)):
        spec = P(*batch_spec, *([None] * (len(r.shape) - nb)))
        out.append(first.update(shape=tuple(r.shape), dtype=r.dtype, weak_type=False,
                                sharding=NamedSharding(sharding.mesh, spec)))
    return out


batched_p.def_abstract_eval(_abstract)
batched_p.def_impl(_primitives._apply(batched_p))


# ---------------------------------------------------------------------------------------------
# Lowering: the call per shard


def _ffi(op: _Op, attrs: tuple, operands, typed: bool):
    """The plain FFI call on `operands` (a whole array, or one device's shard)."""
    structs = op.result_structs([jax.typeof(o) for o in operands], dict(attrs))
    if typed:
        first = operands[op.batched()[0]]
        structs = [_partitioning._struct(first, s.shape, s.dtype, True) for s in structs]
    call = jax.ffi.ffi_call(op.target, structs, input_output_aliases=dict(op.aliases) or None)
    return list(call(*operands, **dict(attrs)))


def _shardings(op: _Op, mesh, shapes, result_ndims):
    """Argument and result shardings: batched operands and results keep the first batched
    operand's batch sharding (core axes whole), unbatched operands are replicated."""
    first = shapes[op.batched()[0]]
    nb = op.batch_ndim(shapes)
    batch = _partitioning._spec(first.sharding.spec, len(first.shape))[:nb]
    args = []
    for s, c in zip(shapes, op.core_ndims):
        args.append(_partitioning._named(mesh) if c is None else _partitioning._named(mesh, *batch, *([None] * c)))
    results = tuple(_partitioning._named(mesh, *batch, *([None] * (nd - nb))) for nd in result_ndims)
    return tuple(args), results


def _rule(op: _Op, value_types, result_types):
    """Shardy: factor b<i> for batch axis i, shared by batched operands and results; every
    other axis a factor of its own that must stay replicated."""
    nb = op.batch_ndim(value_types)
    batch = tuple(f"b{i}" for i in range(nb))
    replicated = []

    def own(prefix, count):
        names = tuple(f"{prefix}_{j}" for j in range(count))
        replicated.extend(names)
        return names

    operands = []
    for i, (v, c) in enumerate(zip(value_types, op.core_ndims)):
        if c is None:
            operands.append(ArrayMapping(*own(f"u{i}", len(v.shape))))
        else:
            operands.append(ArrayMapping(*batch, *own(f"c{i}", c)))
    results = [ArrayMapping(*batch, *own(f"r{k}", len(r.shape) - nb)) for k, r in enumerate(result_types)]
    return SdyShardingRule(tuple(operands), tuple(results), need_replication_factors=tuple(replicated))


@functools.cache
def _partitioned(op: _Op, attrs: tuple):
    """The call wrapped in `custom_partitioning` (one per op and attributes)."""

    def whole(*operands):
        out = _ffi(op, attrs, operands, typed=True)
        return out[0] if len(out) == 1 else tuple(out)

    fn = custom_partitioning(whole)

    def result_ndims(result_shape):
        shapes = result_shape if isinstance(result_shape, (list, tuple)) else [result_shape]
        return [len(s.shape) for s in shapes]

    def partition(mesh, arg_shapes, result_shape):
        args, results = _shardings(op, mesh, arg_shapes, result_ndims(result_shape))

        def per_shard(*operands):
            out = _ffi(op, attrs, operands, typed=False)
            return out[0] if len(out) == 1 else tuple(out)

        return mesh, per_shard, results[0] if len(results) == 1 else results, args

    def infer(mesh, arg_shapes, result_shape):
        _, results = _shardings(op, mesh, arg_shapes, result_ndims(result_shape))
        return results[0] if len(results) == 1 else results

    fn.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        sharding_rule=lambda mesh, value_types, result_types: _rule(op, value_types, result_types),
    )
    return fn


def _lowered(*operands, op: _Op, attrs: tuple):
    avals = [jax.typeof(o) for o in operands]
    if _partitioning.is_explicit(avals[op.batched()[0]]):
        mesh = avals[op.batched()[0]].sharding.mesh
        out_avals = _abstract(*avals, op=op, attrs=attrs)
        shardings = _shardings(op, mesh, avals, [a.ndim for a in out_avals])
        per_shard = lambda *xs: tuple(_ffi(op, attrs, xs, typed=False))  # noqa: E731
        return list(_partitioning._typed_like(_partitioning._shard_mapped(per_shard, operands, shardings), out_avals))
    out = _partitioned(op, attrs)(*operands)
    return list(out) if isinstance(out, (list, tuple)) else [out]


mlir.register_lowering(batched_p, mlir.lower_fun(_lowered, multiple_results=True))
try:
    # As for the norm's primitives: lowering a custom_partitioning call needs the devices.
    from jax._src import dispatch as _dispatch

    _dispatch.prim_requires_devices_during_lowering.add(batched_p)
except (ImportError, AttributeError):  # pragma: no cover - older/newer private layout
    pass


# ---------------------------------------------------------------------------------------------
# Batching: a mapped axis is one more leading batch axis


def _batch(args, dims, *, op: _Op, attrs: tuple):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    if any(d is not None for d, c in zip(dims, op.core_ndims) if c is None):
        # A mapped unbatched operand (per-example weights) cannot be folded into the rows of one
        # call: one call per element.
        moved = [a if d is None else jax.numpy.moveaxis(a, d, 0) for a, d in zip(args, dims)]
        mapped = [d is not None for d in dims]

        def one(xs):
            it = iter(xs)
            ops = [next(it) if m else a for a, m in zip(moved, mapped)]
            return tuple(batched_p.bind(*ops, op=op, attrs=attrs))

        out = jax.lax.map(one, [a for a, m in zip(moved, mapped) if m])
        return list(out), [0] * len(out)
    folded = []
    for a, d, c in zip(args, dims, op.core_ndims):
        if c is None:
            folded.append(a)
        elif d is None:
            folded.append(_primitives._to_front(a, None, size, _primitives._batch_spec(
                next(x for x, dd, cc in zip(args, dims, op.core_ndims) if cc is not None and dd is not None))))
        else:
            folded.append(jax.numpy.moveaxis(a, d, 0))
    out = batched_p.bind(*folded, op=op, attrs=attrs)
    return out, [0] * len(out)


batching.primitive_batchers[batched_p] = _batch

