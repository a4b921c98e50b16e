//! The kernel tables: every kernel stamped in rmsnorm.cu with its family's parameter list (the
//! one list the launch builder checks arguments against, and a test checks against NVRTC's
//! PTX), one table per norm, and the per-capability compile cache.
//!
//! Each norm's kernels are a module of their own (rmsnorm.cu's `KERNEL_NORMS`), compiled and
//! loaded only when a call site of that norm needs them: NVRTC takes about as long again for
//! LayerNorm's kernels as for the RMS norm's (45 s and 50 s for sm_90 on a 2-core VM), which a
//! process that uses one norm should not wait for.

use std::collections::HashMap;
use std::sync::Arc;

use once_cell::sync::{Lazy, OnceCell};
use parking_lot::Mutex;

use super::driver::{self, Compiled, GpuError, GpuResult, KernelSignature, Param};
use super::variant::Variant;
use crate::handlers::contract::{DtypePair, Norm};
use xla_ffi_bundles::ffi::DataType;

/// The CUDA C source of every kernel.
pub const SOURCE: &str = include_str!("rmsnorm.cu");

/// (x, weight) dtype pairs, in table order: the op contract's pairs, one forward, one backward
/// and one residual-forward kernel each per norm, vectorized and scalar (rmsnorm.cu stamps them
/// all: `STAMP_WEIGHTS`); a missing weight uses the pair whose weight is x's dtype (with a null
/// pointer), or LayerNorm's bias's.
pub const COMBOS: [DtypePair; 16] = DtypePair::ALL;

/// (accumulator, weight) dtype pairs of the finalize kernels: one per distinct pair of the
/// contract's accumulation and weight dtypes.
pub static FINALIZE: Lazy<Vec<(DataType, DataType)>> = Lazy::new(|| {
    let mut out = Vec::new();
    for pair in COMBOS {
        let key = (pair.accumulation(), pair.weight());
        if !out.contains(&key) {
            out.push(key);
        }
    }
    out
});

/// The dtype's suffix in kernel names. Only the contract's dtypes have kernels; any other is a
/// bug in the caller, which gets its dtypes from [`COMBOS`] or from checked operands.
fn code(d: DataType) -> &'static str {
    match d {
        DataType::F32 => "f32",
        DataType::F64 => "f64",
        DataType::BF16 => "bf16",
        DataType::F16 => "f16",
        other => panic!("{other} has no GPU kernels: it is not a dtype of the op contract"),
    }
}

use Param::{Ptr, F32, I32, I64};

/// The `offset` parameter of the forward, residual and backward kernels for a call site's scale
/// offset: the offset, or -0.0 for none (`weight_of` in rmsnorm.cu adds it to every weight
/// element, and w + -0.0 is w bit for bit, so a call without an offset gets the same bits as
/// kernels that never added one).
pub fn offset_param(offset: Option<f32>) -> f32 {
    offset.unwrap_or(-0.0)
}

/// `rmsnorm_fwd_*`: FWD_ENTRY in rmsnorm.cu.
pub static FORWARD: KernelSignature = KernelSignature {
    family: "rmsnorm_fwd",
    params: &[
        ("x", Ptr),
        ("w", Ptr),
        ("y", Ptr),
        ("rstd", Ptr),
        ("rows", I64),
        ("n", I32),
        ("team", I32),
        ("eps", F32),
        ("offset", F32),
        ("rows_per_group", I64),
    ],
};

/// `rmsnorm_residual_fwd_*`: RES_ENTRY in rmsnorm.cu.
pub static RESIDUAL: KernelSignature = KernelSignature {
    family: "rmsnorm_residual_fwd",
    params: &[
        ("x", Ptr),
        ("residual", Ptr),
        ("w", Ptr),
        ("y", Ptr),
        ("h", Ptr),
        ("rstd", Ptr),
        ("rows", I64),
        ("n", I32),
        ("team", I32),
        ("eps", F32),
        ("offset", F32),
        ("rows_per_group", I64),
    ],
};

