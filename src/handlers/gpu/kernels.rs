//! The kernel table (names stamped in rmsnorm.cu), the per-capability compile cache, and the
//! launch shapes. Everything here but [`compiled_for`] is plain arithmetic, tested on the CPU.

use std::collections::HashMap;
use std::sync::Arc;

use once_cell::sync::{Lazy, OnceCell};
use parking_lot::Mutex;

use super::driver::{self, Compiled, GpuError, GpuResult};
use crate::ffi::DataType;
use crate::handlers::contract::DtypePair;

/// The CUDA C source of every kernel.
pub const SOURCE: &str = include_str!("rmsnorm.cu");

/// (x, weight) dtype pairs, in table order: the op contract's pairs, one forward and one
/// backward kernel each (rmsnorm.cu stamps them); a missing weight uses the pair whose weight
/// is x's dtype (with a null pointer).
pub const COMBOS: [DtypePair; 7] = DtypePair::ALL;

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

/// Every kernel name, in module order: per combo fwd_v, fwd_s, bwd_v, bwd_s; then finalize.
pub static NAMES: Lazy<Vec<&'static str>> = Lazy::new(|| {
    let mut out: Vec<&'static str> = Vec::new();
    for pair in COMBOS {
        let (x, w) = (pair.x(), pair.weight());
        for kind in ["fwd", "bwd"] {
            for path in ["v", "s"] {
                let name = format!("rmsnorm_{kind}_{}_w{}_{path}", code(x), code(w));
                out.push(Box::leak(name.into_boxed_str()));
            }
        }
    }
    for &(a, w) in FINALIZE.iter() {
        let name = format!("rmsnorm_bwd_finalize_{}_w{}", code(a), code(w));
        out.push(Box::leak(name.into_boxed_str()));
    }
    out
});

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Forward,
    Backward,
}

/// The index in [`NAMES`] of the forward or backward kernel for x's and the weight's dtypes.
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
    };
    Some(4 * combo + dir + usize::from(!vectorized))
}

/// The index in [`NAMES`] of the finalize kernel writing a `w`-typed gradient from `acc`.
pub fn finalize_index(acc: DataType, w: DataType) -> Option<usize> {
    let i = FINALIZE.iter().position(|&c| c == (acc, w))?;
    Some(4 * COMBOS.len() + i)
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

/// Elements per vector access: 16 bytes, or 1 on the scalar path.
pub fn vec_width(x: DataType, vectorized: bool) -> usize {
    if vectorized {
        16 / size_of(x)
    } else {
        1
    }
}

/// Vectors each thread caches (the VPT stamped in rmsnorm.cu).
pub fn vectors_per_thread(dir: Direction, x: DataType, vectorized: bool) -> usize {
    match (dir, vectorized, size_of(x)) {
        (Direction::Backward, true, 4) => 8,
        _ => 4,
    }
}

/// Threads per block of the backward kernel (its `__launch_bounds__(512, 1)`).
pub const BACKWARD_BLOCK: u32 = 512;

/// The shape of one kernel launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    pub grid: u32,
    pub block: u32,
    /// Threads per row (a power of two, 32..=block).
    pub team: u32,
    pub shared_bytes: u32,
    /// Rows per block (backward).
    pub chunk: i64,
}

/// Threads per row: enough for each thread to cache at most `vpt` vectors, 32..=`max`.
fn team_size(n: usize, vec: usize, vpt: usize, max: usize) -> usize {
    let nv = n / vec;
    nv.div_ceil(vpt).next_power_of_two().clamp(32, max)
}

/// Forward: short rows get several rows per block (teams of >= 32 threads), long rows a block
/// of up to 1024 threads; one row per team, no grid-stride needed below 2^31 blocks.
pub fn forward_launch(x: DataType, n: usize, rows: usize, vectorized: bool) -> Launch {
    let vec = vec_width(x, vectorized);
    let team = team_size(
        n,
        vec,
        vectors_per_thread(Direction::Forward, x, vectorized),
        1024,
    );
    let block = team.max(256);
    let teams = block / team;
    let grid = rows.div_ceil(teams).clamp(1, i32::MAX as usize);
    Launch {
        grid: grid as u32,
        block: block as u32,
        team: team as u32,
        shared_bytes: 0,
        chunk: 0,
    }
}

