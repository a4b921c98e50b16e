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
use rmsnorm_ffi::ffi::fake::{self, FakeContext, FrameBuilder, OwnedAttr, OwnedBuffer};
use rmsnorm_ffi::ffi::{BundleDef, DataType, Stage};
use rmsnorm_ffi::handlers::gpu::{self, kernels, resources};
use rmsnorm_ffi::handlers::{cpu, operands::acc_dtype};
use rmsnorm_ffi_cuda_emulator::{self as emu, Fake};

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
            cpu::FORWARD_BUNDLE,
            cpu::BACKWARD_BUNDLE,
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

/// float64 reference: y, rstd, dx, dw (per group).
struct Reference {
    y: Vec<f64>,
    rstd: Vec<f64>,
    dx: Vec<f64>,
    dw: Vec<f64>,
}

fn reference(x: &[f64], w: Option<&[f64]>, dy: &[f64], groups: usize, n: usize) -> Reference {
    let rows = x.len().checked_div(n).unwrap_or(0);
    let per_group = rows.checked_div(groups.max(1)).unwrap_or(0);
    let eps = 1e-5f32 as f64; // eps travels as a float32 attribute
    let mut r = Reference {
        y: vec![0.0; x.len()],
        rstd: vec![0.0; rows],
        dx: vec![0.0; x.len()],
        dw: vec![0.0; groups * n],
    };
    for row in 0..rows {
        let g = row.checked_div(per_group).unwrap_or(0);
        let xs = &x[row * n..(row + 1) * n];
        let wj = |j: usize| w.map_or(1.0, |w| w[g * n + j]);
        let rs = 1.0 / (xs.iter().map(|v| v * v).sum::<f64>() / n as f64 + eps).sqrt();
        r.rstd[row] = rs;
        let dot: f64 = (0..n).map(|j| dy[row * n + j] * wj(j) * xs[j]).sum();
        for j in 0..n {
            r.y[row * n + j] = xs[j] * rs * wj(j);
            r.dx[row * n + j] = rs * dy[row * n + j] * wj(j) - xs[j] * rs.powi(3) * dot / n as f64;
            r.dw[g * n + j] += dy[row * n + j] * xs[j] * rs;
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
        if !((g - w).abs() <= tol * (w.abs() + scale)) {
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
        }
    }
    fn wd(&self) -> Option<DataType> {
        match self.w {
            Weight::None => None,
            Weight::Same => Some(self.x),
            Weight::F32 => Some(DataType::F32),
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

fn fwd_attrs(case: &Case) -> Vec<(&'static str, OwnedAttr)> {
    vec![
        ("eps", OwnedAttr::scalar(1e-5f32)),
        ("has_weight", OwnedAttr::pred(case.wd().is_some())),
        ("row_len", OwnedAttr::scalar(case.n as i64)),
    ]
}

fn bwd_attrs(case: &Case) -> Vec<(&'static str, OwnedAttr)> {
    vec![
        ("has_weight", OwnedAttr::pred(case.wd().is_some())),
        ("row_len", OwnedAttr::scalar(case.n as i64)),
    ]
}

/// Runs one case: GPU forward and backward (twice) against float64 and against the CPU bundles;
/// dweight bitwise equal run to run; every allocation of the state freed by its deleter.
fn run_case(fake: &'static Fake, case: &Case) -> Result<(), String> {
    let tag = format!("{case:?}");
    let in_context = |e: String| format!("{tag}: {e}");
    let (groups, n) = (case.groups, case.n);
    let rows = groups * case.rows;
    let count = rows * n;
    let xd = case.x;
    let ad = acc_dtype(xd);
    let (x_bytes, x) = encode(xd, &values(count, 1 + n as u64));
    let (dy_bytes, dy) = encode(xd, &values(count, 2 + rows as u64));
    let w = case.wd().map(|wd| {
        let v: Vec<f64> = values(groups * n, 3)
            .iter()
            .map(|v| 1.0 + v / 4.0)
            .collect();
        encode(wd, &v)
    });
    let r = reference(&x, w.as_ref().map(|w| w.1.as_slice()), &dy, groups, n);
    let (xdims, wdims) = (case.x_dims(), case.w_dims());
    let rdims = &xdims[..xdims.len() - 1];
    let tol = tolerance(xd, n);
    let before = fake.counters();

    // ---- forward
    let xb = device(fake, case, x_bytes.len(), Some(&x_bytes));
    let wb = w
        .as_ref()
        .map(|(b, _)| device(fake, case, b.len(), Some(b)));
    let yb = device(fake, case, count * size_of(xd), None);
    let rb = device(fake, case, rows * size_of(ad), None);
    let fwd_frame = |stage: Stage| {
        let mut f = FrameBuilder::new(stage).device_arg(xd, &xdims, xb.addr());
        if let (Some(wb), Some(wd)) = (&wb, case.wd()) {
            f = f.device_arg(wd, &wdims, wb.addr());
        }
        f.device_ret(xd, &xdims, yb.addr())
            .device_ret(ad, rdims, rb.addr())
    };
    let (gy, grstd) = {
        let ctx = gpu_context(fake, case);
        fake::instantiate(&ctx, &gpu::FORWARD_BUNDLE, fwd_attrs(case))
            .map_err(|(c, m)| in_context(format!("instantiate: {c:?}: {m}")))?;
        if case.initialize {
            let frame = fwd_frame(Stage::Initialize);
            call(&ctx, &gpu::FORWARD_BUNDLE, Stage::Initialize, frame).map_err(in_context)?;
        }
        let frame = fwd_frame(Stage::Execute);
        call(&ctx, &gpu::FORWARD_BUNDLE, Stage::Execute, frame).map_err(in_context)?;
        (decode(xd, &yb.read()), decode(ad, &rb.read()))
    };
    if rows > 0 {
        compare("y vs float64", &gy, &r.y, tol).map_err(in_context)?;
        compare("rstd vs float64", &grstd, &r.rstd, tol).map_err(in_context)?;
    }

    // ---- the CPU bundles on the same inputs
    let cpu = cpu_results(
        case,
        &x_bytes,
        w.as_ref().map(|w| w.0.as_slice()),
        &dy_bytes,
    )
    .map_err(in_context)?;
    if rows > 0 {
        compare("y vs the CPU bundle", &gy, &cpu.0, 2.0 * tol).map_err(in_context)?;
    }

    // ---- backward, twice
    let dyb = device(fake, case, dy_bytes.len(), Some(&dy_bytes));
    let dxb = device(fake, case, count * size_of(xd), None);
    let dw_bytes = w.as_ref().map_or(0, |(b, _)| b.len());
    let dwb: Vec<emu::DeviceBuffer> = (0..2)
        .filter(|_| case.wd().is_some())
        .map(|_| device(fake, case, dw_bytes, None))
        .collect();
    {
        let ctx = gpu_context(fake, case);
        fake::instantiate(&ctx, &gpu::BACKWARD_BUNDLE, bwd_attrs(case))
            .map_err(|(c, m)| in_context(format!("instantiate: {c:?}: {m}")))?;
        let frame = |stage: Stage, run: usize| {
            let mut f = FrameBuilder::new(stage).device_arg(xd, &xdims, xb.addr());
            if let (Some(wb), Some(wd)) = (&wb, case.wd()) {
                f = f.device_arg(wd, &wdims, wb.addr());
            }
            f = f
                .device_arg(ad, rdims, rb.addr())
                .device_arg(xd, &xdims, dyb.addr())
                .device_ret(xd, &xdims, dxb.addr());
            if let Some(wd) = case.wd() {
                f = f.device_ret(wd, &wdims, dwb[run].addr());
            }
            f
        };
        if case.initialize {
            call(
                &ctx,
                &gpu::BACKWARD_BUNDLE,
                Stage::Initialize,
                frame(Stage::Initialize, 0),
            )
            .map_err(in_context)?;
        }
        for run in 0..2 {
            call(
                &ctx,
                &gpu::BACKWARD_BUNDLE,
                Stage::Execute,
                frame(Stage::Execute, run),
            )
            .map_err(in_context)?;
        }
        let want = if case.initialize {
            "initialize"
        } else {
            "execute"
        };
        let detail = rmsnorm_ffi::state::snapshot()
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
            return Err(in_context(format!(
                "stats detail `{detail}`, want loaded in {want}"
            )));
        }
    }
    let gdx = decode(xd, &dxb.read());
    if rows > 0 {
        compare("dx vs float64", &gdx, &r.dx, 4.0 * tol).map_err(in_context)?;
        compare("dx vs the CPU bundle", &gdx, &cpu.1, 8.0 * tol).map_err(in_context)?;
    }
    if let Some(wd) = case.wd() {
        let a = dwb[0].read();
        let b = dwb[1].read();
        if a != b {
            return Err(in_context("dweight differs between two runs".into()));
        }
        let gdw = decode(wd, &a);
        let wtol = tol.max(tolerance(wd, n)) * 4.0 * ((case.rows as f64) + 1.0).sqrt();
        compare("dw vs float64", &gdw, &r.dw, wtol).map_err(in_context)?;
        compare("dw vs the CPU bundle", &gdw, &cpu.2, 2.0 * wtol).map_err(in_context)?;
    }
    drop((xb, wb, yb, rb, dyb, dxb, dwb));
    let after = fake.counters();
    if after.driver_bytes != before.driver_bytes || after.outstanding != before.outstanding {
        return Err(in_context(format!(
            "the states' deleters left device memory behind: {before:?} -> {after:?}"
        )));
    }
    if after.guard_failures != before.guard_failures {
        return Err(in_context(format!(
            "guard zones overwritten: {}",
            fake.last_error()
        )));
    }
    Ok(())
}

/// The CPU bundles' y, dx, dw on host copies of the same inputs (rstd from the CPU forward).
fn cpu_results(
    case: &Case,
    x: &[u8],
    w: Option<&[u8]>,
    dy: &[u8],
) -> Result<(Vec<f64>, Vec<f64>, Vec<f64>), String> {
    let xd = case.x;
    let ad = acc_dtype(xd);
    let (xdims, wdims) = (case.x_dims(), case.w_dims());
    let rdims = &xdims[..xdims.len() - 1];
    let host = |dt: DataType, dims: &[i64], bytes: &[u8]| {
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
    };
    let bytes_of = |b: &OwnedBuffer| -> Vec<u8> {
        b.data
            .iter()
            .flat_map(|w| w.to_ne_bytes())
            .take(b.bytes)
            .collect()
    };
    let ctx = FakeContext::new();
    fake::instantiate(&ctx, &cpu::FORWARD_BUNDLE, fwd_attrs(case)).map_err(|e| e.1)?;
    let mut f = FrameBuilder::new(Stage::Execute).arg(host(xd, &xdims, x));
    if let (Some(w), Some(wd)) = (w, case.wd()) {
        f = f.arg(host(wd, &wdims, w));
    }
    let mut f = f
        .ret(OwnedBuffer::zeros(xd, &xdims))
        .ret(OwnedBuffer::zeros(ad, rdims))
        .build(&ctx);
    f.call(cpu::FORWARD_BUNDLE.handler(Stage::Execute).unwrap())
        .map_err(|e| format!("CPU forward: {}", e.1))?;
    let y = decode(xd, &bytes_of(f.result(0)));
    let rstd = bytes_of(f.result(1));
    let ctx = FakeContext::new();
    fake::instantiate(&ctx, &cpu::BACKWARD_BUNDLE, bwd_attrs(case)).map_err(|e| e.1)?;
    let mut b = FrameBuilder::new(Stage::Execute).arg(host(xd, &xdims, x));
    if let (Some(w), Some(wd)) = (w, case.wd()) {
        b = b.arg(host(wd, &wdims, w));
    }
    b = b
        .arg(host(ad, rdims, &rstd))
        .arg(host(xd, &xdims, dy))
        .ret(OwnedBuffer::zeros(xd, &xdims));
    if let Some(wd) = case.wd() {
        b = b.ret(OwnedBuffer::zeros(wd, &wdims));
    }
    let mut b = b.build(&ctx);
    b.call(cpu::BACKWARD_BUNDLE.handler(Stage::Execute).unwrap())
        .map_err(|e| format!("CPU backward: {}", e.1))?;
    let dx = decode(xd, &bytes_of(b.result(0)));
    let dw = case
        .wd()
        .map_or_else(Vec::new, |wd| decode(wd, &bytes_of(b.result(1))));
    Ok((y, dx, dw))
}

// ---------------------------------------------------------------------------------------------
// The matrix
// ---------------------------------------------------------------------------------------------

const PAIRS: [(DataType, Weight); 11] = [
    (DataType::F32, Weight::None),
    (DataType::F32, Weight::Same),
    (DataType::F64, Weight::None),
    (DataType::F64, Weight::Same),
    (DataType::F64, Weight::F32),
    (DataType::BF16, Weight::None),
    (DataType::BF16, Weight::Same),
    (DataType::BF16, Weight::F32),
    (DataType::F16, Weight::None),
    (DataType::F16, Weight::Same),
    (DataType::F16, Weight::F32),
];

/// Every (x, weight) pair over: n = 1, odd n (scalar path), zero rows, several rows per block,
/// one block per row, a batched weight; then the streaming path (rows up to 2^20), misaligned
/// buffers (scalar path on even n), a stream on the second device, and XLA skipping initialize.
fn matrix() -> Vec<Case> {
    let mut cases = Vec::new();
    for (x, w) in PAIRS {
        for (rows, n) in [(3, 1), (5, 67), (0, 128), (37, 256), (3, 4096)] {
            cases.push(Case::new(x, w, rows, n));
        }
        cases.push(Case {
            groups: 3,
            ..Case::new(x, w, 5, 64)
        });
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
    cases
}

/// The subset the planted bugs are checked against: every kernel family and path once.
fn quick_matrix() -> Vec<Case> {
    vec![
        Case::new(DataType::F32, Weight::Same, 37, 256),
        Case::new(DataType::F32, Weight::Same, 3, 4096),
        Case::new(DataType::BF16, Weight::F32, 5, 67),
        Case::new(DataType::F16, Weight::Same, 3, 2048),
        Case::new(DataType::F64, Weight::Same, 9, 512),
        Case::new(DataType::F32, Weight::Same, 2, 40000),
        Case {
            groups: 3,
            ..Case::new(DataType::BF16, Weight::Same, 5, 64)
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
    // One module per device for every state of every call site.
    let c = fake.counters();
    assert_eq!(c.module_loads, 2, "{c:?}");
    assert_eq!(resources::modules_loaded(), 2);
}
