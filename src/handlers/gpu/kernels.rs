//! The kernel table: every kernel stamped in rmsnorm.cu with its family's parameter list (the
//! one list the launch builder checks arguments against, and a test checks against NVRTC's
//! PTX), and the per-capability compile cache.

use std::collections::HashMap;
use std::sync::Arc;

use once_cell::sync::{Lazy, OnceCell};
use parking_lot::Mutex;

use super::driver::{self, Compiled, GpuError, GpuResult, KernelSignature, Param};
use super::variant::Variant;
use crate::handlers::contract::DtypePair;
use xla_ffi_bundles::ffi::DataType;

/// The CUDA C source of every kernel.
pub const SOURCE: &str = include_str!("rmsnorm.cu");

/// (x, weight) dtype pairs, in table order: the op contract's pairs, one forward, one backward
/// and one residual-forward kernel each, vectorized and scalar (rmsnorm.cu stamps them all:
/// `STAMP_WEIGHTS`); a missing weight uses the pair whose weight is x's dtype (with a null
/// pointer).
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

/// Kernels per (x, weight) combo: the three directions, each vectorized and scalar, and the
/// backward split across a cluster (vectorized).
const PER_COMBO: usize = 7;

/// Every kernel with its parameter list, in module order: per combo fwd_v, fwd_s, bwd_v,
/// bwd_s, residual_fwd_v, residual_fwd_s, bwd_c; then finalize.
pub static KERNELS: Lazy<Vec<(&'static str, &'static KernelSignature)>> = Lazy::new(|| {
    let mut out: Vec<(&'static str, &'static KernelSignature)> = Vec::new();
    for pair in COMBOS {
        let (x, w) = (pair.x(), pair.weight());
        for (kind, signature) in [
            ("fwd", &FORWARD),
            ("bwd", &BACKWARD),
            ("residual_fwd", &RESIDUAL),
        ] {
            for path in ["v", "s"] {
                let name = format!("rmsnorm_{kind}_{}_w{}_{path}", code(x), code(w));
                out.push((Box::leak(name.into_boxed_str()), signature));
            }
        }
        let name = format!("rmsnorm_bwd_{}_w{}_c", code(x), code(w));
        out.push((Box::leak(name.into_boxed_str()), &BACKWARD));
    }
    for &(a, w) in FINALIZE.iter() {
        let name = format!("rmsnorm_bwd_finalize_{}_w{}", code(a), code(w));
        out.push((Box::leak(name.into_boxed_str()), &FINALIZE_KERNEL));
    }
    out
});

/// Every kernel name, in module order.
pub static NAMES: Lazy<Vec<&'static str>> = Lazy::new(|| KERNELS.iter().map(|k| k.0).collect());

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Forward,
    Backward,
    /// The forward of `h = x + residual` (rmsnorm_residual_fwd).
    Residual,
}

/// The index in [`NAMES`] of the forward, backward or residual kernel for x's and the
/// weight's dtypes.
pub fn kernel_index(
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
    Some(PER_COMBO * combo + dir + usize::from(!vectorized))
}

/// The index in [`NAMES`] of the backward kernel whose blocks split rows across a thread block
/// cluster (rmsnorm.cu's CLUSTER; vectorized only) for x's and the weight's dtypes.
pub fn cluster_index(x: DataType, w: Option<DataType>) -> Option<usize> {
    let pair = DtypePair::of(x, w)?;
    let combo = COMBOS.iter().position(|&c| c == pair)?;
    Some(PER_COMBO * combo + 6)
}

/// The index in [`NAMES`] of the finalize kernel writing a `w`-typed gradient from `acc`.
pub fn finalize_index(acc: DataType, w: DataType) -> Option<usize> {
    let i = FINALIZE.iter().position(|&c| c == (acc, w))?;
    Some(PER_COMBO * COMBOS.len() + i)
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

/// The source NVRTC compiles for `variant`: its `#define` lines, then rmsnorm.cu (the file
/// itself for the default plan).
pub fn source_for(variant: &Variant) -> String {
    variant.defines() + SOURCE
}

/// The kernels compiled for compute capability `cc` and the variant's defines: compiled once
/// per process per (capability, defines) (concurrent callers wait for the first), then shared.
/// Variants that define nothing (launch-only knobs) share the default plan's.
pub fn compiled_for(cc: i32, variant: &Variant) -> GpuResult<Arc<Compiled>> {
    let cell = CACHE
        .lock()
        .entry((cc, variant.defines()))
        .or_default()
        .clone();
    cell.get_or_try_init(|| {
        let nvrtc = driver::nvrtc()?;
        let arch = target_arch(cc, &nvrtc.supported_archs()?)?;
        nvrtc
            .compile(&source_for(variant), "rmsnorm.cu", &arch)
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
            assert_eq!(NAMES[c], format!("rmsnorm_bwd_{}_w{}_c", code(x), code(w)));
            assert!(std::ptr::eq(KERNELS[c].1, &BACKWARD));
            for (dir, kind) in DIRECTIONS {
                for (vectorized, path) in [(true, "v"), (false, "s")] {
                    let i = kernel_index(dir, x, Some(w), vectorized).unwrap();
                    assert_eq!(
                        NAMES[i],
                        format!("rmsnorm_{kind}_{}_w{}_{path}", code(x), code(w))
                    );
                    assert!(std::ptr::eq(
                        KERNELS[i].1,
                        match dir {
                            Direction::Forward => &FORWARD,
                            Direction::Backward => &BACKWARD,
                            Direction::Residual => &RESIDUAL,
                        }
                    ));
                    // No weight: the pair whose weight is x's dtype (a null pointer).
                    assert_eq!(
                        kernel_index(dir, x, None, vectorized),
                        kernel_index(dir, x, Some(x), vectorized)
                    );
                }
            }
            let acc = pair.accumulation();
            let i = finalize_index(acc, w).unwrap();
            assert_eq!(
                NAMES[i],
                format!("rmsnorm_bwd_finalize_{}_w{}", code(acc), code(w))
            );
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
        assert_eq!(NAMES.len(), PER_COMBO * COMBOS.len() + FINALIZE.len());
        let unique: HashSet<&str> = NAMES.iter().copied().collect();
        assert_eq!(unique.len(), NAMES.len(), "every kernel name once");
        // Dtypes outside the contract have no kernel (nothing falls back to a neighbour).
        assert!(
            kernel_index(Direction::Forward, DataType::F32, Some(DataType::S32), true).is_none()
        );
        assert!(kernel_index(Direction::Backward, DataType::S8, None, false).is_none());
        assert!(finalize_index(DataType::BF16, DataType::F32).is_none());
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
