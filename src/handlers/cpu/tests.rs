//! Tests of the CPU RMS norm: each instruction set against the scalar path, and the bundles
//! through the fake runtime against a float64 reference.

use half::{bf16, f16};

use super::simd::Kernel;
use super::widen::{load_slice, store_slice};
use super::*;
use crate::handlers::math;
use xla_ffi_bundles::ffi::fake::{self, FakeContext, FrameBuilder, OwnedAttr, OwnedBuffer};
use xla_ffi_bundles::ffi::{DataType, NativeType, Stage};

/// Deterministic pseudo-random values in [-2, 2).
fn values(count: usize, seed: u64) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..count)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        })
        .collect()
}

fn bits<T: Element>(v: &[T]) -> Vec<u64> {
    v.iter().map(|x| x.to_f64().to_bits()).collect()
}

/// [`bits`] with every NaN alike: where a row's rstd is 0 or NaN (an overflowing or NaN row),
/// `inf * 0` makes NaNs whose sign depends on operand order, which the loops do not fix.
fn nan_bits<T: Element>(v: &[T]) -> Vec<u64> {
    v.iter()
        .map(|e| match e.to_f64() {
            f if f.is_nan() => u64::MAX,
            f => f.to_bits(),
        })
        .collect()
}

fn kernel_results<T: Element, W: Element, A: Accum>(
    kernel: Kernel,
    n: usize,
) -> (Vec<u64>, Vec<u64>, Vec<u64>) {
    let x: Vec<T> = values(n, 1).into_iter().map(T::from_f32).collect();
    let w: Vec<W> = values(n, 2)
        .into_iter()
        .map(|v| W::from_f32(v + 2.5))
        .collect();
    let dy: Vec<T> = values(n, 3).into_iter().map(T::from_f32).collect();
    let mut y = vec![T::default(); n];
    let mut dx = vec![T::default(); n];
    let mut acc = vec![A::Wide::default(); n];
    kernel.run(|| {
        let r = math::forward_row::<T, W, A>(&x, Some(&w), A::from_f32(1e-5), &mut y);
        math::backward_row::<T, W, A>(
            &x,
            Some(&w),
            math::Rstd::Given(&[r]),
            &dy,
            &mut dx,
            Some(&mut acc),
        );
    });
    (
        bits(&y),
        bits(&dx),
        acc.iter().map(|a| a.value().to_bits()).collect(),
    )
}

