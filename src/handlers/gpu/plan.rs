//! Launch plans of the RMS norm kernels: grid, block, team and shared memory for a call's
//! shape, and the weight-gradient scratch those launches use. Plain arithmetic, tested on the
//! CPU; the emulated matrix (tests/gpu_emulated.rs) runs every plan on the kernels.

use super::kernels::{size_of, wide_size_of};
use super::variant::Variant;
use crate::handlers::contract::Norm;
use crate::handlers::operands::acc_dtype;
use xla_ffi_bundles::ffi::DataType;

/// Elements per vector access: 16 bytes, or 1 on the scalar path.
pub fn vec_width(x: DataType, vectorized: bool) -> usize {
    if vectorized {
        16 / size_of(x)
    } else {
        1
    }
}

/// Vectors each backward thread caches (the VPT stamped in rmsnorm.cu: LayerNorm's backward
/// keeps the bias's accumulators too, and caches half as much); the forward's is its variant's
/// ([`Variant::fwd_vpt`]: 4 by default, both norms).
pub fn backward_vectors_per_thread(x: DataType, vectorized: bool, norm: Norm) -> usize {
    match (norm, vectorized, size_of(x)) {
        (Norm::Rms, true, 4) => 8,
        (Norm::Layer, true, 2 | 8) => 2,
        _ => 4,
    }
}

/// What a backward launch sums over rows besides computing dx: the weight's gradient and
/// LayerNorm's bias's (one partial row each per block, one finalize each), and the norm whose
/// kernel runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sums {
    pub norm: Norm,
    pub weight: bool,
    pub bias: bool,
}

impl Sums {
    /// The RMS norm's: the weight's gradient, if it has a weight.
    pub const fn rms(weight: bool) -> Sums {
        Sums {
            norm: Norm::Rms,
            weight,
            bias: false,
        }
    }

    /// Gradient rows per block (0, 1 or 2).
    pub fn rows(self) -> usize {
        self.weight as usize + self.bias as usize
    }
}

/// Threads per block of the backward kernel (its `__launch_bounds__(512, 1)`).
pub const BACKWARD_BLOCK: u32 = 512;

/// Largest weight-gradient scratch per device and call site.
pub const SCRATCH_LIMIT_BYTES: usize = 256 << 20;

/// Largest shared-memory weight-gradient row of a backward block (n `Wide` values, see
/// rmsnorm.cu): blocks of several teams add into one there. Within the 48 KB a launch gets
/// without cuFuncSetAttribute, with room for the kernel's static shared memory.
pub const SHARED_ROW_LIMIT_BYTES: usize = 32 << 10;

/// Rows a backward thread sums in its accumulator type before adding them at the float64 level
/// (rmsnorm.cu's `FOLD_ROWS`).
pub const FOLD_ROWS: i64 = 8;

/// Most blocks per thread block cluster a backward launch takes: the portable cluster size
/// (more needs cuFuncSetAttribute's NON_PORTABLE_CLUSTER_SIZE_ALLOWED). What a device without
/// clusters (before compute capability 9.0) passes as `max_cluster` is 1.
pub const MAX_CLUSTER: usize = 8;

/// The shape of one forward or backward launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    pub grid: u32,
    pub block: u32,
    /// Threads per row (a power of two, 32..=block).
    pub team: u32,
    pub shared_bytes: u32,
    /// Rows per block (backward).
    pub chunk: i64,
    /// Blocks per weight group (backward): `grid = groups * blocks_per_group * cluster`; with
    /// clusters, clusters per weight group.
    pub blocks_per_group: u32,
    /// Blocks per thread block cluster (backward; 1: none): the `_c` kernel, each row of a
    /// cluster's chunk split into `cluster` slices of columns (see [`backward_cluster`]).
    pub cluster: u32,
}

/// Threads per row: enough for each thread to cache at most `vpt` vectors, `min..=max`.
fn team_size(n: usize, vec: usize, vpt: usize, min: usize, max: usize) -> usize {
    let nv = n / vec;
    nv.div_ceil(vpt).next_power_of_two().clamp(min, max)
}

