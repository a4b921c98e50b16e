//! The CUDA path on the CPU: the real GPU bundles (instantiate, initialize, execute, deleter)
//! driven through `ffi::fake`, with the product's driver layer loading the fake libcuda of
//! `tests/cuda_emulator` (through `RMSNORM_FFI_LIBCUDA`) and NVRTC from pip compiling the real
//! kernels; the fake runs `rmsnorm.cu` compiled as host C++ on a CPU emulator.
//!
//! A test binary of its own: the driver handle is a process-wide once-cell read from the
//! environment. Tests hold one lock (the fake's kernels and counters are process-wide).
//!
//! `RMSNORM_FFI_SITE_PACKAGES` (set by `make rust-test` and `make gpu-emulate`) names where
//! pip put NVRTC; without it every test here says SKIPPED and returns. With it, any failure
//! fails.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, Once};

use half::{bf16, f16};
use rmsnorm_ffi::handlers::gpu::{self, kernels, resources};
use rmsnorm_ffi::handlers::{contract, cpu, operands::acc_dtype};
use rmsnorm_ffi_cuda_emulator::{self as emu, Fake};
use xla_ffi_bundles::ffi::fake::{self, FakeContext, FrameBuilder, OwnedAttr, OwnedBuffer};
use xla_ffi_bundles::ffi::{BundleDef, DataType, Stage};

// ---------------------------------------------------------------------------------------------
// Set-up
// ---------------------------------------------------------------------------------------------

static LOCK: Mutex<()> = Mutex::new(());

/// The fake driver, installed for the product's library search; `None` (after saying SKIPPED)
/// when NVRTC's location is not given.
fn setup() -> Option<(&'static Fake, MutexGuard<'static, ()>)> {
    static ONCE: Once = Once::new();
    let guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if std::env::var_os("RMSNORM_FFI_SITE_PACKAGES").is_none() {
        eprintln!("SKIPPED: RMSNORM_FFI_SITE_PACKAGES is not set (make gpu-emulate sets it)");
        return None;
    }
    ONCE.call_once(|| {
        if std::env::var_os("RMSNORM_FFI_LIBCUDA").is_none() {
            // Before any driver use in this process (every test goes through here first).
            std::env::set_var("RMSNORM_FFI_LIBCUDA", emu::fake_libcuda());
        }
        fake::register_bundle_types(&[
            gpu::FORWARD_BUNDLE,
            gpu::BACKWARD_BUNDLE,
            gpu::RESIDUAL_BUNDLE,
            cpu::FORWARD_BUNDLE,
            cpu::BACKWARD_BUNDLE,
            cpu::RESIDUAL_BUNDLE,
        ]);
    });
    let path = PathBuf::from(std::env::var_os("RMSNORM_FFI_LIBCUDA").unwrap());
    let fake = Fake::open(&path);
    let driver = gpu::driver::cuda().expect("the product loads the fake libcuda");
    assert_eq!(Path::new(driver.path()), path);
    Some((fake, guard))
}

// ---------------------------------------------------------------------------------------------
// Values and references
// ---------------------------------------------------------------------------------------------

/// Deterministic values in [-2, 2).
fn values(count: usize, seed: u64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x9e3779b97f4a7c15) | 1;
    (0..count)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f64 / (1u64 << 24) as f64) * 4.0 - 2.0
        })
        .collect()
}

/// Rounds to `dt` and returns (bytes, rounded values).
fn encode(dt: DataType, v: &[f64]) -> (Vec<u8>, Vec<f64>) {
    let mut bytes = Vec::with_capacity(v.len() * 8);
    let mut rounded = Vec::with_capacity(v.len());
    for &x in v {
        match dt {
            DataType::F32 => {
                bytes.extend_from_slice(&(x as f32).to_ne_bytes());
                rounded.push(x as f32 as f64);
            }
            DataType::F64 => {
                bytes.extend_from_slice(&x.to_ne_bytes());
                rounded.push(x);
            }
            DataType::BF16 => {
                let h = bf16::from_f64(x);
                bytes.extend_from_slice(&h.to_bits().to_ne_bytes());
                rounded.push(h.to_f64());
            }
            _ => {
                let h = f16::from_f64(x);
                bytes.extend_from_slice(&h.to_bits().to_ne_bytes());
                rounded.push(h.to_f64());
            }
        }
    }
    (bytes, rounded)
}

fn decode(dt: DataType, bytes: &[u8]) -> Vec<f64> {
    match dt {
        DataType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_ne_bytes(c.try_into().unwrap()) as f64)
            .collect(),
        DataType::F64 => bytes
            .chunks_exact(8)
            .map(|c| f64::from_ne_bytes(c.try_into().unwrap()))
            .collect(),
        DataType::BF16 => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_bits(u16::from_ne_bytes([c[0], c[1]])).to_f64())
            .collect(),
        _ => bytes
            .chunks_exact(2)
            .map(|c| f16::from_bits(u16::from_ne_bytes([c[0], c[1]])).to_f64())
            .collect(),
    }
}

fn size_of(dt: DataType) -> usize {
    kernels::size_of(dt)
}

/// float64 reference: y, rstd, dx, dw (per group), for the weight applied as `offset + w` and dx
/// with `dh` added; LayerNorm's (`layer`) with its mean and bias gradient too.
struct Reference {
    y: Vec<f64>,
    mean: Vec<f64>,
    rstd: Vec<f64>,
    dx: Vec<f64>,
    dw: Vec<f64>,
    db: Vec<f64>,
}

/// The norm of a case and its bias (LayerNorm's, per group).
#[derive(Clone, Copy)]
struct Norm<'a> {
    layer: bool,
    b: Option<&'a [f64]>,
}

#[allow(clippy::too_many_arguments)]
fn reference(
    x: &[f64],
    w: Option<&[f64]>,
    dy: &[f64],
    groups: usize,
    n: usize,
    offset: f64,
    dh: Option<&[f64]>,
    norm: Norm<'_>,
) -> Reference {
    if norm.layer {
        return layer_reference(x, w, norm.b, dy, groups, n, offset, dh);
    }
    let rows = x.len().checked_div(n).unwrap_or(0);
    let per_group = rows.checked_div(groups.max(1)).unwrap_or(0);
    let eps = 1e-5f32 as f64; // eps travels as a float32 attribute
    let mut r = Reference {
        y: vec![0.0; x.len()],
        mean: Vec::new(),
        rstd: vec![0.0; rows],
        dx: vec![0.0; x.len()],
        dw: vec![0.0; groups * n],
        db: Vec::new(),
    };
    for row in 0..rows {
        let g = row.checked_div(per_group).unwrap_or(0);
        let xs = &x[row * n..(row + 1) * n];
        let wj = |j: usize| w.map_or(1.0, |w| offset + w[g * n + j]);
        let rs = 1.0 / (xs.iter().map(|v| v * v).sum::<f64>() / n as f64 + eps).sqrt();
        r.rstd[row] = rs;
        let dot: f64 = (0..n).map(|j| dy[row * n + j] * wj(j) * xs[j]).sum();
        for j in 0..n {
            r.y[row * n + j] = xs[j] * rs * wj(j);
            r.dx[row * n + j] = rs * dy[row * n + j] * wj(j) - xs[j] * rs.powi(3) * dot / n as f64
                + dh.map_or(0.0, |dh| dh[row * n + j]);
            r.dw[g * n + j] += dy[row * n + j] * xs[j] * rs;
        }
    }
    r
}

/// LayerNorm's float64 reference: `y = (x - mean) * rstd * (offset + w) + b`, the variance
/// two-pass; `dx = rstd * (g - mean(g) - xhat * mean(g * xhat))` (+ dh) with `g = dy * (offset +
/// w)`, `dw = sum dy * xhat`, `db = sum dy`.
#[allow(clippy::too_many_arguments)]
fn layer_reference(
    x: &[f64],
    w: Option<&[f64]>,
    b: Option<&[f64]>,
    dy: &[f64],
    groups: usize,
    n: usize,
    offset: f64,
    dh: Option<&[f64]>,
) -> Reference {
    let rows = x.len().checked_div(n).unwrap_or(0);
    let per_group = rows.checked_div(groups.max(1)).unwrap_or(0);
    let eps = 1e-5f32 as f64;
    let nf = n as f64;
    let mut r = Reference {
        y: vec![0.0; x.len()],
        mean: vec![0.0; rows],
        rstd: vec![0.0; rows],
        dx: vec![0.0; x.len()],
        dw: vec![0.0; groups * n],
        db: vec![0.0; groups * n],
    };
    for row in 0..rows {
        let g = row.checked_div(per_group).unwrap_or(0);
        let xs = &x[row * n..(row + 1) * n];
        let ds = &dy[row * n..(row + 1) * n];
        let wj = |j: usize| w.map_or(1.0, |w| offset + w[g * n + j]);
        let mean = xs.iter().sum::<f64>() / nf;
        let var = xs.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / nf;
        let rs = 1.0 / (var + eps).sqrt();
        r.mean[row] = mean;
        r.rstd[row] = rs;
        let xhat = |j: usize| (xs[j] - mean) * rs;
        let gj = |j: usize| ds[j] * wj(j);
        let mg = (0..n).map(gj).sum::<f64>() / nf;
        let mgx = (0..n).map(|j| gj(j) * xhat(j)).sum::<f64>() / nf;
        for j in 0..n {
            r.y[row * n + j] = xhat(j) * wj(j) + b.map_or(0.0, |b| b[g * n + j]);
            r.dx[row * n + j] =
                rs * (gj(j) - mg - xhat(j) * mgx) + dh.map_or(0.0, |dh| dh[row * n + j]);
            r.dw[g * n + j] += ds[j] * xhat(j);
            r.db[g * n + j] += ds[j];
        }
    }
    r
}

/// Relative tolerance of results stored in `dt` for rows of `n` accumulated in `acc`.
fn tolerance(dt: DataType, n: usize) -> f64 {
    match dt {
        DataType::F64 => 1e-12,
        DataType::F32 if n >= 1 << 16 => 2e-4,
        DataType::F32 => 2e-5,
        DataType::BF16 => 1.6e-2,
        _ => 2e-3,
    }
}

fn compare(what: &str, got: &[f64], want: &[f64], tol: f64) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{what}: {} values, want {}", got.len(), want.len()));
    }
    let scale = want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let close = (g - w).abs() <= tol * (w.abs() + scale); // false for NaN
        if !close {
            return Err(format!(
                "MISMATCH {what}[{i}]: got {g}, want {w} (tol {tol:e})"
            ));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// One case through the bundles
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy)]
enum Weight {
    None,
    Same,
    F32,
    Of(DataType),
}

#[derive(Debug, Clone, Copy)]
struct Case {
    x: DataType,
    w: Weight,
    /// Weight groups (batched weight of shape (groups, n)), rows per group, row length.
    groups: usize,
    rows: usize,
    n: usize,
    /// Bytes past 16-byte alignment for every buffer (forces the scalar path).
    misalign: usize,
    /// The CUDA device of the stream (XLA's ordinal stays 0).
    device: i32,
    /// Whether XLA runs the initialize stage (else the first execute loads).
    initialize: bool,
    /// The `scale_offset` attribute of every call (the weight applied is `offset + w`).
    offset: Option<f32>,
    /// The backward has a `dh` operand (`has_dh`), added to dx before its one rounding.
    dh: bool,
    /// LayerNorm (`norm` 1) rather than the RMS norm.
    layer: bool,
    /// LayerNorm's bias (of the weight's dtype, or x's without a weight).
    bias: bool,
    /// Added to every x (LayerNorm's rows whose mean is large against their spread).
    mean: f64,
}

impl Case {
    fn new(x: DataType, w: Weight, rows: usize, n: usize) -> Case {
        Case {
            x,
            w,
            groups: 1,
            rows,
            n,
            misalign: 0,
            device: 0,
            initialize: true,
            offset: None,
            dh: false,
            layer: false,
            bias: false,
            mean: 0.0,
        }
    }
    /// LayerNorm's case, with a bias or not.
    fn layer(x: DataType, w: Weight, rows: usize, n: usize, bias: bool) -> Case {
        Case {
            layer: true,
            bias,
            ..Case::new(x, w, rows, n)
        }
    }
    /// The bias's dtype (LayerNorm with a bias).
    fn bd(&self) -> Option<DataType> {
        self.bias.then(|| self.wd().unwrap_or(self.x))
    }
    fn wd(&self) -> Option<DataType> {
        match self.w {
            Weight::None => None,
            Weight::Same => Some(self.x),
            Weight::F32 => Some(DataType::F32),
            Weight::Of(d) => Some(d),
        }
    }
    fn x_dims(&self) -> Vec<i64> {
        if self.groups > 1 {
            vec![self.groups as i64, self.rows as i64, self.n as i64]
        } else {
            vec![self.rows as i64, self.n as i64]
        }
    }
    fn w_dims(&self) -> Vec<i64> {
        if self.groups > 1 {
            vec![self.groups as i64, self.n as i64]
        } else {
            vec![self.n as i64]
        }
    }
}