#[test]
fn every_instruction_set_matches_the_scalar_path_bit_for_bit() {
    let kernels = Kernel::available();
    assert!(!kernels.is_empty());
    for n in [1usize, 7, 16, 17, 128, 4097] {
        for kernel in &kernels {
            assert_eq!(
                kernel_results::<f32, f32, f32>(*kernel, n),
                kernel_results::<f32, f32, f32>(Kernel::Scalar, n),
                "{kernel:?} f32 n={n}"
            );
            assert_eq!(
                kernel_results::<bf16, bf16, f32>(*kernel, n),
                kernel_results::<bf16, bf16, f32>(Kernel::Scalar, n),
                "{kernel:?} bf16 n={n}"
            );
            assert_eq!(
                kernel_results::<f16, f32, f32>(*kernel, n),
                kernel_results::<f16, f32, f32>(Kernel::Scalar, n),
                "{kernel:?} f16 n={n}"
            );
            assert_eq!(
                kernel_results::<f16, f16, f32>(*kernel, n),
                kernel_results::<f16, f16, f32>(Kernel::Scalar, n),
                "{kernel:?} f16 f16 n={n}"
            );
            assert_eq!(
                kernel_results::<bf16, f16, f32>(*kernel, n),
                kernel_results::<bf16, f16, f32>(Kernel::Scalar, n),
                "{kernel:?} bf16 f16 n={n}"
            );
            assert_eq!(
                kernel_results::<f64, f64, f64>(*kernel, n),
                kernel_results::<f64, f64, f64>(Kernel::Scalar, n),
                "{kernel:?} f64 n={n}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Bundles through the fake runtime
// ---------------------------------------------------------------------------------------------

fn register() {
    fake::register_bundle_types(&[FORWARD_BUNDLE, BACKWARD_BUNDLE]);
}

fn instantiate(
    ctx: &FakeContext,
    def: &BundleDef,
    attrs: Vec<(&str, OwnedAttr)>,
) -> Result<(), String> {
    fake::instantiate(ctx, def, attrs).map_err(|e| e.1)
}

/// float64 reference: (y, rstd, dx, dw).
fn reference(
    x: &[f64],
    w: &[f64],
    dy: &[f64],
    n: usize,
    eps: f64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let rows = x.len().checked_div(n).unwrap_or(0);
    let (mut y, mut rstd, mut dx, mut dw) = (
        vec![0.0; x.len()],
        vec![0.0; rows],
        vec![0.0; x.len()],
        vec![0.0; n],
    );
    for r in 0..rows {
        let xs = &x[r * n..(r + 1) * n];
        let ms = xs.iter().map(|v| v * v).sum::<f64>() / n as f64;
        let rs = 1.0 / (ms + eps).sqrt();
        rstd[r] = rs;
        let c = (0..n)
            .map(|j| dy[r * n + j] * w[j] * xs[j] * rs)
            .sum::<f64>()
            / n as f64;
        for j in 0..n {
            let xhat = xs[j] * rs;
            y[r * n + j] = xhat * w[j];
            dx[r * n + j] = rs * (dy[r * n + j] * w[j] - xhat * c);
            dw[j] += dy[r * n + j] * xhat;
        }
    }
    (y, rstd, dx, dw)
}

fn close(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: got {g}, want {w}"
        );
    }
}

fn as_f64<T: Element>(b: &OwnedBuffer) -> Vec<f64> {
    b.values::<T>().into_iter().map(|v| v.to_f64()).collect()
}

/// Runs forward then backward with a `W` weight through the fake runtime; returns (y, rstd,
/// dx, dw).
fn run_both<T: Element + NativeType, W: Element + NativeType>(
    ctx: &FakeContext,
    dims: &[i64],
    seed: u64,
) -> [Vec<f64>; 4] {
    let n = *dims.last().unwrap() as usize;
    let count: usize = dims.iter().product::<i64>() as usize;
    let lead = &dims[..dims.len() - 1];
    let acc = DtypePair::of(T::DTYPE, Some(W::DTYPE))
        .expect("a pair of the contract")
        .accumulation();
    let x: Vec<T> = values(count, seed).into_iter().map(T::from_f32).collect();
    let w: Vec<W> = values(n, seed + 1)
        .into_iter()
        .map(|v| W::from_f32(v + 2.5))
        .collect();
    let dy: Vec<T> = values(count, seed + 2)
        .into_iter()
        .map(T::from_f32)
        .collect();
    let attrs = |fwd: bool| {
        let mut a = vec![
            ("has_weight", OwnedAttr::pred(true)),
            ("row_len", OwnedAttr::scalar(n as i64)),
        ];
        if fwd {
            a.push(("eps", OwnedAttr::scalar(1e-5f32)));
        }
        a
    };
    let fwd_ctx = FakeContext::with_threads(ctx.num_threads);
    instantiate(&fwd_ctx, &FORWARD_BUNDLE, attrs(true)).unwrap();
    let mut f = FrameBuilder::new(Stage::Execute)
        .arg(OwnedBuffer::from_values(dims, &x))
        .arg(OwnedBuffer::from_values(&[n as i64], &w))
        .ret(OwnedBuffer::zeros(T::DTYPE, dims))
        .ret(OwnedBuffer::zeros(acc, lead))
        .build(&fwd_ctx);
    f.call(FORWARD_BUNDLE.handler(Stage::Execute).unwrap())
        .unwrap();
    let y = as_f64::<T>(f.result(0));
    let rstd_buf = f.result(1).clone();
    instantiate(ctx, &BACKWARD_BUNDLE, attrs(false)).unwrap();
    let mut b = FrameBuilder::new(Stage::Execute)
        .arg(OwnedBuffer::from_values(dims, &x))
        .arg(OwnedBuffer::from_values(&[n as i64], &w))
        .arg(rstd_buf.clone())
        .arg(OwnedBuffer::from_values(dims, &dy))
        .ret(OwnedBuffer::zeros(T::DTYPE, dims))
        .ret(OwnedBuffer::zeros(W::DTYPE, &[n as i64]))
        .build(ctx);
    b.call(BACKWARD_BUNDLE.handler(Stage::Execute).unwrap())
        .unwrap();
    // The backward that takes rstd itself from x and eps (no rstd operand): the same bits.
    let bwd_ctx = FakeContext::with_threads(ctx.num_threads);
    let mut from_x = attrs(false);
    from_x.push(("eps", OwnedAttr::scalar(1e-5f32)));
    instantiate(&bwd_ctx, &BACKWARD_BUNDLE, from_x).unwrap();
    let mut c = FrameBuilder::new(Stage::Execute)
        .arg(OwnedBuffer::from_values(dims, &x))
        .arg(OwnedBuffer::from_values(&[n as i64], &w))
        .arg(OwnedBuffer::from_values(dims, &dy))
        .ret(OwnedBuffer::zeros(T::DTYPE, dims))
        .ret(OwnedBuffer::zeros(W::DTYPE, &[n as i64]))
        .build(&bwd_ctx);
    c.call(BACKWARD_BUNDLE.handler(Stage::Execute).unwrap())
        .unwrap();
    for k in 0..2 {
        assert_eq!(
            bits(&as_f64::<T>(c.result(k))),
            bits(&as_f64::<T>(b.result(k))),
            "result {k} of the backward taking rstd from x, {dims:?}"
        );
    }
    let rstd = if acc == DataType::F64 {
        as_f64::<f64>(&rstd_buf)
    } else {
        as_f64::<f32>(&rstd_buf)
    };
    [y, rstd, as_f64::<T>(b.result(0)), as_f64::<W>(b.result(1))]
}

/// Relative tolerance of results of dtype `d` against the float64 reference.
fn tolerance(d: DataType) -> f64 {
    match d {
        DataType::F64 => 1e-12,
        DataType::F32 => 2e-5,
        DataType::F16 => 4e-3,
        _ => 2e-2,
    }
}

fn check_against_reference<T: Element + NativeType, W: Element + NativeType>(dims: &[i64]) {
    let tol = tolerance(T::DTYPE);
    register();
    let ctx = FakeContext::with_threads(3);
    let [y, rstd, dx, dw] = run_both::<T, W>(&ctx, dims, 7);
    let n = *dims.last().unwrap() as usize;
    let count: usize = dims.iter().product::<i64>() as usize;
    let x: Vec<f64> = values(count, 7)
        .into_iter()
        .map(|v| T::from_f32(v).to_f64())
        .collect();
    let w: Vec<f64> = values(n, 8)
        .into_iter()
        .map(|v| W::from_f32(v + 2.5).to_f64())
        .collect();
    let dy: Vec<f64> = values(count, 9)
        .into_iter()
        .map(|v| T::from_f32(v).to_f64())
        .collect();
    let (ry, rr, rdx, rdw) = reference(&x, &w, &dy, n, 1e-5);
    close(&y, &ry, tol, "y");
    close(&rstd, &rr, tol, "rstd");
    close(&dx, &rdx, tol, "dx");
    // dweight is stored in the weight's dtype, and sums a contribution per row.
    let tol_w = tol.max(tolerance(W::DTYPE));
    close(&dw, &rdw, tol_w * (count / n.max(1)).max(1) as f64, "dw");
}

#[test]
fn every_pair_of_the_contract_matches_a_float64_reference() {
    for dims in [&[3, 5][..], &[300, 64], &[2, 3, 129], &[1], &[4, 1]] {
        for pair in DtypePair::ALL {
            with_pair_types!(pair, |T, W, _K, _A| check_against_reference::<T, W>(dims));
        }
    }
}

#[test]
fn pairs_outside_the_contract_are_refused_naming_what_is_accepted() {
    register();
    let floats = [DataType::F32, DataType::F64, DataType::BF16, DataType::F16];
    let mut refused = 0;
    let others = [DataType::S32, DataType::U8];
    for x in floats.into_iter().chain(others) {
        for w in floats.into_iter().chain(others) {
            if DtypePair::of(x, Some(w)).is_some() {
                continue;
            }
            let ctx = FakeContext::new();
            let attrs = vec![
                ("eps", OwnedAttr::scalar(1e-5f32)),
                ("has_weight", OwnedAttr::pred(true)),
                ("row_len", OwnedAttr::scalar(4i64)),
            ];
            instantiate(&ctx, &FORWARD_BUNDLE, attrs).unwrap();
            let acc = crate::handlers::contract::accumulation(x).unwrap_or(DataType::F32);
            let mut f = FrameBuilder::new(Stage::Execute)
                .arg(OwnedBuffer::zeros(x, &[2, 4]))
                .arg(OwnedBuffer::zeros(w, &[4]))
                .ret(OwnedBuffer::zeros(x, &[2, 4]))
                .ret(OwnedBuffer::zeros(acc, &[2]))
                .build(&ctx);
            let (_, message) = f
                .call(FORWARD_BUNDLE.handler(Stage::Execute).unwrap())
                .unwrap_err();
            let expected = if crate::handlers::contract::accumulation(x).is_some() {
                let accepted = crate::handlers::contract::weight_dtypes(x);
                let names: Vec<&str> = accepted.iter().map(|d| d.name()).collect();
                let expected = match names.as_slice() {
                    [one] => one.to_string(),
                    many => format!("one of {}", many.join(", ")),
                };
                format!("wrong dtype for argument 1: expected {expected}, got {w}")
            } else {
                format!("wrong dtype for argument 0: expected one of F32, F64, BF16, F16, got {x}")
            };
            assert!(message.contains(&expected), "{x} with {w}: {message}");
            refused += 1;
        }
    }
    // Every float pair is in the contract: refused are the 2 unlisted x dtypes with any of the
    // 6 weights, and float x with either unlisted weight.
    assert_eq!(refused, 2 * 6 + 4 * 2);
}

#[test]
fn long_rows_reduce_in_many_column_blocks() {
    // Rows longer than MAX_CHUNKS * REDUCE_BLOCK columns: reduction blocks hold several
    // REDUCE_BLOCK-wide pieces.
    for n in [65_537i64, 131_072] {
        check_against_reference::<f32, f32>(&[9, n]);
    }
}

#[test]
fn weight_gradient_is_bitwise_identical_whatever_the_thread_count() {
    register();
    let dims = [2048, 512];
    // Several chunks, so that each thread count splits the rows among its threads differently
    // (one chunk would make the comparison trivial).
    let chunks = super::plan::Plan::backward(2048, 512, partial_rows(512)).count();
    assert!(chunks >= 4, "{chunks} chunks");
    let runs: Vec<Vec<u64>> = [1, 2, 4, 7]
        .iter()
        .map(|&threads| {
            let ctx = FakeContext::with_threads(threads);
            let [_, _, dx, dw] = run_both::<f32, f32>(&ctx, &dims, 11);
            dx.iter().chain(&dw).map(|v| v.to_bits()).collect()
        })
        .collect();
    assert!(runs.windows(2).all(|w| w[0] == w[1]));
}

#[test]
fn attributes_are_validated_at_instantiation() {
    register();
    let ctx = FakeContext::new();
    let bad_eps = |eps: f32| {
        instantiate(
            &ctx,
            &FORWARD_BUNDLE,
            vec![
                ("eps", OwnedAttr::scalar(eps)),
                ("has_weight", OwnedAttr::pred(false)),
                ("row_len", OwnedAttr::scalar(4i64)),
            ],
        )
        .unwrap_err()
    };
    assert!(bad_eps(-1.0).contains("invalid attribute `eps`: must be finite and >= 0, got -1"));
    assert!(bad_eps(f32::NAN).contains("got NaN"));
    assert!(bad_eps(f32::INFINITY).contains("got inf"));
    let err = instantiate(
        &ctx,
        &BACKWARD_BUNDLE,
        vec![
            ("has_weight", OwnedAttr::pred(true)),
            ("row_len", OwnedAttr::scalar(-3i64)),
        ],
    )
    .unwrap_err();
    assert!(err.contains("invalid attribute `row_len`"), "{err}");
    // The backward that takes rstd itself checks its eps as the forward does.
    let err = instantiate(
        &ctx,
        &BACKWARD_BUNDLE,
        vec![
            ("eps", OwnedAttr::scalar(-1.0f32)),
            ("has_weight", OwnedAttr::pred(true)),
            ("row_len", OwnedAttr::scalar(4i64)),
        ],
    )
    .unwrap_err();
    assert!(
        err.contains("invalid attribute `eps`: must be finite and >= 0"),
        "{err}"
    );
}

#[test]
fn a_backward_taking_rstd_from_x_refuses_an_rstd_operand() {
    register();
    let ctx = FakeContext::new();
    instantiate(
        &ctx,
        &BACKWARD_BUNDLE,
        vec![
            ("eps", OwnedAttr::scalar(1e-5f32)),
            ("has_weight", OwnedAttr::pred(false)),
            ("row_len", OwnedAttr::scalar(4i64)),
        ],
    )
    .unwrap();
    let x = OwnedBuffer::from_values(&[2, 4], &[1.0f32; 8]);
    let e = FrameBuilder::new(Stage::Execute)
        .arg(x.clone())
        .arg(OwnedBuffer::zeros(DataType::F32, &[2]))
        .arg(x.clone())
        .ret(OwnedBuffer::zeros(DataType::F32, &[2, 4]))
        .build(&ctx)
        .call(BACKWARD_BUNDLE.handler(Stage::Execute).unwrap())
        .unwrap_err()
        .1;
    assert!(
        e.contains("wrong number of arguments: expected 2, got 3"),
        "{e}"
    );
}

#[test]
fn execute_checks_buffers_against_the_attributes() {
    register();
    let ctx = FakeContext::new();
    instantiate(
        &ctx,
        &FORWARD_BUNDLE,
        vec![
            ("eps", OwnedAttr::scalar(1e-5f32)),
            ("has_weight", OwnedAttr::pred(true)),
            ("row_len", OwnedAttr::scalar(4i64)),
        ],
    )
    .unwrap();
    let call = |x: OwnedBuffer, w: OwnedBuffer, rstd: OwnedBuffer| {
        let dims = x.dims.clone();
        let dtype = xla_ffi_bundles::ffi::DataType::from_raw(x.dtype);
        FrameBuilder::new(Stage::Execute)
            .arg(x)
            .arg(w)
            .ret(OwnedBuffer::zeros(dtype, &dims))
            .ret(rstd)
            .build(&ctx)
            .call(FORWARD_BUNDLE.handler(Stage::Execute).unwrap())
            .unwrap_err()
            .1
    };
    let x = OwnedBuffer::from_values(&[2, 4], &[1.0f32; 8]);
    let w = OwnedBuffer::from_values(&[4], &[1.0f32; 4]);
    let rstd = OwnedBuffer::zeros(DataType::F32, &[2]);
    let e = call(
        OwnedBuffer::from_values(&[2, 3], &[1.0f32; 6]),
        w.clone(),
        rstd.clone(),
    );
    assert!(
        e.contains("last axis has 3 elements but the call site was instantiated for row_len=4"),
        "{e}"
    );
    let e = call(
        x.clone(),
        OwnedBuffer::zeros(DataType::S32, &[4]),
        rstd.clone(),
    );
    assert!(
        e.contains("wrong dtype for argument 1: expected one of F32, F64, BF16, F16, got S32"),
        "{e}"
    );
    let e = call(
        x.clone(),
        OwnedBuffer::from_values(&[2, 2], &[1.0f32; 4]),
        rstd.clone(),
    );
    assert!(e.contains("wrong shape for argument 1"), "{e}");
    let e = call(
        x.clone(),
        w.clone(),
        OwnedBuffer::zeros(DataType::F64, &[2]),
    );
    assert!(
        e.contains("wrong dtype for result 1: expected F32, got F64"),
        "{e}"
    );
    let e = call(OwnedBuffer::from_values(&[2, 4], &[1i32; 8]), w, rstd);
    assert!(
        e.contains("wrong dtype for argument 0: expected one of F32, F64, BF16, F16, got S32"),
        "{e}"
    );
}

/// Row data for the multi-row loop tests: x, dy, weight, rstd.
fn row_data<T: Element, W: Element>(n: usize, rows: usize) -> (Vec<T>, Vec<T>, Vec<W>, Vec<f32>) {
    let x = values(n * rows, 5).into_iter().map(T::from_f32).collect();
    let dy = values(n * rows, 9).into_iter().map(T::from_f32).collect();
    let w = values(n, 6)
        .into_iter()
        .map(|v| W::from_f32(v + 2.5))
        .collect();
    let rstd = values(rows, 3).into_iter().map(|v| v.abs() + 0.5).collect();
    (x, dy, w, rstd)
}

#[test]
fn multi_row_loops_match_row_by_row_bit_for_bit() {
    fn check<T: Element, W: Element>(n: usize, rows: usize) {
        let (x, dy, w, rstd) = row_data::<T, W>(n, rows);
        for kernel in Kernel::available() {
            // Forward: pipelined against row by row, with and without a weight.
            for weighted in [true, false] {
                let w_of = |_: usize| weighted.then_some(&w[..]);
                let (mut y1, mut y2) = (vec![T::default(); n * rows], vec![T::default(); n * rows]);
                let (mut r1, mut r2) = (vec![0f32; rows], vec![0f32; rows]);
                kernel.run(|| {
                    for (r, (y, rs)) in y1.chunks_exact_mut(n.max(1)).zip(r1.iter_mut()).enumerate()
                    {
                        let span = r * n..(r + 1) * n;
                        *rs = math::forward_row::<T, W, f32>(&x[span], w_of(r), 1e-5, &mut y[..n]);
                    }
                    math::forward_rows::<T, W, f32>(&x, n, w_of, 1e-5, &mut y2, &mut r2);
                });
                if n == 0 {
                    r1.fill(f32::NAN);
                }
                assert_eq!(bits(&y1), bits(&y2), "forward {kernel:?} n={n} rows={rows}");
                assert_eq!(bits(&r1), bits(&r2), "forward {kernel:?} n={n} rows={rows}");
            }
            // Backward with a weight: two rows per loop against row by row, rstd given (any
            // values) and taken from x (whose bits are those of the forward's rstd given).
            let mut forward_rstd = vec![0f32; rows];
            let mut y = vec![T::default(); n * rows];
            kernel.run(|| {
                math::forward_rows::<T, W, f32>(&x, n, |_| None, 1e-5, &mut y, &mut forward_rstd)
            });
            let run = |rstd: math::Rstd<'_, f32>| {
                let (mut dx1, mut dx2) =
                    (vec![T::default(); n * rows], vec![T::default(); n * rows]);
                let (mut a1, mut a2) = (vec![0f64; n], vec![0f64; n]);
                let mut dx3 = vec![T::default(); n * rows];
                kernel.run(|| {
                    let all = |_| Some(&w[..]);
                    math::backward_rows::<T, W, f32>(
                        &x,
                        &dy,
                        n,
                        all,
                        rstd,
                        &mut dx1,
                        Some(&mut a1),
                    );
                    math::backward_rows_paired::<T, W, f32>(
                        &x, &dy, n, &w, rstd, &mut dx2, &mut a2,
                    );
                    math::backward_rows::<T, W, f32>(&x, &dy, n, |_| None, rstd, &mut dx3, None);
                });
                let what = format!("backward {kernel:?} n={n} rows={rows} {rstd:?}");
                assert_eq!(bits(&dx1), bits(&dx2), "{what}");
                assert_eq!(bits(&a1), bits(&a2), "{what}");
                (bits(&dx1), bits(&a1), bits(&dx3))
            };
            run(math::Rstd::Given(&rstd));
            assert_eq!(
                run(math::Rstd::FromX(1e-5)),
                run(math::Rstd::Given(&forward_rstd)),
                "rstd from x, {kernel:?} n={n} rows={rows}"
            );
        }
    }
    for (n, rows) in [
        (1, 1),
        (7, 3),
        (16, 2),
        (33, 5),
        (4097, 3),
        (0, 4),
        (5, 4),
        (40, 6),
        (17, 7),
    ] {
        check::<bf16, bf16>(n, rows);
        check::<f16, f32>(n, rows);
        check::<f32, f32>(n, rows);
    }
}

#[test]
fn chunk_forward_matches_row_by_row_on_every_instruction_set() {
    // `forward_chunk` takes the explicit AVX-512 loops where they apply (groups of 4 rows, each
    // scaled while the next group is summed, the weight loaded once for the group), and the
    // portable loops elsewhere: every path gives row by row's bits. The cases cover groups of
    // 4, 2 and 1 (chained, a chunk's last rows, and rows too long for 4 in a group: 16400 and
    // 140000), groups whose rows share a weight row and groups that straddle two (a batched
    // weight), a last block of an odd number of 16-lane chunks, columns past the last 32 (16 of
    // them, and a scalar tail).
    fn check<T: CpuElement, W: Element, A: Accum + CpuElement>(
        n: usize,
        rows: usize,
        groups: usize,
    ) {
        let mut xs = values(n * rows, 11);
        // Non-finite and overflowing values, in the first tile and the last.
        for (at, v) in [(3, f32::NAN), (n + 5, f32::INFINITY), (2 * n + 1, 3e38)] {
            if let Some(slot) = xs.get_mut(at) {
                *slot = v;
            }
        }
        if let Some(last) = xs.last_mut() {
            *last = -1e-30;
        }
        let x: Vec<T> = xs.into_iter().map(T::from_f32).collect();
        let w: Vec<W> = values(n * groups, 12)
            .into_iter()
            .map(|v| W::from_f32(v + 2.5))
            .collect();
        let per_group = rows.div_ceil(groups);
        let eps = <A as Accum>::from_f32(1e-5);
        for weighted in [true, false] {
            let w_of = |i: usize| weighted.then(|| &w[(i / per_group) * n..][..n]);
            let (mut want_y, mut want_r) = (vec![T::default(); n * rows], vec![A::ZERO; rows]);
            Kernel::Scalar.run(|| {
                for (i, (y, r)) in want_y.chunks_exact_mut(n).zip(&mut want_r).enumerate() {
                    *r = math::forward_row::<T, W, A>(&x[i * n..][..n], w_of(i), eps, y);
                }
            });
            for kernel in Kernel::available() {
                let (mut y, mut r) = (vec![T::default(); n * rows], vec![A::ZERO; rows]);
                kernel.run(|| forward_chunk::<T, W, A>(kernel, &x, n, w_of, eps, &mut y, &mut r));
                let what = format!("{kernel:?} n={n} rows={rows} groups={groups} w={weighted}");
                let first_diff = bits(&y)
                    .iter()
                    .zip(bits(&want_y))
                    .position(|(a, b)| *a != b);
                assert_eq!(first_diff, None, "y {what}");
                let rbits = |r: &[A]| {
                    r.iter()
                        .map(|v| Accum::to_f64(*v).to_bits())
                        .collect::<Vec<_>>()
                };
                assert_eq!(rbits(&r), rbits(&want_r), "rstd {what}");
            }
        }
    }
    for (n, rows, groups) in [
        (1, 1, 1),
        (7, 3, 1),
        (16, 2, 2),
        (33, 5, 1),
        (128, 9, 3),
        (1024, 3, 1),
        (1040, 4, 2),
        (2500, 3, 3),
        (4097, 2, 1),
        (4096, 17, 1),
        (2048, 4, 1),
        (2071, 5, 5),
        (4112, 6, 2),
        (6160, 9, 3),
        (128, 16, 1),
        (4096, 15, 1),
        (1040, 24, 3),
        (96, 20, 3),
        // The narrow-row batches (8 rows, whole vectors, at most 256): batches with every row's
        // own weight, a batch and a few rows after it, the longest narrow rows.
        (64, 24, 24),
        (64, 11, 1),
        // Whole batches of 8 narrow rows (the AVX-512 statistics), a rest after them.
        (16, 9, 3),
        (128, 16, 2),
        (240, 8, 1),
        (256, 17, 2),
        (33, 12, 2),
        // The portable narrow batches take any row up to 256 (tails too): one batch and an odd
        // rest, rows of 7 with a weight row per 10 rows, rows of 257 (just past them).
        (7, 19, 2),
        (200, 9, 9),
        (257, 9, 1),
        (16400, 9, 1),
        (140_000, 3, 1),
    ] {
        check::<f32, f32, f32>(n, rows, groups);
        check::<bf16, bf16, f32>(n, rows, groups);
        check::<bf16, f32, f32>(n, rows, groups);
        check::<f16, f32, f32>(n, rows, groups);
        check::<f16, f16, f32>(n, rows, groups);
        check::<bf16, f16, f32>(n, rows, groups);
        check::<f64, f32, f64>(n, rows, groups);
    }
}

#[test]
fn chunk_backward_matches_row_by_row_on_every_instruction_set() {
    // `BackwardInputs::rows_from` takes the explicit AVX-512 loops where they apply (two rows'
    // dot products at once, then column tiles over groups of rows), the two-rows loop or row
    // by row elsewhere: every path gives row by row's bits for dx and the weight gradient; with
    // dh too (the explicit loops adding it, half precision widened elsewhere).
    fn check<T: CpuElement, W: Element>(n: usize, rows: usize) {
        let mut xs = values(n * rows, 21);
        for (at, v) in [(n + 2, f32::NAN), (2 * n + 3, f32::INFINITY), (3, 3e38)] {
            if let Some(slot) = xs.get_mut(at) {
                *slot = v;
            }
        }
        let x: Vec<T> = xs.into_iter().map(T::from_f32).collect();
        let dy: Vec<T> = values(n * rows, 22).into_iter().map(T::from_f32).collect();
        let w: Vec<W> = values(n, 23)
            .into_iter()
            .map(|v| W::from_f32(v + 2.5))
            .collect();
        let rstd: Vec<f32> = values(rows, 24)
            .into_iter()
            .map(|v| v.abs() + 0.5)
            .collect();
        let (mut want_dx, mut want_acc) = (vec![T::default(); n * rows], vec![0f64; n]);
        // Accumulate onto a nonzero partial row, as a chunk's second call would.
        want_acc
            .iter_mut()
            .enumerate()
            .for_each(|(j, a)| *a = j as f64 * 0.25);
        let start_acc = want_acc.clone();
        Kernel::Scalar.run(|| {
            math::backward_rows::<T, W, f32>(
                &x,
                &dy,
                n,
                |_| Some(&w[..]),
                math::Rstd::Given(&rstd),
                &mut want_dx,
                Some(&mut want_acc),
            )
        });
        let check_kernels_adding = |rstd: math::Rstd<'_, f32>,
                                    dh: Option<&[T]>,
                                    want_dx: &[T],
                                    want_acc: &[f64],
                                    form: &str| {
            for kernel in Kernel::available() {
                let inputs = BackwardInputs {
                    x: &x,
                    dy: &dy,
                    rstd,
                    w: Some(&w[..]),
                    dh,
                    n,
                    rows_per_group: rows,
                    kernel,
                    moments: None,
                };
                let (mut dx, mut acc) = (vec![T::default(); n * rows], start_acc.clone());
                inputs.run_rows(kernel, 0, &mut dx, Some(&mut acc));
                let what = format!(
                    "{kernel:?} n={n} rows={rows} rstd {form} dh {}",
                    dh.is_some()
                );
                let first_diff = nan_bits(&dx)
                    .iter()
                    .zip(nan_bits(want_dx))
                    .position(|(a, b)| *a != b);
                assert_eq!(first_diff, None, "dx {what}");
                assert_eq!(nan_bits(&acc), nan_bits(want_acc), "dweight {what}");
            }
        };
        let check_kernels =
            |rstd: math::Rstd<'_, f32>, want_dx: &[T], want_acc: &[f64], form: &str| {
                check_kernels_adding(rstd, None, want_dx, want_acc, form)
            };
        // With dh (the fused residual add's): dx has `math::backward_row_adding`'s bits, row by
        // row, and the weight's gradient the scalar path's (rows over a widened block in half
        // precision add it row by row, not in pairs) on every instruction set.
        let dh: Vec<T> = values(n * rows, 25).into_iter().map(T::from_f32).collect();
        let check_adding = |rstd: math::Rstd<'_, f32>, form: &str| {
            let inputs = BackwardInputs {
                x: &x,
                dy: &dy,
                rstd,
                w: Some(&w[..]),
                dh: Some(&dh[..]),
                n,
                rows_per_group: rows,
                kernel: Kernel::Scalar,
                moments: None,
            };
            let (mut dx, mut want_acc) = (vec![T::default(); n * rows], start_acc.clone());
            inputs.run_rows(Kernel::Scalar, 0, &mut dx, Some(&mut want_acc));
            let mut want_dx = vec![T::default(); n * rows];
            Kernel::Scalar.run(|| {
                for (i, dx) in want_dx.chunks_exact_mut(n).enumerate() {
                    let row = i * n..(i + 1) * n;
                    math::backward_row_adding::<T, W, f32>(
                        &x[row.clone()],
                        Some(&w[..]),
                        rstd.from_row(i),
                        &dy[row.clone()],
                        &dh[row],
                        dx,
                        None,
                    );
                }
            });
            check_kernels_adding(rstd, Some(&dh), &want_dx, &want_acc, form);
        };
        check_adding(math::Rstd::Given(&rstd), "given");
        check_kernels(math::Rstd::Given(&rstd), &want_dx, &want_acc, "given");
        // rstd taken from x, block by block: the bits of the forward's rstd given.
        let eps = 1e-5f32;
        let forward_rstd: Vec<f32> = x
            .chunks_exact(n)
            .map(|r| math::rstd::<T, f32>(r, eps))
            .collect();
        let (mut want_dx, mut want_acc) = (vec![T::default(); n * rows], start_acc.clone());
        Kernel::Scalar.run(|| {
            math::backward_rows::<T, W, f32>(
                &x,
                &dy,
                n,
                |_| Some(&w[..]),
                math::Rstd::Given(&forward_rstd),
                &mut want_dx,
                Some(&mut want_acc),
            )
        });
        check_kernels(
            math::Rstd::Given(&forward_rstd),
            &want_dx,
            &want_acc,
            "forward given",
        );
        check_kernels(math::Rstd::FromX(eps), &want_dx, &want_acc, "from x");
        check_adding(math::Rstd::FromX(eps), "from x");
    }
    for (n, rows) in [
        (1, 1),
        (7, 3),
        (16, 2),
        (33, 5),
        (128, 9),
        (1024, 3),
        (1040, 4),
        (2500, 3),
        (4097, 2),
        (4096, 17),
        (64, 700),
        // The portable narrow batches (8 rows of up to 256, tails too), then the pairs: one
        // batch and an odd rest, two batches, rows just past the longest narrow ones.
        (33, 13),
        (7, 16),
        (256, 11),
        (257, 9),
        // Groups of 31 rows would split the pair of rows 30 and 31 (the AVX-512 loops keep
        // groups even).
        (1040, 33),
    ] {
        check::<f32, f32>(n, rows);
        check::<bf16, bf16>(n, rows);
        check::<bf16, f32>(n, rows);
        check::<f16, f32>(n, rows);
        check::<f16, f16>(n, rows);
        check::<bf16, f16>(n, rows);
    }
}