/// `rmsnorm_bwd_*` (not finalize): BWD_ENTRY in rmsnorm.cu, the `_c` (cluster) kernels too
/// (`dots`: their cluster's dot-product slots; null for the others).
pub static BACKWARD: KernelSignature = KernelSignature {
    family: "rmsnorm_bwd",
    params: &[
        ("x", Ptr),
        ("w", Ptr),
        ("rstd", Ptr),
        ("dy", Ptr),
        ("dh", Ptr),
        ("dx", Ptr),
        ("partial", Ptr),
        ("dots", Ptr),
        ("n", I32),
        ("team", I32),
        ("offset", F32),
        ("chunk", I64),
        ("rows_per_group", I64),
        ("blocks_per_group", I64),
    ],
};

/// `layernorm_fwd_*`: LN_FWD_ENTRY in rmsnorm.cu (the forward's, with the bias and the mean).
pub static LAYER_FORWARD: KernelSignature = KernelSignature {
    family: "layernorm_fwd",
    params: &[
        ("x", Ptr),
        ("w", Ptr),
        ("b", Ptr),
        ("y", Ptr),
        ("mean", Ptr),
        ("rstd", Ptr),
        ("rows", I64),
        ("n", I32),
        ("team", I32),
        ("eps", F32),
        ("offset", F32),
        ("rows_per_group", I64),
    ],
};

/// `layernorm_residual_fwd_*`: LN_RES_ENTRY in rmsnorm.cu.
pub static LAYER_RESIDUAL: KernelSignature = KernelSignature {
    family: "layernorm_residual_fwd",
    params: &[
        ("x", Ptr),
        ("residual", Ptr),
        ("w", Ptr),
        ("b", Ptr),
        ("y", Ptr),
        ("h", Ptr),
        ("mean", Ptr),
        ("rstd", Ptr),
        ("rows", I64),
        ("n", I32),
        ("team", I32),
        ("eps", F32),
        ("offset", F32),
        ("rows_per_group", I64),
    ],
};

/// `layernorm_bwd_*`: LN_BWD_ENTRY in rmsnorm.cu (`partial_b`: the bias gradient's partial
/// rows, null without a bias; no clusters, so no `dots`).
pub static LAYER_BACKWARD: KernelSignature = KernelSignature {
    family: "layernorm_bwd",
    params: &[
        ("x", Ptr),
        ("w", Ptr),
        ("mean", Ptr),
        ("rstd", Ptr),
        ("dy", Ptr),
        ("dh", Ptr),
        ("dx", Ptr),
        ("partial", Ptr),
        ("partial_b", Ptr),
        ("n", I32),
        ("team", I32),
        ("offset", F32),
        ("chunk", I64),
        ("rows_per_group", I64),
        ("blocks_per_group", I64),
    ],
};

/// `rmsnorm_bwd_finalize_*`: FINALIZE_ENTRY in rmsnorm.cu.
pub static FINALIZE_KERNEL: KernelSignature = KernelSignature {
    family: "rmsnorm_bwd_finalize",
    params: &[
        ("partial", Ptr),
        ("blocks", I32),
        ("n", I32),
        ("narrow", I32),
        ("dw", Ptr),
    ],
};

/// Kernels per (x, weight) combo in a norm's table: the three directions, each vectorized and
/// scalar, and the RMS norm's backward split across a cluster (vectorized).
const fn per_combo(norm: Norm) -> usize {
    match norm {
        Norm::Rms => 7,
        Norm::Layer => 6,
    }
}

/// The norms' kernel name prefixes and signatures, per direction (forward, backward,
/// residual forward).
fn family(norm: Norm) -> (&'static str, [&'static KernelSignature; 3]) {
    match norm {
        Norm::Rms => ("rmsnorm", [&FORWARD, &BACKWARD, &RESIDUAL]),
        Norm::Layer => (
            "layernorm",
            [&LAYER_FORWARD, &LAYER_BACKWARD, &LAYER_RESIDUAL],
        ),
    }
}

