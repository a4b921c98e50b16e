"""rms_norm in a data-parallel training step across two `jax.distributed` processes on
localhost: 2 processes x 2 forced host devices = one 4-device CPU mesh (gloo collectives), rows
sharded over all 4 devices, global arrays built by `jax.make_array_from_callback`. Under an
explicit mesh and an automatic one, the loss and the gradients (x's, sharded over both
processes, and the weight's, replicated) must match a single-process computation of the same
step with `rms_norm` and with `rms_norm_reference`; the compiled step must have no all-gather
and exactly one all-reduce carrying the weight gradient (f32[N]: no other value has that shape).

The workers are children of this test with bounded timeouts: if either fails or hangs, both are
killed and their stderr is printed."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rmsnorm_ffi import rms_norm, rms_norm_reference

ROWS, N = 32, 96  # rows: 8 per device; N: the weight length, unlike any other shape in the step
EPS = 1e-5
PROCESSES, LOCAL_DEVICES = 2, 2
TIMEOUT_S = 90  # for both workers together; a run takes ~10 s on 2 cores

# Gradients and loss are float32 sums over a few thousand terms in a different order.
RTOL = 1e-5

WORKER = textwrap.dedent(
    """
    import json, os, re, sys, traceback


    def main():
        import jax
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        port, pid, rows, n, eps, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), sys.argv[6]
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid, initialization_timeout=60)
        import jax.numpy as jnp, numpy as np
        from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
        from rmsnorm_ffi import rms_norm

        assert jax.process_count() == 2 and jax.device_count() == 4 and jax.local_device_count() == 2
        rng = np.random.default_rng(0)  # every process draws the same global arrays
        x_np = rng.standard_normal((rows, n)).astype(np.float32)
        t_np = rng.standard_normal((rows, n)).astype(np.float32)
        w_np = (1.0 + 0.5 * rng.standard_normal(n)).astype(np.float32)

        def loss_fn(x, w, t):
            return 0.5 * jnp.mean((rms_norm(x, w, eps) - t) ** 2)

        def spec_of(spec):
            entries = list(spec)
            while entries and entries[-1] is None:
                entries.pop()
            return entries

        step = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))
        result = {}
        for mode, axis_type in (("explicit", AxisType.Explicit), ("auto", AxisType.Auto)):
            mesh = jax.make_mesh((4,), ("data",), axis_types=(axis_type,))
            with jax.set_mesh(mesh):
                rows_sharded, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
                x = jax.make_array_from_callback(x_np.shape, rows_sharded, lambda i: x_np[i])
                t = jax.make_array_from_callback(t_np.shape, rows_sharded, lambda i: t_np[i])
                w = jax.make_array_from_callback(w_np.shape, replicated, lambda i: w_np[i])
                hlo = step.lower(x, w, t).compile().as_text()
                loss, (dx, dw) = step(x, w, t)
                jax.block_until_ready((loss, dx, dw))
            all_reduces = [l for l in hlo.splitlines() if re.search(r"\\ball-reduce(-start)?\\(", l)]
            result[mode] = {
                "loss": float(loss.addressable_data(0)),
                "dw": np.asarray(dw.addressable_data(0)).tolist(),
                "dx_shards": [
                    [[s.start or 0, s.stop] for s in shard.index[:1]] + [np.asarray(shard.data).tolist()]
                    for shard in dx.addressable_shards
                ],
                "dx_spec": spec_of(dx.sharding.spec),
                "dx_typed": spec_of(jax.typeof(dx).sharding.spec) if mode == "explicit" else None,
                "all_gathers": len(re.findall(r"\\ball-gather(-start)?\\(", hlo)),
                "all_reduces": len(all_reduces),
                "weight_all_reduces": sum(f"f32[{n}]" in l for l in all_reduces),
                "all_reduce_lines": [l.strip()[:200] for l in all_reduces],
            }
        with open(f"{out}/result{pid}.json", "w") as f:
            json.dump(result, f)
        jax.distributed.shutdown()
        print("done", pid)


    try:
        main()
    except BaseException:
        # Exit at once: a failed process would otherwise wait at exit for the other (the
        # distributed runtime's shutdown barrier), and the test would only see a timeout.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    """
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(tmp_path, worker=WORKER):
    """Starts both workers and waits at most TIMEOUT_S for both. As soon as one fails (or the
    time is up) both are killed and the test fails with their stderr."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={LOCAL_DEVICES}".strip())
    port = free_port()
    procs = []
    logs = []
    try:
        for i in range(PROCESSES):
            # Output to files, not pipes: nobody reads a pipe while we poll, and a full one blocks.
            out, err = open(tmp_path / f"stdout{i}", "w+"), open(tmp_path / f"stderr{i}", "w+")
            logs.append((out, err))
            procs.append(subprocess.Popen(
                [sys.executable, "-c", worker, str(port), str(i), str(ROWS), str(N), repr(EPS), str(tmp_path)],
                stdout=out, stderr=err, text=True, env=env,
            ))
        deadline = time.monotonic() + TIMEOUT_S
        problem = None
        while problem is None and any(p.poll() is None for p in procs):
            failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:
                problem = f"worker {failed[0]} exited with {procs[failed[0]].returncode}"
            elif time.monotonic() > deadline:
                problem = f"the workers did not finish within {TIMEOUT_S} s"
            else:
                time.sleep(0.1)
        if problem is None and any(p.returncode for p in procs):
            problem = "exit statuses " + ", ".join(str(p.returncode) for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        for out, err in logs:
            out.close(), err.close()
    if problem is not None:
        report = [
            f"--- worker {i} (exit {p.returncode}) stderr:\n{(tmp_path / f'stderr{i}').read_text()[-4000:]}"
            for i, p in enumerate(procs)
        ]
        pytest.fail(f"{problem}\n" + "\n".join(report), pytrace=False)
    return [json.loads((tmp_path / f"result{i}.json").read_text()) for i in range(PROCESSES)]


def single_process(norm):
    """The same step on one device in this process: (loss, dx, dw)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, N)).astype(np.float32)
    t = rng.standard_normal((ROWS, N)).astype(np.float32)
    w = (1.0 + 0.5 * rng.standard_normal(N)).astype(np.float32)
    loss_fn = lambda x, w, t: 0.5 * jnp.mean((norm(x, w, EPS) - t) ** 2)  # noqa: E731
    loss, (dx, dw) = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))(x, w, t)
    return float(loss), np.asarray(dx), np.asarray(dw)