// ---------------------------------------------------------------------------------------------
// Scale offset and dh
// ---------------------------------------------------------------------------------------------

/// One call of `def` with these attributes, arguments and result (dtype, dims); its results.
fn call_bundle(
    def: &BundleDef,
    attrs: Vec<(&str, OwnedAttr)>,
    args: Vec<OwnedBuffer>,
    rets: &[(DataType, Vec<i64>)],
) -> Vec<OwnedBuffer> {
    register();
    let ctx = FakeContext::with_threads(3);
    instantiate(&ctx, def, attrs).unwrap();
    let mut frame = FrameBuilder::new(Stage::Execute);
    for a in args {
        frame = frame.arg(a);
    }
    for (d, dims) in rets {
        frame = frame.ret(OwnedBuffer::zeros(*d, dims));
    }
    let mut f = frame.build(&ctx);
    f.call(def.handler(Stage::Execute).unwrap()).unwrap();
    (0..rets.len()).map(|k| f.result(k).clone()).collect()
}

/// `(y, rstd, dx, dw)` of forward then backward, the weight applied with `offset` and, given
/// `dh`, the backward adding it.
fn forward_backward<T: Element + NativeType, W: Element + NativeType>(
    dims: &[i64],
    w: &[W],
    offset: f32,
    dh: Option<&[T]>,
) -> [OwnedBuffer; 4] {
    let n = *dims.last().unwrap();
    let count = dims.iter().product::<i64>() as usize;
    let lead = dims[..dims.len() - 1].to_vec();
    let acc = crate::handlers::contract::accumulation(T::DTYPE).unwrap();
    let x: Vec<T> = values(count, 3).into_iter().map(T::from_f32).collect();
    let dy: Vec<T> = values(count, 4).into_iter().map(T::from_f32).collect();
    let mut attrs = vec![
        ("has_weight", OwnedAttr::pred(true)),
        ("row_len", OwnedAttr::scalar(n)),
    ];
    if offset != 0.0 {
        attrs.push(("scale_offset", OwnedAttr::scalar(offset)));
    }
    let mut fwd_attrs = attrs.clone();
    fwd_attrs.push(("eps", OwnedAttr::scalar(1e-5f32)));
    let wb = OwnedBuffer::from_values(&[n], w);
    let [y, rstd]: [OwnedBuffer; 2] = call_bundle(
        &FORWARD_BUNDLE,
        fwd_attrs,
        vec![OwnedBuffer::from_values(dims, &x), wb.clone()],
        &[(T::DTYPE, dims.to_vec()), (acc, lead)],
    )
    .try_into()
    .unwrap();
    let mut args = vec![
        OwnedBuffer::from_values(dims, &x),
        wb,
        rstd.clone(),
        OwnedBuffer::from_values(dims, &dy),
    ];
    if let Some(dh) = dh {
        attrs.push(("has_dh", OwnedAttr::pred(true)));
        args.push(OwnedBuffer::from_values(dims, dh));
    }
    let [dx, dw]: [OwnedBuffer; 2] = call_bundle(
        &BACKWARD_BUNDLE,
        attrs,
        args,
        &[(T::DTYPE, dims.to_vec()), (W::DTYPE, vec![n])],
    )
    .try_into()
    .unwrap();
    [y, rstd, dx, dw]
}

