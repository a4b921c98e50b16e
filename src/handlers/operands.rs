//! The operands of the `rmsnorm_fwd` / `rmsnorm_bwd` targets, shared by the CPU and GPU bundles:
//! their attributes and the checks instantiate makes of them, and which dtypes and shapes the
//! arguments and results must have, checked against those attributes and the op contract
//! ([`super::contract`]). Every check names the attribute or operand it rejects.

use super::contract::{self, DtypePair, Norm, Split};
use super::error::HandlerError;
use xla_ffi_bundles::ffi::{
    AnyBuffer, AnyResult, ArgsView, DataType, FfiError, FfiResult, Operand, Platform, ResultList,
};

pub use super::contract::MAX_ROW_LEN;

xla_ffi_bundles::ffi_attrs! {
    /// Attributes of `rmsnorm_fwd`.
    pub struct ForwardAttrs {
        /// Added to the mean square; finite and >= 0.
        pub eps: f32,
        /// Whether argument 1 is a weight.
        pub has_weight: bool,
        /// Length of the normalized (last) axis.
        pub row_len: i64,
        /// Present and not 0: the weight is applied as `scale_offset + w` (zero-centred gamma:
        /// Gemma's `1 + w`), taken in the accumulation dtype; finite. Absent (the form every
        /// call had before it existed): `w`.
        pub scale_offset: Option<f32>,
        /// The norm (`contract::Norm`'s values); absent: the RMS norm.
        pub norm: Option<Norm>,
        /// Present and true (LayerNorm only): the argument after the weight (or x) is a bias
        /// added to y, shaped and typed as a weight. Absent: false.
        pub has_bias: Option<bool>,
        /// Present: the part of a split row the call computes (`contract::Split`; CPU only).
        pub split: Option<Split>,
        /// With `split`: the whole row's length (`row_len` is this device's slice's).
        pub full_len: Option<i64>,
    }
}

xla_ffi_bundles::ffi_attrs! {
    /// Attributes of `rmsnorm_bwd`.
    pub struct BackwardAttrs {
        /// Present: the call has no `rstd` operand and takes each row's `rstd` itself, from x
        /// and this `eps`, exactly as the forward does (finite and >= 0; CPU only). Absent:
        /// `rstd` is an operand (the form artifacts exported before it existed call).
        pub eps: Option<f32>,
        /// Whether argument 1 is a weight (and result 1 its gradient).
        pub has_weight: bool,
        /// Length of the normalized (last) axis.
        pub row_len: i64,
        /// As the forward's: the weight the forward applied is `scale_offset + w`; the weight
        /// gradient is still with respect to `w`.
        pub scale_offset: Option<f32>,
        /// Present and true: the call has one more argument after dy, `dh`, a gradient of x's
        /// shape and dtype added to dx in the accumulation dtype before dx is rounded once
        /// (the fused residual add's backward, where `h = x + residual` flows on to later
        /// layers too). Absent: false.
        pub has_dh: Option<bool>,
        /// As the forward's. A LayerNorm backward is given the forward's `mean` and `rstd`
        /// (or, with `eps`, takes both from x).
        pub norm: Option<Norm>,
        /// Present and true (LayerNorm only): the call has one more result after dweight (or
        /// dx), the bias's gradient. Absent: false.
        pub has_bias: Option<bool>,
        /// As the forward's (`Sums` or `Apply`).
        pub split: Option<Split>,
        /// As the forward's.
        pub full_len: Option<i64>,
    }
}

/// `split` and `full_len` checked against each other, the norm and the row: the whole row's
/// length (`full_len`, at least the slice's `row_len`) for a split call, `None` for a whole
/// one. `backward`: a backward call (no `CentredSums`; LayerNorm given its statistics).
pub fn check_split(
    split: Option<Split>,
    full_len: Option<i64>,
    row_len: usize,
    norm: Norm,
    backward: bool,
) -> Result<Option<usize>, HandlerError> {
    let Some(split) = split else {
        return match full_len {
            Some(_) => Err(HandlerError::attribute(
                "full_len",
                "is the length of a split row: it needs `split`",
            )),
            None => Ok(None),
        };
    };
    if split == Split::CentredSums && (backward || !norm.centred()) {
        return Err(HandlerError::attribute(
            "split",
            "CentredSums (2) is LayerNorm's forward's second sums pass",
        ));
    }
    match full_len {
        Some(len) if (row_len as i64..=MAX_ROW_LEN).contains(&len) && len > 0 => {
            Ok(Some(len as usize))
        }
        Some(len) => Err(HandlerError::attribute(
            "full_len",
            format!("must be in {}..={MAX_ROW_LEN} and > 0 (the slice has row_len={row_len}), got {len}", row_len.max(1)),
        )),
        None => Err(HandlerError::attribute(
            "full_len",
            "a split call needs the whole row's length",
        )),
    }
}