/// A norm's kernels with their parameter lists, in module order: per combo fwd_v, fwd_s, bwd_v,
/// bwd_s, residual_fwd_v, residual_fwd_s (and the RMS norm's bwd_c); then the finalizes, which
/// both norms' modules have.
fn build_table(norm: Norm) -> Vec<(&'static str, &'static KernelSignature)> {
    let mut out: Vec<(&'static str, &'static KernelSignature)> = Vec::new();
    let (prefix, signatures) = family(norm);
    for pair in COMBOS {
        let (x, w) = (pair.x(), pair.weight());
        for (kind, signature) in ["fwd", "bwd", "residual_fwd"].into_iter().zip(signatures) {
            for path in ["v", "s"] {
                let name = format!("{prefix}_{kind}_{}_w{}_{path}", code(x), code(w));
                out.push((Box::leak(name.into_boxed_str()), signature));
            }
        }
        if norm == Norm::Rms {
            let name = format!("rmsnorm_bwd_{}_w{}_c", code(x), code(w));
            out.push((Box::leak(name.into_boxed_str()), &BACKWARD));
        }
    }
    for &(a, w) in FINALIZE.iter() {
        let name = format!("rmsnorm_bwd_finalize_{}_w{}", code(a), code(w));
        out.push((Box::leak(name.into_boxed_str()), &FINALIZE_KERNEL));
    }
    out
}

static RMS_TABLE: Lazy<Vec<(&'static str, &'static KernelSignature)>> =
    Lazy::new(|| build_table(Norm::Rms));
static LAYER_TABLE: Lazy<Vec<(&'static str, &'static KernelSignature)>> =
    Lazy::new(|| build_table(Norm::Layer));

/// The kernels of a norm's module, in module order (the indices below are into it).
pub fn table(norm: Norm) -> &'static [(&'static str, &'static KernelSignature)] {
    match norm {
        Norm::Rms => &RMS_TABLE,
        Norm::Layer => &LAYER_TABLE,
    }
}

/// Every kernel of both norms, each once (the finalizes are in both modules): what rmsnorm.cu
/// stamps with `KERNEL_NORMS` 3, which the tests compile.
pub static KERNELS: Lazy<Vec<(&'static str, &'static KernelSignature)>> = Lazy::new(|| {
    let mut out = table(Norm::Rms).to_vec();
    for k in table(Norm::Layer) {
        if !out.iter().any(|o| o.0 == k.0) {
            out.push(*k);
        }
    }
    out
});

/// Every kernel name of both norms.
pub static NAMES: Lazy<Vec<&'static str>> = Lazy::new(|| KERNELS.iter().map(|k| k.0).collect());

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Forward,
    Backward,
    /// The forward of `h = x + residual` (rmsnorm_residual_fwd).
    Residual,
}

/// The index in the norm's [`table`] of its forward, backward or residual kernel for x's and
/// the weight's dtypes (LayerNorm without a weight: the bias's).
pub fn kernel_index(
    norm: Norm,
    dir: Direction,
    x: DataType,
    w: Option<DataType>,
    vectorized: bool,
) -> Option<usize> {
    let pair = DtypePair::of(x, w)?;
    let combo = COMBOS.iter().position(|&c| c == pair)?;
    let dir = match dir {
        Direction::Forward => 0,
        Direction::Backward => 2,
        Direction::Residual => 4,
    };
    Some(per_combo(norm) * combo + dir + usize::from(!vectorized))
}

/// The index in the RMS norm's [`table`] of the backward kernel whose blocks split rows across
/// a thread block cluster (rmsnorm.cu's CLUSTER; vectorized only) for x's and the weight's
/// dtypes.
pub fn cluster_index(x: DataType, w: Option<DataType>) -> Option<usize> {
    let pair = DtypePair::of(x, w)?;
    let combo = COMBOS.iter().position(|&c| c == pair)?;
    Some(per_combo(Norm::Rms) * combo + 6)
}