/// A scale offset is the plain op with the weight `offset + w` taken in the accumulation dtype
/// (handed over as a weight of that dtype): the same bits of y, rstd and dx, and dweight that
/// one rounded to w's dtype. At offset 0, `w` itself in the accumulation dtype (a weight the
/// kernels convert); dweight then only where w's dtype is no wider than that (a float64
/// gradient of float32 x is summed wider than the float32 call's result holds).
fn offset_is_the_offset_weight<T: Element + NativeType, W: Element + NativeType>(
    dims: &[i64],
    offset: f32,
) {
    let n = *dims.last().unwrap() as usize;
    let w: Vec<W> = values(n, 9)
        .into_iter()
        .map(|v| W::from_f32(v * 0.1))
        .collect();
    let with_offset = forward_backward::<T, W>(dims, &w, offset, None);
    let what = format!(
        "{} x, {} weight, offset {offset}, {dims:?}",
        T::DTYPE,
        W::DTYPE
    );
    let check = |shifted: [OwnedBuffer; 4], acc_bits: fn(&OwnedBuffer) -> Vec<u64>| {
        for k in 0..3 {
            assert_eq!(with_offset[k].data, shifted[k].data, "result {k}, {what}");
        }
        if W::DTYPE != DataType::F64 || T::DTYPE == DataType::F64 {
            let dw: Vec<u64> = acc_bits(&shifted[3]);
            assert_eq!(bits(&with_offset[3].values::<W>()), dw, "dw, {what}");
        }
    };
    if T::DTYPE == DataType::F64 {
        let shifted: Vec<f64> = w.iter().map(|&v| offset as f64 + v.to_f64()).collect();
        check(forward_backward::<T, f64>(dims, &shifted, 0.0, None), |b| {
            bits(
                &b.values::<f64>()
                    .into_iter()
                    .map(W::from_f64)
                    .collect::<Vec<W>>(),
            )
        });
    } else {
        let shifted: Vec<f32> = w.iter().map(|&v| offset + v.to_f32()).collect();
        check(forward_backward::<T, f32>(dims, &shifted, 0.0, None), |b| {
            bits(
                &b.values::<f32>()
                    .into_iter()
                    .map(|v| W::from_f64(v as f64))
                    .collect::<Vec<W>>(),
            )
        });
    }
}