/// The norm and whether it has a bias, from the attributes `norm` and `has_bias`: a bias only
/// with LayerNorm.
pub fn check_norm(
    norm: Option<Norm>,
    has_bias: Option<bool>,
) -> Result<(Norm, bool), HandlerError> {
    let norm = norm.unwrap_or(Norm::Rms);
    let has_bias = has_bias == Some(true);
    if has_bias && !norm.centred() {
        return Err(HandlerError::attribute(
            "has_bias",
            "a bias is LayerNorm's (norm=1); the RMS norm has none",
        ));
    }
    Ok((norm, has_bias))
}

/// `scale_offset`: finite; `None` for an absent or zero offset (then the weight is `w` itself).
pub fn check_scale_offset(offset: Option<f32>) -> Result<Option<f32>, HandlerError> {
    match offset {
        Some(v) if !v.is_finite() => Err(HandlerError::attribute(
            "scale_offset",
            format!("must be finite, got {v}"),
        )),
        Some(v) if v != 0.0 => Ok(Some(v)),
        _ => Ok(None),
    }
}

/// `eps`: finite and >= 0 (it is added to a mean of squares).
pub fn check_eps(eps: f32) -> Result<(), HandlerError> {
    if !eps.is_finite() || eps < 0.0 {
        return Err(HandlerError::attribute(
            "eps",
            format!("must be finite and >= 0, got {eps}"),
        ));
    }
    Ok(())
}

/// `row_len`: in 0..=[`MAX_ROW_LEN`].
pub fn check_row_len(row_len: i64) -> Result<usize, HandlerError> {
    if !(0..=MAX_ROW_LEN).contains(&row_len) {
        return Err(HandlerError::attribute(
            "row_len",
            format!("must be in 0..={MAX_ROW_LEN}, got {row_len}"),
        ));
    }
    Ok(row_len as usize)
}

/// The shape of a call, checked against the state's attributes.
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    pub rows: usize,
    pub n: usize,
    /// Weight groups: 1, or the product of the weight's leading (batch) dimensions (0 if one
    /// of them is 0, and then there are no rows either).
    pub groups: usize,
}

impl Layout {
    pub fn rows_per_group(&self) -> usize {
        self.rows.checked_div(self.groups).unwrap_or(0)
    }
}

/// The accumulator dtype for `x`'s dtype (the dtype of `rstd`), for an x that the operand
/// checks accepted; any other dtype is a bug here and panics (the trampoline reports it).
pub fn acc_dtype(x: DataType) -> DataType {
    contract::accumulation(x)
        .unwrap_or_else(|| panic!("{x} is not an x dtype of the op contract (checked before)"))
}

fn check_x<P: Platform>(
    x: &AnyBuffer<'_, P>,
    row_len: usize,
) -> Result<(usize, usize), HandlerError> {
    if contract::accumulation(x.dtype()).is_none() {
        let accepted = contract::x_dtypes();
        return Err(HandlerError::dtype(x.operand(), &accepted, x.dtype()));
    }
    let Some((&n, lead)) = x.dims().split_last() else {
        return Err(HandlerError::shape(
            x.operand(),
            "a scalar has no rows; expected rank >= 1",
        ));
    };
    if n as usize != row_len {
        return Err(HandlerError::shape(
            x.operand(),
            format!("last axis has {n} elements but the call site was instantiated for row_len={row_len}"),
        ));
    }
    Ok((lead.iter().product::<i64>() as usize, row_len))
}

/// The weight's groups (see [`Layout::groups`]), for a weight whose dtype pairs with x's.
fn check_weight<P: Platform>(
    x: &AnyBuffer<'_, P>,
    w: &AnyBuffer<'_, P>,
) -> Result<usize, HandlerError> {
    check_weight_like(x, w.operand(), w.dtype(), w.dims())
}