/// Forward: short rows get several rows per block, and rows of fewer than 32 threads' vectors
/// several per warp (teams of 1..32 threads: a warp's accesses cover whole rows, and no lane
/// idles; docs/gpu-traffic.md measured teams of 32 there at 8 of 32 lanes busy for rows of 64
/// bfloat16), long rows a block of up to 1024 threads; one row per team, no grid-stride needed
/// below 2^31 blocks. Batched weights need nothing more: the kernel picks a row's weight row
/// from its index. A [`Variant`] sets the vectors per thread, the smallest block, the most
/// threads (rows needing a larger team stream) and, `persistent`, a grid of at most that many
/// blocks per multiprocessor (`sm_count` of them), the kernel's row loop taking the rest.
pub fn forward_launch(
    x: DataType,
    n: usize,
    rows: usize,
    vectorized: bool,
    variant: &Variant,
    sm_count: usize,
) -> Launch {
    let vec = vec_width(x, vectorized);
    let max_threads = variant.fwd_max_threads();
    let team = team_size(n, vec, variant.fwd_vpt(), 1, max_threads);
    let block = team.max(variant.fwd_min_block());
    let teams = block / team;
    let mut grid = rows.div_ceil(teams).clamp(1, i32::MAX as usize);
    if variant.persistent() > 0 {
        grid = grid.min(variant.persistent() * sm_count.max(1));
    }
    Launch {
        grid: grid as u32,
        block: block as u32,
        team: team as u32,
        shared_bytes: 0,
        chunk: 0,
        blocks_per_group: 0,
        cluster: 1,
    }
}

/// Blocks per cluster of a backward launch: rows too long for one block's cache (which would
/// stream, x and dy read twice, one vector of each in flight per thread) split across the
/// smallest cluster of 2, 4 or 8 blocks whose slices of the row fit their caches, where the
/// device has clusters (`max_cluster`) and the vector path applies; else 1. Few such rows left
/// each SM's block with a partial row of its own, 17-33% of the call's bytes
/// (docs/gpu-traffic.md); a cluster writes one, and reads x once.
pub fn backward_cluster(
    x: DataType,
    n: usize,
    vectorized: bool,
    max_cluster: usize,
    norm: Norm,
) -> usize {
    // LayerNorm's backward has no cluster kernels (its rows stream instead).
    if !vectorized || norm != Norm::Rms {
        return 1;
    }
    let nv = n / vec_width(x, true);
    let cached = BACKWARD_BLOCK as usize * backward_vectors_per_thread(x, true, norm);
    if nv <= cached {
        return 1;
    }
    [2, 4, 8]
        .into_iter()
        .filter(|&c| c <= max_cluster.min(MAX_CLUSTER))
        .find(|&c| nv.is_multiple_of(c) && nv / c <= cached)
        .unwrap_or(1)
}