/// Shapes of the weight-conversion tests: vector rows, a ragged row, three axes, one column.
const CONVERTED_WEIGHT_SHAPES: [&[i64]; 4] = [&[37, 64], &[5, 229], &[2, 3, 16], &[4, 1]];

#[test]
fn a_scale_offset_applies_offset_plus_w_in_the_accumulation_dtype() {
    for dims in CONVERTED_WEIGHT_SHAPES {
        offset_is_the_offset_weight::<f32, f32>(dims, 1.0);
        offset_is_the_offset_weight::<bf16, bf16>(dims, 1.0);
        offset_is_the_offset_weight::<f16, bf16>(dims, 1.0);
        offset_is_the_offset_weight::<f32, f16>(dims, 1.0);
        offset_is_the_offset_weight::<f64, bf16>(dims, 1.0);
    }
}

/// A weight the kernels are not built for (neither x's dtype nor the accumulation dtype) is
/// converted to the accumulation dtype once per call: every result has the bits of the call
/// given that converted weight (the gradient rounded to the weight's dtype).
#[test]
fn a_weight_of_another_dtype_is_the_weight_in_the_accumulation_dtype() {
    for dims in CONVERTED_WEIGHT_SHAPES {
        offset_is_the_offset_weight::<f32, bf16>(dims, 0.0);
        offset_is_the_offset_weight::<f32, f16>(dims, 0.0);
        offset_is_the_offset_weight::<f32, f64>(dims, 0.0);
        offset_is_the_offset_weight::<bf16, f64>(dims, 0.0);
        offset_is_the_offset_weight::<bf16, f16>(dims, 0.0);
        offset_is_the_offset_weight::<f16, bf16>(dims, 0.0);
        offset_is_the_offset_weight::<f64, f32>(dims, 0.0);
        offset_is_the_offset_weight::<f64, bf16>(dims, 0.0);
    }
}

/// dh of zeros: dx has the plain backward's bits; any dh: dx is within one rounding of the
/// plain backward's dx plus dh (exactly that sum, rounded once, where x is the accumulation
/// dtype and the plain dx is unrounded).
fn dh_adds_once<T: Element + NativeType>(dims: &[i64]) {
    let n = *dims.last().unwrap() as usize;
    let count = dims.iter().product::<i64>() as usize;
    let w: Vec<T> = values(n, 5)
        .into_iter()
        .map(|v| T::from_f32(v + 1.5))
        .collect();
    let plain = forward_backward::<T, T>(dims, &w, 0.0, None);
    let zeros = vec![T::default(); count];
    let with_zeros = forward_backward::<T, T>(dims, &w, 0.0, Some(&zeros));
    let what = format!("{} {dims:?}", T::DTYPE);
    assert_eq!(plain[2].data, with_zeros[2].data, "dx with dh = 0, {what}");
    let dh: Vec<T> = values(count, 6).into_iter().map(T::from_f32).collect();
    let with_dh = forward_backward::<T, T>(dims, &w, 0.0, Some(&dh));
    let (dx, base) = (with_dh[2].values::<T>(), plain[2].values::<T>());
    let exact = matches!(T::DTYPE, DataType::F32 | DataType::F64);
    for i in 0..count {
        let want = base[i].to_f64() + dh[i].to_f64();
        let got = dx[i].to_f64();
        if exact {
            assert_eq!(
                got.to_bits(),
                T::from_f64(want).to_f64().to_bits(),
                "dx[{i}], {what}"
            );
        } else {
            // The plain dx was rounded already (half an ulp of its own magnitude, which the
            // sum may cancel) and the fused one rounds once: within one ulp at the larger term.
            let ulp = (base[i].to_f64().abs().max(dh[i].to_f64().abs()) * 2f64.powi(-7)).max(1e-7);
            assert!(
                (got - want).abs() <= ulp,
                "dx[{i}] = {got}, want {want}, {what}"
            );
        }
    }
    // dweight does not see dh.
    let close_dw = plain[3]
        .values::<T>()
        .iter()
        .zip(with_dh[3].values::<T>())
        .all(|(a, b)| (a.to_f64() - b.to_f64()).abs() <= 1e-2 * (1.0 + a.to_f64().abs()));
    assert!(close_dw, "dw, {what}");
}

#[test]
fn dh_is_added_to_dx_before_its_one_rounding() {
    for dims in [&[37, 64][..], &[5, 229], &[2, 3, 16], &[4, 1], &[64, 256]] {
        dh_adds_once::<f32>(dims);
        dh_adds_once::<f64>(dims);
        dh_adds_once::<bf16>(dims);
        dh_adds_once::<f16>(dims);
    }
}

// Split rows
// ---------------------------------------------------------------------------------------------

/// Columns `s * len..(s + 1) * len` of each row of `v` (rows of `n`).
fn columns<T: Copy>(v: &[T], n: usize, s: usize, len: usize) -> Vec<T> {
    v.chunks_exact(n)
        .flat_map(|row| row[s * len..][..len].iter().copied())
        .collect()
}

/// `parts[s]` (rows of `len`) put back side by side into rows of `len * parts.len()`.
fn side_by_side(parts: &[Vec<f64>], len: usize) -> Vec<f64> {
    let rows = parts[0].len() / len.max(1);
    (0..rows)
        .flat_map(|r| {
            parts
                .iter()
                .flat_map(move |p| p[r * len..][..len].iter().copied())
        })
        .collect()
}

/// The element-wise sum of the slices' sums: what the all-reduce gives.
fn all_reduced(parts: &[OwnedBuffer]) -> OwnedBuffer {
    let mut total = parts[0].values::<f32>();
    for p in &parts[1..] {
        for (t, v) in total.iter_mut().zip(p.values::<f32>()) {
            *t += v;
        }
    }
    OwnedBuffer::from_values(&parts[0].dims, &total)
}