/// A device buffer holding `bytes` (or 0xff when `None`), misaligned as the case says.
fn device(
    fake: &'static Fake,
    case: &Case,
    bytes: usize,
    data: Option<&[u8]>,
) -> emu::DeviceBuffer {
    let mut b = fake.buffer(bytes, case.misalign);
    if let Some(d) = data {
        b.write(d);
    }
    b
}

fn call(
    ctx: &FakeContext,
    def: &BundleDef,
    stage: Stage,
    frame: FrameBuilder,
) -> Result<(), String> {
    let handler = def.handler(stage).expect("stage defined");
    frame
        .build(ctx)
        .call(handler)
        .map_err(|(c, m)| format!("{stage}: {c:?}: {m}"))
}

fn gpu_context(fake: &Fake, case: &Case) -> FakeContext {
    let mut ctx = FakeContext::new();
    ctx.stream = Some(fake.stream(case.device));
    ctx.device_ordinal = 0;
    ctx
}

/// LayerNorm's attributes (none for the RMS norm: its defaults).
fn norm_attrs(case: &Case) -> Vec<(&'static str, OwnedAttr)> {
    if !case.layer {
        return Vec::new();
    }
    vec![
        ("norm", OwnedAttr::scalar(1i64)),
        ("has_bias", OwnedAttr::pred(case.bias)),
    ]
}

fn fwd_attrs(case: &Case) -> Vec<(&'static str, OwnedAttr)> {
    let mut attrs = vec![
        ("eps", OwnedAttr::scalar(1e-5f32)),
        ("has_weight", OwnedAttr::pred(case.wd().is_some())),
        ("row_len", OwnedAttr::scalar(case.n as i64)),
    ];
    attrs.extend(norm_attrs(case));
    if let Some(offset) = case.offset {
        attrs.push(("scale_offset", OwnedAttr::scalar(offset)));
    }
    attrs
}

fn bwd_attrs(case: &Case) -> Vec<(&'static str, OwnedAttr)> {
    let mut attrs = vec![
        ("has_weight", OwnedAttr::pred(case.wd().is_some())),
        ("row_len", OwnedAttr::scalar(case.n as i64)),
    ];
    attrs.extend(norm_attrs(case));
    if let Some(offset) = case.offset {
        attrs.push(("scale_offset", OwnedAttr::scalar(offset)));
    }
    if case.dh {
        attrs.push(("has_dh", OwnedAttr::pred(true)));
    }
    attrs
}

/// One case's inputs: bytes in their dtypes, and the float64 values those bytes hold.
struct Inputs {
    x: (Vec<u8>, Vec<f64>),
    w: Option<(Vec<u8>, Vec<f64>)>,
    /// LayerNorm's bias.
    b: Option<(Vec<u8>, Vec<f64>)>,
    dy: (Vec<u8>, Vec<f64>),
    /// The backward's `dh` (cases with `dh`).
    dh: Option<(Vec<u8>, Vec<f64>)>,
}

/// What the GPU bundles returned: y, (LayerNorm's mean,) rstd and dx as float64, dweight's (and
/// dbias's) bytes per backward run.
struct Outputs {
    y: Vec<f64>,
    mean: Vec<f64>,
    rstd: Vec<f64>,
    dx: Vec<f64>,
    dw: Vec<Vec<u8>>,
    db: Vec<Vec<u8>>,
}

/// The GPU forward at x, then the backward `runs` times at x, the weight, the forward's rstd and
/// dy, through the bundles' stages as XLA:GPU calls them. Checks that the stats detail names
/// the stage that loaded the backward's resources, that the states' deleters freed every device
/// allocation, and that no guard zone was overwritten.
fn run_gpu(fake: &'static Fake, case: &Case, inp: &Inputs, runs: usize) -> Result<Outputs, String> {
    let n = case.n;
    let rows = case.groups * case.rows;
    let count = rows * n;
    let xd = case.x;
    let ad = acc_dtype(xd);
    let (xdims, wdims) = (case.x_dims(), case.w_dims());
    let rdims = &xdims[..xdims.len() - 1];
    let before = fake.counters();

    // ---- forward
    let xb = device(fake, case, inp.x.0.len(), Some(&inp.x.0));
    let wb = inp
        .w
        .as_ref()
        .map(|(b, _)| device(fake, case, b.len(), Some(b)));
    let bb = inp
        .b
        .as_ref()
        .map(|(b, _)| device(fake, case, b.len(), Some(b)));
    let yb = device(fake, case, count * size_of(xd), None);
    let mb = case
        .layer
        .then(|| device(fake, case, rows * size_of(ad), None));
    let rb = device(fake, case, rows * size_of(ad), None);
    let fwd_frame = |stage: Stage| {
        let mut f = FrameBuilder::new(stage).device_arg(xd, &xdims, xb.addr());
        if let (Some(wb), Some(wd)) = (&wb, case.wd()) {
            f = f.device_arg(wd, &wdims, wb.addr());
        }
        if let (Some(bb), Some(bd)) = (&bb, case.bd()) {
            f = f.device_arg(bd, &wdims, bb.addr());
        }
        f = f.device_ret(xd, &xdims, yb.addr());
        if let Some(mb) = &mb {
            f = f.device_ret(ad, rdims, mb.addr());
        }
        f.device_ret(ad, rdims, rb.addr())
    };
    {
        let ctx = gpu_context(fake, case);
        fake::instantiate(&ctx, &gpu::FORWARD_BUNDLE, fwd_attrs(case))
            .map_err(|(c, m)| format!("instantiate: {c:?}: {m}"))?;
        if case.initialize {
            let frame = fwd_frame(Stage::Initialize);
            call(&ctx, &gpu::FORWARD_BUNDLE, Stage::Initialize, frame)?;
        }
        let frame = fwd_frame(Stage::Execute);
        call(&ctx, &gpu::FORWARD_BUNDLE, Stage::Execute, frame)?;
    }

    // ---- backward
    let dyb = device(fake, case, inp.dy.0.len(), Some(&inp.dy.0));
    let dhb = inp
        .dh
        .as_ref()
        .map(|(b, _)| device(fake, case, b.len(), Some(b)));
    let dxb = device(fake, case, count * size_of(xd), None);
    let dw_bytes = inp.w.as_ref().map_or(0, |(b, _)| b.len());
    let dwb: Vec<emu::DeviceBuffer> = (0..runs)
        .filter(|_| case.wd().is_some())
        .map(|_| device(fake, case, dw_bytes, None))
        .collect();
    let db_bytes = inp.b.as_ref().map_or(0, |(b, _)| b.len());
    let dbb: Vec<emu::DeviceBuffer> = (0..runs)
        .filter(|_| case.bd().is_some())
        .map(|_| device(fake, case, db_bytes, None))
        .collect();
    {
        let ctx = gpu_context(fake, case);
        fake::instantiate(&ctx, &gpu::BACKWARD_BUNDLE, bwd_attrs(case))
            .map_err(|(c, m)| format!("instantiate: {c:?}: {m}"))?;
        let frame = |stage: Stage, run: usize| {
            let mut f = FrameBuilder::new(stage).device_arg(xd, &xdims, xb.addr());
            if let (Some(wb), Some(wd)) = (&wb, case.wd()) {
                f = f.device_arg(wd, &wdims, wb.addr());
            }
            if let Some(mb) = &mb {
                f = f.device_arg(ad, rdims, mb.addr());
            }
            f = f
                .device_arg(ad, rdims, rb.addr())
                .device_arg(xd, &xdims, dyb.addr());
            if let Some(dhb) = &dhb {
                f = f.device_arg(xd, &xdims, dhb.addr());
            }
            f = f.device_ret(xd, &xdims, dxb.addr());
            if let Some(wd) = case.wd() {
                f = f.device_ret(wd, &wdims, dwb[run].addr());
            }
            if let Some(bd) = case.bd() {
                f = f.device_ret(bd, &wdims, dbb[run].addr());
            }
            f
        };
        if case.initialize {
            let frame = frame(Stage::Initialize, 0);
            call(&ctx, &gpu::BACKWARD_BUNDLE, Stage::Initialize, frame)?;
        }
        for run in 0..runs {
            let frame = frame(Stage::Execute, run);
            call(&ctx, &gpu::BACKWARD_BUNDLE, Stage::Execute, frame)?;
        }
        let want = if case.initialize {
            "initialize"
        } else {
            "execute"
        };
        let detail = xla_ffi_bundles::state::snapshot()
            .states
            .iter()
            .rev()
            .find(|s| s.target == gpu::BACKWARD_TARGET)
            .and_then(|s| {
                s.details
                    .get(&format!("cuda device {}", case.device))
                    .cloned()
            })
            .unwrap_or_default();
        if !detail.contains(&format!("loaded in {want}")) {
            return Err(format!("stats detail `{detail}`, want loaded in {want}"));
        }
    }
    let out = Outputs {
        y: decode(xd, &yb.read()),
        mean: mb.as_ref().map_or_else(Vec::new, |m| decode(ad, &m.read())),
        rstd: decode(ad, &rb.read()),
        dx: decode(xd, &dxb.read()),
        dw: dwb.iter().map(|b| b.read()).collect(),
        db: dbb.iter().map(|b| b.read()).collect(),
    };
    drop((xb, wb, bb, yb, mb, rb, dyb, dhb, dxb, dwb, dbb));
    clean_teardown(fake, &before, "the states' deleters")?;
    Ok(out)
}

/// After a run's buffers and states are gone: the device memory is back where it was before
/// the run (`whose` freed it, or failed to), and no guard zone around a buffer was written.
fn clean_teardown(fake: &Fake, before: &emu::Counters, whose: &str) -> Result<(), String> {
    let after = fake.counters();
    if after.driver_bytes != before.driver_bytes || after.outstanding != before.outstanding {
        return Err(format!(
            "{whose} left device memory behind: {before:?} -> {after:?}"
        ));
    }
    if after.guard_failures != before.guard_failures {
        return Err(format!("guard zones overwritten: {}", fake.last_error()));
    }
    Ok(())
}