/// Backward: blocks of 512 threads, at most `max_blocks` (resident blocks, bounded by the
/// scratch rows), each owning a contiguous chunk of rows and one partial weight-gradient row.
pub fn backward_launch(
    x: DataType,
    n: usize,
    rows: usize,
    vectorized: bool,
    max_blocks: usize,
) -> Launch {
    let vec = vec_width(x, vectorized);
    let block = BACKWARD_BLOCK as usize;
    let team = team_size(
        n,
        vec,
        vectors_per_thread(Direction::Backward, x, vectorized),
        block,
    );
    let teams = block / team;
    let nv = n / vec;
    let cached = nv <= team * vectors_per_thread(Direction::Backward, x, vectorized);
    let shared = if teams > 1 && cached {
        n * size_of(crate::handlers::operands::acc_dtype(x))
    } else {
        0
    };
    let wanted = rows.div_ceil(teams).max(1);
    let grid = wanted.min(max_blocks.max(1));
    let chunk = rows.div_ceil(grid).max(1);
    let grid = rows.div_ceil(chunk).max(1);
    Launch {
        grid: grid as u32,
        block: block as u32,
        team: team as u32,
        shared_bytes: shared as u32,
        chunk: chunk as i64,
    }
}

/// Largest dweight scratch per device and call site.
pub const SCRATCH_LIMIT_BYTES: usize = 256 << 20;

/// Partial rows (float32-sized) of the backward scratch for rows of `n` on `sm_count` SMs:
/// two per SM, within [`SCRATCH_LIMIT_BYTES`], at least two (one float64 row).
pub fn partial_rows(n: usize, sm_count: usize) -> usize {
    let by_limit = SCRATCH_LIMIT_BYTES / (n.max(1) * 4);
    (2 * sm_count).min(by_limit).max(2)
}

/// Whether every pointer is 16-byte aligned and rows are whole vectors (the `_v` kernels).
pub fn can_vectorize(x: DataType, n: usize, pointers: &[u64]) -> bool {
    n.is_multiple_of(16 / size_of(x)) && pointers.iter().all(|p| p.is_multiple_of(16))
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
    fn names_and_indices_agree() {
        assert_eq!(NAMES.len(), 4 * COMBOS.len() + FINALIZE.len());
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
    fn launch_shapes() {
        // Short rows: several rows per block.
        let l = forward_launch(DataType::BF16, 1024, 4096, true);
        assert_eq!((l.team, l.block), (32, 256));
        assert_eq!(l.grid, 4096 / 8);
        // Long rows: one row per block, every vector cached (nv <= team * 4).
        let l = forward_launch(DataType::F32, 16384, 10, true);
        assert_eq!((l.team, l.block, l.grid), (1024, 1024, 10));
        let l = backward_launch(DataType::BF16, 16384, 4096, true, 132);
        // 32 rows per block: 128 blocks (no block left without rows).
        assert_eq!(
            (l.team, l.block, l.grid, l.shared_bytes),
            (512, 512, 128, 0)
        );
        assert!(l.chunk * l.grid as i64 >= 4096);
        let l = backward_launch(DataType::F32, 1024, 5, true, 264);
        assert_eq!(l.team, 32);
        assert_eq!(l.shared_bytes, 1024 * 4);
        assert_eq!(l.grid, 1);
        // No empty blocks.
        let l = backward_launch(DataType::F32, 4096, 100, true, 64);
        assert!((l.grid as i64 - 1) * l.chunk < 100);
        assert_eq!(backward_launch(DataType::F32, 8, 0, false, 64).grid, 1);
    }

    #[test]
    fn scratch_and_vectorization() {
        assert_eq!(partial_rows(16384, 132), 264);
        assert_eq!(partial_rows(1 << 26, 132), 2);
        assert!(can_vectorize(DataType::BF16, 4096, &[256, 512]));
        assert!(!can_vectorize(DataType::BF16, 4100, &[256]));
        assert!(!can_vectorize(DataType::F32, 4096, &[8]));
    }

    #[test]
    fn architecture_choice() {
        assert_eq!(target_arch(90, &[80, 86, 90]).unwrap(), "sm_90");
        assert_eq!(target_arch(100, &[80, 90]).unwrap(), "compute_90");
        assert!(target_arch(70, &[80, 90]).is_err());
    }
}