/// The index in the norm's [`table`] of the finalize kernel writing a `w`-typed gradient from
/// `acc`.
pub fn finalize_index(norm: Norm, acc: DataType, w: DataType) -> Option<usize> {
    let i = FINALIZE.iter().position(|&c| c == (acc, w))?;
    Some(per_combo(norm) * COMBOS.len() + i)
}

/// Bytes per element of a dtype of the contract (any other is a bug in the caller, as for
/// the kernel names).
pub fn size_of(d: DataType) -> usize {
    match d {
        DataType::F64 => 8,
        DataType::F32 => 4,
        DataType::BF16 | DataType::F16 => 2,
        other => panic!("{other} has no GPU kernels: it is not a dtype of the op contract"),
    }
}

/// Bytes of one `Wide<A>` in rmsnorm.cu for the accumulator `acc`: the float64 level of the
/// sums (a float64, or a compensated pair of them for float64 accumulators), in which the
/// weight-gradient partial rows are kept.
pub fn wide_size_of(acc: DataType) -> usize {
    if acc == DataType::F64 {
        16
    } else {
        8
    }
}

/// The NVRTC target for a device of capability `cc` (e.g. 90): a cubin for `sm_XY` when this
/// NVRTC knows the architecture, else PTX for the newest `compute_XY` it knows that the device
/// runs (the driver JIT-compiles it).
pub fn target_arch(cc: i32, supported: &[i32]) -> GpuResult<String> {
    if supported.contains(&cc) {
        return Ok(format!("sm_{cc}"));
    }
    supported
        .iter()
        .copied()
        .filter(|&a| a <= cc)
        .max()
        .map(|a| format!("compute_{a}"))
        .ok_or_else(|| {
            GpuError::Unsupported(format!(
                "this NVRTC supports none of the architectures a device of compute capability \
                 {}.{} runs (it knows {supported:?})",
                cc / 10,
                cc % 10
            ))
        })
}

type Cell = Arc<OnceCell<Arc<Compiled>>>;
static CACHE: Lazy<Mutex<HashMap<(i32, String), Cell>>> = Lazy::new(|| Mutex::new(HashMap::new()));

/// The `#define` that makes rmsnorm.cu stamp one norm's kernels (`KERNEL_NORMS`: 1 the RMS
/// norm's, 2 LayerNorm's).
pub fn norm_define(norm: Norm) -> String {
    let bit = match norm {
        Norm::Rms => 1,
        Norm::Layer => 2,
    };
    format!("#define KERNEL_NORMS {bit}\n")
}

/// The source NVRTC compiles for `variant` and `norm`: the variant's `#define` lines and the
/// norm's, then rmsnorm.cu.
pub fn source_for(variant: &Variant, norm: Norm) -> String {
    variant.defines() + &norm_define(norm) + SOURCE
}