/// Runs one case: GPU forward and backward (twice) against float64 and against the CPU bundles;
/// dweight bitwise equal run to run; every allocation of the state freed by its deleter. The
/// plain ops run at h = x + residual (rounded to x's dtype on the host), and the fused residual
/// forward at (x, residual) must give that h bit for bit (as the CPU bundle does) and the plain
/// forward's y and rstd at h bit for bit. With a scale offset the weights are zero-centred (as
/// Gemma's: the offset carries the scale); with `dh`, dx must also be within one unit of the
/// correctly rounded float64 value ([`check_dx_with_dh`]).
/// One case through the GPU bundles, checked against float64 and the CPU bundles (and its fused
/// residual forward against the plain one); the GPU's outputs when every check passes.
fn run_case(fake: &'static Fake, case: &Case) -> Result<Outputs, String> {
    let tag = format!("{case:?}");
    let in_context = |e: String| format!("{tag}: {e}");
    let (groups, n) = (case.groups, case.n);
    let rows = groups * case.rows;
    let count = rows * n;
    let xd = case.x;
    let x = encode(
        xd,
        &values(count, 1 + n as u64)
            .iter()
            .map(|v| v + case.mean)
            .collect::<Vec<_>>(),
    );
    let residual = encode(xd, &values(count, 4 + n as u64));
    let h: Vec<f64> = x.1.iter().zip(&residual.1).map(|(a, b)| a + b).collect();
    let inp = Inputs {
        x: encode(xd, &h),
        dy: encode(xd, &values(count, 2 + rows as u64)),
        w: case.wd().map(|wd| {
            let centre = if case.offset.is_some() { 0.0 } else { 1.0 };
            let v: Vec<f64> = values(groups * n, 3)
                .iter()
                .map(|v| centre + v / 4.0)
                .collect();
            encode(wd, &v)
        }),
        b: case.bd().map(|bd| {
            encode(
                bd,
                &values(groups * n, 7)
                    .iter()
                    .map(|v| v / 2.0)
                    .collect::<Vec<_>>(),
            )
        }),
        dh: case.dh.then(|| encode(xd, &values(count, 6 + rows as u64))),
    };
    let r = reference(
        &inp.x.1,
        inp.w.as_ref().map(|w| w.1.as_slice()),
        &inp.dy.1,
        groups,
        n,
        case.offset.map_or(0.0, f64::from),
        inp.dh.as_ref().map(|d| d.1.as_slice()),
        Norm {
            layer: case.layer,
            b: inp.b.as_ref().map(|b| b.1.as_slice()),
        },
    );
    let tol = tolerance(xd, n);
    let out = run_gpu(fake, case, &inp, 2).map_err(in_context)?;
    let cpu = cpu_results(
        case,
        &inp.x.0,
        inp.w.as_ref().map(|w| w.0.as_slice()),
        inp.b.as_ref().map(|b| b.0.as_slice()),
        &inp.dy.0,
        inp.dh.as_ref().map(|d| d.0.as_slice()),
    )
    .map_err(in_context)?;
    if rows > 0 {
        compare("y vs float64", &out.y, &r.y, tol).map_err(in_context)?;
        compare("rstd vs float64", &out.rstd, &r.rstd, tol).map_err(in_context)?;
        if case.layer {
            // The mean within a few units of the accumulation dtype of the row's magnitude,
            // mean(|x|): the kernels' partial sums in that dtype round at that scale (a row
            // whose values cancel has a mean far smaller than they are); at a mean large
            // against the spread that is a few units of the mean itself.
            let unit = if acc_dtype(xd) == DataType::F64 {
                f64::EPSILON
            } else {
                f32::EPSILON as f64
            };
            for (i, (g, w)) in out.mean.iter().zip(&r.mean).enumerate() {
                let row = &inp.x.1[i * n..(i + 1) * n];
                let scale = row.iter().map(|v| v.abs()).sum::<f64>() / n as f64;
                let close = (g - w).abs() <= 4.0 * unit * scale; // false for NaN
                if !close {
                    return Err(in_context(format!(
                        "MISMATCH mean[{i}]: got {g}, want {w} (row scale {scale:e})"
                    )));
                }
            }
        }
        compare("y vs the CPU bundle", &out.y, &cpu.0, 2.0 * tol).map_err(in_context)?;
        compare("dx vs float64", &out.dx, &r.dx, 4.0 * tol).map_err(in_context)?;
        compare("dx vs the CPU bundle", &out.dx, &cpu.1, 8.0 * tol).map_err(in_context)?;
        if case.dh {
            check_dx_with_dh(xd, &out.dx, &r.dx).map_err(in_context)?;
        }
    }
    // The weight's gradient and LayerNorm's bias's: bitwise the same run to run, close to
    // float64 and to the CPU bundle's.
    for (what, dt, runs, want, theirs) in [
        ("dw", case.wd(), &out.dw, &r.dw, &cpu.2),
        ("db", case.bd(), &out.db, &r.db, &cpu.3),
    ] {
        let Some(dt) = dt else { continue };
        if runs[0] != runs[1] {
            return Err(in_context(format!("{what} differs between two runs")));
        }
        let got = decode(dt, &runs[0]);
        let gtol = tol.max(tolerance(dt, n)) * 4.0 * ((case.rows as f64) + 1.0).sqrt();
        compare(&format!("{what} vs float64"), &got, want, gtol).map_err(in_context)?;
        compare(
            &format!("{what} vs the CPU bundle"),
            &got,
            theirs,
            2.0 * gtol,
        )
        .map_err(in_context)?;
    }

    // ---- the fused residual forward
    if rows > 0 {
        let w = inp.w.as_ref().map(|w| w.0.as_slice());
        let b = inp.b.as_ref().map(|b| b.0.as_slice());
        let (gy, gh, gstats) =
            run_residual_gpu(fake, case, &x.0, &residual.0, w, b).map_err(in_context)?;
        if gh != inp.x.0 {
            let at = gh
                .chunks(size_of(xd))
                .zip(inp.x.0.chunks(size_of(xd)))
                .position(|(a, b)| a != b)
                .unwrap_or(0);
            return Err(in_context(format!(
                "residual h differs from x + residual rounded to {} at [{at}]",
                xd.name()
            )));
        }
        let stats: Vec<f64> = out.mean.iter().chain(&out.rstd).copied().collect();
        if gy != out.y || gstats != stats {
            return Err(in_context(
                "residual y or statistics differ from the forward at h (bit for bit)".into(),
            ));
        }
        let (cy, ch) = cpu_residual(case, &x.0, &residual.0, w, b).map_err(in_context)?;
        if ch != gh {
            return Err(in_context(
                "residual h differs from the CPU bundle's".into(),
            ));
        }
        compare("residual y vs the CPU bundle", &gy, &cy, 2.0 * tol).map_err(in_context)?;
    }
    Ok(out)
}

/// y, h's bytes, and the statistics (LayerNorm's mean, then rstd; as float64).
type ResidualOutputs = (Vec<f64>, Vec<u8>, Vec<f64>);

/// The GPU `rmsnorm_residual_fwd` at (x, residual). Checks, like [`run_gpu`], that the state's
/// deleter freed everything and no guard zone was hit.
fn run_residual_gpu(
    fake: &'static Fake,
    case: &Case,
    x: &[u8],
    residual: &[u8],
    w: Option<&[u8]>,
    b: Option<&[u8]>,
) -> Result<ResidualOutputs, String> {
    let xd = case.x;
    let ad = acc_dtype(xd);
    let rows = case.groups * case.rows;
    let (xdims, wdims) = (case.x_dims(), case.w_dims());
    let rdims = &xdims[..xdims.len() - 1];
    let before = fake.counters();
    let xb = device(fake, case, x.len(), Some(x));
    let resb = device(fake, case, residual.len(), Some(residual));
    let wb = w.map(|b| device(fake, case, b.len(), Some(b)));
    let bb = b.map(|b| device(fake, case, b.len(), Some(b)));
    let yb = device(fake, case, x.len(), None);
    let hb = device(fake, case, x.len(), None);
    let mb = case
        .layer
        .then(|| device(fake, case, rows * size_of(ad), None));
    let rb = device(fake, case, rows * size_of(ad), None);
    let frame = |stage: Stage| {
        let mut f = FrameBuilder::new(stage)
            .device_arg(xd, &xdims, xb.addr())
            .device_arg(xd, &xdims, resb.addr());
        if let (Some(wb), Some(wd)) = (&wb, case.wd()) {
            f = f.device_arg(wd, &wdims, wb.addr());
        }
        if let (Some(bb), Some(bd)) = (&bb, case.bd()) {
            f = f.device_arg(bd, &wdims, bb.addr());
        }
        f = f
            .device_ret(xd, &xdims, yb.addr())
            .device_ret(xd, &xdims, hb.addr());
        if let Some(mb) = &mb {
            f = f.device_ret(ad, rdims, mb.addr());
        }
        f.device_ret(ad, rdims, rb.addr())
    };
    {
        let ctx = gpu_context(fake, case);
        fake::instantiate(&ctx, &gpu::RESIDUAL_BUNDLE, fwd_attrs(case))
            .map_err(|(c, m)| format!("residual instantiate: {c:?}: {m}"))?;
        if case.initialize {
            call(
                &ctx,
                &gpu::RESIDUAL_BUNDLE,
                Stage::Initialize,
                frame(Stage::Initialize),
            )?;
        }
        call(
            &ctx,
            &gpu::RESIDUAL_BUNDLE,
            Stage::Execute,
            frame(Stage::Execute),
        )?;
    }
    let mut stats = mb.as_ref().map_or_else(Vec::new, |m| decode(ad, &m.read()));
    stats.extend(decode(ad, &rb.read()));
    let out = (decode(xd, &yb.read()), hb.read(), stats);
    drop((xb, resb, wb, bb, yb, hb, mb, rb));
    clean_teardown(fake, &before, "the residual state's deleter")?;
    Ok(out)
}

/// The CPU bundle's `rmsnorm_residual_fwd` at (x, residual): y as float64, h's bytes.
fn cpu_residual(
    case: &Case,
    x: &[u8],
    residual: &[u8],
    w: Option<&[u8]>,
    b: Option<&[u8]>,
) -> Result<(Vec<f64>, Vec<u8>), String> {
    let xd = case.x;
    let (xdims, wdims) = (case.x_dims(), case.w_dims());
    let rdims = &xdims[..xdims.len() - 1];
    let ctx = FakeContext::new();
    fake::instantiate(&ctx, &cpu::RESIDUAL_BUNDLE, fwd_attrs(case)).map_err(|e| e.1)?;
    let mut f = FrameBuilder::new(Stage::Execute)
        .arg(host_buffer(xd, &xdims, x))
        .arg(host_buffer(xd, &xdims, residual));
    if let (Some(w), Some(wd)) = (w, case.wd()) {
        f = f.arg(host_buffer(wd, &wdims, w));
    }
    if let (Some(b), Some(bd)) = (b, case.bd()) {
        f = f.arg(host_buffer(bd, &wdims, b));
    }
    f = f
        .ret(OwnedBuffer::zeros(xd, &xdims))
        .ret(OwnedBuffer::zeros(xd, &xdims));
    if case.layer {
        f = f.ret(OwnedBuffer::zeros(acc_dtype(xd), rdims));
    }
    let mut f = f.ret(OwnedBuffer::zeros(acc_dtype(xd), rdims)).build(&ctx);
    f.call(cpu::RESIDUAL_BUNDLE.handler(Stage::Execute).unwrap())
        .map_err(|e| format!("CPU residual forward: {}", e.1))?;
    Ok((
        decode(xd, &host_bytes(f.result(0))),
        host_bytes(f.result(1)),
    ))
}

/// A host buffer of `dt` and `dims` holding `bytes`.
fn host_buffer(dt: DataType, dims: &[i64], bytes: &[u8]) -> OwnedBuffer {
    let mut b = OwnedBuffer::zeros(dt, dims);
    let words: Vec<u64> = bytes
        .chunks(8)
        .map(|c| {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            u64::from_ne_bytes(w)
        })
        .collect();
    b.data[..words.len()].copy_from_slice(&words);
    b
}

/// The bytes a host buffer holds.
fn host_bytes(b: &OwnedBuffer) -> Vec<u8> {
    b.data
        .iter()
        .flat_map(|w| w.to_ne_bytes())
        .take(b.bytes)
        .collect()
}

/// y, dx, dw, db.
type Results = (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>);

/// The CPU bundles' y, dx, dw (and LayerNorm's db) on host copies of the same inputs (the
/// statistics from the CPU forward).
fn cpu_results(
    case: &Case,
    x: &[u8],
    w: Option<&[u8]>,
    b: Option<&[u8]>,
    dy: &[u8],
    dh: Option<&[u8]>,
) -> Result<Results, String> {
    let xd = case.x;
    let ad = acc_dtype(xd);
    let (xdims, wdims) = (case.x_dims(), case.w_dims());
    let rdims = &xdims[..xdims.len() - 1];
    let (host, bytes_of) = (host_buffer, host_bytes);
    let ctx = FakeContext::new();
    fake::instantiate(&ctx, &cpu::FORWARD_BUNDLE, fwd_attrs(case)).map_err(|e| e.1)?;
    let mut f = FrameBuilder::new(Stage::Execute).arg(host(xd, &xdims, x));
    if let (Some(w), Some(wd)) = (w, case.wd()) {
        f = f.arg(host(wd, &wdims, w));
    }
    if let (Some(b), Some(bd)) = (b, case.bd()) {
        f = f.arg(host(bd, &wdims, b));
    }
    f = f.ret(OwnedBuffer::zeros(xd, &xdims));
    if case.layer {
        f = f.ret(OwnedBuffer::zeros(ad, rdims));
    }
    let mut f = f.ret(OwnedBuffer::zeros(ad, rdims)).build(&ctx);
    f.call(cpu::FORWARD_BUNDLE.handler(Stage::Execute).unwrap())
        .map_err(|e| format!("CPU forward: {}", e.1))?;
    let y = decode(xd, &bytes_of(f.result(0)));
    // The statistics, each as the backward takes it (LayerNorm's mean, then rstd).
    let stats: Vec<Vec<u8>> = (1..=1 + case.layer as usize)
        .map(|i| bytes_of(f.result(i)))
        .collect();
    let ctx = FakeContext::new();
    fake::instantiate(&ctx, &cpu::BACKWARD_BUNDLE, bwd_attrs(case)).map_err(|e| e.1)?;
    let mut b = FrameBuilder::new(Stage::Execute).arg(host(xd, &xdims, x));
    if let (Some(w), Some(wd)) = (w, case.wd()) {
        b = b.arg(host(wd, &wdims, w));
    }
    for s in &stats {
        b = b.arg(host(ad, rdims, s));
    }
    b = b.arg(host(xd, &xdims, dy));
    if let Some(dh) = dh {
        b = b.arg(host(xd, &xdims, dh));
    }
    b = b.ret(OwnedBuffer::zeros(xd, &xdims));
    if let Some(wd) = case.wd() {
        b = b.ret(OwnedBuffer::zeros(wd, &wdims));
    }
    if let Some(bd) = case.bd() {
        b = b.ret(OwnedBuffer::zeros(bd, &wdims));
    }
    let mut b = b.build(&ctx);
    b.call(cpu::BACKWARD_BUNDLE.handler(Stage::Execute).unwrap())
        .map_err(|e| format!("CPU backward: {}", e.1))?;
    let dx = decode(xd, &bytes_of(b.result(0)));
    let has_w = case.wd().is_some() as usize;
    let dw = case
        .wd()
        .map_or_else(Vec::new, |wd| decode(wd, &bytes_of(b.result(1))));
    let db = case
        .bd()
        .map_or_else(Vec::new, |bd| decode(bd, &bytes_of(b.result(1 + has_w))));
    Ok((y, dx, dw, db))
}