/// Backward: blocks of 512 threads, each owning a contiguous chunk of one weight group's rows
/// and (with a weight) one partial weight-gradient row of `Wide` values. One launch for all
/// `groups`: every group gets the same number of blocks, about `sm_count` in all (resident
/// blocks: one per SM by the launch bounds), at least one per group, within
/// [`SCRATCH_LIMIT_BYTES`] of partials. Several teams share a block only while the block's
/// shared weight-gradient row fits [`SHARED_ROW_LIMIT_BYTES`]; longer rows get one team of 512
/// (which adds into its partial row in global memory instead). Such blocks with float32
/// accumulators take chunks of at most [`FOLD_ROWS`] rows (narrow partials, see
/// [`narrow_partials`]) where that writes no more partial bytes than the float64 rows of about
/// `sm_count` blocks: with few long rows the partials were 8-67% of the call's minimum traffic
/// (docs/gpu-traffic.md), and a chunk of 8 rows is never folded in between. Rows that would
/// stream take clusters where the device has them ([`backward_cluster`], `max_cluster`: 1 for
/// none): everything above then counts clusters, of one team of 512 per block. LayerNorm with a
/// weight and a bias has two gradient rows where this says one ([`Sums`]): twice the shared
/// memory and scratch per block.
// The call's shape (dtype, n, groups, rows, vectorized), the device's (sm_count, max_cluster)
// and the weight: plain values, each named where it is passed.
#[allow(clippy::too_many_arguments)]
pub fn backward_launch(
    x: DataType,
    n: usize,
    groups: usize,
    rows_per_group: usize,
    vectorized: bool,
    sm_count: usize,
    sums: Sums,
    max_cluster: usize,
) -> Launch {
    let vec = vec_width(x, vectorized);
    let block = BACKWARD_BLOCK as usize;
    let vpt = backward_vectors_per_thread(x, vectorized, sums.norm);
    let wide = wide_size_of(acc_dtype(x));
    let grad_rows = sums.rows().max(1);
    let cluster = backward_cluster(
        x,
        n,
        vectorized,
        max_cluster.min(sm_count.max(1)),
        sums.norm,
    );
    let mut team = team_size(n, vec, vpt, 32, block);
    if grad_rows * n * wide > SHARED_ROW_LIMIT_BYTES || cluster > 1 {
        team = block;
    }
    let teams = block / team;
    let cached = n / vec <= team * vpt;
    let shared = if teams > 1 && cached {
        grad_rows * n * wide
    } else {
        0
    };
    let groups = groups.max(1);
    let wanted = rows_per_group.div_ceil(teams).max(1);
    // Clusters (or blocks) resident at once: one block per SM.
    let mut per_group = (sm_count / cluster).max(1).div_ceil(groups);
    if sums.rows() > 0 {
        let rows_in_limit = SCRATCH_LIMIT_BYTES / (n.max(1) * wide * grad_rows);
        per_group = per_group.min(rows_in_limit / groups).max(1);
    }
    let per_group = wanted.min(per_group);
    let mut chunk = rows_per_group.div_ceil(per_group).max(1);
    let one_team_f32 = sums.rows() > 0 && teams == 1 && wide == 8;
    if one_team_f32 && chunk > FOLD_ROWS as usize {
        let narrow_blocks = rows_per_group.div_ceil(FOLD_ROWS as usize);
        if narrow_blocks * 4 <= per_group * wide
            && groups * narrow_blocks * n.max(1) * 4 * grad_rows <= SCRATCH_LIMIT_BYTES
        {
            chunk = FOLD_ROWS as usize;
        }
    }
    let per_group = rows_per_group.div_ceil(chunk).max(1);
    Launch {
        grid: (groups * per_group * cluster).min(i32::MAX as usize) as u32,
        block: block as u32,
        team: team as u32,
        shared_bytes: shared as u32,
        chunk: chunk as i64,
        blocks_per_group: per_group as u32,
        cluster: cluster as u32,
    }
}

/// Where a backward launch's scratch holds what: its partial rows (one of `n` values per
/// cluster, or block, per gradient: [`partial_value_bytes`] each), the weight's from 0 and
/// LayerNorm's bias's from `bias_offset`, and with clusters their dot-product slots (2 per
/// block, `Wide` values: rmsnorm.cu's cluster_dot) from `dots_offset`; `bytes` in all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScratchLayout {
    pub bias_offset: usize,
    pub dots_offset: usize,
    pub bytes: usize,
}

pub fn backward_scratch(x: DataType, n: usize, launch: &Launch, sums: Sums) -> ScratchLayout {
    let row = (launch.grid / launch.cluster.max(1)) as usize * n * partial_value_bytes(x, launch);
    let bias_offset = if sums.weight { row } else { 0 };
    let partial = row * sums.rows();
    if launch.cluster <= 1 {
        return ScratchLayout {
            bias_offset,
            dots_offset: 0,
            bytes: partial,
        };
    }
    let dots_offset = partial.next_multiple_of(256);
    ScratchLayout {
        bias_offset,
        dots_offset,
        bytes: dots_offset + launch.grid as usize * 2 * wide_size_of(acc_dtype(x)),
    }
}

/// Whether a backward launch's blocks write narrow partial rows (n float32 sums of at most
/// [`FOLD_ROWS`] rows each, exact: rmsnorm.cu's `narrow`): one team per block, float32
/// accumulators, chunks of at most [`FOLD_ROWS`] rows (per cluster, with clusters). The
/// finalize is told (`narrow`).
pub fn narrow_partials(x: DataType, launch: &Launch) -> bool {
    wide_size_of(acc_dtype(x)) == 8 && launch.team == launch.block && launch.chunk <= FOLD_ROWS
}

/// Bytes per column of a backward launch's partial rows: 4 when narrow, else `Wide`'s.
pub fn partial_value_bytes(x: DataType, launch: &Launch) -> usize {
    if narrow_partials(x, launch) {
        4
    } else {
        wide_size_of(acc_dtype(x))
    }
}

