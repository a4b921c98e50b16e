"""Train a small character-level transformer whose norms are `rmsnorm_ffi.RMSNorm`.

Run with `make demo` (or `.venv/bin/python examples/train.py --help`). No downloads: the text is
generated here, lines of additions such as `318+74=392`, so the model can learn something real
(the digits after `=` follow from the ones before) in a few hundred steps on two cores.

The same model is trained twice from the same initial parameters on the same batches: once with
the Rust RMS norm (`rmsnorm_ffi.RMSNorm`), once with flax's jnp one (`flax.linen.RMSNorm`, which
has the same parameters). The script prints both final losses and speeds, then what the
live-state registry saw during the Rust run: one state per norm call site in the compiled train
step (the instantiate stage ran once for each), every later execution reusing it, and no
workspace allocation after warm-up. It exits non-zero if the two final losses differ by more than
the stated tolerance or if anything was allocated after warm-up.

With `--devices N` (N > 1) the CPU is split into N XLA devices and both runs train data-parallel
under an explicit mesh (`jax.make_mesh((N,), ("data",))` + `jax.set_mesh`): each batch is
sharded over the devices (`P("data")`), the parameters are replicated, and the norms run per
device on their rows. The model, data and steps are those of one device, so the final losses
are those of a `--devices 1` run up to reductions done in another order (the batch mean and the
gradients summed over devices): within DEVICES_TOLERANCE. There a state's workspace pool grows
to one workspace per device running its call site at once, which may first happen after
warm-up, so the allocation check becomes: at most one workspace per device per state.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time


def _devices_from_argv(argv: list[str]) -> int:
    """`--devices`, read before JAX is imported: the device count is fixed when the backend
    starts. (argparse checks the value again, with the other flags.)"""
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--devices", type=int, default=1)
    try:
        return early.parse_known_args(argv)[0].devices
    except SystemExit:  # a malformed value: let the real parser report it
        return 1


_DEVICES = _devices_from_argv(sys.argv[1:])
if _DEVICES > 1:  # before `import jax`: the environment is read when its CPU backend starts
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={_DEVICES}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402  (after XLA_FLAGS)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import rmsnorm_ffi  # noqa: E402

# The final losses (mean of the last LAST steps) of the two runs must agree within this. Both runs
# do the same float32 math up to the order of a few products inside each norm; a few hundred
# AdamW steps amplify those last-bit differences to a few 1e-3 (2e-3 at the defaults).
LOSS_TOLERANCE = 2e-2
# A --devices N run's final losses must match a --devices 1 run's within this (checked by
# tests/python/test_train_example.py): the same math, with the batch mean and the gradient sums
# split over devices, so only the order of float32 additions differs, amplified by AdamW as for
# LOSS_TOLERANCE (at the defaults, --devices 2 against 1: 4e-4 for rmsnorm_ffi, 2e-3 for jnp).
DEVICES_TOLERANCE = 2e-2
LAST = 10
# Steps before the workspace count is taken: compilation, and the pools growing to the
# concurrency the first executions see.
WARMUP_STEPS = 10


# ---------------------------------------------------------------------------------------------
# Data: generated additions, one per line.


def make_text(seed: int, lines: int = 20000) -> str:
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 1000, lines)
    b = rng.integers(0, 1000, lines)
    return "".join(f"{x}+{y}={x + y}\n" for x, y in zip(a, b))


class Batches:
    """Random windows of the encoded text, the same sequence for every run with the same seed."""

    def __init__(self, text: str, seq_len: int, batch: int, seed: int):
        self.vocab = sorted(set(text))
        lookup = {c: i for i, c in enumerate(self.vocab)}
        self.tokens = np.array([lookup[c] for c in text], np.int32)
        self.seq_len, self.batch, self.seed = seq_len, batch, seed

    def __iter__(self):
        rng = np.random.default_rng(self.seed + 1)
        while True:
            starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, self.batch)
            window = np.stack([self.tokens[s : s + self.seq_len + 1] for s in starts])
            yield window[:, :-1], window[:, 1:]


# ---------------------------------------------------------------------------------------------
# Model: pre-norm transformer blocks; `norm` is the RMSNorm class to use.


class Block(nn.Module):
    width: int
    heads: int
    norm: type

    @nn.compact
    def __call__(self, x, mask):
        h = self.norm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, qkv_features=self.width)(h, h, mask=mask)
        h = self.norm()(x)
        h = nn.Dense(4 * self.width)(h)
        return x + nn.Dense(self.width)(nn.gelu(h))


def embed(table: nn.Embed, tokens):
    """`table(tokens)`; under an explicit mesh, the same lookup with its result sharded like the
    tokens (JAX asks a gather from a replicated table by sharded indices to say so)."""
    sharding = jax.typeof(tokens).sharding
    if sharding.mesh.empty:
        return table(tokens)
    return table.embedding.at[tokens].get(out_sharding=P(*sharding.spec, None))


class CharTransformer(nn.Module):
    vocab: int
    width: int
    layers: int
    heads: int
    seq_len: int
    norm: type

    @nn.compact
    def __call__(self, tokens):
        x = embed(nn.Embed(self.vocab, self.width), tokens)
        x = x + self.param("pos", nn.initializers.normal(0.02), (self.seq_len, self.width))
        mask = nn.make_causal_mask(tokens)
        for _ in range(self.layers):
            x = Block(self.width, self.heads, self.norm)(x, mask)
        return nn.Dense(self.vocab)(self.norm()(x))


# ---------------------------------------------------------------------------------------------
# Training.


class Progress:
    """A progress bar with the loss: redrawn in place on a terminal, a line per tenth otherwise."""

    def __init__(self, label: str, total: int):
        self.label, self.total = label, total
        self.tty = sys.stdout.isatty()
        self.start = time.perf_counter()

    def update(self, step: int, loss: float) -> None:
        done = step + 1
        if not self.tty and done % max(1, self.total // 10) and done != self.total:
            return
        width = 30
        filled = width * done // self.total
        bar = "#" * filled + "-" * (width - filled)
        rate = done / (time.perf_counter() - self.start)
        line = f"{self.label:>12} [{bar}] {done:4d}/{self.total} loss {loss:.4f} {rate:5.1f} steps/s"
        if self.tty:
            print("\r" + line, end="\n" if done == self.total else "", flush=True)
        else:
            print(line, flush=True)


def train(label, model, params, batches, steps, lr, on_warm=None, mesh=None):
    """Trains `params` for `steps` AdamW steps; returns (losses, steps/s after compilation).
    With a `mesh`, data-parallel: the parameters replicated and every batch sharded over its
    "data" axis (the caller has set the mesh with `jax.set_mesh`)."""
    place = lambda value, spec: value if mesh is None else jax.device_put(value, NamedSharding(mesh, spec))  # noqa: E731
    params = jax.tree.map(lambda p: place(p, P()), params)
    optimizer = optax.adamw(lr, weight_decay=0.01)

    @jax.jit
    def step(params, opt_state, x, y):
        def loss_fn(params):
            logits = model.apply(params, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = optimizer.init(params)
    progress = Progress(label, steps)
    losses = []
    timed_from = None
    for i, (x, y) in zip(range(steps), batches):
        params, opt_state, loss = step(params, opt_state, place(x, P("data")), place(y, P("data")))
        losses.append(float(loss))  # also waits for the step to finish
        progress.update(i, losses[-1])
        if i == 0:
            timed_from = time.perf_counter()  # steps/s excludes the first (compiling) step
        if i + 1 == min(WARMUP_STEPS, steps) and on_warm is not None:
            on_warm()
    rate = (steps - 1) / (time.perf_counter() - timed_from) if steps > 1 else float("nan")
    return losses, rate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    parser.add_argument("--width", type=int, default=64, help="model width (default 64)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--batch", type=int, default=32, help="sequences per batch (default 32)")
    parser.add_argument("--seq-len", type=int, default=64, help="characters per sequence (default 64)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    parser.add_argument("--seed", type=int, default=0, help="data and initialization seed (default 0)")
    parser.add_argument("--devices", type=int, default=1,
                        help="train data-parallel on this many host devices under an explicit mesh, the batch "
                             "sharded over them (default 1)")
    args = parser.parse_args()
    if args.devices < 1:
        parser.error("--devices must be at least 1")
    if args.batch % args.devices:
        parser.error("--batch must be a multiple of --devices (the batch is split over the devices)")
    if jax.device_count() < args.devices:
        parser.error(f"--devices {args.devices}: JAX has {jax.device_count()} devices (XLA_FLAGS was set too late?)")
    if args.steps < WARMUP_STEPS + 1:
        parser.error(f"--steps must be at least {WARMUP_STEPS + 1} (warm-up is {WARMUP_STEPS} steps)")
    if args.width % args.heads:
        parser.error("--width must be a multiple of --heads")

    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({jax.device_count()} device{'s' if jax.device_count() > 1 else ''}), "
          f"rmsnorm_ffi registered for: {', '.join(rmsnorm_ffi.register())}")
    batches = Batches(make_text(args.seed), args.seq_len, args.batch, args.seed)
    config = dict(vocab=len(batches.vocab), width=args.width, layers=args.layers, heads=args.heads,
                  seq_len=args.seq_len)
    ours = CharTransformer(norm=rmsnorm_ffi.RMSNorm, **config)
    reference = CharTransformer(norm=nn.RMSNorm, **config)
    # One set of initial parameters for both runs (the two norms have the same parameters).
    params = jax.jit(reference.init)(jax.random.key(args.seed), next(iter(batches))[0])
    n_params = sum(p.size for p in jax.tree.leaves(params))
    print(f"model: {args.layers} blocks, width {args.width}, {n_params:,} parameters, "
          f"{2 * args.layers + 1} RMSNorms; data: generated additions, vocabulary {len(batches.vocab)}; "
          f"{args.steps} AdamW steps of {args.batch}x{args.seq_len} characters")
    mesh = None
    if args.devices > 1:
        mesh = jax.make_mesh((args.devices,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
        print(f"data-parallel over {args.devices} devices (explicit mesh, batch sharded P('data'), parameters "
              f"replicated); final losses should match a 1-device run within {DEVICES_TOLERANCE:g}")

    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        before = rmsnorm_ffi.stats()
        warm = {}
        ffi_losses, ffi_rate = train("rmsnorm_ffi", ours, params, batches, args.steps, args.lr,
                                     on_warm=lambda: warm.update(rmsnorm_ffi.stats()), mesh=mesh)
        after = rmsnorm_ffi.stats()
        ref_losses, ref_rate = train("jnp (flax)", reference, params, batches, args.steps, args.lr, mesh=mesh)

    ffi_final = float(np.mean(ffi_losses[-LAST:]))
    ref_final = float(np.mean(ref_losses[-LAST:]))
    difference = abs(ffi_final - ref_final)
    agree = difference <= LOSS_TOLERANCE

    def executions(snapshot):
        return sum(n for target, n in snapshot["executions"].items() if target.startswith("rmsnorm_"))

    instantiated = after["created_states"] - before["created_states"]
    executed = executions(after) - executions(before)
    late_allocations = after["workspace_allocations"] - warm["workspace_allocations"]
    total_allocations = after["workspace_allocations"] - before["workspace_allocations"]
    # On N devices a state's pool grows to the number of devices that run its call site at the
    # same moment, which may first happen after warm-up: at most N workspaces per state.
    allocation_bound = args.devices * instantiated

    print()
    print(f"final loss (mean of last {LAST} steps): rmsnorm_ffi {ffi_final:.4f}, jnp {ref_final:.4f} "
          f"(first step {ffi_losses[0]:.4f}); difference {difference:.1e}, tolerance {LOSS_TOLERANCE:g}: "
          f"{'agree' if agree else 'DISAGREE'}")
    print(f"speed (after the compiling step): rmsnorm_ffi {ffi_rate:.1f} steps/s, jnp {ref_rate:.1f} steps/s "
          f"({ffi_rate / ref_rate:.2f}x)")
    print(f"states instantiated: {instantiated} (one per norm call site in the compiled step: "
          f"{2 * args.layers + 1} forward, {2 * args.layers + 1} backward)")
    print(f"norm executions that reused them: {executed - instantiated} of {executed}")
    print(f"workspace allocations after warm-up ({WARMUP_STEPS} steps): {late_allocations} "
          f"(total {total_allocations}, {after['workspace_bytes']} bytes held"
          + (f"; at most one per device per state: {allocation_bound}" if args.devices > 1 else "") + ")")

    failures = []
    if not agree:
        failures.append(f"final losses differ by {difference:.3g} > {LOSS_TOLERANCE:g}")
    if args.devices > 1 and total_allocations > allocation_bound:
        failures.append(f"{total_allocations} workspace allocations, more than one per device per state "
                        f"({allocation_bound})")
    if args.devices == 1 and late_allocations:
        failures.append(f"{late_allocations} workspace allocations after warm-up")
    if failures:
        print("FAILED: " + "; ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