/// Where `got` and `want` (rows of `n`) are NaN and infinite must agree, infinities in sign too;
/// the finite values of each row within `tol` of `want`'s (row by row: a row of 1e30 must not
/// widen another row's bound).
fn same_non_finite(
    what: &str,
    got: &[f64],
    want: &[f64],
    n: usize,
    tol: f64,
) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{what}: {} values, want {}", got.len(), want.len()));
    }
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if g.is_nan() != w.is_nan()
            || (w.is_infinite() && g != w)
            || (g.is_infinite() && !w.is_infinite())
        {
            return Err(format!("{what}[{i}]: got {g}, want {w}"));
        }
    }
    for (r, (g, w)) in got.chunks(n).zip(want.chunks(n)).enumerate() {
        let (g, w): (Vec<f64>, Vec<f64>) = g
            .iter()
            .zip(w)
            .filter(|(_, w)| w.is_finite())
            .map(|(g, w)| (*g, *w))
            .unzip();
        compare(&format!("{what} row {r}"), &g, &w, tol)?;
    }
    Ok(())
}

/// Non-finite input through the GPU bundles gives what the CPU bundles give: a row with a NaN,
/// +inf, -inf, or squares past float32's range (bfloat16 and float32 hold 1e30; float16
/// saturates to inf). The half-precision kernels round packs holding a NaN with the bit
/// arithmetic and the rest in pairs (rmsnorm.cu's Narrow): both run here.
#[test]
fn non_finite_rows_match_the_cpu_bundles() {
    let Some((fake, _guard)) = setup() else {
        return;
    };
    let (rows, n) = (6, 256);
    let mut failures = Vec::new();
    for x in [DataType::BF16, DataType::F16, DataType::F32] {
        let case = Case::new(x, Weight::Same, rows, n);
        let mut xv = values(rows * n, 11);
        xv[n + 5] = f64::NAN;
        xv[2 * n + 7] = f64::INFINITY;
        xv[3 * n + 9] = f64::NEG_INFINITY;
        for v in &mut xv[4 * n..5 * n] {
            *v *= 1e30;
        }
        let w: Vec<f64> = values(n, 13).iter().map(|v| 1.0 + v / 4.0).collect();
        let inp = Inputs {
            x: encode(x, &xv),
            w: Some(encode(x, &w)),
            b: None,
            dy: encode(x, &values(rows * n, 12)),
            dh: None,
        };
        let tol = 2.0 * tolerance(x, n);
        let checked = run_gpu(fake, &case, &inp, 1).and_then(|out| {
            let cpu = cpu_results(
                &case,
                &inp.x.0,
                inp.w.as_ref().map(|w| w.0.as_slice()),
                None,
                &inp.dy.0,
                None,
            )?;
            same_non_finite("y", &out.y, &cpu.0, n, tol)?;
            same_non_finite("dx", &out.dx, &cpu.1, n, 4.0 * tol)?;
            let dw = decode(x, &out.dw[0]);
            same_non_finite("dw", &dw, &cpu.2, n, 4.0 * tol * (rows as f64).sqrt())
        });
        if let Err(e) = checked {
            failures.push(format!("{}: {e}", x.name()));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---------------------------------------------------------------------------------------------
// The matrix
// ---------------------------------------------------------------------------------------------

/// Every x dtype of the op contract without a weight and with each weight dtype the contract
/// pairs it with (all 16 pairs: `DtypePair::ALL`).
fn pairs() -> Vec<(DataType, Weight)> {
    let mut out = Vec::new();
    for x in contract::x_dtypes() {
        out.push((x, Weight::None));
        out.extend(
            contract::weight_dtypes(x)
                .into_iter()
                .map(|w| (x, Weight::Of(w))),
        );
    }
    out
}

/// Every (x, weight) pair over: n = 1, odd n (scalar path), zero rows, several rows per block,
/// several rows per team (each block accumulating many rows), one block per row, a batched
/// weight; then blocks folding their weight-gradient sums many times, the streaming path (rows
/// up to 2^20), misaligned
/// buffers (scalar path on even n), a stream on the second device, and XLA skipping initialize;
/// then scale offsets (Gemma's 1 and -0.5) and the fused residual's dh over every path.
fn matrix() -> Vec<Case> {
    let mut cases = Vec::new();
    for (x, w) in pairs() {
        for (rows, n) in [(3, 1), (5, 67), (0, 128), (37, 256), (150, 128), (3, 4096)] {
            cases.push(Case::new(x, w, rows, n));
        }
        cases.push(Case {
            groups: 3,
            ..Case::new(x, w, 5, 64)
        });
    }
    // Blocks of several teams that fold their weight-gradient sums into the block's row more
    // than once (FOLD_ROWS rows per team at a time), one block per fake SM.
    for (x, w, rows, n) in [
        (DataType::F32, Weight::Same, 600, 256),
        (DataType::BF16, Weight::F32, 900, 512),
        (DataType::F64, Weight::Same, 600, 64),
    ] {
        cases.push(Case::new(x, w, rows, n));
    }
    for (x, w, rows, n) in [
        (DataType::F32, Weight::Same, 2, 1 << 20),
        (DataType::BF16, Weight::F32, 1, 1 << 20),
        (DataType::F16, Weight::Same, 2, 40000),
        (DataType::F64, Weight::F32, 2, 20001),
    ] {
        cases.push(Case::new(x, w, rows, n));
    }
    for x in [DataType::BF16, DataType::F32] {
        cases.push(Case {
            misalign: size_of(x),
            ..Case::new(x, Weight::Same, 9, 512)
        });
    }
    cases.push(Case {
        device: 1,
        ..Case::new(DataType::BF16, Weight::Same, 17, 1024)
    });
    cases.push(Case {
        initialize: false,
        ..Case::new(DataType::F32, Weight::Same, 6, 2048)
    });
    cases.push(Case {
        groups: 4,
        ..Case::new(DataType::F32, Weight::Same, 40, 8192)
    });
    // Narrow (float32) partial rows of cached bfloat16 rows, transposed among lanes before they
    // are stored: 40 rows on 4 fake SMs take 5 blocks of 8 rows (plan.rs), not 4 of 10.
    cases.push(Case::new(DataType::BF16, Weight::F32, 40, 8192));
    // Rows split across thread block clusters (the fake is compute capability 9.0 with
    // cuLaunchKernelEx; plan.rs's backward_cluster): 40 rows of 32768 bfloat16 on 4 fake SMs are
    // 2 clusters of 2 blocks, 20 rows each (float64 partial rows, folded); float32 with 3 weight
    // groups (narrow rows, a cluster per group); float64 (compensated dot slots); no weight
    // (the dot slots alone); the 40000-element rows above take clusters of 4.
    for (x, w, rows, n, groups) in [
        (DataType::BF16, Weight::F32, 40, 32768, 1),
        (DataType::F32, Weight::Same, 6, 32768, 3),
        (DataType::F64, Weight::Same, 5, 8192, 1),
        (DataType::BF16, Weight::None, 3, 32768, 1),
    ] {
        cases.push(Case {
            groups,
            ..Case::new(x, w, rows, n)
        });
    }
    cases.extend(offset_and_dh_cases());
    cases.extend(layer_cases());
    cases
}

/// LayerNorm's kernels (rmsnorm.cu's LAYER) over every pair: the scalar path with a bias, the
/// cached path with several rows per block (a bias: its gradient's partial rows beside the
/// weight's in shared memory) and per team (no bias), a batched weight and bias; then the
/// streaming path, narrow partials, rows whose mean is 1e4 and 1e6 times their spread (float32:
/// a naive variance loses every digit there, and a rounded mean 3% of the spread without the
/// shift), a bias without a weight, scale offsets with dh, misaligned buffers, float64.
fn layer_cases() -> Vec<Case> {
    use DataType::{BF16, F16, F32, F64};
    let mut cases = Vec::new();
    for (x, w) in pairs() {
        cases.push(Case::layer(x, w, 5, 67, true));
        cases.push(Case::layer(x, w, 37, 256, true));
        cases.push(Case::layer(x, w, 150, 128, false));
        cases.push(Case {
            groups: 3,
            ..Case::layer(x, w, 5, 64, true)
        });
    }
    let with = |offset: Option<f32>, dh: bool, case: Case| Case { offset, dh, ..case };
    cases.extend([
        Case::layer(F32, Weight::Same, 2, 40000, true),
        Case::layer(BF16, Weight::F32, 2, 1 << 17, true),
        Case::layer(F16, Weight::None, 2, 40000, true),
        Case::layer(F64, Weight::Same, 3, 20001, true),
        Case::layer(BF16, Weight::F32, 40, 8192, true),
        Case::layer(F32, Weight::Same, 600, 256, true),
        Case::layer(F32, Weight::None, 37, 256, true),
        Case {
            mean: 1e4,
            ..Case::layer(F32, Weight::Same, 9, 1024, true)
        },
        Case {
            mean: 1e6,
            ..Case::layer(F32, Weight::Same, 9, 1024, true)
        },
        Case {
            mean: 1e6,
            ..Case::layer(F32, Weight::Same, 2, 40000, true)
        },
        Case {
            misalign: 2,
            ..Case::layer(BF16, Weight::Same, 9, 512, true)
        },
        with(
            Some(1.0),
            true,
            Case::layer(BF16, Weight::Of(BF16), 37, 256, true),
        ),
        with(
            Some(-0.5),
            true,
            Case::layer(F32, Weight::Same, 2, 40000, true),
        ),
        with(
            Some(1.0),
            true,
            Case::layer(F64, Weight::Of(BF16), 9, 512, true),
        ),
        with(None, true, Case::layer(F16, Weight::None, 9, 512, false)),
    ]);
    cases
}

/// The scale offset (1 and -0.5, bfloat16 weights among others) and the fused residual's dh over
/// the kernels' paths: scalar (odd n, misaligned), cached with several rows per block and per
/// team, one block per row, streaming, narrow partials, a batched weight, float64; dh without a
/// weight too.
fn offset_and_dh_cases() -> Vec<Case> {
    use DataType::{BF16, F16, F32, F64};
    let with = |offset: Option<f32>, dh: bool, case: Case| Case { offset, dh, ..case };
    vec![
        with(Some(1.0), false, Case::new(F32, Weight::Of(BF16), 37, 256)),
        with(Some(-0.5), true, Case::new(BF16, Weight::Of(BF16), 5, 67)),
        with(Some(1.0), true, Case::new(BF16, Weight::Of(BF16), 150, 128)),
        with(Some(1.0), true, Case::new(BF16, Weight::F32, 3, 4096)),
        with(Some(-0.5), true, Case::new(F32, Weight::Of(BF16), 600, 256)),
        with(Some(1.0), true, Case::new(F16, Weight::Same, 2, 40000)),
        with(Some(-0.5), true, Case::new(F32, Weight::Same, 2, 40000)),
        with(Some(1.0), true, Case::new(BF16, Weight::F32, 40, 8192)),
        with(Some(1.0), true, Case::new(F64, Weight::Of(BF16), 9, 512)),
        with(Some(-0.5), false, Case::new(F64, Weight::Same, 2, 20001)),
        with(None, true, Case::new(F16, Weight::None, 9, 512)),
        with(None, true, Case::new(F32, Weight::Same, 37, 256)),
        with(
            Some(1.0),
            true,
            Case {
                groups: 3,
                ..Case::new(BF16, Weight::Of(BF16), 5, 64)
            },
        ),
        with(
            Some(1.0),
            true,
            Case {
                misalign: 2,
                ..Case::new(BF16, Weight::Of(BF16), 9, 512)
            },
        ),
    ]
}

/// The subset the planted bugs are checked against: every kernel family and path once, and a
/// scale offset with dh (bfloat16: dh's rounding is checked to one unit).
fn quick_matrix() -> Vec<Case> {
    vec![
        Case {
            offset: Some(1.0),
            dh: true,
            ..Case::new(DataType::BF16, Weight::Of(DataType::BF16), 37, 256)
        },
        Case::new(DataType::F32, Weight::Same, 37, 256),
        Case::new(DataType::F32, Weight::Same, 600, 256),
        Case::new(DataType::F32, Weight::Same, 3, 4096),
        Case::new(DataType::BF16, Weight::F32, 5, 67),
        Case::new(DataType::F16, Weight::Same, 3, 2048),
        Case::new(DataType::F64, Weight::Same, 9, 512),
        Case::new(DataType::F32, Weight::Same, 2, 40000),
        // Rows split across a cluster, several per cluster: each row's dot-product slots must be
        // this row's (two rows, each with a slot of its own, pass on stale slots of an earlier
        // run; float32's tolerance sees a dot product of the wrong row).
        Case::new(DataType::F32, Weight::Same, 12, 32768),
        Case {
            groups: 3,
            ..Case::new(DataType::BF16, Weight::Same, 5, 64)
        },
        // LayerNorm: cached with a scale offset and dh, streaming, a mean 1e6 times the spread.
        Case {
            offset: Some(1.0),
            dh: true,
            ..Case::layer(DataType::BF16, Weight::Of(DataType::BF16), 37, 256, true)
        },
        Case::layer(DataType::F32, Weight::Same, 2, 40000, true),
        Case {
            mean: 1e6,
            ..Case::layer(DataType::F32, Weight::Same, 9, 1024, true)
        },
    ]
}

fn run_all(fake: &'static Fake, cases: &[Case]) -> Vec<String> {
    cases
        .iter()
        .filter_map(|c| run_case(fake, c).err())
        .collect()
}

#[test]
fn the_matrix_through_the_gpu_bundles_matches_float64_and_the_cpu_bundles() {
    let Some((fake, _guard)) = setup() else {
        return;
    };
    let cases = matrix();
    let start = std::time::Instant::now();
    let launches = fake.counters().launches;
    let clusters = fake.counters().cluster_launches;
    // Modules loaded before (by other tests of this process: the default plan's on each device,
    // and the kernel-variant test's, one per set of defines).
    let (loads, loaded) = (fake.counters().module_loads, resources::modules_loaded());
    let failures = run_all(fake, &cases);
    println!(
        "{} cases, {} launches, {:.1} s",
        cases.len(),
        fake.counters().launches - launches,
        start.elapsed().as_secs_f64()
    );
    assert!(
        failures.is_empty(),
        "{} failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    // One module per device and norm for every state of every call site: the matrix's hundreds
    // of states loaded at most one each on its 2 devices per norm (none if an earlier test had).
    let c = fake.counters();
    assert!(c.module_loads - loads <= 4, "{loads} loads before: {c:?}");
    // The cases of rows split across clusters ran as cluster launches.
    assert!(c.cluster_launches - clusters >= 6, "{c:?}");
    assert!(resources::modules_loaded() - loaded <= 4);
}

// ---------------------------------------------------------------------------------------------
// Accuracy against a float64 truth, in units of the last place
// ---------------------------------------------------------------------------------------------

/// A double-double: `hi + lo` with |lo| <= half an ulp of hi (about 106 bits), so that the
/// truth for float64 results is itself far more accurate than the float64 eps it judges.
#[derive(Debug, Clone, Copy, Default)]
struct Dd {
    hi: f64,
    lo: f64,
}

impl Dd {
    fn of(v: f64) -> Dd {
        Dd { hi: v, lo: 0.0 }
    }
    fn norm(hi: f64, lo: f64) -> Dd {
        let s = hi + lo;
        Dd {
            hi: s,
            lo: lo - (s - hi),
        }
    }
    fn add(self, b: Dd) -> Dd {
        let s = self.hi + b.hi;
        let bb = s - self.hi;
        let e = (self.hi - (s - bb)) + (b.hi - bb);
        Dd::norm(s, e + self.lo + b.lo)
    }
    fn sub(self, b: Dd) -> Dd {
        self.add(Dd {
            hi: -b.hi,
            lo: -b.lo,
        })
    }
    fn mul(self, b: Dd) -> Dd {
        let p = self.hi * b.hi;
        let e = self.hi.mul_add(b.hi, -p);
        Dd::norm(p, e + self.hi * b.lo + self.lo * b.hi)
    }
    fn div(self, b: Dd) -> Dd {
        let q1 = self.hi / b.hi;
        let r = self.sub(b.mul(Dd::of(q1)));
        let q2 = r.hi / b.hi;
        let r = r.sub(b.mul(Dd::of(q2)));
        Dd::norm(q1, q2).add(Dd::of(r.hi / b.hi))
    }
    fn sqrt(self) -> Dd {
        let s = self.hi.sqrt();
        let r = self.sub(Dd::of(s).mul(Dd::of(s)));
        Dd::norm(s, r.hi / (2.0 * s))
    }
}

/// Standard normal values (Box-Muller on the generator of [`values`]).
fn normals(count: usize, seed: u64) -> Vec<f64> {
    let u = values(count + 1, seed);
    (0..count)
        .map(|i| {
            let a = (u[i] + 2.0) / 4.0 + 1.0 / (1u64 << 26) as f64; // (0, 1]
            let b = (u[i + 1] + 2.0) / 4.0;
            (-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()
        })
        .collect()
}

/// y, dx and dweight in double-double from the rounded inputs (one weight row).
fn truth(x: &[f64], w: &[f64], dy: &[f64], n: usize) -> (Vec<Dd>, Vec<Dd>, Vec<Dd>) {
    truth_with(x, w, dy, n, 0.0, None)
}

/// [`truth`] with the weight applied as `offset + w` and `dh` added to dx.
fn truth_with(
    x: &[f64],
    w: &[f64],
    dy: &[f64],
    n: usize,
    offset: f64,
    dh: Option<&[f64]>,
) -> (Vec<Dd>, Vec<Dd>, Vec<Dd>) {
    let rows = x.len() / n;
    let eps = Dd::of(1e-5f32 as f64); // eps travels as a float32 attribute
    let inv_n = Dd::of(1.0).div(Dd::of(n as f64));
    let (mut y, mut dx, mut dw) = (
        Vec::with_capacity(x.len()),
        Vec::with_capacity(x.len()),
        vec![Dd::default(); n],
    );
    for row in 0..rows {
        let xs = &x[row * n..(row + 1) * n];
        let ds = &dy[row * n..(row + 1) * n];
        let ss = xs
            .iter()
            .fold(Dd::default(), |s, &v| s.add(Dd::of(v).mul(Dd::of(v))));
        let r = Dd::of(1.0).div(ss.mul(inv_n).add(eps).sqrt());
        let weight = |j: usize| Dd::of(offset).add(Dd::of(w[j]));
        let dot = (0..n).fold(Dd::default(), |s, j| {
            s.add(Dd::of(ds[j]).mul(weight(j)).mul(Dd::of(xs[j])))
        });
        let c = r.mul(r).mul(r).mul(dot).mul(inv_n);
        for j in 0..n {
            let (xv, wv, gv) = (Dd::of(xs[j]), weight(j), Dd::of(ds[j]));
            y.push(xv.mul(r).mul(wv));
            let added = Dd::of(dh.map_or(0.0, |dh| dh[row * n + j]));
            dx.push(r.mul(gv).mul(wv).sub(xv.mul(c)).add(added));
            dw[j] = dw[j].add(gv.mul(xv).mul(r));
        }
    }
    (y, dx, dw)
}

/// max |got - truth| / max |truth|, in units of `unit` (the dtype's eps).
fn eps_error(got: &[f64], truth: &[Dd], unit: f64) -> f64 {
    let scale = truth.iter().fold(0.0f64, |m, t| m.max(t.hi.abs()));
    let err = got
        .iter()
        .zip(truth)
        .fold(0.0f64, |m, (&g, t)| m.max(((g - t.hi) - t.lo).abs()));
    if scale == 0.0 {
        return err;
    }
    err / scale / unit
}

/// max over elements of |got - rn(truth)| in units of the last place of rn(truth), where rn is
/// the correctly rounded value in `dt` (bfloat16 or float16). With `floor`, a unit is at least
/// `floor` times max |truth|: for results that cancel (dx, and dweight columns whose terms
/// nearly cancel), whose float32 evaluation is only that close to the truth below about 2^-15
/// (bfloat16) or 2^-12 (float16) of the largest.
fn ulp_error(got: &[f64], truth: &[Dd], dt: DataType, floor: f64) -> f64 {
    let (eps, tiny) = match dt {
        DataType::BF16 => (2f64.powi(-7), 2f64.powi(-126)),
        _ => (2f64.powi(-10), 2f64.powi(-14)),
    };
    let floor = floor * truth.iter().fold(0.0f64, |m, t| m.max(t.hi.abs()));
    got.iter()
        .zip(truth)
        .map(|(&g, t)| {
            let rounded = encode(dt, &[t.hi]).1[0];
            let ulp = 2f64.powf(rounded.abs().max(tiny).log2().floor()) * eps;
            (g - rounded).abs() / ulp.max(floor)
        })
        .fold(0.0, f64::max)
}

/// dx of a backward with dh against its float64 value: half precision within one unit of the
/// correctly rounded value (a unit at least 2 float32 eps of the largest, as in
/// [`ulp_error`]: the float32 evaluation's own error where the terms cancel), float32 within 2
/// eps of the largest. Rounding the norm's gradient to x's dtype before adding dh (rounding
/// twice) misses the bound on some elements of any case of a few thousand.
fn check_dx_with_dh(xd: DataType, got: &[f64], want: &[f64]) -> Result<(), String> {
    let truth: Vec<Dd> = want.iter().map(|&v| Dd::of(v)).collect();
    let (error, bound, unit) = match xd {
        DataType::BF16 | DataType::F16 => (
            ulp_error(got, &truth, xd, 2.0 * f32::EPSILON as f64),
            1.0,
            "ulp",
        ),
        DataType::F32 => (eps_error(got, &truth, f32::EPSILON as f64), 2.0, "eps"),
        _ => return Ok(()), // float64: `compare` (a float64 reference is no better than dx)
    };
    // NaN counts as over the bound.
    if error.is_nan() || error > bound {
        return Err(format!(
            "dx with dh: {error:.2} {unit} from the float64 value (bound {bound})"
        ));
    }
    Ok(())
}

/// (x dtype, rows, n): the row lengths the kernels take, from one element to the streaming path
/// at 2^20 (the longest row the matrix runs), and the weight gradient over many rows.
const ACCURACY: &[(DataType, usize, usize)] = &[
    (DataType::F32, 8, 1),
    (DataType::F32, 8, 7),
    (DataType::F32, 8, 255),
    (DataType::F32, 8, 4096),
    (DataType::F32, 4, 65536),
    (DataType::F32, 2, 1 << 20),
    (DataType::F32, 1 << 16, 64),
    (DataType::F64, 8, 4096),
    (DataType::F64, 2, 1 << 18),
    (DataType::F64, 1 << 14, 64),
    (DataType::BF16, 16, 64),
    (DataType::BF16, 16, 4096),
    (DataType::BF16, 4, 65536),
    (DataType::BF16, 1 << 14, 64),
    (DataType::F16, 16, 64),
    (DataType::F16, 16, 4096),
    (DataType::F16, 4, 65536),
];

#[test]
fn accuracy_against_a_float64_truth_is_independent_of_rows_and_row_length() {
    let Some((fake, _guard)) = setup() else {
        return;
    };
    let start = std::time::Instant::now();
    let mut table = vec![format!(
        "{:<6} {:>12} | {:>8} {:>8} {:>8} | {:>6} | unit",
        "dtype", "rows x n", "fwd", "dx", "dw", "s"
    )];
    let mut failures = Vec::new();
    for &(xd, rows, n) in ACCURACY {
        let case = Case::new(xd, Weight::Same, rows, n);
        let count = rows * n;
        let case_start = std::time::Instant::now();
        let w: Vec<f64> = normals(n, 7).iter().map(|v| 1.0 + 0.1 * v).collect();
        let inp = Inputs {
            x: encode(
                xd,
                &normals(count, 5)
                    .iter()
                    .map(|v| v + 0.5)
                    .collect::<Vec<_>>(),
            ),
            dy: encode(xd, &normals(count, 6)),
            w: Some(encode(xd, &w)),
            b: None,
            dh: None,
        };
        let out = run_gpu(fake, &case, &inp, 1).unwrap_or_else(|e| panic!("{case:?}: {e}"));
        let t_gpu = case_start.elapsed().as_secs_f64();
        let (ty, tdx, tdw) = truth(&inp.x.1, &inp.w.as_ref().unwrap().1, &inp.dy.1, n);
        eprintln!(
            "TIMING gpu {t_gpu:.1} truth {:.1}",
            case_start.elapsed().as_secs_f64() - t_gpu
        );
        let dw = decode(xd, &out.dw[0]);
        let (errors, unit, bound) = match xd {
            DataType::F32 | DataType::F64 => {
                let unit = if xd == DataType::F32 {
                    f32::EPSILON as f64
                } else {
                    f64::EPSILON
                };
                let e = [
                    eps_error(&out.y, &ty, unit),
                    eps_error(&out.dx, &tdx, unit),
                    eps_error(&dw, &tdw, unit),
                ];
                (e, "eps", 2.0)
            }
            _ => {
                let f32_floor = 2.0 * f32::EPSILON as f64;
                let e = [
                    ulp_error(&out.y, &ty, xd, 0.0),
                    ulp_error(&out.dx, &tdx, xd, f32_floor),
                    ulp_error(&dw, &tdw, xd, f32_floor),
                ];
                (
                    e,
                    "ulp of the rounded truth (dx, dw: at least 2 f32 eps of the max)",
                    1.0,
                )
            }
        };
        // Rows of one element are left out for dx and dw: dx cancels there (r * g * (1 - x^2
        // r^2) = r * g * eps * r^2), which no evaluation of the formula in the accumulator
        // type gets within 2 eps, and dw is a sum of one term per row (8 here) that nearly
        // cancels: the float32 rstd the forward hands the backward alone puts it past 2 eps of
        // so small a sum (the table shows the value).
        let dx_shown = if n == 1 {
            "-".to_string()
        } else {
            format!("{:.2}", errors[1])
        };
        table.push(format!(
            "{:<6} {:>12} | {:>8.2} {dx_shown:>8} {:>8.2} | {:>6.1} | {unit}",
            xd.name(),
            format!("{rows}x{n}"),
            errors[0],
            errors[2],
            case_start.elapsed().as_secs_f64()
        ));
        let checked = if n == 1 {
            vec![errors[0]]
        } else {
            errors.to_vec()
        };
        // NaN counts as over the bound.
        if checked.iter().any(|&e| e.is_nan() || e > bound) {
            failures.push(format!(
                "{} {rows}x{n}: {errors:?} over {bound} {unit}",
                xd.name()
            ));
        }
    }
    println!("{}", table.join("\n"));
    println!("accuracy sweep: {:.1} s", start.elapsed().as_secs_f64());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// (x dtype, weight dtype, rows, n, scale offset): the fused residual add's backward (dh) over
/// TransformerEngine's smallest odd shape (71x229: the scalar path) and cached rows up to
/// 12288 (its widest), zero-centred weights under Gemma's offset 1 and -0.5, bfloat16 weights
/// with float32 and bfloat16 x.
const DH_ACCURACY: &[(DataType, DataType, usize, usize, f32)] = &[
    (DataType::BF16, DataType::BF16, 71, 229, 1.0),
    (DataType::BF16, DataType::F32, 16, 4096, 0.0),
    (DataType::BF16, DataType::BF16, 4, 12288, -0.5),
    (DataType::F16, DataType::F16, 71, 229, 1.0),
    (DataType::F16, DataType::F32, 16, 4096, -0.5),
    (DataType::F32, DataType::BF16, 71, 229, 1.0),
    (DataType::F32, DataType::F32, 16, 4096, 0.0),
];

/// The backward with dh (the fused residual add's) rounds dx once: within one unit of the
/// correctly rounded double-double value in bfloat16 and float16 (2 float32 eps of the largest
/// in float32), with the scale offset applied inside the kernels; y and dweight as in the
/// accuracy sweep. The table shows what rounding twice, `rn(rn(norm's dx) + dh)`, would give
/// against the same truth, and how far the CPU bundle's dx (one rounding too, by its own
/// formula) is from the GPU's.
#[test]
fn the_fused_residual_backward_rounds_dx_once() {
    let Some((fake, _guard)) = setup() else {
        return;
    };
    let start = std::time::Instant::now();
    let mut table = vec![format!(
        "{:<5} {:<5} {:>9} {:>5} | {:>6} {:>6} {:>6} | {:>6} | {:>8} | unit",
        "x", "w", "rows x n", "off", "y", "dx", "dw", "twice", "cpu-gpu"
    )];
    let mut failures = Vec::new();
    for &(xd, wd, rows, n, offset) in DH_ACCURACY {
        let count = rows * n;
        let case_start = std::time::Instant::now();
        let case = Case {
            offset: (offset != 0.0).then_some(offset),
            dh: true,
            ..Case::new(xd, Weight::Of(wd), rows, n)
        };
        let centre = if offset != 0.0 { 0.0 } else { 1.0 };
        let w: Vec<f64> = normals(n, 7).iter().map(|v| centre + 0.1 * v).collect();
        let x: Vec<f64> = normals(count, 5).iter().map(|v| v + 0.5).collect();
        let inp = Inputs {
            x: encode(xd, &x),
            dy: encode(xd, &normals(count, 6)),
            w: Some(encode(wd, &w)),
            b: None,
            dh: Some(encode(xd, &normals(count, 8))),
        };
        let out = run_gpu(fake, &case, &inp, 1).unwrap_or_else(|e| panic!("{case:?}: {e}"));
        let dh = &inp.dh.as_ref().unwrap().1;
        let w = &inp.w.as_ref().unwrap().1;
        let t_gpu = case_start.elapsed().as_secs_f64();
        let (ty, tdx, tdw) = truth_with(&inp.x.1, w, &inp.dy.1, n, offset as f64, Some(dh));
        let t_truth = case_start.elapsed().as_secs_f64() - t_gpu;
        let dw = decode(wd, &out.dw[0]);
        let cpu = cpu_results(
            &case,
            &inp.x.0,
            Some(&inp.w.as_ref().unwrap().0),
            None,
            &inp.dy.0,
            Some(&inp.dh.as_ref().unwrap().0),
        )
        .unwrap_or_else(|e| panic!("{case:?}: {e}"));
        eprintln!(
            "TIMING dh gpu {t_gpu:.1} truth {t_truth:.1} cpu {:.1}",
            case_start.elapsed().as_secs_f64() - t_gpu - t_truth
        );
        // (error, bound) in the result's unit: ulp of the correctly rounded truth for half
        // precision (at least 2 float32 eps of the largest where the terms cancel, as in the
        // accuracy sweep), float32 eps of the largest for float32.
        let floor = 2.0 * f32::EPSILON as f64;
        let judge = |got: &[f64], truth: &[Dd], dt: DataType, floor: f64| match dt {
            DataType::F32 => (eps_error(got, truth, f32::EPSILON as f64), 2.0),
            _ => (ulp_error(got, truth, dt, floor), 1.0),
        };
        let errors = [
            judge(&out.y, &ty, xd, 0.0),
            judge(&out.dx, &tdx, xd, floor),
            judge(&dw, &tdw, wd, floor),
        ];
        // Rounded twice: the norm's dx rounded to x's dtype, plus dh, rounded again (the same
        // as once in float32, whose sum is rounded once either way).
        let norm: Vec<f64> = (tdx.iter().zip(dh))
            .map(|(t, &h)| encode(xd, &[t.sub(Dd::of(h)).hi]).1[0])
            .collect();
        let sums: Vec<f64> = norm.iter().zip(dh).map(|(a, b)| a + b).collect();
        let twice = judge(&encode(xd, &sums).1, &tdx, xd, floor).0;
        let cpu_dx: Vec<Dd> = cpu.1.iter().map(|&v| Dd::of(v)).collect();
        let apart = judge(&out.dx, &cpu_dx, xd, floor).0;
        let unit = if xd == DataType::F32 {
            "eps of the largest"
        } else {
            "ulp of the rounded truth"
        };
        table.push(format!(
            "{:<5} {:<5} {:>9} {:>5} | {:>6.2} {:>6.2} {:>6.2} | {:>6.2} | {:>8.2} | {unit}",
            xd.name(),
            wd.name(),
            format!("{rows}x{n}"),
            offset,
            errors[0].0,
            errors[1].0,
            errors[2].0,
            twice,
            apart
        ));
        // NaN counts as over the bound.
        if errors.iter().any(|&(e, bound)| e.is_nan() || e > bound) {
            failures.push(format!(
                "{} w {} {rows}x{n} offset {offset}: (error, bound) of y, dx, dw {errors:?}",
                xd.name(),
                wd.name()
            ));
        }
        // The inputs tell one rounding from two: rounding twice misses the bound somewhere.
        let tells_apart = twice > errors[1].1; // false for NaN
        if xd == DataType::BF16 && !tells_apart {
            failures.push(format!(
                "{} {rows}x{n}: rounding twice stays within one ulp ({twice:.2}): the check \
                 cannot tell",
                xd.name()
            ));
        }
    }
    println!("{}", table.join("\n"));
    println!("dh sweep: {:.1} s", start.elapsed().as_secs_f64());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---------------------------------------------------------------------------------------------
// The emulator bites: planted bugs
// ---------------------------------------------------------------------------------------------

struct PlantedBug {
    name: String,
    why: String,
    find: String,
    replace: String,
}

/// Parses src/handlers/gpu/rmsnorm.bugs (format in its header).
fn planted_bugs() -> Vec<PlantedBug> {
    let text = include_str!("../src/handlers/gpu/rmsnorm.bugs");
    let mut bugs = Vec::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let Some(name) = line.strip_prefix("=== ").filter(|n| *n != "end") else {
            continue;
        };
        let mut bug = PlantedBug {
            name: name.trim().to_string(),
            why: String::new(),
            find: String::new(),
            replace: String::new(),
        };
        let mut section = "";
        for line in lines.by_ref() {
            match line {
                "=== end" => break,
                "--- find" => section = "find",
                "--- replace" => section = "replace",
                _ if section.is_empty() => {
                    if let Some(why) = line.strip_prefix("why: ") {
                        bug.why = why.to_string();
                    }
                }
                _ => {
                    let target = if section == "find" {
                        &mut bug.find
                    } else {
                        &mut bug.replace
                    };
                    target.push_str(line);
                    target.push('\n');
                }
            }
        }
        assert!(
            !bug.find.is_empty() && !bug.why.is_empty(),
            "planted bug `{}` lacks find or why",
            bug.name
        );
        bugs.push(bug);
    }
    bugs
}

/// rmsnorm.cu's `EMU_PAIRS` for the kernels `cases` launch: a STAMP line per (x, weight) pair,
/// a FINALIZE_ENTRY line per (accumulator, weight) pair.
fn stamped_pairs(cases: &[Case]) -> String {
    let ctype = |d: DataType| match d {
        DataType::F32 => ("f32", "float"),
        DataType::F64 => ("f64", "double"),
        DataType::BF16 => ("bf16", "bf16_t"),
        DataType::F16 => ("f16", "f16_t"),
        other => panic!("{other} is not a dtype of the contract"),
    };
    let mut lines: Vec<String> = Vec::new();
    for case in cases {
        let (x, w) = (ctype(case.x), ctype(case.wd().unwrap_or(case.x)));
        let a = ctype(acc_dtype(case.x));
        for line in [
            format!("STAMP({}, {}, {}, {})", x.0, x.1, w.0, w.1),
            format!("FINALIZE_ENTRY({}, {}, {}, {})", a.0, a.1, w.0, w.1),
        ] {
            if !lines.contains(&line) {
                lines.push(line);
            }
        }
    }
    lines.join(" ")
}

/// Plan overrides (`RMSNORM_FFI_GPU_PLAN`, src/handlers/gpu/variant.rs) the emulated matrix
/// runs: a different team per row (fwd_vpt, and bounds that cap it: other reduction orders,
/// folds between cached vectors) and launch-only knobs (a persistent grid whose blocks loop
/// over rows, smaller blocks), each with its defines compiled by NVRTC and the emulator alike.
const VARIANTS: [&str; 3] = [
    "fwd_vpt=8,persistent=1",
    "fwd_block=64,fwd_bounds=128:8,fwd_weight_early=1,persistent=3",
    "fwd_block=1024,persistent=2",
];

/// The forward's team for a case under `variant` (its reduction order: the same team, the same
/// sums in the same order).
fn forward_team(case: &Case, variant: &gpu::variant::Variant) -> u32 {
    let vectorized = gpu::plan::can_vectorize(case.x, case.n, &[case.misalign as u64]);
    let rows = case.groups * case.rows;
    gpu::plan::forward_launch(case.x, case.n, rows, vectorized, variant, 4).team
}

/// The quick matrix under `variant` with the emulated `library`: failures, and how many cases
/// kept the default's team and gave its y and rstd bit for bit (`default`: the default plan's
/// outputs).
fn run_variant(
    fake: &'static Fake,
    text: &str,
    library: &Path,
    cases: &[Case],
    default: &[Outputs],
) -> (Vec<String>, usize) {
    use gpu::variant::{Variant, ENV};
    let variant = Variant::parse(text).unwrap();
    fake.use_kernels(library).unwrap();
    std::env::set_var(ENV, text);
    let mut failures = Vec::new();
    // The state says which plan it took (stats()'s details).
    {
        let ctx = gpu_context(fake, &cases[0]);
        fake::instantiate(&ctx, &gpu::FORWARD_BUNDLE, fwd_attrs(&cases[0])).unwrap();
        let plan = xla_ffi_bundles::state::snapshot()
            .states
            .iter()
            .rev()
            .find(|s| s.target == gpu::FORWARD_TARGET)
            .and_then(|s| s.details.get("plan").cloned());
        if plan.as_deref() != Some(variant.to_string().as_str()) {
            failures.push(format!("{text}: the state's plan detail is {plan:?}"));
        }
    }
    let mut same_bits = 0;
    for (i, (case, want)) in cases.iter().zip(default).enumerate() {
        let out = match run_case(fake, case) {
            Ok(out) => out,
            Err(e) => {
                failures.push(format!("{text}: case {i}: {e}"));
                continue;
            }
        };
        if forward_team(case, &variant) == forward_team(case, &Variant::default()) {
            if out.y != want.y || out.rstd != want.rstd {
                failures.push(format!(
                    "{text}: case {i} {case:?}: the default's team, other bits"
                ));
            }
            same_bits += 1;
        }
    }
    std::env::remove_var(ENV);
    (failures, same_bits)
}

#[test]
fn kernel_variants_pass_the_matrix_with_the_default_bits_where_the_team_is_the_same() {
    use gpu::variant::Variant;
    let Some((fake, _guard)) = setup() else {
        return;
    };
    let start = std::time::Instant::now();
    // The RMS norm's cases: each variant of LayerNorm's kernels would be one more NVRTC module
    // (about 50 s each on 2 cores); `make gpu-sanitize` runs LayerNorm's forward with a
    // variant's defines (FWD_VPT 8, the weight read early) against float64 instead.
    let quick: Vec<Case> = quick_matrix().into_iter().filter(|c| !c.layer).collect();
    const RMS_ONLY: &str = "#define KERNEL_NORMS 1\n";
    let default: Vec<Outputs> = quick
        .iter()
        .map(|c| run_case(fake, c).unwrap_or_else(|e| panic!("default plan: {e}")))
        .collect();
    // The emulated kernels of the variants with defines, and a planted fault in the first
    // one's (the fold between cached vectors drops its partial), built in parallel.
    let dir = std::env::temp_dir().join(format!("rmsnorm_ffi_variants_{}", std::process::id()));
    let pairs = stamped_pairs(&quick);
    let fold = "            ss.s[0].add(part);\n            part = A(0);\n          }";
    let mut sources: Vec<(usize, String)> = Vec::new();
    for (i, text) in VARIANTS.iter().enumerate() {
        let v = Variant::parse(text).unwrap();
        if !v.defines().is_empty() {
            sources.push((i, v.defines() + RMS_ONLY + kernels::SOURCE));
        }
        // The product's module for the variant (NVRTC), loaded while the full emulated build is
        // in use (every kernel's name resolved): the subset builds have only what the cases run.
        resources::module_for(0, &v, contract::Norm::Rms).unwrap();
    }
    let planted = Variant::parse(VARIANTS[0]).unwrap().defines() + RMS_ONLY + kernels::SOURCE;
    assert_eq!(planted.matches(fold).count(), 1, "the fold's text changed");
    sources.push((
        VARIANTS.len(),
        planted.replacen(fold, "            part = A(0);\n          }", 1),
    ));
    let libraries: Vec<(usize, PathBuf)> = std::thread::scope(|s| {
        let handles: Vec<_> = sources
            .iter()
            .map(|(i, src)| {
                let (dir, pairs) = (&dir, pairs.as_str());
                s.spawn(move || {
                    let lib = emu::build_kernels_from(src, Some(pairs), &dir.join(i.to_string()))
                        .unwrap_or_else(|e| panic!("{e}"));
                    (*i, lib)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let library = |i: usize| {
        libraries
            .iter()
            .find(|(j, _)| *j == i)
            .map_or_else(emu::emulated_kernels, |(_, l)| l.clone())
    };
    let mut failures = Vec::new();
    for (i, text) in VARIANTS.iter().enumerate() {
        let (f, same) = run_variant(fake, text, &library(i), &quick, &default);
        println!(
            "{text}: {} cases, {same} with the default's team and bits",
            quick.len()
        );
        failures.extend(f);
    }
    // The planted fold: the product's module of the first variant, the planted kernels.
    let (planted_failures, _) = run_variant(
        fake,
        VARIANTS[0],
        &library(VARIANTS.len()),
        &quick,
        &default,
    );
    fake.use_kernels(&emu::emulated_kernels()).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    if let Some(first) = planted_failures.first() {
        println!(
            "caught the planted fold: {}",
            first.chars().take(300).collect::<String>()
        );
    }
    println!("variants: {:.1} s", start.elapsed().as_secs_f64());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(
        !planted_failures.is_empty(),
        "a fold that drops its partial passed the variant's matrix"
    );
}

#[test]
fn planted_bugs_make_the_matrix_fail() {
    let Some((fake, _guard)) = setup() else {
        return;
    };
    let bugs = planted_bugs();
    assert!(bugs.len() >= 9, "{} planted bugs", bugs.len());
    // Every pattern must still match the kernels exactly once: fail loudly rather than skip.
    for bug in &bugs {
        let n = kernels::SOURCE.matches(bug.find.as_str()).count();
        assert_eq!(
            n, 1,
            "planted bug `{}`: its `find` text occurs {n} times in rmsnorm.cu (must be once); \
             the kernels changed: update src/handlers/gpu/rmsnorm.bugs to plant the same bug",
            bug.name
        );
    }
    let start = std::time::Instant::now();
    let dir = std::env::temp_dir().join(format!("rmsnorm_ffi_planted_{}", std::process::id()));
    // Build every variant (and a control from the unchanged source) two at a time. A bug in
    // LayerNorm's code (named `layer-...`) is built with LayerNorm's kernels alone and runs its
    // cases, any other with the RMS norm's (rmsnorm.cu's KERNEL_NORMS): half the kernels to
    // compile per build, and shared code is caught on the RMS norm's cases. The control has
    // both and runs every case.
    let norms = |name: &str| match name {
        "control" => 3,
        n if n.starts_with("layer-") => 2,
        _ => 1,
    };
    let mut sources: Vec<(String, String)> = vec![("control".into(), kernels::SOURCE.into())];
    for bug in &bugs {
        sources.push((
            bug.name.clone(),
            kernels::SOURCE.replacen(&bug.find, &bug.replace, 1),
        ));
    }
    for (name, src) in &mut sources {
        *src = format!("#define KERNEL_NORMS {}\n{src}", norms(name));
    }
    // Two builder threads compile the variants while this thread runs each one as soon as it is
    // built (the builds and the runs share the two cores). Each build stamps only the pairs the
    // subset runs (the control too, so a kernel missing from them fails the control).
    let next = std::sync::atomic::AtomicUsize::new(0);
    let (sender, built) = std::sync::mpsc::channel::<(usize, PathBuf)>();
    let quick = quick_matrix();
    let pairs = stamped_pairs(&quick);
    // The module (every kernel's name resolved) loaded while the full build is in use: the
    // variants have only the subset's kernels, which is all the subset launches.
    for case in &quick {
        let norm = if case.layer {
            contract::Norm::Layer
        } else {
            contract::Norm::Rms
        };
        resources::module_for(case.device, &gpu::variant::Variant::default(), norm).unwrap();
    }
    let mut report = Vec::new();
    let mut missed = Vec::new();
    std::thread::scope(|s| {
        for _ in 0..2 {
            let (sender, next, sources, dir, pairs) =
                (sender.clone(), &next, &sources, &dir, pairs.as_str());
            s.spawn(move || loop {
                let index = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some((name, src)) = sources.get(index) else {
                    break;
                };
                let library = emu::build_kernels_from(src, Some(pairs), &dir.join(name))
                    .unwrap_or_else(|e| panic!("{e}"));
                if sender.send((index, library)).is_err() {
                    break;
                }
            });
        }
        drop(sender);
        for (index, library) in built.iter() {
            let name = &sources[index].0;
            fake.use_kernels(&library).unwrap();
            // A planted bug needs one failing case of its norm: the rest is not run.
            let failures: Vec<String> = if name == "control" {
                run_all(fake, &quick)
            } else {
                let layer = norms(name) == 2;
                quick
                    .iter()
                    .enumerate()
                    .filter(|(_, c)| c.layer == layer)
                    .find_map(|(i, c)| run_case(fake, c).err().map(|e| format!("case {i}: {e}")))
                    .into_iter()
                    .collect()
            };
            if name == "control" {
                assert!(
                    failures.is_empty(),
                    "the unchanged source fails:\n{}",
                    failures.join("\n")
                );
                continue;
            }
            match failures.first() {
                Some(first) => report.push(format!(
                    "caught {name}: {}{}",
                    first
                        .lines()
                        .next()
                        .unwrap_or("")
                        .chars()
                        .take(300)
                        .collect::<String>(),
                    if first.contains("cuLaunchKernel") {
                        format!(" (the emulator: {})", fake.last_error())
                    } else {
                        String::new()
                    }
                )),
                None => missed.push(name.clone()),
            }
        }
    });
    fake.use_kernels(&emu::emulated_kernels()).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    println!("{}", report.join("\n"));
    println!(
        "{} planted bugs against {} cases: {:.1} s",
        bugs.len(),
        quick.len(),
        start.elapsed().as_secs_f64()
    );
    assert!(
        missed.is_empty(),
        "planted bugs the matrix did not catch: {missed:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// The fake's checks, the glue's contracts
// ---------------------------------------------------------------------------------------------

#[test]
fn the_host_half_conversions_match_the_half_crate_bit_for_bit() {
    let conv = emu::HalfConversions::load();
    for bits in 0..=u16::MAX {
        let want = f16::from_bits(bits).to_f32();
        assert_eq!(
            conv.to_f32(bits).to_bits(),
            want.to_bits(),
            "f16 {bits:#06x}"
        );
    }
    let check = |f: f32| {
        let want = f16::from_f32(f).to_bits();
        assert_eq!(conv.from_f32(f), want, "f32 {:#010x} ({f:e})", f.to_bits());
    };
    // Every half, the midpoints to its neighbour and one float either side (ties to even,
    // subnormals, overflow), and a stride through all float bit patterns.
    for bits in 0..=u16::MAX {
        let a = f16::from_bits(bits).to_f32();
        let b = f16::from_bits(bits.wrapping_add(1)).to_f32();
        check(a);
        if a.is_finite() && b.is_finite() && (a < 0.0) == (b < 0.0) {
            let mid = ((a as f64 + b as f64) / 2.0) as f32;
            for m in [mid.to_bits() - 1, mid.to_bits(), mid.to_bits() + 1] {
                check(f32::from_bits(m));
            }
        }
    }
    for bits in (0..=u32::MAX).step_by(4099) {
        check(f32::from_bits(bits));
    }
}

#[test]
fn launches_outside_the_limits_or_the_parameter_table_are_refused() {
    let Some((fake, _guard)) = setup() else {
        return;
    };
    let module =
        resources::module_for(0, &gpu::variant::Variant::default(), contract::Norm::Rms).unwrap();
    let stream = xla_ffi_bundles::ffi::Stream::from_raw(fake.stream(0) as *mut std::ffi::c_void);
    let fwd = kernels::kernel_index(
        contract::Norm::Rms,
        kernels::Direction::Forward,
        DataType::F32,
        None,
        false,
    )
    .unwrap();
    let fin = kernels::finalize_index(contract::Norm::Rms, DataType::F32, DataType::F32).unwrap();
    let config = |grid, block, shared_bytes| gpu::driver::LaunchConfig {
        grid,
        block,
        shared_bytes,
        cluster: 1,
    };
    // The builder: names and types in the table's order, all of them.
    let err = module
        .launch(fin, config(1, (32, 8), 0))
        .unwrap()
        .ptr("partial", 0)
        .i64("blocks", 0)
        .enqueue(stream)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`blocks: I64` but the kernel's parameter is `blocks: I32`"),
        "{err}"
    );
    let err = module
        .launch(fin, config(1, (32, 8), 0))
        .unwrap()
        .ptr("partial", 0)
        .enqueue(stream)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("1 of the kernel's 5 parameters given (next: `blocks`)"),
        "{err}"
    );
    // The fake driver: sm_90's limits and the 48 KB default of dynamic shared memory.
    let y = fake.buffer(4 * 1024, 0);
    let r = fake.buffer(4, 0);
    let launch = |c: gpu::driver::LaunchConfig| {
        module
            .launch(fwd, c)
            .unwrap()
            .ptr("x", y.addr() as u64)
            .ptr("w", 0)
            .ptr("y", y.addr() as u64)
            .ptr("rstd", r.addr() as u64)
            .i64("rows", 1)
            .i32("n", 1)
            .i32("team", 32)
            .f32("eps", 1e-5)
            .f32("offset", -0.0)
            .i64("rows_per_group", 1)
            .enqueue(stream)
    };
    launch(config(1, (256, 1), 0)).unwrap();
    for (c, why) in [
        (config(1, (256, 1), 48 * 1024 + 1), "over the 48 KB default"),
        (config(1, (2048, 1), 0), "exceeds sm_90's limits"),
        (config(0, (256, 1), 0), "a zero dimension"),
    ] {
        let err = launch(c).unwrap_err().to_string();
        assert!(err.contains("cuLaunchKernel failed"), "{err}");
        assert!(fake.last_error().contains(why), "{}", fake.last_error());
    }
    // Threads over a kernel's launch bounds: the backward takes 512.
    let bwd = kernels::kernel_index(
        contract::Norm::Rms,
        kernels::Direction::Backward,
        DataType::F32,
        None,
        false,
    )
    .unwrap();
    let err = module
        .launch(bwd, config(1, (1024, 1), 0))
        .unwrap()
        .ptr("x", 0)
        .ptr("w", 0)
        .ptr("rstd", 0)
        .ptr("dy", 0)
        .ptr("dh", 0)
        .ptr("dx", 0)
        .ptr("partial", 0)
        .ptr("dots", 0)
        .i32("n", 1)
        .i32("team", 32)
        .f32("offset", -0.0)
        .i64("chunk", 1)
        .i64("rows_per_group", 1)
        .i64("blocks_per_group", 1)
        .enqueue(stream)
        .unwrap_err()
        .to_string();
    assert!(err.contains("CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"), "{err}");
    assert!(
        fake.last_error().contains("__launch_bounds__(512)"),
        "{}",
        fake.last_error()
    );
}

#[test]
fn an_out_of_bounds_write_fails_the_launch() {
    let Some((fake, _guard)) = setup() else {
        return;
    };
    let module =
        resources::module_for(0, &gpu::variant::Variant::default(), contract::Norm::Rms).unwrap();
    let stream = xla_ffi_bundles::ffi::Stream::from_raw(fake.stream(0) as *mut std::ffi::c_void);
    let fwd = kernels::kernel_index(
        contract::Norm::Rms,
        kernels::Direction::Forward,
        DataType::F32,
        None,
        false,
    )
    .unwrap();
    // Two rows of 64 into a y of one row: the second row lands in the guard zone.
    let mut x = fake.buffer(2 * 64 * 4, 0);
    x.write(&vec![0x3f; 2 * 64 * 4]);
    let y = fake.buffer(64 * 4, 0);
    let r = fake.buffer(2 * 4, 0);
    let err = module
        .launch(
            fwd,
            gpu::driver::LaunchConfig {
                grid: 1,
                block: (256, 1),
                shared_bytes: 0,
                cluster: 1,
            },
        )
        .unwrap()
        .ptr("x", x.addr() as u64)
        .ptr("w", 0)
        .ptr("y", y.addr() as u64)
        .ptr("rstd", r.addr() as u64)
        .i64("rows", 2)
        .i32("n", 64)
        .i32("team", 32)
        .f32("eps", 1e-5)
        .f32("offset", -0.0)
        .i64("rows_per_group", 2)
        .enqueue(stream)
        .unwrap_err()
        .to_string();
    assert!(err.contains("CUDA_ERROR_ILLEGAL_ADDRESS"), "{err}");
    assert!(
        fake.last_error()
            .contains("write past the end of a 256-byte buffer"),
        "{}",
        fake.last_error()
    );
    // Freeing the buffer reports the overwritten guard too.
    let freed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(y)));
    assert!(freed.is_err());
}

#[test]
fn concurrent_first_calls_share_one_module_and_allocate_the_scratch_once() {
    let Some((fake, _guard)) = setup() else {
        return;
    };
    // Many call sites: the module is loaded once per device, never per state.
    for n in [64, 96, 128] {
        run_case(fake, &Case::new(DataType::F32, Weight::Same, 2, n)).unwrap();
    }
    let c = fake.counters();
    assert!(c.module_loads <= 2, "{c:?}");
    assert_eq!(c.module_loads as usize, resources::modules_loaded());
    // One backward state; four threads make its first call at once, without initialize.
    let case = Case {
        initialize: false,
        ..Case::new(DataType::BF16, Weight::Same, 33, 512)
    };
    let (xdims, wdims) = (case.x_dims(), case.w_dims());
    let (xb, _) = encode(DataType::BF16, &values(33 * 512, 5));
    let mut inputs: Vec<emu::DeviceBuffer> = [33 * 512 * 2, 512 * 2, 33 * 4, 33 * 512 * 2]
        .iter()
        .map(|&n| fake.buffer(n, 0))
        .collect();
    inputs[0].write(&xb);
    inputs[1].write(&vec![0x80; 512 * 2]);
    inputs[2].write(&1.0f32.to_ne_bytes().repeat(33));
    inputs[3].write(&xb);
    let outputs: Vec<(emu::DeviceBuffer, emu::DeviceBuffer)> = (0..4)
        .map(|_| (fake.buffer(33 * 512 * 2, 0), fake.buffer(512 * 2, 0)))
        .collect();
    let ctx = gpu_context(fake, &case);
    fake::instantiate(&ctx, &gpu::BACKWARD_BUNDLE, bwd_attrs(&case)).unwrap();
    let before = fake.counters();
    std::thread::scope(|s| {
        for (dx, dw) in &outputs {
            let (ctx, inputs, xdims, wdims) = (&ctx, &inputs, &xdims, &wdims);
            s.spawn(move || {
                let frame = FrameBuilder::new(Stage::Execute)
                    .device_arg(DataType::BF16, xdims, inputs[0].addr())
                    .device_arg(DataType::BF16, wdims, inputs[1].addr())
                    .device_arg(DataType::F32, &xdims[..1], inputs[2].addr())
                    .device_arg(DataType::BF16, xdims, inputs[3].addr())
                    .device_ret(DataType::BF16, xdims, dx.addr())
                    .device_ret(DataType::BF16, wdims, dw.addr());
                call(ctx, &gpu::BACKWARD_BUNDLE, Stage::Execute, frame).unwrap();
            });
        }
    });
    let after = fake.counters();
    assert_eq!(
        after.driver_allocations,
        before.driver_allocations + 1,
        "one scratch"
    );
    assert_eq!(after.module_loads, before.module_loads);
    let first = outputs[0].1.read();
    assert!(first.iter().any(|&b| b != 0xff), "dweight written");
    for (dx, dw) in &outputs {
        assert_eq!(
            dw.read(),
            first,
            "dweight equal across the concurrent calls"
        );
        assert_eq!(dx.read(), outputs[0].0.read());
    }
    drop(ctx);
    assert_eq!(
        fake.counters().driver_bytes,
        before.driver_bytes,
        "scratch freed"
    );
}

#[test]
fn execute_under_capture_without_initialize_fails_clearly_and_leaves_the_capture_intact() {
    let Some((fake, _guard)) = setup() else {
        return;
    };
    let case = Case::new(DataType::F32, Weight::Same, 4, 256);
    let (xdims, wdims) = (case.x_dims(), case.w_dims());
    let x = fake.buffer(4 * 256 * 4, 0);
    let w = fake.buffer(256 * 4, 0);
    let y = fake.buffer(4 * 256 * 4, 0);
    let r = fake.buffer(4 * 4, 0);
    let frame = |stage| {
        FrameBuilder::new(stage)
            .device_arg(DataType::F32, &xdims, x.addr())
            .device_arg(DataType::F32, &wdims, w.addr())
            .device_ret(DataType::F32, &xdims, y.addr())
            .device_ret(DataType::F32, &xdims[..1], r.addr())
    };
    let ctx = gpu_context(fake, &case);
    let stream = ctx.stream.unwrap();
    fake::instantiate(&ctx, &gpu::FORWARD_BUNDLE, fwd_attrs(&case)).unwrap();
    fake.set_capture(stream, 1);
    let err = call(
        &ctx,
        &gpu::FORWARD_BUNDLE,
        Stage::Execute,
        frame(Stage::Execute),
    )
    .unwrap_err();
    assert!(err.contains("FailedPrecondition"), "{err}");
    assert!(err.contains("being captured into a CUDA graph"), "{err}");
    assert!(err.contains("did not run the initialize stage"), "{err}");
    // Nothing was attempted that would have invalidated the capture: it still records.
    let before = fake.counters().launches;
    // What XLA does: initialize before it records, then execute inside the capture.
    fake.set_capture(stream, 0);
    call(
        &ctx,
        &gpu::FORWARD_BUNDLE,
        Stage::Initialize,
        frame(Stage::Initialize),
    )
    .unwrap();
    fake.set_capture(stream, 1);
    call(
        &ctx,
        &gpu::FORWARD_BUNDLE,
        Stage::Execute,
        frame(Stage::Execute),
    )
    .unwrap();
    assert_eq!(fake.counters().launches, before + 1);
    fake.set_capture(stream, 0);
}

#[test]
fn devices_are_keyed_by_the_stream_not_by_xla_s_ordinal() {
    let Some((fake, _guard)) = setup() else {
        return;
    };
    // XLA's ordinal says 0, the stream is device 1's: the state's resources are device 1's.
    let case = Case {
        device: 1,
        ..Case::new(DataType::F32, Weight::Same, 3, 128)
    };
    run_case(fake, &case).unwrap();
    let mut ctx = gpu_context(fake, &case);
    ctx.device_ordinal = 0;
    fake::instantiate(&ctx, &gpu::BACKWARD_BUNDLE, bwd_attrs(&case)).unwrap();
    let dims = case.x_dims();
    let b: Vec<emu::DeviceBuffer> = [3 * 128, 128, 3, 3 * 128, 3 * 128, 128]
        .iter()
        .map(|n| fake.buffer(n * 4, 0))
        .collect();
    let frame = FrameBuilder::new(Stage::Initialize)
        .device_arg(DataType::F32, &dims, b[0].addr())
        .device_arg(DataType::F32, &[128], b[1].addr())
        .device_arg(DataType::F32, &[3], b[2].addr())
        .device_arg(DataType::F32, &dims, b[3].addr())
        .device_ret(DataType::F32, &dims, b[4].addr())
        .device_ret(DataType::F32, &[128], b[5].addr());
    call(&ctx, &gpu::BACKWARD_BUNDLE, Stage::Initialize, frame).unwrap();
    let details = xla_ffi_bundles::state::snapshot()
        .states
        .into_iter()
        .rev()
        .find(|s| s.target == gpu::BACKWARD_TARGET)
        .unwrap()
        .details;
    assert!(details.contains_key("cuda device 1"), "{details:?}");
    assert!(!details.contains_key("cuda device 0"), "{details:?}");
    // 3 rows of 128 on 4 fake SMs: a team of 32 per row, 16 teams per block: one block.
    assert_eq!(
        details["cuda device 1"],
        format!("resources loaded in initialize, {} scratch bytes", 128 * 8)
    );
}

#[test]
fn the_cuda_backward_refuses_to_take_rstd_from_x() {
    // The CPU backward may take rstd itself (an `eps` attribute, no rstd operand); the CUDA
    // kernels read it, and the Python lowering passes it there. A call site that asks anyway
    // is refused when instantiated, naming the attribute.
    let Some((fake, _guard)) = setup() else {
        return;
    };
    let case = Case::new(DataType::F32, Weight::Same, 4, 256);
    let ctx = gpu_context(fake, &case);
    let mut attrs = bwd_attrs(&case);
    attrs.push(("eps", OwnedAttr::scalar(1e-5f32)));
    let err = fake::instantiate(&ctx, &gpu::BACKWARD_BUNDLE, attrs)
        .err()
        .expect("refused")
        .1;
    assert!(
        err.contains("attribute `eps`") && err.contains("CPU only"),
        "{err}"
    );
}
