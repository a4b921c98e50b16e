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

xla_ffi_bundles::ffi_int_enum! {
    /// Which norm a call computes: the kind is a parameter of every target (their attribute
    /// `norm`; absent, the form every call had before LayerNorm, the RMS norm), so both norms
    /// share the operand checks, the dtype pairs, the thread plans and the partitioning rules.
    pub enum Norm {
        /// `x * rstd * w`, `rstd = 1 / sqrt(mean(x^2) + eps)`: statistics `(rstd,)`.
        Rms = 0,
        /// `(x - mean) * rstd * w + b`, `rstd = 1 / sqrt(var(x) + eps)`: statistics
        /// `(mean, rstd)`, and an optional bias.
        Layer = 1,
    }
}

impl Norm {
    /// The per-row statistics a forward returns after y (and h), in order, and a backward that
    /// is given them takes before dy; each in the accumulation dtype, shaped like x without its
    /// last axis.
    pub const fn statistics(self) -> &'static [&'static str] {
        match self {
            Norm::Rms => &["rstd"],
            Norm::Layer => &["mean", "rstd"],
        }
    }

    /// Whether the norm subtracts the row's mean (and may add a bias).
    pub const fn centred(self) -> bool {
        matches!(self, Norm::Layer)
    }
}

xla_ffi_bundles::ffi_int_enum! {
    /// Which part of a split row a call computes (attribute `split`; absent: the whole row).
    /// When a mesh shards the normalized axis itself (tensor-parallel activations), no device
    /// holds a whole row: each runs a sums pass over its slice, the devices all-reduce those
    /// per-row sums (a few floats per row, never the activations), and each runs the apply
    /// pass over its slice given the whole row's sums. Every sum is in the accumulation dtype,
    /// `sums` shaped `(*rows, k)`; `full_len` is the whole row's length (what the sums are
    /// divided by). Per norm, forward (`rmsnorm_fwd`):
    ///
    /// - `Sums`: `(x) -> (sums)`, k = 1: the RMS norm's `sum(x^2)`, LayerNorm's `sum(x)`;
    /// - `CentredSums` (LayerNorm): `(x, mean) -> (sums)`, k = 2: `sum(x - m)`,
    ///   `sum((x - m)^2)` about the mean `m` taken from the first all-reduce;
    /// - `Apply`: the whole forward's operands, then `[mean]` (LayerNorm) and the all-reduced
    ///   `sums` (of the last sums pass) -> the whole forward's results.
    ///
    /// Backward (`rmsnorm_bwd`, given the statistics; the RMS norm with `eps` takes rstd from
    /// the row, its sum of squares travelling with the dot products):
    ///
    /// - `Sums`: the whole backward's arguments -> `(sums)`: the RMS norm's `sum(g * x)`
    ///   (and `sum(x^2)` with `eps`: k = 2), LayerNorm's `sum(x - m)`, `sum(g)`,
    ///   `sum(g * (x - m))` (k = 3), with `g = dy * w`;
    /// - `Apply`: the whole backward's arguments, then the all-reduced `sums` -> dx and this
    ///   device's rows' gradient sums (dweight, dbias) in the accumulation dtype, for the
    ///   caller to all-reduce over the mesh axes that shard the rows and round once.
    pub enum Split {
        Sums = 1,
        CentredSums = 2,
        Apply = 3,
    }
}

impl Split {
    /// The sums per row a sums pass of `norm` returns (`backward`: of the backward; `squares`:
    /// a backward that takes rstd from x).
    pub const fn sums(self, norm: Norm, backward: bool, squares: bool) -> usize {
        match (norm, backward, self) {
            (Norm::Rms, false, _) => 1,
            (Norm::Rms, true, _) => 1 + squares as usize,
            (Norm::Layer, false, Split::CentredSums | Split::Apply) => 2,
            (Norm::Layer, false, Split::Sums) => 1,
            (Norm::Layer, true, _) => 3,
        }
    }
}

/// Longest row (normalized axis) accepted: keeps workspaces and the GPU scratch bounded.
pub const MAX_ROW_LEN: i64 = 1 << 26;

/// A floating-point dtype of the op contract: every x dtype, and every weight dtype with every
/// x dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Float {
    F32,
    F64,
    BF16,
    F16,
}

impl Float {
    /// Every float, in the order the tables list them.
    pub const ALL: [Float; 4] = [Float::F32, Float::F64, Float::BF16, Float::F16];

    pub const fn dtype(self) -> DataType {
        match self {
            Float::F32 => DataType::F32,
            Float::F64 => DataType::F64,
            Float::BF16 => DataType::BF16,
            Float::F16 => DataType::F16,
        }
    }

    pub fn of(d: DataType) -> Option<Float> {
        Float::ALL.into_iter().find(|f| f.dtype() == d)
    }
}

/// One accepted pair of x's dtype (also y's, dy's, dx's) and the weight's dtype (also
/// dweight's): any float x with any float weight (mixed-precision trainers keep bfloat16
/// parameters next to float32 activations, or the reverse). The weight is read in its own
/// dtype and combined in the accumulation dtype, which x alone decides. A call without a weight
/// uses the pair whose weight dtype is x's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DtypePair {
    pub x: Float,
    pub weight: Float,
}

impl DtypePair {
    /// Every pair, x-major in [`Float::ALL`]'s order.
    pub const ALL: [DtypePair; 16] = {
        let mut out = [DtypePair {
            x: Float::F32,
            weight: Float::F32,
        }; 16];
        let mut i = 0;
        while i < 16 {
            out[i] = DtypePair {
                x: Float::ALL[i / 4],
                weight: Float::ALL[i % 4],
            };
            i += 1;
        }
        out
    };

    /// The dtype of x, y, dy and dx.
    pub const fn x(self) -> DataType {
        self.x.dtype()
    }

    /// The dtype of the weight and its gradient.
    pub const fn weight(self) -> DataType {
        self.weight.dtype()
    }

    /// The dtype sums of squares and the weight gradient accumulate in, and `rstd`'s dtype:
    /// float64 for float64 input, float32 for the others (half precision included), whatever
    /// the weight's dtype.
    pub const fn accumulation(self) -> DataType {
        match self.x {
            Float::F64 => DataType::F64,
            _ => DataType::F32,
        }
    }

    /// The pair for x's and the weight's dtypes (`None`: no weight), if the contract lists it.
    pub fn of(x: DataType, weight: Option<DataType>) -> Option<DtypePair> {
        Some(DtypePair {
            x: Float::of(x)?,
            weight: Float::of(weight.unwrap_or(x))?,
        })
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
    fn every_x_dtype_pairs_with_every_float_weight_its_own_first() {
        assert_eq!(
            x_dtypes(),
            [DataType::F32, DataType::F64, DataType::BF16, DataType::F16]
        );
        for x in x_dtypes() {
            assert_eq!(DtypePair::of(x, None), DtypePair::of(x, Some(x)));
            assert_eq!(weight_dtypes(x)[0], x);
            assert_eq!(weight_dtypes(x).len(), 4, "{x}");
            for w in x_dtypes() {
                let pair = DtypePair::of(x, Some(w)).expect("listed");
                assert_eq!((pair.x(), pair.weight()), (x, w));
                assert_eq!(pair.accumulation(), accumulation(x).unwrap());
            }
        }
        assert!(weight_dtypes(DataType::S32).is_empty());
    }

    #[test]
    fn unlisted_dtypes_have_no_pair() {
        for (x, w) in [
            (DataType::F32, DataType::S32),
            (DataType::S32, DataType::F32),
            (DataType::S32, DataType::S32),
            (DataType::BF16, DataType::F8E5M2),
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