def max_rel(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


def test_two_processes_train_step_matches_one_process(tmp_path):
    results = run_workers(tmp_path)
    ours, ref = single_process(rms_norm), single_process(rms_norm_reference)
    assert abs(ours[0] - ref[0]) <= RTOL * abs(ref[0])
    report = []
    for mode in ("explicit", "auto"):
        # dx: each process holds its two devices' rows; together they cover every row once.
        dx = np.full((ROWS, N), np.nan, np.float32)
        for r in results:
            for (start, stop), rows in r[mode]["dx_shards"]:
                dx[start:stop] = rows
        assert not np.isnan(dx).any(), f"{mode}: rows missing from the processes' shards"
        covered = sorted(tuple(s[0]) for r in results for s in r[mode]["dx_shards"])
        assert covered == [(i * ROWS // 4, (i + 1) * ROWS // 4) for i in range(4)], covered
        for r in results:
            res = r[mode]
            assert res["dx_spec"] == ["data"], res["dx_spec"]
            if mode == "explicit":
                assert res["dx_typed"] == ["data"], res["dx_typed"]
            for name, (loss, _, dw) in (("rms_norm", ours), ("rms_norm_reference", ref)):
                assert abs(res["loss"] - loss) <= RTOL * abs(loss), (mode, name, res["loss"], loss)
                assert max_rel(res["dw"], dw) <= RTOL, (mode, name, max_rel(res["dw"], dw))
            assert res["all_gathers"] == 0, (mode, res["all_gathers"])
            # XLA may combine the loss's all-reduce with the weight gradient's (it does, on
            # jax 0.10.2 and 0.12: one `(f32[], f32[N]) all-reduce`); the gradient is in one.
            assert res["weight_all_reduces"] == 1, (mode, res["all_reduce_lines"])
        # Both processes hold the same replicated values.
        assert results[0][mode]["loss"] == results[1][mode]["loss"]
        assert results[0][mode]["dw"] == results[1][mode]["dw"]
        for name, (_, want_dx, want_dw) in (("rms_norm", ours), ("rms_norm_reference", ref)):
            assert max_rel(dx, want_dx) <= RTOL, (mode, name, max_rel(dx, want_dx))
        res = results[0][mode]
        report.append(
            f"{mode}: loss {res['loss']:.7f} (1 process {ours[0]:.7f}, reference {ref[0]:.7f}); "
            f"max rel diff dx {max_rel(dx, ours[1]):.1e} / {max_rel(dx, ref[1]):.1e}, "
            f"dw {max_rel(res['dw'], ours[2]):.1e} / {max_rel(res['dw'], ref[2]):.1e}; "
            f"all-gathers {res['all_gathers']}, all-reduces {res['all_reduces']} "
            f"({res['weight_all_reduces']} with the weight gradient)"
        )
    print("\n".join(report))
