//! The kernel table: every kernel stamped in rmsnorm.cu with its family's parameter list (the
//! one list the launch builder checks arguments against, and a test checks against NVRTC's
//! PTX), and the per-capability compile cache.

use std::collections::HashMap;
use std::sync::Arc;

use once_cell::sync::{Lazy, OnceCell};
use parking_lot::Mutex;

use super::driver::{self, Compiled, GpuError, GpuResult, KernelSignature, Param};
use crate::handlers::contract::DtypePair;
use xla_ffi_bundles::ffi::DataType;

/// The CUDA C source of every kernel.
pub const SOURCE: &str = include_str!("rmsnorm.cu");

/// (x, weight) dtype pairs, in table order: the op contract's pairs, one forward and one
/// backward kernel each (rmsnorm.cu stamps them); a missing weight uses the pair whose weight
/// is x's dtype (with a null pointer).
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
        ("rows_per_group", I64),
    ],
};

/// `rmsnorm_bwd_*` (not finalize): BWD_ENTRY in rmsnorm.cu.
pub static BACKWARD: KernelSignature = KernelSignature {
    family: "rmsnorm_bwd",
    params: &[
        ("x", Ptr),
        ("w", Ptr),
        ("rstd", Ptr),
        ("dy", Ptr),
        ("dx", Ptr),
        ("partial", Ptr),
        ("n", I32),
        ("team", I32),
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

/// Kernels per (x, weight) combo: the three directions, each vectorized and scalar.
const PER_COMBO: usize = 6;

/// Every kernel with its parameter list, in module order: per combo fwd_v, fwd_s, bwd_v,
/// bwd_s, residual_fwd_v, residual_fwd_s; then finalize.
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
static CACHE: Lazy<Mutex<HashMap<i32, Cell>>> = Lazy::new(|| Mutex::new(HashMap::new()));

/// The kernels compiled for compute capability `cc`: compiled once per process per
/// capability (concurrent callers wait for the first), then shared.
pub fn compiled_for(cc: i32) -> GpuResult<Arc<Compiled>> {
    let cell = CACHE.lock().entry(cc).or_default().clone();
    cell.get_or_try_init(|| {
        let nvrtc = driver::nvrtc()?;
        let arch = target_arch(cc, &nvrtc.supported_archs()?)?;
        nvrtc.compile(SOURCE, "rmsnorm.cu", &arch).map(Arc::new)
    })
    .cloned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_pair_of_the_contract_has_its_kernels() {
        for pair in DtypePair::ALL {
            let (x, w) = (pair.x(), pair.weight());
            for dir in [Direction::Forward, Direction::Backward] {
                for vectorized in [true, false] {
                    let i = kernel_index(dir, x, Some(w), vectorized).unwrap();
                    let kind = if dir == Direction::Forward {
                        "fwd"
                    } else {
                        "bwd"
                    };
                    assert!(NAMES[i].starts_with(&format!(
                        "rmsnorm_{kind}_{}_w{}_",
                        code(x),
                        code(w)
                    )));
                }
            }
            let i = finalize_index(pair.accumulation(), w).unwrap();
            assert!(NAMES[i].ends_with(&format!("_{}_w{}", code(pair.accumulation()), code(w))));
        }
        assert_eq!(
            kernel_index(Direction::Forward, DataType::F32, None, true),
            kernel_index(Direction::Forward, DataType::F32, Some(DataType::F32), true)
        );
    }

    #[test]
    fn names_and_indices_agree() {
        assert_eq!(NAMES.len(), PER_COMBO * COMBOS.len() + FINALIZE.len());
        let i = kernel_index(Direction::Forward, DataType::BF16, None, true).unwrap();
        assert_eq!(NAMES[i], "rmsnorm_fwd_bf16_wbf16_v");
        let i = kernel_index(
            Direction::Backward,
            DataType::F16,
            Some(DataType::F32),
            false,
        )
        .unwrap();
        assert_eq!(NAMES[i], "rmsnorm_bwd_f16_wf32_s");
        let i = kernel_index(Direction::Residual, DataType::F32, None, true).unwrap();
        assert_eq!(NAMES[i], "rmsnorm_residual_fwd_f32_wf32_v");
        let i = kernel_index(
            Direction::Residual,
            DataType::BF16,
            Some(DataType::F32),
            false,
        )
        .unwrap();
        assert_eq!(NAMES[i], "rmsnorm_residual_fwd_bf16_wf32_s");
        let i = finalize_index(DataType::F64, DataType::F32).unwrap();
        assert_eq!(NAMES[i], "rmsnorm_bwd_finalize_f64_wf32");
        assert!(kernel_index(
            Direction::Forward,
            DataType::F32,
            Some(DataType::BF16),
            true
        )
        .is_none());
        for name in NAMES.iter() {
            assert!(SOURCE.contains(&name[..name.len() - 2]) || SOURCE.contains("STAMP"));
        }
    }

    #[test]
    fn every_family_packs_like_its_cuda_signature() {
        // Pointers and i64 on 8-byte boundaries, i32/f32 on 4 (the layout cuLaunchKernel's
        // parameter buffer takes).
        assert_eq!(FORWARD.packed_bytes(), 4 * 8 + 8 + 4 + 4 + 4 + 4 + 8);
        assert_eq!(RESIDUAL.packed_bytes(), 6 * 8 + 8 + 4 + 4 + 4 + 4 + 8);
        assert_eq!(BACKWARD.packed_bytes(), 6 * 8 + 4 + 4 + 8 + 8 + 8);
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