/// [`check_weight`] for any operand shaped and typed as a weight (a bias, a bias's gradient).
fn check_weight_like<P: Platform>(
    x: &AnyBuffer<'_, P>,
    operand: Operand,
    dtype: DataType,
    wd: &[i64],
) -> Result<usize, HandlerError> {
    if DtypePair::of(x.dtype(), Some(dtype)).is_none() {
        let accepted = contract::weight_dtypes(x.dtype());
        return Err(HandlerError::dtype(operand, &accepted, dtype));
    }
    let xd = x.dims();
    let k = wd.len().wrapping_sub(1);
    if wd.is_empty() || k >= xd.len() || wd[k] != xd[xd.len() - 1] || wd[..k] != xd[..k] {
        return Err(HandlerError::shape(
            operand,
            format!(
                "expected (n,) with n = {} (or x's leading batch dims then n), got {wd:?}",
                xd[xd.len() - 1]
            ),
        ));
    }
    let groups = wd[..k].iter().product::<i64>() as usize;
    // 0 when a batch dim is 0: then the weight gradient is empty and nothing may be written.
    Ok(groups)
}

/// Arguments 0 (x) and, with a weight, 1, checked against the attributes, each other and the
/// contract, with the contract's pair for their dtypes.
#[allow(clippy::type_complexity)]
fn x_and_weight<'a, P: Platform>(
    args: &ArgsView<'a, P>,
    has_weight: bool,
    row_len: usize,
) -> FfiResult<(
    AnyBuffer<'a, P>,
    Option<AnyBuffer<'a, P>>,
    DtypePair,
    Layout,
)> {
    let x = args.get(0)?;
    let (rows, n) = check_x(&x, row_len)?;
    let w = if has_weight { Some(args.get(1)?) } else { None };
    let (pair, layout) = pair_and_layout(&x, w.as_ref(), rows, n)?;
    Ok((x, w, pair, layout))
}

/// The contract's pair and the layout of a call with x and a weight-shaped operand (the weight,
/// else the bias or its gradient), checked.
fn pair_and_layout<P: Platform>(
    x: &AnyBuffer<'_, P>,
    w: Option<&AnyBuffer<'_, P>>,
    rows: usize,
    n: usize,
) -> FfiResult<(DtypePair, Layout)> {
    let groups = match w {
        Some(w) => check_weight(x, w)?,
        None => 1,
    };
    let pair = DtypePair::of(x.dtype(), w.map(|w| w.dtype()))
        .ok_or_else(|| FfiError::internal("the checked dtypes have no pair in the contract"))?;
    Ok((pair, Layout { rows, n, groups }))
}

/// A bias (argument `index`): the weight's dtype and shape where there is a weight, else shaped
/// and typed as a weight would be (then it sets the pair and the layout, as a weight would).
fn check_bias<P: Platform>(
    x: &AnyBuffer<'_, P>,
    w: Option<&AnyBuffer<'_, P>>,
    b: &AnyBuffer<'_, P>,
) -> Result<(), HandlerError> {
    match w {
        Some(w) => expect(b.operand(), b.dtype(), b.dims(), w.dtype(), w.dims()),
        None => check_weight(x, b).map(|_| ()),
    }
}

fn expect(
    operand: Operand,
    dtype: DataType,
    dims: &[i64],
    want_dtype: DataType,
    want_dims: &[i64],
) -> Result<(), HandlerError> {
    if dtype != want_dtype {
        return Err(HandlerError::dtype(operand, &[want_dtype], dtype));
    }
    if dims != want_dims {
        return Err(HandlerError::shape(
            operand,
            format!("expected {want_dims:?}, got {dims:?}"),
        ));
    }
    Ok(())
}

fn result<'r, P: Platform>(
    list: &mut ResultList<'r, P>,
    index: usize,
) -> FfiResult<AnyResult<'r, P>> {
    list.take(index)
        .ok_or_else(|| FfiError::invalid_argument(format!("missing result {index}")))
}

fn count(what: &str, got: usize, want: usize) -> FfiResult<()> {
    if got != want {
        return Err(FfiError::invalid_argument(format!(
            "wrong number of {what}: expected {want}, got {got}"
        )));
    }
    Ok(())
}

/// Which operands a forward call has.
#[derive(Debug, Clone, Copy)]
pub struct ForwardForm {
    pub norm: Norm,
    pub has_weight: bool,
    pub has_bias: bool,
    pub row_len: usize,
    /// `Some(Split::Apply)`: the call is a split row's apply pass (its sums passes have
    /// operands of their own: [`sums_operands`]).
    pub split: Option<Split>,
}