/// A row split over `shards` devices (sums passes, the all-reduce done here, apply passes)
/// gives the whole row's y, statistics, dx and gradients: within a few float32 units (the
/// slices' sums are rounded to float32 before they are added), for both norms, x float32 and
/// bfloat16, with and without the RMS backward taking rstd from x.
fn split_matches_whole<T: Element + NativeType>(layer: bool, from_x: bool) {
    let (rows, shards, len) = (6usize, 3usize, 40usize);
    let n = shards * len;
    let dims = [rows as i64, n as i64];
    let lead = vec![rows as i64];
    let x: Vec<T> = values(rows * n, 11)
        .into_iter()
        .map(|v| T::from_f32(v + if layer { 30.0 } else { 0.0 }))
        .collect();
    let dy: Vec<T> = values(rows * n, 12).into_iter().map(T::from_f32).collect();
    let w: Vec<f32> = values(n, 13).into_iter().map(|v| v + 1.5).collect();
    let b: Vec<f32> = values(n, 14);
    let norm = |a: &mut Vec<(&str, OwnedAttr)>| {
        if layer {
            a.push(("norm", OwnedAttr::scalar(1i64)));
            a.push(("has_bias", OwnedAttr::pred(true)));
        }
    };
    let base = |row_len: usize| {
        let mut a = vec![
            ("has_weight", OwnedAttr::pred(true)),
            ("row_len", OwnedAttr::scalar(row_len as i64)),
            ("scale_offset", OwnedAttr::scalar(0.25f32)),
        ];
        norm(&mut a);
        a
    };
    let stats = if layer { 2 } else { 1 };
    let what = format!("{} layer={layer} from_x={from_x}", T::DTYPE);

    // The whole rows.
    let mut fwd = base(n);
    fwd.push(("eps", OwnedAttr::scalar(1e-5f32)));
    let mut args = vec![
        OwnedBuffer::from_values(&dims, &x),
        OwnedBuffer::from_values(&[n as i64], &w),
    ];
    if layer {
        args.push(OwnedBuffer::from_values(&[n as i64], &b));
    }
    let mut rets = vec![(T::DTYPE, dims.to_vec())];
    rets.extend(std::iter::repeat_n((DataType::F32, lead.clone()), stats));
    let whole = call_bundle(&FORWARD_BUNDLE, fwd, args, &rets);
    let mut bwd = base(n);
    if from_x {
        bwd.push(("eps", OwnedAttr::scalar(1e-5f32)));
    }
    let mut args = vec![
        OwnedBuffer::from_values(&dims, &x),
        OwnedBuffer::from_values(&[n as i64], &w),
    ];
    if !from_x {
        args.extend(whole[1..].iter().cloned());
    }
    args.push(OwnedBuffer::from_values(&dims, &dy));
    let mut grads = vec![(T::DTYPE, dims.to_vec()), (DataType::F32, vec![n as i64])];
    if layer {
        grads.push((DataType::F32, vec![n as i64]));
    }
    let whole_grads = call_bundle(&BACKWARD_BUNDLE, bwd, args, &grads);

    // The slices.
    let split = |a: &mut Vec<(&str, OwnedAttr)>, pass: i64| {
        a.push(("split", OwnedAttr::scalar(pass)));
        a.push(("full_len", OwnedAttr::scalar(n as i64)));
    };
    let xs: Vec<Vec<T>> = (0..shards).map(|s| columns(&x, n, s, len)).collect();
    let dys: Vec<Vec<T>> = (0..shards).map(|s| columns(&dy, n, s, len)).collect();
    let ws: Vec<Vec<f32>> = (0..shards).map(|s| w[s * len..][..len].to_vec()).collect();
    let bs: Vec<Vec<f32>> = (0..shards).map(|s| b[s * len..][..len].to_vec()).collect();
    let sdims = [rows as i64, len as i64];
    let sums_pass = |pass: i64, k: usize, extra: Option<&OwnedBuffer>| {
        let parts: Vec<OwnedBuffer> = (0..shards)
            .map(|s| {
                let mut a = base(len);
                a.retain(|(name, _)| {
                    *name != "has_weight" && *name != "scale_offset" && *name != "has_bias"
                });
                a.push(("has_weight", OwnedAttr::pred(false)));
                a.push(("eps", OwnedAttr::scalar(1e-5f32)));
                split(&mut a, pass);
                let mut args = vec![OwnedBuffer::from_values(&sdims, &xs[s])];
                args.extend(extra.cloned());
                call_bundle(
                    &FORWARD_BUNDLE,
                    a,
                    args,
                    &[(DataType::F32, vec![rows as i64, k as i64])],
                )
                .remove(0)
            })
            .collect();
        all_reduced(&parts)
    };
    let first = sums_pass(1, 1, None);
    let (mean, sums) = if layer {
        let m: Vec<f32> = first.values::<f32>().iter().map(|s| s / n as f32).collect();
        let m = OwnedBuffer::from_values(&lead, &m);
        let centred = sums_pass(2, 2, Some(&m));
        (Some(m), centred)
    } else {
        (None, first)
    };
    let mut ys = Vec::new();
    for s in 0..shards {
        let mut a = base(len);
        a.push(("eps", OwnedAttr::scalar(1e-5f32)));
        split(&mut a, 3);
        let mut args = vec![
            OwnedBuffer::from_values(&sdims, &xs[s]),
            OwnedBuffer::from_values(&[len as i64], &ws[s]),
        ];
        if layer {
            args.push(OwnedBuffer::from_values(&[len as i64], &bs[s]));
        }
        args.extend(mean.iter().cloned());
        args.push(sums.clone());
        let mut rets = vec![(T::DTYPE, sdims.to_vec())];
        rets.extend(std::iter::repeat_n((DataType::F32, lead.clone()), stats));
        let out = call_bundle(&FORWARD_BUNDLE, a, args, &rets);
        for (k, r) in out[1..].iter().enumerate() {
            close(
                &as_f64::<f32>(r),
                &as_f64::<f32>(&whole[1 + k]),
                4e-7,
                &format!("stat {k}, {what}"),
            );
        }
        ys.push(as_f64::<T>(&out[0]));
    }
    let tol = if T::DTYPE == DataType::F32 {
        2e-6
    } else {
        8e-3
    };
    close(
        &side_by_side(&ys, len),
        &as_f64::<T>(&whole[0]),
        tol,
        &format!("y, {what}"),
    );

    // The backward: sums given the whole forward's statistics, all-reduced, then apply.
    let k = if layer { 3 } else { 1 + from_x as usize };
    let slice_args = |s: usize| {
        let mut args = vec![
            OwnedBuffer::from_values(&sdims, &xs[s]),
            OwnedBuffer::from_values(&[len as i64], &ws[s]),
        ];
        if !from_x {
            args.extend(whole[1..].iter().cloned());
        }
        args.push(OwnedBuffer::from_values(&sdims, &dys[s]));
        args
    };
    let bwd_attrs = |pass: i64| {
        let mut a = base(len);
        if from_x {
            a.push(("eps", OwnedAttr::scalar(1e-5f32)));
        }
        split(&mut a, pass);
        a
    };
    let parts: Vec<OwnedBuffer> = (0..shards)
        .map(|s| {
            call_bundle(
                &BACKWARD_BUNDLE,
                bwd_attrs(1),
                slice_args(s),
                &[(DataType::F32, vec![rows as i64, k as i64])],
            )
            .remove(0)
        })
        .collect();
    let totals = all_reduced(&parts);
    let (mut dxs, mut dws, mut dbs) = (Vec::new(), Vec::new(), Vec::new());
    for s in 0..shards {
        let mut args = slice_args(s);
        args.push(totals.clone());
        let mut rets = vec![
            (T::DTYPE, sdims.to_vec()),
            (DataType::F32, vec![len as i64]),
        ];
        if layer {
            rets.push((DataType::F32, vec![len as i64]));
        }
        let out = call_bundle(&BACKWARD_BUNDLE, bwd_attrs(3), args, &rets);
        dxs.push(as_f64::<T>(&out[0]));
        dws.push(as_f64::<f32>(&out[1]));
        if layer {
            dbs.push(as_f64::<f32>(&out[2]));
        }
    }
    let tol = if T::DTYPE == DataType::F32 {
        1e-5
    } else {
        8e-3
    };
    close(
        &side_by_side(&dxs, len),
        &as_f64::<T>(&whole_grads[0]),
        tol,
        &format!("dx, {what}"),
    );
    close(
        &dws.concat(),
        &as_f64::<f32>(&whole_grads[1]),
        1e-5,
        &format!("dw, {what}"),
    );
    if layer {
        close(
            &dbs.concat(),
            &as_f64::<f32>(&whole_grads[2]),
            1e-5,
            &format!("db, {what}"),
        );
    }
}

#[test]
fn a_row_split_over_devices_gives_the_whole_rows_results() {
    for layer in [false, true] {
        split_matches_whole::<f32>(layer, false);
        split_matches_whole::<bf16>(layer, false);
    }
    split_matches_whole::<f32>(false, true);
    split_matches_whole::<bf16>(false, true);
}

#[test]
fn split_attributes_are_checked() {
    register();
    let ctx = FakeContext::with_threads(1);
    let attrs = |extra: Vec<(&'static str, OwnedAttr)>| {
        let mut a = vec![
            ("has_weight", OwnedAttr::pred(false)),
            ("row_len", OwnedAttr::scalar(8i64)),
            ("eps", OwnedAttr::scalar(1e-5f32)),
        ];
        a.extend(extra);
        a
    };
    let refused = |def: &BundleDef, extra| instantiate(&ctx, def, attrs(extra)).unwrap_err();
    let e = refused(&FORWARD_BUNDLE, vec![("split", OwnedAttr::scalar(1i64))]);
    assert!(
        e.contains("full_len") && e.contains("whole row's length"),
        "{e}"
    );
    let e = refused(
        &FORWARD_BUNDLE,
        vec![("full_len", OwnedAttr::scalar(16i64))],
    );
    assert!(e.contains("full_len") && e.contains("needs `split`"), "{e}");
    let e = refused(
        &FORWARD_BUNDLE,
        vec![
            ("split", OwnedAttr::scalar(1i64)),
            ("full_len", OwnedAttr::scalar(4i64)),
        ],
    );
    assert!(e.contains("full_len") && e.contains("got 4"), "{e}");
    let e = refused(
        &FORWARD_BUNDLE,
        vec![
            ("split", OwnedAttr::scalar(2i64)),
            ("full_len", OwnedAttr::scalar(16i64)),
        ],
    );
    assert!(e.contains("CentredSums"), "{e}");
    let e = refused(
        &FORWARD_BUNDLE,
        vec![
            ("split", OwnedAttr::scalar(7i64)),
            ("full_len", OwnedAttr::scalar(16i64)),
        ],
    );
    assert!(e.contains("split") && e.contains("1 (Sums)"), "{e}");
    let e = refused(
        &BACKWARD_BUNDLE,
        vec![
            ("split", OwnedAttr::scalar(1i64)),
            ("full_len", OwnedAttr::scalar(16i64)),
            ("norm", OwnedAttr::scalar(1i64)),
        ],
    );
    assert!(e.contains("given the forward's mean and rstd"), "{e}");
}

/// `layer_forward_chunk` over all of `x` on `kernel`: y, the mean and rstd.
fn layer_forward_on<'w, T: CpuElement, W: Element + 'w, A: Accum + CpuElement>(
    kernel: Kernel,
    x: &[T],
    n: usize,
    w_of: impl Fn(usize) -> Option<&'w [W]> + Copy,
    b_of: impl Fn(usize) -> Option<&'w [W]> + Copy,
    eps: A,
) -> (Vec<T>, Vec<A>, Vec<A>) {
    let rows = x.len() / n;
    let (mut y, mut mean, mut rstd) = (
        vec![T::default(); x.len()],
        vec![A::ZERO; rows],
        vec![A::ZERO; rows],
    );
    kernel.run(|| {
        layer_forward_chunk::<T, W, A>(
            kernel,
            x,
            n,
            w_of,
            b_of,
            eps,
            None,
            &mut y,
            Some(&mut mean),
            &mut rstd,
        )
    });
    (y, mean, rstd)
}

