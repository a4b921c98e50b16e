"""Stress specs (``rmsnorm_ffi.stress.Spec``) for the test fixtures' reverse bundle
(``rmsnorm_ffi_testing_reverse`` in ``tests/fixtures/testing_bundles``): the correct one, with a
workspace pool, and the three deliberately broken variants the harness must catch.

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


def reverse(x, *, scale: float, variant: str):
    """``scale * x[..., ::-1]`` through the fixture, built in scratch rows by ``variant``."""
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype))
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