impl ForwardForm {
    /// An RMS norm's (no bias).
    pub fn rms(has_weight: bool, row_len: usize) -> ForwardForm {
        ForwardForm {
            norm: Norm::Rms,
            has_weight,
            has_bias: false,
            row_len,
            split: None,
        }
    }

    /// The arguments after x (and the residual).
    fn params(&self) -> usize {
        self.has_weight as usize + self.has_bias as usize
    }
}

/// The checked operands of one `rmsnorm_fwd` call: x, the optional weight and bias, y and the
/// statistics (LayerNorm's mean, rstd).
pub struct ForwardOperands<'a, 'r, P: Platform> {
    pub x: AnyBuffer<'a, P>,
    pub w: Option<AnyBuffer<'a, P>>,
    pub b: Option<AnyBuffer<'a, P>>,
    pub y: AnyResult<'r, P>,
    /// LayerNorm's mean (`None` for the RMS norm).
    pub mean: Option<AnyResult<'r, P>>,
    pub rstd: AnyResult<'r, P>,
    /// The contract's pair for x's and the weight's dtypes.
    pub pair: DtypePair,
    pub layout: Layout,
    /// A split row's apply pass: LayerNorm's mean and the whole rows' sums.
    pub split: Option<SplitInputs<'a, P>>,
}

/// The arguments an apply pass adds after the whole call's (see `contract::Split`).
pub struct SplitInputs<'a, P: Platform> {
    /// LayerNorm's mean (a forward's; a backward's is among its statistics).
    pub mean: Option<AnyBuffer<'a, P>>,
    pub sums: AnyBuffer<'a, P>,
    /// Sums per row.
    pub k: usize,
}

/// A split call's `sums`: the pair's accumulation dtype, x's leading shape and then `k`.
fn expect_sums<P: Platform>(
    operand: Operand,
    dtype: DataType,
    dims: &[i64],
    x: &AnyBuffer<'_, P>,
    pair: DtypePair,
    k: usize,
) -> Result<(), HandlerError> {
    let mut want = x.dims()[..x.rank() - 1].to_vec();
    want.push(k as i64);
    expect(operand, dtype, dims, pair.accumulation(), &want)
}

/// The checked operands of a split row's sums pass: a forward's x (and LayerNorm's mean in a
/// `CentredSums` pass), or a backward's arguments without dh (x, [weight], [statistics], dy);
/// and the one result, the sums.
pub struct SumsOperands<'a, 'r, P: Platform> {
    pub x: AnyBuffer<'a, P>,
    pub w: Option<AnyBuffer<'a, P>>,
    pub mean: Option<AnyBuffer<'a, P>>,
    pub rstd: Option<AnyBuffer<'a, P>>,
    /// A backward's (`None` in a forward's pass).
    pub dy: Option<AnyBuffer<'a, P>>,
    pub sums: AnyResult<'r, P>,
    pub k: usize,
    pub pair: DtypePair,
    pub layout: Layout,
}

/// Decodes and checks a forward sums pass: `(x) -> (sums)`, or LayerNorm's `CentredSums`
/// `(x, mean) -> (sums)`.
pub fn sums_operands<'a, 'r, P: Platform>(
    args: &ArgsView<'a, P>,
    rets: &mut ResultList<'r, P>,
    norm: Norm,
    split: Split,
    row_len: usize,
) -> FfiResult<SumsOperands<'a, 'r, P>> {
    let centred = split == Split::CentredSums;
    count("arguments", args.len(), 1 + centred as usize)?;
    count("results", rets.len(), 1)?;
    let (x, _, pair, layout) = x_and_weight(args, false, row_len)?;
    let mean = if centred {
        let mean = args.get(1)?;
        expect_rstd(mean.operand(), mean.dtype(), mean.dims(), &x, pair)?;
        Some(mean)
    } else {
        None
    };
    let k = split.sums(norm, false, false);
    let sums = result(rets, 0)?;
    expect_sums(sums.operand(), sums.dtype(), sums.dims(), &x, pair, k)?;
    Ok(SumsOperands {
        x,
        w: None,
        mean,
        rstd: None,
        dy: None,
        sums,
        k,
        pair,
        layout,
    })
}

