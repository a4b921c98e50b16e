"""The norm ops: `rms_norm` and `layer_norm` (differentiable), their `_fwd`, `_bwd` and fused
`_residual` forms.

Each op checks its inputs in Python (raising `TypeError`/`ValueError` that name the argument)
before anything is lowered, then binds the primitives of `_primitives`, which own the
transformation rules (vmap, jvp and transposition, sharding) and lower to the `rmsnorm_fwd` /
`rmsnorm_bwd` FFI targets. The same target names are registered for every platform this build
supports, so XLA picks the platform's implementation; the ops only check that the default
backend is one of them.
"""

from __future__ import annotations

import math
from numbers import Real

import jax
import jax.numpy as jnp
import numpy as np

from rmsnorm_ffi import _math, _native, _primitives
from rmsnorm_ffi._partitioning import BACKWARD_TARGET, FORWARD_TARGET, RESIDUAL_TARGET
from rmsnorm_ffi._registration import register, registered_targets

# The checks read the op contract the Rust handlers enforce (src/handlers/contract.rs), so the
# two cannot disagree: the (x, weight) dtype pairs, each with its accumulation dtype, and the
# longest row.
_CONTRACT = _native.contract()
_PAIRS = {(jnp.dtype(p["x"]), jnp.dtype(p["weight"])): jnp.dtype(p["accumulation"]) for p in _CONTRACT["dtype_pairs"]}
_FLOATS = tuple(dict.fromkeys(x for x, _ in _PAIRS))
_FLOAT_NAMES = ", ".join(str(d) for d in _FLOATS[:-1]) + f" or {_FLOATS[-1]}"


def _acc_dtype(dtype) -> jnp.dtype:
    """The accumulation dtype (rstd's) of x's dtype, from the contract."""
    return _PAIRS[(jnp.dtype(dtype), jnp.dtype(dtype))]


MAX_ROW_LEN = _CONTRACT["max_row_len"]  # the Rust handlers' limit on the normalized axis


def _check_array(op: str, name: str, value):
    # Always through jnp: a NumPy float64 array with x64 disabled becomes float32 here, so the
    # result specs agree with what XLA is handed.
    try:
        value = jnp.asarray(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{op}: {name} must be a {_FLOAT_NAMES} array, got {type(value).__name__} ({e})") from None
    if jnp.dtype(value.dtype) not in _FLOATS:
        raise TypeError(f"{op}: {name} must be a {_FLOAT_NAMES} array, got dtype {value.dtype}")
    return value


def _trailing_axes(op: str, axis, ndim: int) -> int:
    """How many trailing axes of an `ndim`-array `axis` names (an int or a tuple of ints, as
    Flax's `reduction_axes` and Haiku's `axis` take them): the op normalizes over the last k
    axes together. Anything else raises, naming the axes."""
    items = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
    if not items or not all(isinstance(a, (int, np.integer)) and not isinstance(a, bool) for a in items):
        raise TypeError(f"{op}: axis must be an int or a tuple of ints, got {axis!r}")
    for a in items:
        if not -ndim <= a < ndim:
            raise ValueError(f"{op}: axis {a} is out of range for x with {ndim} axes")
    axes = sorted({int(a) % ndim for a in items})
    if len(axes) != len(items):
        raise ValueError(f"{op}: axis {axis!r} names an axis twice")
    k = len(axes)
    others = [a for a in axes if a < ndim - k]
    if others:
        raise ValueError(
            f"{op}: axis must name trailing axes (the last {k} of x's {ndim}), got {axis!r}: "
            f"{'axes' if len(others) > 1 else 'axis'} {', '.join(map(str, others))} "
            f"{'are' if len(others) > 1 else 'is'} not trailing; move {'them' if len(others) > 1 else 'it'} "
            "last (jnp.moveaxis) first"
        )
    return k


def _check_x(op: str, x, axis=-1):
    """x as an array, and how many trailing axes are normalized (see `_trailing_axes`)."""
    x = _check_array(op, "x", x)
    if x.ndim < 1:
        raise ValueError(f"{op}: x must have at least one axis (normalization is over the last), got a scalar")
    k = _trailing_axes(op, axis, x.ndim)
    n = math.prod(x.shape[x.ndim - k:])
    if n > MAX_ROW_LEN:
        what = "last axis has" if k == 1 else f"last {k} axes have"
        raise ValueError(f"{op}: x's {what} {n} elements; at most {MAX_ROW_LEN} are supported")
    return x, k


def _rows(a, k: int):
    """`a` with its last `k` axes merged into one (the op's rows)."""
    return a if k == 1 else a.reshape(a.shape[: a.ndim - k] + (math.prod(a.shape[a.ndim - k:]),))


def _check_weight(op: str, x, weight, k: int = 1, name: str = "weight"):
    """The weight (or another operand shaped as one, `name`) checked against x's last `k`
    axes, with those merged (see `_rows`)."""
    if weight is None:
        return None
    weight = _check_array(op, name, weight)
    want = tuple(x.shape[x.ndim - k:])
    if weight.shape != want:
        axes = "last axis" if k == 1 else f"last {k} axes"
        raise ValueError(f"{op}: {name} must have shape {want} to match x's {axes}, got {tuple(weight.shape)}")
    if (jnp.dtype(x.dtype), jnp.dtype(weight.dtype)) not in _PAIRS:
        accepted = ", ".join(str(w) for (xd, w) in _PAIRS if xd == jnp.dtype(x.dtype))
        raise TypeError(f"{op}: {name} must have one of the dtypes {accepted} with x of {x.dtype}, got {weight.dtype}")
    return weight.reshape(-1) if k > 1 else weight


def _check_residual(op: str, x, residual):
    """The residual of a fused op: x's shape and dtype."""
    residual = _check_array(op, "residual", residual)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"{op}: residual must have x's shape {tuple(x.shape)} and dtype {x.dtype}, "
            f"got {tuple(residual.shape)} {residual.dtype}"
        )
    return residual