/// A norm's kernels compiled for compute capability `cc` and the variant's defines: compiled
/// once per process per (capability, defines) (concurrent callers wait for the first), then
/// shared. Variants that define nothing (launch-only knobs) share the default plan's.
pub fn compiled_for(cc: i32, variant: &Variant, norm: Norm) -> GpuResult<Arc<Compiled>> {
    let cell = CACHE
        .lock()
        .entry((cc, variant.defines() + &norm_define(norm)))
        .or_default()
        .clone();
    cell.get_or_try_init(|| {
        let nvrtc = driver::nvrtc()?;
        let arch = target_arch(cc, &nvrtc.supported_archs()?)?;
        nvrtc
            .compile(&source_for(variant, norm), "rmsnorm.cu", &arch)
            .map(Arc::new)
    })
    .cloned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    const DIRECTIONS: [(Direction, &str); 3] = [
        (Direction::Forward, "fwd"),
        (Direction::Backward, "bwd"),
        (Direction::Residual, "residual_fwd"),
    ];

    #[test]
    fn every_pair_of_the_contract_has_its_kernels() {
        for pair in DtypePair::ALL {
            let (x, w) = (pair.x(), pair.weight());
            let c = cluster_index(x, Some(w)).unwrap();
            let rms = table(Norm::Rms);
            assert_eq!(rms[c].0, format!("rmsnorm_bwd_{}_w{}_c", code(x), code(w)));
            assert!(std::ptr::eq(rms[c].1, &BACKWARD));
            for norm in [Norm::Rms, Norm::Layer] {
                let (prefix, signatures) = family(norm);
                let t = table(norm);
                for ((dir, kind), signature) in DIRECTIONS.into_iter().zip(signatures) {
                    for (vectorized, path) in [(true, "v"), (false, "s")] {
                        let i = kernel_index(norm, dir, x, Some(w), vectorized).unwrap();
                        assert_eq!(
                            t[i].0,
                            format!("{prefix}_{kind}_{}_w{}_{path}", code(x), code(w))
                        );
                        assert!(std::ptr::eq(t[i].1, signature));
                        assert_eq!(t[i].1.family, format!("{prefix}_{kind}"));
                        // No weight: the pair whose weight is x's dtype (a null pointer).
                        assert_eq!(
                            kernel_index(norm, dir, x, None, vectorized),
                            kernel_index(norm, dir, x, Some(x), vectorized)
                        );
                    }
                }
            }
            let acc = pair.accumulation();
            for norm in [Norm::Rms, Norm::Layer] {
                let i = finalize_index(norm, acc, w).unwrap();
                assert_eq!(
                    table(norm)[i].0,
                    format!("rmsnorm_bwd_finalize_{}_w{}", code(acc), code(w))
                );
            }
        }
    }

    #[test]
    fn names_and_indices_agree() {
        // The table holds the contract's pairs and (accumulator, weight) pairs, each once.
        assert_eq!(COMBOS, DtypePair::ALL);
        let finalize: HashSet<(DataType, DataType)> = DtypePair::ALL
            .iter()
            .map(|p| (p.accumulation(), p.weight()))
            .collect();
        assert_eq!(FINALIZE.len(), finalize.len());
        assert_eq!(FINALIZE.iter().copied().collect::<HashSet<_>>(), finalize);
        for norm in [Norm::Rms, Norm::Layer] {
            let names: HashSet<&str> = table(norm).iter().map(|k| k.0).collect();
            assert_eq!(names.len(), per_combo(norm) * COMBOS.len() + FINALIZE.len());
        }
        assert_eq!(NAMES.len(), 13 * COMBOS.len() + FINALIZE.len());
        let unique: HashSet<&str> = NAMES.iter().copied().collect();
        assert_eq!(unique.len(), NAMES.len(), "every kernel name once");
        // Dtypes outside the contract have no kernel (nothing falls back to a neighbour).
        assert!(kernel_index(
            Norm::Rms,
            Direction::Forward,
            DataType::F32,
            Some(DataType::S32),
            true
        )
        .is_none());
        assert!(
            kernel_index(Norm::Layer, Direction::Backward, DataType::S8, None, false).is_none()
        );
        assert!(finalize_index(Norm::Rms, DataType::BF16, DataType::F32).is_none());
    }

    /// The dtype-code pairs rmsnorm.cu stamps through `list` (`STAMP_WEIGHTS(x, T)` lines, or
    /// `FINALIZE_WEIGHTS(acc, A)`) times the `entry` lines in that macro's definition
    /// (`  STAMP(XN, T, w, W)`, or `  FINALIZE_ENTRY(AN, A, w, W)`): (x or acc code, w code).
    fn stamped(list: &str, entry: &str) -> HashSet<(String, String)> {
        let args = |rest: &str| -> Vec<String> {
            let inside = rest.split(')').next().unwrap_or("");
            inside.split(',').map(|a| a.trim().to_string()).collect()
        };
        let outer: Vec<String> = SOURCE
            .lines()
            .filter_map(|l| l.strip_prefix(&format!("{list}(")))
            .map(|rest| args(rest)[0].clone())
            .collect();
        let inner: Vec<String> = SOURCE
            .lines()
            .filter_map(|l| l.strip_prefix(&format!("  {entry}(")))
            .map(|rest| args(rest)[2].clone())
            .collect();
        outer
            .iter()
            .flat_map(|a| inner.iter().map(move |w| (a.clone(), w.clone())))
            .collect()
    }

    #[test]
    fn rmsnorm_cu_stamps_exactly_the_contracts_pairs() {
        let want: HashSet<(String, String)> = COMBOS
            .iter()
            .map(|p| (code(p.x()).to_string(), code(p.weight()).to_string()))
            .collect();
        assert_eq!(stamped("STAMP_WEIGHTS", "STAMP"), want);
        let want: HashSet<(String, String)> = FINALIZE
            .iter()
            .map(|&(a, w)| (code(a).to_string(), code(w).to_string()))
            .collect();
        assert_eq!(stamped("FINALIZE_WEIGHTS", "FINALIZE_ENTRY"), want);
    }

    #[test]
    fn no_offset_adds_the_additive_identity() {
        // What weight_of computes without a scale offset is the weight itself, bit for bit.
        let none = offset_param(None);
        for w in [
            0.0f32,
            -0.0,
            1.5,
            -2.0,
            f32::MIN_POSITIVE,
            -1e-45,
            f32::INFINITY,
        ] {
            assert_eq!((w + none).to_bits(), w.to_bits(), "{w:e}");
            assert_eq!((w as f64 + none as f64).to_bits(), (w as f64).to_bits());
        }
        assert_eq!(offset_param(Some(1.0)), 1.0);
    }

    #[test]
    fn every_family_packs_like_its_cuda_signature() {
        // Pointers and i64 on 8-byte boundaries, i32/f32 on 4 (the layout cuLaunchKernel's
        // parameter buffer takes).
        // x, w, y, rstd, rows, n, team, eps, offset, rows_per_group.
        assert_eq!(FORWARD.packed_bytes(), 4 * 8 + 8 + 4 + 4 + 4 + 4 + 8);
        assert_eq!(RESIDUAL.packed_bytes(), 6 * 8 + 8 + 4 + 4 + 4 + 4 + 8);
        // LayerNorm's: the bias and the mean besides.
        assert_eq!(LAYER_FORWARD.packed_bytes(), 6 * 8 + 8 + 4 + 4 + 4 + 4 + 8);
        assert_eq!(LAYER_RESIDUAL.packed_bytes(), 8 * 8 + 8 + 4 + 4 + 4 + 4 + 8);
        // x, w, mean, rstd, dy, dh, dx, partial, partial_b, n, team, offset, 4 bytes of
        // padding, chunk, rows_per_group, blocks_per_group.
        assert_eq!(
            LAYER_BACKWARD.packed_bytes(),
            9 * 8 + 4 + 4 + 4 + 4 + 8 + 8 + 8
        );
        // x, w, rstd, dy, dh, dx, partial, dots, n, team, offset, 4 bytes of padding, chunk,
        // rows_per_group, blocks_per_group.
        assert_eq!(BACKWARD.packed_bytes(), 8 * 8 + 4 + 4 + 4 + 4 + 8 + 8 + 8);
        // partial, blocks, n, narrow, 4 bytes of padding, dw.
        assert_eq!(FINALIZE_KERNEL.packed_bytes(), 8 + 4 + 4 + 4 + 4 + 8);
    }

    #[test]
    fn architecture_choice() {
        assert_eq!(target_arch(90, &[80, 86, 90]).unwrap(), "sm_90");
        assert_eq!(target_arch(100, &[80, 90]).unwrap(), "compute_90");
        assert!(target_arch(70, &[80, 90]).is_err());
    }
}