/// Decodes and checks a forward call: counts, x, weight and bias against the attributes, y of
/// x's dtype and shape, the statistics of the accumulator dtype and x's leading shape.
pub fn forward_operands<'a, 'r, P: Platform>(
    args: &ArgsView<'a, P>,
    rets: &mut ResultList<'r, P>,
    form: ForwardForm,
) -> FfiResult<ForwardOperands<'a, 'r, P>> {
    let apply = form.split == Some(Split::Apply);
    let extra = if apply {
        1 + form.norm.centred() as usize
    } else {
        0
    };
    count("arguments", args.len(), 1 + form.params() + extra)?;
    count("results", rets.len(), 1 + form.norm.statistics().len())?;
    let x = args.get(0)?;
    let (rows, n) = check_x(&x, form.row_len)?;
    let mut ops = forward_rest(args, rets, form, x, (rows, n), 1, 1)?;
    if apply {
        let first = 1 + form.params();
        let mean = if form.norm.centred() {
            let mean = args.get(first)?;
            expect_rstd(mean.operand(), mean.dtype(), mean.dims(), &ops.x, ops.pair)?;
            Some(mean)
        } else {
            None
        };
        let sums = args.get(first + mean.is_some() as usize)?;
        let k = Split::Apply.sums(form.norm, false, false);
        expect_sums(
            sums.operand(),
            sums.dtype(),
            sums.dims(),
            &ops.x,
            ops.pair,
            k,
        )?;
        ops.split = Some(SplitInputs { mean, sums, k });
    }
    Ok(ops)
}

/// The rest of a forward call after x (and the residual): the weight and bias from argument
/// `arg`, y (result 0) and the statistics from result `stat`.
fn forward_rest<'a, 'r, P: Platform>(
    args: &ArgsView<'a, P>,
    rets: &mut ResultList<'r, P>,
    form: ForwardForm,
    x: AnyBuffer<'a, P>,
    (rows, n): (usize, usize),
    arg: usize,
    stat: usize,
) -> FfiResult<ForwardOperands<'a, 'r, P>> {
    let w = if form.has_weight {
        Some(args.get(arg)?)
    } else {
        None
    };
    let b = if form.has_bias {
        Some(args.get(arg + form.has_weight as usize)?)
    } else {
        None
    };
    if let Some(b) = &b {
        check_bias(&x, w.as_ref(), b)?;
    }
    let (pair, layout) = pair_and_layout(&x, w.as_ref().or(b.as_ref()), rows, n)?;
    let y = result(rets, 0)?;
    expect(y.operand(), y.dtype(), y.dims(), x.dtype(), x.dims())?;
    let mean = if form.norm.centred() {
        let mean = result(rets, stat)?;
        expect_rstd(mean.operand(), mean.dtype(), mean.dims(), &x, pair)?;
        Some(mean)
    } else {
        None
    };
    let rstd = result(rets, stat + mean.is_some() as usize)?;
    expect_rstd(rstd.operand(), rstd.dtype(), rstd.dims(), &x, pair)?;
    Ok(ForwardOperands {
        x,
        w,
        b,
        y,
        mean,
        rstd,
        pair,
        layout,
        split: None,
    })
}

/// A statistic (rstd, mean: a result of the forward, an operand of the backward): the pair's
/// accumulator dtype and x's leading shape.
fn expect_rstd<P: Platform>(
    operand: Operand,
    dtype: DataType,
    dims: &[i64],
    x: &AnyBuffer<'_, P>,
    pair: DtypePair,
) -> Result<(), HandlerError> {
    expect(
        operand,
        dtype,
        dims,
        pair.accumulation(),
        &x.dims()[..x.rank() - 1],
    )
}

/// The checked operands of one `rmsnorm_residual_fwd` call: x, the residual, the optional
/// weight, and the results y, h (= x + residual) and rstd.
pub struct ResidualOperands<'a, 'r, P: Platform> {
    pub forward: ForwardOperands<'a, 'r, P>,
    pub residual: AnyBuffer<'a, P>,
    pub h: AnyResult<'r, P>,
}

