//! The CPU kernels alone, one thread, no XLA: nanoseconds per row of the forward, of the
//! backward (with a weight and its gradient) and of LayerNorm's forward (weight and bias) at a
//! few row lengths, so per-row costs can be
//! profiled (`perf record`) without the call frame, the thread pool or Python around them.
//!
//!     cargo run --release --example kernel_rows [-- [f32|bf16|f16] ROWSxN ...]
//!
//! x, y and dy are of the dtype named (float32 by default); the weight is float32.
//!
//! Each shape is timed as the median of 15 runs of enough calls for ~20 ms, x and the outputs
//! warm in cache (as the narrow rows of a training step are).

use std::time::Instant;

use half::{bf16, f16};
use rmsnorm_ffi::handlers::cpu::{
    backward_chunk, forward_chunk, layer_forward_chunk, simd::Kernel, widen::CpuElement,
};
use rmsnorm_ffi::handlers::math::Rstd;

fn median_ns_per_row(rows: usize, mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    let mut calls = 0usize;
    while start.elapsed().as_millis() < 20 {
        f();
        calls += 1;
    }
    let mut runs: Vec<f64> = (0..15)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..calls {
                f();
            }
            t.elapsed().as_nanos() as f64 / (calls * rows) as f64
        })
        .collect();
    runs.sort_by(f64::total_cmp);
    runs[runs.len() / 2]
}

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let dtype = match args.first().map(String::as_str) {
        Some(d @ ("f32" | "bf16" | "f16")) => {
            let d = d.to_string();
            args.remove(0);
            d
        }
        _ => "f32".to_string(),
    };
    match dtype.as_str() {
        "bf16" => rows_of::<bf16>(&args, &dtype),
        "f16" => rows_of::<f16>(&args, &dtype),
        _ => rows_of::<f32>(&args, &dtype),
    }
}

fn rows_of<T: CpuElement>(args: &[String], dtype: &str) {
    let shapes: Vec<(usize, usize)> = if args.is_empty() {
        vec![
            (1408, 64),
            (8192, 64),
            (4096, 128),
            (1024, 1024),
            (256, 4096),
        ]
    } else {
        args.iter()
            .map(|s| {
                let (r, n) = s.split_once('x').expect("ROWSxN");
                (r.parse().expect("rows"), n.parse().expect("n"))
            })
            .collect()
    };
    let kernel = Kernel::detect();
    println!(
        "kernel {}, x {dtype}, one thread, ns per row (median of 15)",
        kernel.name()
    );
    for (rows, n) in shapes {
        let x: Vec<T> = (0..rows * n)
            .map(|i| T::from_f32(((i * 7919) % 1000) as f32 / 500.0 - 1.0))
            .collect();
        let w: Vec<f32> = (0..n).map(|i| 1.0 + (i % 13) as f32 / 100.0).collect();
        let mut y = vec![T::default(); rows * n];
        let mut rstd = vec![0f32; rows];
        let fwd = median_ns_per_row(rows, || {
            kernel.run(
                #[inline(always)]
                || {
                    forward_chunk::<T, f32, f32>(
                        kernel,
                        &x,
                        n,
                        |_| Some(&w[..]),
                        1e-6,
                        &mut y,
                        &mut rstd,
                    )
                },
            )
        });
        let b: Vec<f32> = (0..n).map(|i| (i % 7) as f32 / 50.0).collect();
        let mut mean = vec![0f32; rows];
        let layer = median_ns_per_row(rows, || {
            kernel.run(
                #[inline(always)]
                || {
                    layer_forward_chunk::<T, f32, f32>(
                        kernel,
                        &x,
                        n,
                        |_| Some(&w[..]),
                        |_| Some(&b[..]),
                        1e-6,
                        None,
                        &mut y,
                        Some(&mut mean),
                        &mut rstd,
                    )
                },
            )
        });
        let floor = median_ns_per_row(rows, || {
            kernel.run(
                #[inline(always)]
                || {
                    for (o, &v) in y.iter_mut().zip(&x) {
                        *o = T::from_f32(v.to_f32() * 1.5);
                    }
                },
            )
        });
        let mut dx = vec![T::default(); rows * n];
        let mut acc = vec![0f64; n];
        let bwd = median_ns_per_row(rows, || {
            acc.fill(0.0);
            kernel.run(
                #[inline(always)]
                || {
                    backward_chunk::<T, f32, f32>(
                        kernel,
                        &x,
                        &y,
                        n,
                        &w,
                        Rstd::Given(&rstd),
                        &mut dx,
                        &mut acc,
                    )
                },
            )
        });
        println!(
            "{rows:>6}x{n:<6} forward {fwd:8.1}  backward {bwd:8.1}  layer fwd {layer:8.1}  x*c {floor:8.1}  ({:.2} / {:.2} / {:.2} / {:.2} ns per element)",
            fwd / n as f64,
            bwd / n as f64,
            layer / n as f64,
            floor / n as f64
        );
    }
}