#[test]
fn layer_norm_rows_match_row_by_row_on_every_instruction_set() {
    // `layer::forward_rows` takes narrow rows (up to 256) in batches whose statistics run side
    // by side (on AVX-512, rows of whole vectors in `avx512::layer_forward_narrow`), the rest
    // row by row, and float16 rows (up to 2048) go through float32's loops
    // where F16C converts them (`layer_forward_chunk`): every path gives
    // `layer::forward_row`'s bits for y, the mean and rstd. Cases: tails and rests after whole
    // batches, a weight row per few rows, rows just past the narrow ones, rows of large mean
    // (the centred sums matter there), blocks of float16 rows whole and cut (2048 and 2049),
    // longer rows in pieces.
    fn check<T: CpuElement, A: Accum + CpuElement>(n: usize, rows: usize, groups: usize) {
        let mut xs = values(n * rows, 31);
        for (at, v) in [(2, f32::NAN), (n + 1, f32::INFINITY)] {
            if let Some(slot) = xs.get_mut(at) {
                *slot = v;
            }
        }
        for v in xs.iter_mut().skip(3 * n).take(n) {
            *v += 1e4;
        }
        // A row of equal elements: a variance of 0, rstd 1 / sqrt(eps).
        for v in xs.iter_mut().skip(5 * n).take(n) {
            *v = 0.7;
        }
        let x: Vec<T> = xs.into_iter().map(T::from_f32).collect();
        let w: Vec<A> = values(n * groups, 32)
            .into_iter()
            .map(|v| <A as Accum>::from_f32(v + 2.5))
            .collect();
        let b: Vec<A> = values(n * groups, 33)
            .into_iter()
            .map(<A as Accum>::from_f32)
            .collect();
        let per_group = rows.div_ceil(groups);
        let eps = <A as Accum>::from_f32(1e-5);
        let w_of = |i: usize| Some(&w[(i / per_group) * n..][..n]);
        let b_of = |i: usize| Some(&b[(i / per_group) * n..][..n]);
        let mut want_y = vec![T::default(); n * rows];
        let mut want = Vec::new();
        Kernel::Scalar.run(|| {
            for (i, y) in want_y.chunks_exact_mut(n).enumerate() {
                want.push(layer::forward_row::<T, A, A>(
                    &x[i * n..][..n],
                    w_of(i),
                    b_of(i),
                    eps,
                    y,
                ));
            }
        });
        let stat_bits = |v: &[A]| {
            v.iter()
                .map(|a| Accum::to_f64(*a).to_bits())
                .collect::<Vec<_>>()
        };
        let want_mean: Vec<A> = want.iter().map(|s| s.mean).collect();
        let want_rstd: Vec<A> = want.iter().map(|s| s.rstd).collect();
        for kernel in Kernel::available() {
            let (y, mean, rstd) = layer_forward_on::<T, A, A>(kernel, &x, n, w_of, b_of, eps);
            let what = format!("{kernel:?} n={n} rows={rows} groups={groups}");
            assert_eq!(nan_bits(&y), nan_bits(&want_y), "y {what}");
            assert_eq!(stat_bits(&mean), stat_bits(&want_mean), "mean {what}");
            assert_eq!(stat_bits(&rstd), stat_bits(&want_rstd), "rstd {what}");
        }
    }
    for (n, rows, groups) in [
        (7, 19, 2),
        (64, 24, 24),
        (64, 11, 1),
        (200, 9, 9),
        (256, 17, 2),
        (257, 9, 1),
        (1, 8, 1),
        (1000, 5, 2),
        (2048, 3, 1),
        (2049, 2, 1),
        // Rows summed block by block, float16 widened a piece at a time: a last piece of one
        // chunk, of a tail alone, of chunks and a tail.
        (2064, 4, 2),
        (4103, 5, 1),
        (6170, 5, 5),
        // Rows of one block and a tail in a second piece, summed by trees.
        (2056, 4, 1),
        (2063, 2, 2),
    ] {
        check::<f32, f32>(n, rows, groups);
        check::<bf16, f32>(n, rows, groups);
        check::<f16, f32>(n, rows, groups);
        check::<f64, f64>(n, rows, groups);
    }
}

#[test]
fn layer_norm_weights_and_biases_of_every_dtype_match_row_by_row_on_every_instruction_set() {
    // The weight and the bias in each element type, each present or not (`layer::forward_apply`'s
    // four cases, and on AVX-512 `avx512::layer_row`'s, which loads them 32 at a time in x's
    // lanes and the last 16 apart), at rows of whole vectors: narrow ones in batches and a rest,
    // odd numbers of vectors, one block's longest, rows of more blocks.
    fn check<T: CpuElement, W: Element + CpuElement>(n: usize, rows: usize) {
        let x: Vec<T> = values(n * rows, 41)
            .into_iter()
            .map(|v| T::from_f32(3.0 * v - 1.0))
            .collect();
        let w: Vec<W> = values(n, 42)
            .into_iter()
            .map(|v| W::from_f32(v + 1.5))
            .collect();
        let b: Vec<W> = values(n, 43).into_iter().map(W::from_f32).collect();
        let eps = 1e-5f32;
        for (with_w, with_b) in [(true, true), (true, false), (false, true), (false, false)] {
            let w_of = |_: usize| with_w.then_some(&w[..]);
            let b_of = |_: usize| with_b.then_some(&b[..]);
            let mut want = vec![T::default(); n * rows];
            let mut want_stats = Vec::new();
            Kernel::Scalar.run(|| {
                for (i, y) in want.chunks_exact_mut(n).enumerate() {
                    let s =
                        layer::forward_row::<T, W, f32>(&x[i * n..][..n], w_of(i), b_of(i), eps, y);
                    want_stats.push((s.mean.to_bits(), s.rstd.to_bits()));
                }
            });
            for kernel in Kernel::available() {
                let (y, mean, rstd) = layer_forward_on::<T, W, f32>(kernel, &x, n, w_of, b_of, eps);
                let what = format!("{kernel:?} n={n} rows={rows} weight={with_w} bias={with_b}");
                assert_eq!(nan_bits(&y), nan_bits(&want), "y {what}");
                let stats: Vec<_> = mean
                    .iter()
                    .zip(&rstd)
                    .map(|(m, r)| (m.to_bits(), r.to_bits()))
                    .collect();
                assert_eq!(stats, want_stats, "statistics {what}");
            }
        }
    }
    for (n, rows) in [
        (16, 11),
        (48, 9),
        (128, 3),
        (112, 10),
        (1040, 3),
        (2048, 2),
        (2064, 2),
        (4096, 2),
    ] {
        check::<f32, f32>(n, rows);
        check::<f32, bf16>(n, rows);
        check::<bf16, f32>(n, rows);
        check::<bf16, bf16>(n, rows);
        check::<f16, f16>(n, rows);
        check::<f16, f32>(n, rows);
    }
}

#[test]
fn layer_norm_backward_matches_the_scalar_path_on_every_instruction_set() {
    // `BackwardInputs::run_rows` with LayerNorm's statistics: float16 rows (up to 2048) go
    // through float32's loops where F16C converts them, dh added before dx's one rounding;
    // every path gives the scalar path's bits for dx and the weight's and bias's gradient sums,
    // statistics given (the forward's) or taken from x.
    fn check<T: CpuElement>(n: usize, rows: usize) {
        let mut xs = values(n * rows, 41);
        for (at, v) in [(n + 2, f32::NAN), (3, 3e4)] {
            if let Some(slot) = xs.get_mut(at) {
                *slot = v;
            }
        }
        for v in xs.iter_mut().skip(2 * n).take(n) {
            *v += 1e3;
        }
        let x: Vec<T> = xs.into_iter().map(T::from_f32).collect();
        let dy: Vec<T> = values(n * rows, 42).into_iter().map(T::from_f32).collect();
        let dh: Vec<T> = values(n * rows, 43).into_iter().map(T::from_f32).collect();
        let w: Vec<f32> = values(n, 44).into_iter().map(|v| v + 2.5).collect();
        let eps = 1e-5f32;
        let (mut y, mut mean, mut rstd) = (
            vec![T::default(); n * rows],
            vec![0f32; rows],
            vec![0f32; rows],
        );
        Kernel::Scalar.run(|| {
            layer::forward_rows::<T, f32, f32>(
                &x,
                n,
                |_| Some(&w[..]),
                |_| None,
                eps,
                None,
                &mut y,
                Some(&mut mean),
                &mut rstd,
            )
        });
        let start_acc: Vec<f64> = (0..2 * n).map(|j| j as f64 * 0.125).collect();
        let given = Moments::Given {
            mean: &mean,
            rstd: &rstd,
        };
        // A split row's apply pass: whole rows' sums as an all-reduce would hand them over.
        let sums: Vec<f32> = values(3 * rows, 45)
            .into_iter()
            .enumerate()
            .map(|(j, v)| if j % 3 == 1 { v * n as f32 } else { v })
            .collect();
        let split = Moments::Split(layer::SplitRows {
            mean: Some(&mean),
            rstd: Some(&rstd),
            sums: &sums,
            k: 3,
            full_len: 3 * n,
            eps,
        });
        // The gradient sums of the weight and the bias, of the weight alone, or none.
        let acc_lens = [Some(2 * n), Some(n), None];
        for (moments, with_dh, acc_len) in [given, Moments::FromX(eps), split]
            .into_iter()
            .flat_map(|m| [false, true].into_iter().map(move |dh| (m, dh)))
            .flat_map(|(m, dh)| acc_lens.into_iter().map(move |a| (m, dh, a)))
        {
            let run = |kernel: Kernel| {
                let inputs = BackwardInputs {
                    x: &x,
                    dy: &dy,
                    rstd: math::Rstd::FromX(eps),
                    w: Some(&w[..]),
                    dh: with_dh.then_some(&dh[..]),
                    n,
                    rows_per_group: rows,
                    kernel,
                    moments: Some(moments),
                };
                let (mut dx, mut acc) = (vec![T::default(); n * rows], start_acc.clone());
                let acc_of = acc_len.map(|len| &mut acc[..len]);
                inputs.run_rows(kernel, 0, &mut dx, acc_of);
                (nan_bits(&dx), nan_bits(&acc))
            };
            let want = run(Kernel::Scalar);
            for kernel in Kernel::available() {
                let what = format!(
                    "{kernel:?} n={n} rows={rows} dh={with_dh} sums of {acc_len:?} {}",
                    match moments {
                        Moments::Given { .. } => "given",
                        Moments::FromX(_) => "from x",
                        Moments::Split(_) => "split",
                    }
                );
                let (dx, acc) = run(kernel);
                let first_diff = dx.iter().zip(&want.0).position(|(a, b)| a != b);
                assert_eq!(first_diff, None, "dx {what}");
                assert_eq!(acc, want.1, "gradient sums {what}");
            }
        }
    }
    for (n, rows) in [
        (1, 3),
        (7, 19),
        (64, 40),
        (200, 9),
        (1000, 5),
        (2048, 3),
        (2049, 2),
        // Longer rows, float16 widened a piece at a time: a tail in a second piece (summed by
        // trees), pieces whole, a tail alone, chunks and a tail.
        (2063, 3),
        (4096, 3),
        (4103, 2),
        (6170, 3),
    ] {
        check::<f32>(n, rows);
        check::<bf16>(n, rows);
        check::<f16>(n, rows);
    }
}