/// Decodes and checks a fused residual-add forward call: arguments (x, residual, [weight],
/// [bias]), results (y, h, statistics); the residual and h of x's dtype and shape, the rest as
/// for [`forward_operands`].
pub fn residual_operands<'a, 'r, P: Platform>(
    args: &ArgsView<'a, P>,
    rets: &mut ResultList<'r, P>,
    form: ForwardForm,
) -> FfiResult<ResidualOperands<'a, 'r, P>> {
    count("arguments", args.len(), 2 + form.params())?;
    count("results", rets.len(), 2 + form.norm.statistics().len())?;
    let x = args.get(0)?;
    let (rows, n) = check_x(&x, form.row_len)?;
    let residual = args.get(1)?;
    expect(
        residual.operand(),
        residual.dtype(),
        residual.dims(),
        x.dtype(),
        x.dims(),
    )?;
    let h = result(rets, 1)?;
    expect(h.operand(), h.dtype(), h.dims(), x.dtype(), x.dims())?;
    let forward = forward_rest(args, rets, form, x, (rows, n), 2, 2)?;
    Ok(ResidualOperands {
        forward,
        residual,
        h,
    })
}

/// The checked operands of one `rmsnorm_bwd` call.
pub struct BackwardOperands<'a, 'r, P: Platform> {
    pub x: AnyBuffer<'a, P>,
    pub w: Option<AnyBuffer<'a, P>>,
    /// LayerNorm's mean, where the call is given the statistics.
    pub mean: Option<AnyBuffer<'a, P>>,
    /// `None` in a call that takes rstd itself (see [`BackwardAttrs::eps`]).
    pub rstd: Option<AnyBuffer<'a, P>>,
    pub dy: AnyBuffer<'a, P>,
    pub dx: AnyResult<'r, P>,
    pub dw: Option<AnyResult<'r, P>>,
    /// The bias's gradient (LayerNorm with a bias).
    pub db: Option<AnyResult<'r, P>>,
    /// The gradient added to dx before it is rounded (see [`BackwardAttrs::has_dh`]).
    pub dh: Option<AnyBuffer<'a, P>>,
    /// The contract's pair for x's and the weight's dtypes.
    pub pair: DtypePair,
    pub layout: Layout,
    /// A split row's apply pass: the whole rows' sums.
    pub split: Option<SplitInputs<'a, P>>,
}

/// Which optional operands a backward call has.
#[derive(Debug, Clone, Copy)]
pub struct BackwardForm {
    pub norm: Norm,
    pub has_weight: bool,
    /// The call returns the bias's gradient.
    pub has_bias: bool,
    /// `rstd` is an operand (else the call takes it from x).
    pub has_rstd: bool,
    /// `dh` follows dy.
    pub has_dh: bool,
    pub row_len: usize,
    /// `Some(Split::Apply)`: a split row's apply pass (the sums follow the whole call's
    /// arguments; the gradients are this device's rows' sums, in the accumulation dtype). Its
    /// sums pass has operands of its own: [`backward_sums_operands`].
    pub split: Option<Split>,
}

/// A backward's statistics (from argument `first`: LayerNorm's mean, then rstd, each where
/// the call has them) and dy after them, checked against x.
#[allow(clippy::type_complexity)]
fn statistics_and_dy<'a, P: Platform>(
    args: &ArgsView<'a, P>,
    x: &AnyBuffer<'a, P>,
    pair: DtypePair,
    (norm, has_rstd): (Norm, bool),
    first: usize,
) -> FfiResult<(
    Option<AnyBuffer<'a, P>>,
    Option<AnyBuffer<'a, P>>,
    AnyBuffer<'a, P>,
)> {
    let mean = if has_rstd && norm.centred() {
        Some(args.get(first)?)
    } else {
        None
    };
    let rstd = if has_rstd {
        Some(args.get(first + mean.is_some() as usize)?)
    } else {
        None
    };
    let dy = args.get(first + mean.is_some() as usize + rstd.is_some() as usize)?;
    for s in mean.iter().chain(&rstd) {
        expect_rstd(s.operand(), s.dtype(), s.dims(), x, pair)?;
    }
    expect(dy.operand(), dy.dtype(), dy.dims(), x.dtype(), x.dims())?;
    Ok((mean, rstd, dy))
}