def _number(op: str, name: str, value) -> float:
    """A compile-time attribute as a float: a Python number, a NumPy scalar, or a concrete 0-d
    array of a real dtype (models that keep eps in their parameters or configs as an array, as
    penzai does); never a traced value."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(f"{op}: {name} must be a Python number (it is a compile-time attribute), got a traced value")
    if isinstance(value, (np.ndarray, jax.Array)):
        if value.ndim != 0:
            raise ValueError(f"{op}: {name} must be a scalar (a 0-d array at most), got an array of shape {tuple(value.shape)}")
        if not (jnp.issubdtype(value.dtype, jnp.floating) or jnp.issubdtype(value.dtype, jnp.integer)):
            raise TypeError(f"{op}: {name} must be a real number, got a 0-d array of dtype {value.dtype}")
        value = np.asarray(value).item()
    if isinstance(value, bool) or not isinstance(value, (Real, np.floating, np.integer)):
        raise TypeError(f"{op}: {name} must be a real number, got {type(value).__name__}")
    return float(value)


def _check_scale_offset(op: str, offset, weight) -> float:
    """The scale offset (the weight applied is ``offset + weight``), a number as `_number` takes
    it, finite as a float32 (the kernels' attribute); it needs a weight to offset."""
    offset = _number(op, "scale_offset", offset)
    if not math.isfinite(offset) or abs(offset) > float(np.finfo(np.float32).max):
        raise ValueError(f"{op}: scale_offset must be finite (as a float32), got {offset}")
    if offset and weight is None:
        raise ValueError(f"{op}: scale_offset={offset} applies to a weight (offset + weight), but weight is None")
    return float(np.float32(offset))


def _check_eps(op: str, eps) -> float:
    """eps as the float the kernels take (see `_number`): finite and >= 0."""
    eps = _number(op, "eps", eps)
    # eps travels as a float32 attribute: it must be finite there too.
    if not math.isfinite(eps) or eps < 0 or eps > float(np.finfo(np.float32).max):
        raise ValueError(f"{op}: eps must be finite and >= 0 (as a float32), got {eps}")
    return eps


def _check_platform(op: str, target: str = FORWARD_TARGET) -> None:
    platforms = register()
    backend = jax.default_backend()
    # JAX calls a CUDA backend "gpu"; its bundles are registered for platform "cuda".
    if backend == "gpu" and "cuda" in platforms:
        backend = "cuda"
    if backend not in platforms:
        raise NotImplementedError(
            f"{op}: no rmsnorm_ffi implementation for platform '{backend}' in this build "
            f"(available: {', '.join(platforms) or 'none'})"
        )
    if target not in registered_targets(backend):
        have = [p for p in platforms if target in registered_targets(p)]
        raise NotImplementedError(
            f"{op}: the {target} target has no implementation for platform '{backend}' in this "
            f"build (it has one for: {', '.join(have) or 'none'})"
        )


def rms_norm_fwd(x, weight=None, eps: float = 1e-5, *, scale_offset=0.0, axis=-1):
    """Forward pass: returns ``(y, rstd)`` with ``rstd.shape == x.shape[:-1]`` (float32, or
    float64 for float64 input) and ``y = x * rstd[..., None] * (scale_offset + weight)``. With
    ``axis`` naming the last k axes, over those together: rstd has x's shape without them."""
    op = "rms_norm_fwd"
    x, k = _check_x(op, x, axis)
    weight = _check_weight(op, x, weight, k)
    eps = _check_eps(op, eps)
    offset = _check_scale_offset(op, scale_offset, weight)
    _check_platform(op)
    y, rstd = _primitives.forward(_rows(x, k), weight, eps, offset)
    return y.reshape(x.shape), rstd


def rms_norm_bwd(x, weight, rstd, dy, *, scale_offset=0.0, axis=-1):
    """Backward pass: returns ``(dx, dweight)``; ``dweight`` is None when ``weight`` is None.
    ``scale_offset`` and ``axis`` as for :func:`rms_norm_fwd` (dweight is with respect to
    ``weight``)."""
    op = "rms_norm_bwd"
    x, k = _check_x(op, x, axis)
    weight_shape = None if weight is None else jnp.shape(weight)
    weight = _check_weight(op, x, weight, k)
    offset = _check_scale_offset(op, scale_offset, weight)
    rstd = _check_array(op, "rstd", rstd)
    dy = _check_array(op, "dy", dy)
    acc = _acc_dtype(x.dtype)
    lead = tuple(x.shape[: x.ndim - k])
    if rstd.shape != lead or jnp.dtype(rstd.dtype) != acc:
        raise ValueError(
            f"{op}: rstd must have shape {lead} and dtype {acc}, got {tuple(rstd.shape)} {rstd.dtype}"
        )
    if dy.shape != x.shape or dy.dtype != x.dtype:
        raise ValueError(f"{op}: dy must have x's shape {tuple(x.shape)} and dtype {x.dtype}, got {tuple(dy.shape)} {dy.dtype}")
    _check_platform(op, BACKWARD_TARGET)
    dx, dweight, _ = _primitives.backward(_rows(x, k), weight, (rstd,), _rows(dy, k), offset=offset)
    return dx.reshape(x.shape), None if dweight is None else dweight.reshape(weight_shape)


def rms_norm_residual(x, residual, weight=None, eps: float = 1e-5, *, scale_offset=0.0, axis=-1):
    """The residual add of a pre-norm transformer block fused with the norm: returns
    ``(y, h)`` with ``h = x + residual`` (rounded to x's dtype, as jnp's ``x + residual``) and
    ``y = rms_norm(h, weight, eps)``, in one pass that reads x and the residual and writes h
    and y. ``residual`` has x's shape and dtype. Differentiable in x, the residual and the
    weight (the gradients of y and h both flow into x and the residual), under the same
    transformations as :func:`rms_norm`; in reverse mode the gradient reaching x (and the
    residual) is the norm's plus h's, added in the accumulation dtype and rounded once.
    ``scale_offset`` and ``axis`` as for :func:`rms_norm`.
    """
    op = "rms_norm_residual"
    x, k = _check_x(op, x, axis)
    residual = _check_residual(op, x, residual)
    weight = _check_weight(op, x, weight, k)
    eps = _check_eps(op, eps)
    offset = _check_scale_offset(op, scale_offset, weight)
    _check_platform(op, RESIDUAL_TARGET)
    y, h, *_ = _primitives.residual_forward(_rows(x, k), _rows(residual, k), weight, eps, offset)
    return y.reshape(x.shape), h.reshape(x.shape)


def rms_norm(x, weight=None, eps: float = 1e-5, *, scale_offset=0.0, axis=-1):
    """RMS norm over the last axis: ``x / sqrt(mean(x**2, -1) + eps) * (scale_offset + weight)``.

    ``scale_offset``: a number added to the weight inside the kernels, in the accumulation
    dtype (zero-centred gamma: Gemma's ``1 + w``, TransformerEngine's ``zero_centered_gamma``);
    the gradient is with respect to ``weight``. 0 by default.

    ``axis``: the last axis (-1), or a tuple naming the last k axes (e.g. ``(-2, -1)``, as
    Flax's ``reduction_axes`` and Haiku's ``axis``), normalized over together; axes that are not
    trailing raise ``ValueError``, naming them. ``weight``, when given, has the shape of those
    axes (``(x.shape[-1],)`` by default) and any float dtype (read in its own dtype, applied in
    the accumulation dtype). Returns an
    array of x's shape and dtype, typed (sharding, varying manual axes) like x. Differentiable
    in ``x`` and ``weight`` in both modes and to any order (first-order reverse mode is the
    fused Rust backward; higher derivatives add jnp math); works under ``jit``, ``vmap``,
    ``shard_map`` and explicit or automatic meshes. Accumulates in float32 (float64 for float64
    input).
    """
    op = "rms_norm"
    x, k = _check_x(op, x, axis)
    weight = _check_weight(op, x, weight, k)
    eps = _check_eps(op, eps)
    offset = _check_scale_offset(op, scale_offset, weight)
    _check_platform(op)
    return _primitives.forward(_rows(x, k), weight, eps, offset)[0].reshape(x.shape)


def rms_norm_reference(x, weight=None, eps: float = 1e-5, *, scale_offset=0.0, axis=-1):
    """The same computation in jnp (float32 accumulation; float64 for float64 input), for tests
    and benchmarks."""
    x = jnp.asarray(x)
    k = _trailing_axes("rms_norm_reference", axis, x.ndim)
    w = None if weight is None else jnp.asarray(weight).reshape(-1)
    return _math.reference(_rows(x, k), w, eps, float(scale_offset)).reshape(x.shape)


# ---------------------------------------------------------------------------------------------
# LayerNorm: the same targets, primitives and checks, with norm="layer"


def _check_bias(op: str, x, bias, weight, k: int):
    """The bias checked as a weight is (`_check_weight`), and of the weight's dtype when there
    is one (the two are parameters of one module, and their gradients come back together)."""
    bias = _check_weight(op, x, bias, k, name="bias")
    if bias is not None and weight is not None and bias.dtype != weight.dtype:
        raise TypeError(f"{op}: bias must have the weight's dtype {weight.dtype}, got {bias.dtype}")
    return bias


def _check_layer(op: str, x, weight, bias, eps, scale_offset, axis):
    """x (rows merged), weight, bias, eps, offset and the trailing axes count, checked."""
    x, k = _check_x(op, x, axis)
    weight = _check_weight(op, x, weight, k)
    bias = _check_bias(op, x, bias, weight, k)
    return x, weight, bias, _check_eps(op, eps), _check_scale_offset(op, scale_offset, weight), k


def layer_norm_fwd(x, weight=None, bias=None, eps: float = 1e-5, *, scale_offset=0.0, axis=-1):
    """LayerNorm's forward: returns ``(y, mean, rstd)``, ``y = (x - mean) * rstd *
    (scale_offset + weight) + bias`` with ``rstd = 1 / sqrt(var + eps)``; ``mean`` and ``rstd``
    have x's shape without the normalized axes, in the accumulation dtype (float32, or float64
    for float64 input). The variance is never ``E[x^2] - E[x]^2``: rows whose mean is large
    against their spread keep their digits."""
    op = "layer_norm_fwd"
    x, weight, bias, eps, offset, k = _check_layer(op, x, weight, bias, eps, scale_offset, axis)
    _check_platform(op)
    y, mean, rstd = _primitives.forward(_rows(x, k), weight, eps, offset, bias=bias, norm="layer")
    return y.reshape(x.shape), mean, rstd


def layer_norm_bwd(x, weight, mean, rstd, dy, *, has_bias: bool = False, bias_dtype=None, scale_offset=0.0, axis=-1):
    """LayerNorm's backward: returns ``(dx, dweight, dbias)``; ``dweight`` is None when
    ``weight`` is None, ``dbias`` None unless ``has_bias`` (the bias's gradient does not depend
    on the bias: it is shaped like the weight and typed like it, or ``bias_dtype`` without a
    weight, x's dtype by default). ``mean`` and ``rstd`` as :func:`layer_norm_fwd` returns
    them; a float32 mean loses nothing, as the backward takes the part of the mean it cannot
    hold from x itself."""
    op = "layer_norm_bwd"
    x, k = _check_x(op, x, axis)
    weight_shape = None if weight is None else jnp.shape(weight)
    weight = _check_weight(op, x, weight, k)
    offset = _check_scale_offset(op, scale_offset, weight)
    dy = _check_array(op, "dy", dy)
    acc = _acc_dtype(x.dtype)
    lead = tuple(x.shape[: x.ndim - k])
    stats = []
    for name, value in (("mean", mean), ("rstd", rstd)):
        value = _check_array(op, name, value)
        if value.shape != lead or jnp.dtype(value.dtype) != acc:
            raise ValueError(
                f"{op}: {name} must have shape {lead} and dtype {acc}, got {tuple(value.shape)} {value.dtype}"
            )
        stats.append(value)
    if dy.shape != x.shape or dy.dtype != x.dtype:
        raise ValueError(f"{op}: dy must have x's shape {tuple(x.shape)} and dtype {x.dtype}, got {tuple(dy.shape)} {dy.dtype}")
    bias = None
    if has_bias:
        dtype = weight.dtype if weight is not None else jnp.dtype(bias_dtype or x.dtype)
        bias = _check_bias(op, x, jnp.zeros(x.shape[x.ndim - k:], dtype), weight, k)
    _check_platform(op, BACKWARD_TARGET)
    dx, dweight, dbias = _primitives.backward(
        _rows(x, k), weight, tuple(stats), _rows(dy, k), offset=offset, norm="layer", bias=bias
    )
    param_shape = tuple(x.shape[x.ndim - k:])
    return (
        dx.reshape(x.shape),
        None if dweight is None else dweight.reshape(weight_shape),
        None if dbias is None else dbias.reshape(param_shape),
    )


def layer_norm_residual(x, residual, weight=None, bias=None, eps: float = 1e-5, *, scale_offset=0.0, axis=-1):
    """The residual add fused with LayerNorm, as :func:`rms_norm_residual` with the RMS norm:
    returns ``(y, h)`` with ``h = x + residual`` (rounded to x's dtype) and ``y =
    layer_norm(h, weight, bias, eps)``, differentiable in x, the residual, the weight and the
    bias, the gradient reaching x being the norm's plus h's, rounded once."""
    op = "layer_norm_residual"
    x, weight, bias, eps, offset, k = _check_layer(op, x, weight, bias, eps, scale_offset, axis)
    residual = _check_residual(op, x, residual)
    _check_platform(op, RESIDUAL_TARGET)
    y, h, *_ = _primitives.residual_forward(_rows(x, k), _rows(residual, k), weight, eps, offset, bias=bias, norm="layer")
    return y.reshape(x.shape), h.reshape(x.shape)


def layer_norm(x, weight=None, bias=None, eps: float = 1e-5, *, scale_offset=0.0, axis=-1):
    """LayerNorm over the last axis (or the trailing axes ``axis`` names):
    ``(x - mean) / sqrt(var + eps) * (scale_offset + weight) + bias``.

    The same contract as :func:`rms_norm`: ``weight`` and ``bias`` have the normalized axes'
    shape and any float dtype that pairs with x's (the bias the weight's, when both are
    given); accumulation in float32 (float64 for float64 input); the result has x's shape and
    dtype. Differentiable in x, weight and bias in both modes and to any order (first-order
    reverse mode is the fused Rust backward); works under ``jit``, ``vmap`` and meshes whose
    rows are sharded. The variance is a two-pass one over the cached row (never
    ``E[x^2] - E[x]^2``), so rows whose mean is 1e6 times their spread keep their digits.
    CPU only in this build.
    """
    op = "layer_norm"
    x, weight, bias, eps, offset, k = _check_layer(op, x, weight, bias, eps, scale_offset, axis)
    _check_platform(op)
    return _primitives.forward(_rows(x, k), weight, eps, offset, bias=bias, norm="layer")[0].reshape(x.shape)


def layer_norm_reference(x, weight=None, bias=None, eps: float = 1e-5, *, scale_offset=0.0, axis=-1):
    """LayerNorm in jnp, as Flax computes it (float32 accumulation; float64 for float64), for
    tests and benchmarks."""
    x = jnp.asarray(x)
    k = _trailing_axes("layer_norm_reference", axis, x.ndim)
    w = None if weight is None else jnp.asarray(weight).reshape(-1)
    b = None if bias is None else jnp.asarray(bias).reshape(-1)
    return _math.layer_reference(_rows(x, k), w, b, eps, float(scale_offset)).reshape(x.shape)