#[test]
fn long_float16_rows_backward_matches_the_scalar_path_on_every_instruction_set() {
    // `BackwardInputs::run_rows` for the RMS norm's rows longer than a widened block: float16
    // rows go through float32's loops a piece at a time where F16C converts them (`widen`),
    // with and without dh, a weight, an accumulator; rows pair only with an accumulator and no
    // dh, so odd counts leave a row alone. Every path gives the scalar path's bits for dx and
    // the weight gradient, rstd given or taken from x.
    fn check<T: CpuElement>(n: usize, rows: usize, rows_per_group: usize) {
        let mut xs = values(n * rows, 51);
        for (at, v) in [(n + 2, f32::NAN), (3, 3e4), (n * rows - 1, 6e4)] {
            if let Some(slot) = xs.get_mut(at) {
                *slot = v;
            }
        }
        let x: Vec<T> = xs.into_iter().map(T::from_f32).collect();
        let dy: Vec<T> = values(n * rows, 52).into_iter().map(T::from_f32).collect();
        let dh: Vec<T> = values(n * rows, 53).into_iter().map(T::from_f32).collect();
        let groups = rows.div_ceil(rows_per_group);
        let w: Vec<f32> = values(n * groups, 54)
            .into_iter()
            .map(|v| v + 2.5)
            .collect();
        let rstd: Vec<f32> = values(rows, 55)
            .into_iter()
            .map(|v| v.abs() + 0.5)
            .collect();
        let start_acc: Vec<f64> = (0..n).map(|j| j as f64 * 0.125).collect();
        let forms = [math::Rstd::Given(&rstd[..]), math::Rstd::FromX(1e-5)];
        for (rstd, with_dh, with_w, with_acc) in forms
            .into_iter()
            .flat_map(|r| (0..8).map(move |k| (r, k & 1 == 1, k & 2 == 2, k & 4 == 4)))
        {
            // A weight gradient is summed per weight row: one group's rows at a time.
            let with_acc = with_acc && (!with_w || groups == 1);
            let run = |kernel: Kernel| {
                let inputs = BackwardInputs {
                    x: &x,
                    dy: &dy,
                    rstd,
                    w: with_w.then_some(&w[..]),
                    dh: with_dh.then_some(&dh[..]),
                    n,
                    rows_per_group,
                    kernel,
                    moments: None,
                };
                let (mut dx, mut acc) = (vec![T::default(); n * rows], start_acc.clone());
                // Two calls, as two chunks of a call's rows (the second from an odd row).
                let split = (rows / 2 + 1).min(rows);
                let (dx0, dx1) = dx.split_at_mut(split * n);
                inputs.run_rows(kernel, 0, dx0, with_acc.then_some(&mut acc[..]));
                if !dx1.is_empty() {
                    inputs.run_rows(kernel, split, dx1, with_acc.then_some(&mut acc[..]));
                }
                (nan_bits(&dx), nan_bits(&acc))
            };
            let want = run(Kernel::Scalar);
            for kernel in Kernel::available() {
                let what = format!(
                    "{kernel:?} n={n} rows={rows} groups of {rows_per_group} dh={with_dh} \
                     w={with_w} acc={with_acc} given={}",
                    matches!(rstd, math::Rstd::Given(_))
                );
                let (dx, acc) = run(kernel);
                let first_diff = dx.iter().zip(&want.0).position(|(a, b)| a != b);
                assert_eq!(first_diff, None, "dx {what}");
                assert_eq!(acc, want.1, "dweight {what}");
            }
        }
    }
    for (n, rows, per_group) in [
        (2049, 1, 1),
        (2056, 3, 3),
        (4096, 2, 2),
        (4111, 5, 5),
        (6150, 4, 2),
        (16384, 3, 3),
    ] {
        check::<f16>(n, rows, per_group);
        check::<bf16>(n, rows, per_group);
    }
}

#[test]
fn widened_residual_add_matches_the_portable_one() {
    // The fused residual's `h = x + residual` for float16 goes through float32 a piece at a time
    // where F16C converts it (`widen`), in one loop on AVX-512 (`avx512::add_f16`):
    // `math::add_into`'s bits, sums rounding either way at
    // the top of the range, overflowing, cancelling, NaN and infinity among them, over slices
    // of every length to 17 (the conversions' remainders) and across pieces.
    let mut x: Vec<f16> = values(5000, 61).into_iter().map(f16::from_f32).collect();
    let mut r: Vec<f16> = values(5000, 62).into_iter().map(f16::from_f32).collect();
    let special = [
        (65504.0, 16.0),
        (65504.0, 15.99),
        (2048.0, 1.0),
        (2049.0, 0.5),
        (1.0, -1.0),
        (6e-8, 6e-8),
        (f32::NAN, 1.0),
        (f32::INFINITY, -65504.0),
    ];
    for (k, (a, b)) in special.into_iter().enumerate() {
        x[3 + 7 * k] = f16::from_f32(a);
        r[3 + 7 * k] = f16::from_f32(b);
        x[4100 + k] = f16::from_f32(a);
        r[4100 + k] = f16::from_f32(b);
    }
    let mut want = vec![f16::ZERO; x.len()];
    math::add_into::<f16, f32>(&x, &r, &mut want);
    for kernel in Kernel::available().into_iter().filter(|k| k.has_f16c()) {
        for len in (1..=17).chain([x.len()]) {
            let mut h = vec![f16::ZERO; x.len()];
            let pieces = x.chunks(len).zip(r.chunks(len)).zip(h.chunks_mut(len));
            for ((xs, rs), hs) in pieces {
                assert!(f16::add_widened::<f32>(kernel, xs, rs, hs));
            }
            let first_diff = (h.iter().zip(&want)).position(|(a, b)| a.to_bits() != b.to_bits());
            assert_eq!(first_diff, None, "{kernel:?} in slices of {len}");
        }
    }
}

#[test]
fn f16c_slice_conversions_match_the_portable_ones() {
    // `widen::load_slice`/`store_slice` convert float16 with F16C (through `half`) in the x86
    // contexts, element by element elsewhere: the same bits as `math`'s integer conversions
    // (which `math`'s tests hold to `half`'s), every half widened, floats at every boundary of
    // the half range and a spread narrowed, in slices of every length up to 17 (the
    // conversions' remainders) and one long one.
    let halves: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
    let mut floats: Vec<f32> = Vec::new();
    for h in &halves {
        let f = h.to_f32().to_bits() as i64;
        for d in [-0x1001i64, -0x1000, -1, 1, 0x1000, 0x1001] {
            floats.push(f32::from_bits((f + d) as u32));
        }
    }
    floats.extend((0..1u32 << 18).map(|i| f32::from_bits(i.wrapping_mul(0x9e37_79b9))));
    let want_wide: Vec<u32> = halves
        .iter()
        .map(|&h| Element::to_f32(h).to_bits())
        .collect();
    let want_narrow: Vec<u16> = floats
        .iter()
        .map(|&v| <f16 as Element>::from_f32(v).to_bits())
        .collect();
    for kernel in Kernel::available() {
        let mut lengths: Vec<usize> = (1..=17).collect();
        lengths.push(halves.len());
        for len in lengths {
            let mut wide = vec![0f32; halves.len()];
            for (src, dst) in halves.chunks(len).zip(wide.chunks_mut(len)) {
                kernel.run(|| load_slice(kernel, src, dst));
            }
            let got: Vec<u32> = wide.iter().map(|v| v.to_bits()).collect();
            let first_diff = got.iter().zip(&want_wide).position(|(a, b)| a != b);
            assert_eq!(first_diff, None, "{kernel:?} widened in slices of {len}");
            let mut narrow = vec![f16::ZERO; floats.len()];
            for (src, dst) in floats.chunks(len).zip(narrow.chunks_mut(len)) {
                kernel.run(|| store_slice(kernel, src, dst));
            }
            let first_diff = narrow
                .iter()
                .zip(&want_narrow)
                .position(|(a, b)| a.to_bits() != *b);
            assert_eq!(
                first_diff.map(|i| floats[i].to_bits()),
                None,
                "{kernel:?} narrowed in slices of {len}"
            );
        }
    }
}