/// Decodes and checks a split backward's sums pass (see `contract::Split`).
pub fn backward_sums_operands<'a, 'r, P: Platform>(
    args: &ArgsView<'a, P>,
    rets: &mut ResultList<'r, P>,
    form: BackwardForm,
) -> FfiResult<SumsOperands<'a, 'r, P>> {
    let has_w = form.has_weight as usize;
    let has_r = if form.has_rstd {
        form.norm.statistics().len()
    } else {
        0
    };
    count("arguments", args.len(), 2 + has_w + has_r)?;
    count("results", rets.len(), 1)?;
    let (x, w, pair, layout) = x_and_weight(args, form.has_weight, form.row_len)?;
    let (mean, rstd, dy) =
        statistics_and_dy(args, &x, pair, (form.norm, form.has_rstd), 1 + has_w)?;
    let k = Split::Sums.sums(form.norm, true, !form.has_rstd);
    let sums = result(rets, 0)?;
    expect_sums(sums.operand(), sums.dtype(), sums.dims(), &x, pair, k)?;
    Ok(SumsOperands {
        x,
        w,
        mean,
        rstd,
        dy: Some(dy),
        sums,
        k,
        pair,
        layout,
    })
}

/// Decodes and checks a backward call: arguments (x, [weight], [statistics], dy, [dh]),
/// results (dx, [dweight], [dbias]), each against x, the weight and the attributes; a split
/// row's apply pass has the sums after them and its gradients in the accumulation dtype.
pub fn backward_operands<'a, 'r, P: Platform>(
    args: &ArgsView<'a, P>,
    rets: &mut ResultList<'r, P>,
    form: BackwardForm,
) -> FfiResult<BackwardOperands<'a, 'r, P>> {
    let BackwardForm {
        norm,
        has_weight,
        has_bias,
        has_rstd,
        has_dh,
        row_len,
        split,
    } = form;
    let apply = split == Some(Split::Apply);
    let has_w = has_weight as usize;
    let has_r = if has_rstd { norm.statistics().len() } else { 0 };
    let n_args = 2 + has_w + has_r + has_dh as usize;
    count("arguments", args.len(), n_args + apply as usize)?;
    count("results", rets.len(), 1 + has_w + has_bias as usize)?;
    let (x, w, mut pair, mut layout) = x_and_weight(args, has_weight, row_len)?;
    // The gradients' dtype: the weight's (the bias's), or in an apply pass the sums' own.
    let grad_dtype = |pair: DtypePair, param: DataType| {
        if apply {
            pair.accumulation()
        } else {
            param
        }
    };
    let db = if has_bias {
        let db = result(rets, 1 + has_w)?;
        match &w {
            Some(w) => expect(
                db.operand(),
                db.dtype(),
                db.dims(),
                grad_dtype(pair, w.dtype()),
                w.dims(),
            )?,
            None => {
                // The bias's gradient sets the pair and the groups, as a weight would.
                layout.groups = check_weight_like(&x, db.operand(), db.dtype(), db.dims())?;
                pair = DtypePair::of(x.dtype(), Some(db.dtype())).ok_or_else(|| {
                    FfiError::internal("the checked dtypes have no pair in the contract")
                })?;
                if apply && db.dtype() != pair.accumulation() {
                    return Err(HandlerError::dtype(
                        db.operand(),
                        &[pair.accumulation()],
                        db.dtype(),
                    )
                    .into());
                }
            }
        }
        Some(db)
    } else {
        None
    };
    let (mean, rstd, dy) = statistics_and_dy(args, &x, pair, (norm, has_rstd), 1 + has_w)?;
    let dh = if has_dh {
        let dh = args.get(2 + has_w + has_r)?;
        expect(dh.operand(), dh.dtype(), dh.dims(), x.dtype(), x.dims())?;
        Some(dh)
    } else {
        None
    };
    let dx = result(rets, 0)?;
    expect(dx.operand(), dx.dtype(), dx.dims(), x.dtype(), x.dims())?;
    let dw = match &w {
        Some(w) => {
            let dw = result(rets, 1)?;
            let want = grad_dtype(pair, w.dtype());
            expect(dw.operand(), dw.dtype(), dw.dims(), want, w.dims())?;
            Some(dw)
        }
        None => None,
    };
    let split = if apply {
        let sums = args.get(n_args)?;
        let k = Split::Apply.sums(norm, true, !has_rstd);
        expect_sums(sums.operand(), sums.dtype(), sums.dims(), &x, pair, k)?;
        Some(SplitInputs {
            mean: None,
            sums,
            k,
        })
    } else {
        None
    };
    Ok(BackwardOperands {
        x,
        w,
        mean,
        rstd,
        dy,
        dx,
        dw,
        db,
        dh,
        pair,
        layout,
        split,
    })
}