/// Bytes of scratch the backward launches of a call site use ([`backward_scratch`]: the
/// gradients' partials, one row of `n` values per block or cluster and gradient, and a cluster
/// launch's dot-product slots), for whichever of the vector and scalar plans needs more (the
/// choice depends on buffer alignment, which can change from call to call). None without a
/// gradient to sum and clusters, or with nothing to reduce.
pub fn backward_scratch_bytes(
    x: DataType,
    n: usize,
    groups: usize,
    rows_per_group: usize,
    sm_count: usize,
    sums: Sums,
    max_cluster: usize,
) -> usize {
    if n == 0 || groups == 0 || rows_per_group == 0 {
        return 0;
    }
    [true, false]
        .into_iter()
        .filter(|&v| !v || n.is_multiple_of(vec_width(x, true)))
        .map(|v| {
            let l = backward_launch(x, n, groups, rows_per_group, v, sm_count, sums, max_cluster);
            backward_scratch(x, n, &l, sums).bytes
        })
        .max()
        .unwrap_or(0)
}

/// Whether every pointer is 16-byte aligned and rows are whole vectors (the `_v` kernels).
pub fn can_vectorize(x: DataType, n: usize, pointers: &[u64]) -> bool {
    n.is_multiple_of(16 / size_of(x)) && pointers.iter().all(|p| p.is_multiple_of(16))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launch_shapes() {
        // Short rows: several rows per block.
        let d = Variant::default();
        let l = forward_launch(DataType::BF16, 1024, 4096, true, &d, 132);
        assert_eq!((l.team, l.block), (32, 256));
        assert_eq!(l.grid, 4096 / 8);
        // Long rows: one row per block, every vector cached (nv <= team * 4).
        let l = forward_launch(DataType::F32, 16384, 10, true, &d, 132);
        assert_eq!((l.team, l.block, l.grid), (1024, 1024, 10));
        let l = backward_launch(
            DataType::BF16,
            16384,
            1,
            4096,
            true,
            132,
            Sums::rms(true),
            1,
        );
        // 32 rows per block: 128 blocks (no block left without rows).
        assert_eq!(
            (l.team, l.block, l.grid, l.shared_bytes),
            (512, 512, 128, 0)
        );
        assert!(l.chunk * l.grid as i64 >= 4096);
        let l = backward_launch(DataType::F32, 1024, 1, 5, true, 264, Sums::rms(true), 1);
        assert_eq!(l.team, 32);
        // The block's float64 weight-gradient row in shared memory.
        assert_eq!(l.shared_bytes, 1024 * 8);
        assert_eq!(l.grid, 1);
        // Rows whose float64 row would not fit: one team of 512 (several would take 64 KB).
        let l = backward_launch(DataType::F32, 8192, 1, 100, true, 64, Sums::rms(true), 1);
        assert_eq!((l.team, l.shared_bytes), (512, 0));
        let l = backward_launch(DataType::F32, 4096, 1, 100, true, 64, Sums::rms(true), 1);
        assert_eq!((l.team, l.shared_bytes), (128, 4096 * 8));
        let l = backward_launch(DataType::F64, 2048, 1, 100, true, 64, Sums::rms(true), 1);
        assert_eq!((l.team, l.shared_bytes), (256, 2048 * 16));
        // No empty blocks.
        let l = backward_launch(DataType::F32, 4096, 1, 100, true, 64, Sums::rms(true), 1);
        assert!((l.grid as i64 - 1) * l.chunk < 100);
        assert_eq!(
            backward_launch(DataType::F32, 8, 1, 0, false, 64, Sums::rms(true), 1).grid,
            1
        );
    }

    #[test]
    fn forward_variants_change_only_what_they_name() {
        let v = |s: &str| Variant::parse(s).unwrap();
        // 4096 rows of 1024 bfloat16 (128 vectors): teams of 32 by default, 16 with 8 vectors
        // per thread (16 teams per block of 256).
        let l = forward_launch(DataType::BF16, 1024, 4096, true, &v("fwd_vpt=8"), 132);
        assert_eq!((l.team, l.block, l.grid), (16, 256, 4096 / 16));
        // A smaller block, and a persistent grid of 2 blocks per multiprocessor.
        let l = forward_launch(
            DataType::BF16,
            1024,
            4096,
            true,
            &v("fwd_block=64,persistent=2"),
            132,
        );
        assert_eq!((l.team, l.block, l.grid), (32, 64, 264));
        // The persistent cap never raises the grid.
        let l = forward_launch(DataType::F32, 16384, 10, true, &v("persistent=2"), 132);
        assert_eq!(l.grid, 10);
        // Bounds of 256 threads: rows of 16384 float32 (4096 vectors) get a team of 256, which
        // caches 1024 of them (the kernel streams the row); the block is the bound.
        let l = forward_launch(DataType::F32, 16384, 10, true, &v("fwd_bounds=256:4"), 132);
        assert_eq!((l.team, l.block, l.grid), (256, 256, 10));
        let l = forward_launch(DataType::F32, 256, 100, true, &v("fwd_bounds=128"), 132);
        assert_eq!((l.team, l.block), (16, 128));
    }

    #[test]
    fn batched_weights_take_one_launch_with_whole_groups_per_block() {
        // 4 groups on 132 SMs: 33 blocks per group, chunks never straddle a group.
        let l = backward_launch(DataType::BF16, 4096, 4, 1024, true, 132, Sums::rms(true), 1);
        assert_eq!(l.grid, 4 * l.blocks_per_group);
        assert!(l.chunk * l.blocks_per_group as i64 >= 1024);
        assert!((l.blocks_per_group as i64 - 1) * l.chunk < 1024);
        // More groups than SMs: one block per group.
        let l = backward_launch(DataType::F32, 64, 500, 3, false, 132, Sums::rms(true), 1);
        assert_eq!((l.grid, l.blocks_per_group, l.chunk), (500, 1, 3));
    }

    #[test]
    fn scratch_is_what_the_launches_use() {
        // 4096 rows of 16384 bf16 on 132 SMs: 128 blocks of 32 rows, float64 partials.
        assert_eq!(
            backward_scratch_bytes(DataType::BF16, 16384, 1, 4096, 132, Sums::rms(true), 1),
            128 * 16384 * 8
        );
        // A few rows: one block per team of rows, not one per SM; the scalar plan (teams of
        // 256, two rows per block: 3 blocks) uses more than the vector plan (1 block).
        assert_eq!(
            backward_scratch_bytes(DataType::F32, 1024, 1, 5, 132, Sums::rms(true), 1),
            3 * 1024 * 8
        );
        // float64 input has compensated partials (two float64); no weight, no scratch.
        assert_eq!(
            backward_scratch_bytes(DataType::F64, 4096, 1, 8, 132, Sums::rms(true), 1),
            8 * 4096 * 16
        );
        assert_eq!(
            backward_scratch_bytes(DataType::F32, 4096, 1, 4096, 132, Sums::rms(false), 1),
            0
        );
        // Huge rows stay within the limit, or take one block (one partial row) if a row alone
        // is over it.
        assert_eq!(
            backward_scratch_bytes(DataType::F32, 1 << 26, 1, 64, 132, Sums::rms(true), 1),
            (1 << 26) * 8
        );
        assert!(
            backward_scratch_bytes(DataType::F32, 1 << 22, 1, 64, 132, Sums::rms(true), 1)
                <= SCRATCH_LIMIT_BYTES
        );
    }

    #[test]
    fn few_long_rows_take_narrow_partials() {
        // 2048 rows of 8192 bfloat16: 128 blocks of 16 rows would write 128 float64 rows and
        // fold twice; 256 blocks of 8 write 256 float32 rows (the same bytes), never folded.
        let l = backward_launch(DataType::BF16, 8192, 1, 2048, true, 132, Sums::rms(true), 1);
        assert_eq!((l.grid, l.team, l.chunk), (256, 512, 8));
        assert!(narrow_partials(DataType::BF16, &l));
        assert_eq!(
            backward_scratch_bytes(DataType::BF16, 8192, 1, 2048, 132, Sums::rms(true), 1),
            256 * 8192 * 4
        );
        // 1024 rows of 16384: 128 blocks of 8 rows as before, now narrow (half the bytes).
        let l = backward_launch(
            DataType::BF16,
            16384,
            1,
            1024,
            true,
            132,
            Sums::rms(true),
            1,
        );
        assert_eq!((l.grid, l.chunk), (128, 8));
        assert_eq!(partial_value_bytes(DataType::BF16, &l), 4);
        // Many rows: the float64 rows of about one block per SM are fewer bytes.
        let l = backward_launch(
            DataType::BF16,
            16384,
            1,
            4096,
            true,
            132,
            Sums::rms(true),
            1,
        );
        assert_eq!((l.grid, l.chunk), (128, 32));
        assert!(!narrow_partials(DataType::BF16, &l));
        // Several teams per block (a shared-memory row) or float64 input: never narrow.
        let l = backward_launch(DataType::F32, 1024, 1, 5, true, 132, Sums::rms(true), 1);
        assert!(!narrow_partials(DataType::F32, &l));
        let l = backward_launch(DataType::F64, 8192, 1, 4, true, 132, Sums::rms(true), 1);
        assert_eq!((l.team, l.chunk), (512, 1));
        assert_eq!(partial_value_bytes(DataType::F64, &l), 16);
    }

    #[test]
    fn rows_that_would_stream_split_across_clusters() {
        // 512 rows of 32768 bfloat16 (4096 vectors; a block caches 2048): clusters of 2, one
        // block per SM (66 clusters of 8 rows: narrow partials, 66 rows instead of 128).
        assert_eq!(
            backward_cluster(DataType::BF16, 32768, true, MAX_CLUSTER, Norm::Rms),
            2
        );
        let l = backward_launch(
            DataType::BF16,
            32768,
            1,
            512,
            true,
            132,
            Sums::rms(true),
            MAX_CLUSTER,
        );
        assert_eq!((l.cluster, l.team, l.block), (2, 512, 512));
        assert_eq!((l.grid, l.blocks_per_group, l.chunk), (128, 64, 8));
        assert!(narrow_partials(DataType::BF16, &l));
        let s = backward_scratch(DataType::BF16, 32768, &l, Sums::rms(true));
        assert_eq!(s.dots_offset, 64 * 32768 * 4);
        assert_eq!(s.bytes, s.dots_offset + 128 * 2 * 8);
        // 65536 bfloat16: clusters of 4; float32 rows of 32768 (8192 vectors, 4096 cached): 2.
        assert_eq!(
            backward_cluster(DataType::BF16, 65536, true, MAX_CLUSTER, Norm::Rms),
            4
        );
        assert_eq!(
            backward_cluster(DataType::F32, 32768, true, MAX_CLUSTER, Norm::Rms),
            2
        );
        // Rows a block caches, no clusters on the device, the scalar path, rows of no whole
        // slices (40000 bfloat16: 5000 vectors, slices of 2500 or 1250 too many for 2, 4 fits)
        // and rows too long for 8 blocks.
        assert_eq!(
            backward_cluster(DataType::BF16, 16384, true, MAX_CLUSTER, Norm::Rms),
            1
        );
        assert_eq!(
            backward_cluster(DataType::BF16, 32768, true, 1, Norm::Rms),
            1
        );
        assert_eq!(
            backward_cluster(DataType::BF16, 32768, false, MAX_CLUSTER, Norm::Rms),
            1
        );
        assert_eq!(
            backward_cluster(DataType::BF16, 40000, true, MAX_CLUSTER, Norm::Rms),
            4
        );
        assert_eq!(
            backward_cluster(DataType::BF16, 40008, true, MAX_CLUSTER, Norm::Rms),
            1
        );
        assert_eq!(
            backward_cluster(DataType::BF16, 1 << 20, true, MAX_CLUSTER, Norm::Rms),
            1
        );
        // Without a weight a cluster launch still needs its dot-product slots.
        assert_eq!(
            backward_scratch_bytes(
                DataType::BF16,
                32768,
                1,
                512,
                132,
                Sums::rms(false),
                MAX_CLUSTER
            ),
            128 * 2 * 8
        );
        // Batched weights: clusters per group, the grid a multiple of the cluster.
        let l = backward_launch(
            DataType::F32,
            32768,
            3,
            40,
            true,
            132,
            Sums::rms(true),
            MAX_CLUSTER,
        );
        assert_eq!(l.cluster, 2);
        assert_eq!(l.grid, 3 * l.blocks_per_group * 2);
        assert!(l.chunk * l.blocks_per_group as i64 >= 40);
    }

    #[test]
    fn layer_norm_launches_hold_both_gradients_and_take_no_clusters() {
        let both = Sums {
            norm: Norm::Layer,
            weight: true,
            bias: true,
        };
        // Its own vectors per thread: rows of 1024 float32 (256 vectors) get teams of 64.
        let l = backward_launch(DataType::F32, 1024, 1, 100, true, 64, both, 1);
        assert_eq!(l.team, 64);
        // Two gradient rows in shared memory, and two partial rows per block in the scratch,
        // the bias's after the weight's.
        assert_eq!(l.shared_bytes, 2 * 1024 * 8);
        let s = backward_scratch(DataType::F32, 1024, &l, both);
        assert_eq!(s.bias_offset, l.grid as usize * 1024 * 8);
        assert_eq!(s.bytes, 2 * s.bias_offset);
        // The bias alone: its rows from 0; neither: no scratch.
        let bias = Sums {
            weight: false,
            ..both
        };
        let s = backward_scratch(DataType::F32, 1024, &l, bias);
        assert_eq!((s.bias_offset, s.bytes), (0, l.grid as usize * 1024 * 8));
        let none = Sums {
            bias: false,
            ..bias
        };
        assert_eq!(backward_scratch(DataType::F32, 1024, &l, none).bytes, 0);
        // Rows whose two float64 rows would not fit shared memory: one team of 512 (the RMS
        // norm's single row of 2048 float32 fits: teams of 128).
        let l = backward_launch(DataType::F32, 4096, 1, 100, true, 64, both, 1);
        assert_eq!((l.team, l.shared_bytes), (512, 0));
        // No clusters: rows a block cannot cache stream.
        assert_eq!(
            backward_cluster(DataType::BF16, 32768, true, MAX_CLUSTER, Norm::Layer),
            1
        );
        let l = backward_launch(DataType::BF16, 32768, 1, 512, true, 132, both, MAX_CLUSTER);
        assert_eq!(l.cluster, 1);
    }

    /// The launches `make gpu-traffic` emulated and its table describes (written by
    /// tests/cuda_emulator/traffic.py from its own reading of this file's functions) are the
    /// ones these functions make.
    #[test]
    fn the_traffic_table_describes_these_plans() {
        let plans = include_str!("../../../docs/gpu-traffic-plans.txt");
        let mut checked = 0;
        for line in plans.lines() {
            let mut words = line.split_whitespace();
            let kind = words.next().unwrap();
            let x = match words.next().unwrap() {
                "f32" => DataType::F32,
                "bf16" => DataType::BF16,
                "f16" => DataType::F16,
                "f64" => DataType::F64,
                other => panic!("{line}: dtype {other}"),
            };
            let vectorized = words.next().unwrap() == "v";
            let field = |name: &str| -> usize {
                line.split_whitespace()
                    .find_map(|w| w.strip_prefix(&format!("{name}=")))
                    .unwrap_or_else(|| panic!("{line}: no {name}="))
                    .parse()
                    .unwrap()
            };
            let (n, rows) = (field("n"), field("rows"));
            assert_eq!(vectorized, can_vectorize(x, n, &[0]), "{line}");
            if kind == "bwd" || kind == "lnb" {
                // LayerNorm's backward (lnb) with a weight and a bias.
                let sums = if kind == "lnb" {
                    Sums {
                        norm: Norm::Layer,
                        weight: true,
                        bias: true,
                    }
                } else {
                    Sums::rms(true)
                };
                let l = backward_launch(
                    x,
                    n,
                    1,
                    rows,
                    vectorized,
                    field("sms"),
                    sums,
                    field("max_cluster"),
                );
                let want = (
                    l.grid as usize,
                    l.block as usize,
                    l.team as usize,
                    l.shared_bytes as usize,
                    l.chunk as usize,
                    l.blocks_per_group as usize,
                    l.cluster as usize,
                );
                let got = (
                    field("grid"),
                    field("block"),
                    field("team"),
                    field("shared"),
                    field("chunk"),
                    field("blocks_per_group"),
                    field("cluster"),
                );
                assert_eq!(got, want, "{line}");
            } else {
                let l = forward_launch(x, n, rows, vectorized, &Variant::default(), 1);
                let want = (l.grid as usize, l.block as usize, l.team as usize);
                assert_eq!(
                    (field("grid"), field("block"), field("team")),
                    want,
                    "{line}"
                );
            }
            checked += 1;
        }
        assert!(
            checked >= 60,
            "{checked} plans in docs/gpu-traffic-plans.txt"
        );
    }

    #[test]
    fn vectorization() {
        assert!(can_vectorize(DataType::BF16, 4096, &[256, 512]));
        assert!(!can_vectorize(DataType::BF16, 4100, &[256]));
        assert!(!can_vectorize(DataType::F32, 4096, &[8]));
    }
}
