//! The op contract of the RMS norm targets, defined once.
//!
//! Everything that says which calls are valid is here: the target names, the longest row, and
//! the (x, weight) dtype pairs with the dtype each accumulates in (which is also `rstd`'s).
//! Everything that acts on it reads it from here: the operand checks
//! ([`super::operands`]), the CPU dispatch (an exhaustive `match` over [`DtypePair`], so a
//! pair added here does not compile until the CPU has a kernel for it), the GPU kernel table
//! ([`super::gpu::kernels`] stamps one kernel per pair), the Python checks (through
//! `rmsnorm_ffi._native.contract()`) and the tests on both sides. A dtype or pair not listed is
//! refused with an error naming what is accepted; nothing falls back to a neighbour.

use xla_ffi_bundles::ffi::DataType;

/// The forward target: `(x[, weight]) -> (y, rstd)`.
pub const FORWARD_TARGET: &str = "rmsnorm_fwd";
/// The backward target: `(x[, weight], rstd, dy) -> (dx[, dweight])`.
pub const BACKWARD_TARGET: &str = "rmsnorm_bwd";
/// The fused residual-add forward (CPU only): `(x, residual[, weight]) -> (y, h, rstd)`, with
/// `h = x + residual` and the forward of `h`.
pub const RESIDUAL_TARGET: &str = "rmsnorm_residual_fwd";
/// Every target, in registration order (the CPU has all three, CUDA the first two).
pub const TARGETS: [&str; 3] = [FORWARD_TARGET, BACKWARD_TARGET, RESIDUAL_TARGET];

/// Longest row (normalized axis) accepted: keeps workspaces and the GPU scratch bounded.
pub const MAX_ROW_LEN: i64 = 1 << 26;

/// One accepted pair of x's dtype (also y's, dy's, dx's) and the weight's dtype (also
/// dweight's). A call without a weight uses the pair whose weight dtype is x's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DtypePair {
    F32,
    F64,
    F64WeightF32,
    BF16,
    BF16WeightF32,
    F16,
    F16WeightF32,
}

impl DtypePair {
    /// Every pair, in the order the tables list them.
    pub const ALL: [DtypePair; 7] = [
        DtypePair::F32,
        DtypePair::F64,
        DtypePair::F64WeightF32,
        DtypePair::BF16,
        DtypePair::BF16WeightF32,
        DtypePair::F16,
        DtypePair::F16WeightF32,
    ];

    /// The dtype of x, y, dy and dx.
    pub const fn x(self) -> DataType {
        match self {
            DtypePair::F32 => DataType::F32,
            DtypePair::F64 | DtypePair::F64WeightF32 => DataType::F64,
            DtypePair::BF16 | DtypePair::BF16WeightF32 => DataType::BF16,
            DtypePair::F16 | DtypePair::F16WeightF32 => DataType::F16,
        }
    }

    /// The dtype of the weight and its gradient.
    pub const fn weight(self) -> DataType {
        match self {
            DtypePair::F64 => DataType::F64,
            DtypePair::BF16 => DataType::BF16,
            DtypePair::F16 => DataType::F16,
            DtypePair::F32
            | DtypePair::F64WeightF32
            | DtypePair::BF16WeightF32
            | DtypePair::F16WeightF32 => DataType::F32,
        }
    }

    /// The dtype sums of squares and the weight gradient accumulate in, and `rstd`'s dtype:
    /// float64 for float64 input, float32 for the others (half precision included).
    pub const fn accumulation(self) -> DataType {
        match self.x() {
            DataType::F64 => DataType::F64,
            _ => DataType::F32,
        }
    }

    /// The pair for x's and the weight's dtypes (`None`: no weight), if the contract lists it.
    pub fn of(x: DataType, weight: Option<DataType>) -> Option<DtypePair> {
        let weight = weight.unwrap_or(x);
        DtypePair::ALL
            .into_iter()
            .find(|p| p.x() == x && p.weight() == weight)
    }
}

/// The dtypes x may have, in the order of [`DtypePair::ALL`].
pub fn x_dtypes() -> Vec<DataType> {
    let mut out: Vec<DataType> = Vec::new();
    for pair in DtypePair::ALL {
        if !out.contains(&pair.x()) {
            out.push(pair.x());
        }
    }
    out
}

/// The dtypes a weight may have with x of dtype `x` (x's own first); empty for an unlisted x.
pub fn weight_dtypes(x: DataType) -> Vec<DataType> {
    let mut out: Vec<DataType> = DtypePair::ALL
        .into_iter()
        .filter(|p| p.x() == x)
        .map(DtypePair::weight)
        .collect();
    out.sort_by_key(|w| *w != x);
    out
}

/// The accumulation dtype for x of dtype `x` (`rstd`'s dtype), if x's dtype is listed.
pub fn accumulation(x: DataType) -> Option<DataType> {
    DtypePair::of(x, None).map(DtypePair::accumulation)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_x_dtype_has_its_own_pair_and_a_float32_weight() {
        assert_eq!(
            x_dtypes(),
            [DataType::F32, DataType::F64, DataType::BF16, DataType::F16]
        );
        for x in x_dtypes() {
            assert_eq!(DtypePair::of(x, None), DtypePair::of(x, Some(x)));
            assert!(DtypePair::of(x, Some(DataType::F32)).is_some(), "{x}");
            assert_eq!(weight_dtypes(x)[0], x);
        }
        assert_eq!(weight_dtypes(DataType::F32), [DataType::F32]);
        assert_eq!(
            weight_dtypes(DataType::BF16),
            [DataType::BF16, DataType::F32]
        );
        assert!(weight_dtypes(DataType::S32).is_empty());
    }

    #[test]
    fn unlisted_pairs_and_dtypes_have_no_pair() {
        for (x, w) in [
            (DataType::F32, DataType::BF16),
            (DataType::F32, DataType::F64),
            (DataType::BF16, DataType::F16),
            (DataType::F16, DataType::F64),
            (DataType::S32, DataType::S32),
        ] {
            assert_eq!(DtypePair::of(x, Some(w)), None, "{x} with {w}");
        }
        assert_eq!(accumulation(DataType::S8), None);
        assert_eq!(accumulation(DataType::BF16), Some(DataType::F32));
        assert_eq!(accumulation(DataType::F64), Some(DataType::F64));
        let pairs: std::collections::HashSet<_> =
            DtypePair::ALL.iter().map(|p| (p.x(), p.weight())).collect();
        assert_eq!(pairs.len(), DtypePair::ALL.len(), "each pair listed once");
    }
}
