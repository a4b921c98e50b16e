"""Stress specs (``rmsnorm_ffi.stress.Spec``) for the test fixtures' reverse bundle
(``rmsnorm_ffi_testing_reverse`` in ``tests/fixtures/testing_bundles``): the correct one, with a
workspace pool, and the three deliberately broken variants the harness must catch; and our RMS
norm with a planted leak (``LEAKING_RMS_NORM``: 10 KB kept per compile), which the churn's heap
check in ``tests/python/test_stress.py`` must catch.

    python -m rmsnorm_ffi.stress --library target/bundles/librmsnorm_ffi_testing.so \\
        --spec tests/python/stress_specs.py:POOLED -t 2 -k 2 -n 50

The library must be registered before a spec runs (``--library``, or
``rmsnorm_ffi.register_library``): the specs do not know where it was built.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rmsnorm_ffi import stress

TARGET = "rmsnorm_ffi_testing_reverse"
# (rows, row length) of the executables, by index.
SHAPES = [(8, 256), (16, 1024), (4, 4096), (64, 128), (1, 4000)]


ASYNC_TARGET = "rmsnorm_ffi_testing_async"


def reverse(x, *, scale: float, variant: str):
    """``scale * x[..., ::-1]`` through the fixture, built in scratch rows by ``variant`` (the
    ``async`` variants: the asynchronous bundle, completed on the library's worker threads)."""
    target = ASYNC_TARGET if variant.startswith("async") else TARGET
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype))
    return call(x, row_len=np.int64(x.shape[-1]), scale=np.float32(scale), variant=variant)


def reverse_spec(variant: str) -> stress.Spec:
    def cases(index, rng, devices=1):
        rows, n = SHAPES[index % len(SHAPES)]
        rows = max(devices, rows - rows % devices)  # rows divide over the devices of a mesh
        x = rng.standard_normal((rows, n), np.float32)
        return stress.Inputs(x, scale=0.5 + index % 3, variant=variant)

    def reference(x, *, scale, variant):
        # The same float32 product, reversed: the bundle's result is exact.
        return (np.float32(scale) * x)[..., ::-1]

    def control(x, *, scale, variant):
        return (jnp.float32(scale) * x)[..., ::-1]

    return stress.Spec(fn=reverse, cases=cases, reference=reference, tolerance=(0.0, 0.0), control=control,
                       name=f"{TARGET} ({variant})")


POOLED = reverse_spec("pooled")
SHARED_SCRATCH = reverse_spec("shared_scratch")
HISTORY = reverse_spec("history")
LEAKY = reverse_spec("leaky")
ASYNC = reverse_spec("async")
ASYNC_DROPPED = reverse_spec("async_dropped")


# A planted leak for the churn's memory checks: our RMS norm spec, but every compile of `fn` (one
# per churn cycle) keeps 10 KB, written so that its pages are resident. That is 1 MB per 100
# cycles, as a bundle that leaked a small buffer in every instantiate stage would.
PLANTED_LEAK_BYTES = 10 * 1024
_planted: list = []


def _leaking_rms_norm() -> stress.Spec:
    import dataclasses

    spec = stress.rms_norm_spec()

    def fn(x, w, g, *, kind, eps, mesh=None):
        _planted.append(np.ones(PLANTED_LEAK_BYTES // 8, np.float64))
        return spec.fn(x, w, g, kind=kind, eps=eps, mesh=mesh)

    return dataclasses.replace(spec, fn=fn, name="rmsnorm_ffi.rms_norm, leaking 10 KB per compile")


LEAKING_RMS_NORM = _leaking_rms_norm()
