//! Buffers: validated views of the `XLA_FFI_Buffer`s in a call frame, and their typed decoding.
//!
//! Arguments are read-only; results are writable. Before a result is handed out, decoding checks
//! that its memory overlaps no argument and no other result, so the `&[T]` and `&mut [T]` views
//! this module gives out never alias.
//!
//! In-place updates (XLA's `input_output_aliases`, donated buffers) are declared by the bundle,
//! on both sides: the result is an [`InPlace`]`<ARG>` (or [`InPlaceBuffer`]), one writable view
//! that holds argument `ARG`'s values when the handler starts, and argument `ARG` is an
//! [`AliasedArg`], which gives its dtype and dimensions but no view of its data. Decoding checks
//! that the call site aliases exactly that pair (the same buffer) and that the handler takes no
//! readable view of it; a mismatch either way is a decode error naming both operands, never two
//! overlapping slices.
//!
//! Every buffer type carries the platform of the bundle that decodes it (`P`, [`Host`] by
//! default). Typed views (`as_slice`, [`Buffer`], [`ResultBuffer`]) exist only for [`Host`]:
//! XLA:CPU buffers are host memory. A bundle for a device platform ([`Cuda`]) gets
//! [`AnyBuffer::device_ptr`] instead, and asking it for a slice does not compile: a slice over
//! device memory is not a valid Rust reference even if it is never read.

use std::ffi::c_void;
use std::fmt;
use std::marker::PhantomData;
use std::mem::{align_of, size_of};
use std::ptr::{self, NonNull};

use super::dtype::{DataType, NativeType};
use super::error::{DecodeErrors, FfiError};
#[cfg(doc)]
use super::platform::Cuda;
use super::platform::{Device, Host, Platform};
use super::sys;

/// Ranks above this are rejected as malformed (XLA itself supports far fewer).
pub const MAX_RANK: i64 = 64;
/// Counts of arguments, results or attributes above this are rejected as malformed.
pub const MAX_OPERANDS: i64 = 1 << 16;

/// Whether a buffer is an argument or a result, and its index: used in every message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operand {
    /// The argument at this index.
    Argument(usize),
    /// The result at this index.
    Result(usize),
}

impl fmt::Display for Operand {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Operand::Argument(i) => write!(f, "argument {i}"),
            Operand::Result(i) => write!(f, "result {i}"),
        }
    }
}

impl Operand {
    /// An invalid-argument error for this operand's dtype `got` where one of `accepted` was
    /// expected: "wrong dtype for argument 0: expected one of F32, BF16, got F64".
    pub fn wrong_dtype(self, accepted: &[DataType], got: DataType) -> FfiError {
        let expected = DataType::describe_accepted(accepted);
        FfiError::InvalidArgument(format!(
            "wrong dtype for {self}: expected {expected}, got {got}"
        ))
    }

    /// An invalid-argument error for this operand's shape: "wrong shape for result 0: ...".
    pub fn wrong_shape(self, problem: impl fmt::Display) -> FfiError {
        FfiError::InvalidArgument(format!("wrong shape for {self}: {problem}"))
    }
}

/// A validated buffer of any dtype, of a bundle for platform `P`. For arguments, typed views
/// (host only) are read-only.
pub struct AnyBuffer<'a, P: Platform = Host> {
    dtype: DataType,
    data: *mut c_void,
    dims: &'a [i64],
    element_count: usize,
    byte_size: usize,
    operand: Operand,
    _platform: PhantomData<P>,
}

impl<P: Platform> Clone for AnyBuffer<'_, P> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<P: Platform> Copy for AnyBuffer<'_, P> {}

// SAFETY: an `AnyBuffer` only ever hands out shared (`&[T]`) views of memory that XLA keeps alive
// for the call (host), or addresses (device); sharing those across threads is as safe as
// sharing a slice.
unsafe impl<P: Platform> Send for AnyBuffer<'_, P> {}
// SAFETY: as above.
unsafe impl<P: Platform> Sync for AnyBuffer<'_, P> {}

impl<P: Platform> fmt::Debug for AnyBuffer<'_, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AnyBuffer")
            .field("operand", &self.operand)
            .field("dtype", &self.dtype)
            .field("dims", &self.dims)
            .finish()
    }
}

impl<'a, P: Platform> AnyBuffer<'a, P> {
    /// Validates a raw `XLA_FFI_Buffer`.
    ///
    /// # Safety
    /// `raw` must be null or point to memory readable for at least its declared `struct_size`,
    /// whose `dims` (when the rank and struct size say so) points to `rank` readable `i64`s and
    /// whose `data` points to the buffer's bytes, all valid for `'a`.
    pub(crate) unsafe fn from_raw(raw: *const c_void, operand: Operand) -> Result<Self, String> {
        let raw = raw.cast::<sys::XLA_FFI_Buffer>();
        if raw.is_null() {
            return Err(format!("{operand} is a null buffer pointer"));
        }
        // SAFETY: non-null and readable by the caller's contract.
        let struct_size = unsafe { ptr::addr_of!((*raw).struct_size).read() };
        if struct_size < sys::XLA_FFI_Buffer::STRUCT_SIZE {
            return Err(format!(
                "{operand}: unexpected XLA_FFI_Buffer size: expected at least {}, got {struct_size}",
                sys::XLA_FFI_Buffer::STRUCT_SIZE
            ));
        }
        // SAFETY: struct_size covers every field (checked above).
        let buffer = unsafe { raw.read() };
        let dtype = DataType::from_raw(buffer.dtype);
        if dtype.bit_width().is_none() {
            return Err(format!("{operand} has unsupported dtype {dtype}"));
        }
        if !(0..=MAX_RANK).contains(&buffer.rank) {
            return Err(format!("{operand} has invalid rank {}", buffer.rank));
        }
        let rank = buffer.rank as usize;
        let dims: &'a [i64] = if rank == 0 {
            &[]
        } else if buffer.dims.is_null() {
            return Err(format!("{operand} has rank {rank} but no dimensions"));
        } else if !(buffer.dims as usize).is_multiple_of(align_of::<i64>()) {
            return Err(format!("{operand} has misaligned dimensions"));
        } else {
            // SAFETY: the caller guarantees `rank` readable i64s at `dims` for `'a`.
            unsafe { std::slice::from_raw_parts(buffer.dims, rank) }
        };
        let mut element_count: usize = 1;
        for &d in dims {
            let d = usize::try_from(d)
                .map_err(|_| format!("{operand} has a negative dimension in {dims:?}"))?;
            element_count = element_count
                .checked_mul(d)
                .ok_or_else(|| format!("{operand}: element count of {dims:?} overflows"))?;
        }
        let byte_size = dtype
            .bytes_for(element_count)
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| {
                format!("{operand}: byte size of {dtype} {dims:?} is not representable")
            })?;
        if byte_size > 0 && buffer.data.is_null() {
            return Err(format!(
                "{operand} of {byte_size} bytes has a null data pointer"
            ));
        }
        if (buffer.data as usize).checked_add(byte_size).is_none() {
            return Err(format!(
                "{operand}: its {byte_size} bytes wrap around the address space"
            ));
        }
        Ok(AnyBuffer {
            dtype,
            data: buffer.data,
            dims,
            element_count,
            byte_size,
            operand,
            _platform: PhantomData,
        })
    }

    /// The dtype of the elements.
    pub fn dtype(&self) -> DataType {
        self.dtype
    }

    /// The dimensions (empty for a scalar).
    pub fn dims(&self) -> &'a [i64] {
        self.dims
    }

    /// The number of dimensions.
    pub fn rank(&self) -> usize {
        self.dims.len()
    }

    /// The number of elements: the product of the dimensions.
    pub fn element_count(&self) -> usize {
        self.element_count
    }

    /// The size of the data in bytes (sub-byte dtypes rounded up).
    pub fn byte_size(&self) -> usize {
        self.byte_size
    }

    /// Which argument or result this is, for messages.
    pub fn operand(&self) -> Operand {
        self.operand
    }

    /// The half-open byte range of the data, for the aliasing check (it cannot overflow:
    /// `from_raw` checked).
    fn byte_range(&self) -> (usize, usize) {
        let start = self.data as usize;
        (start, start + self.byte_size)
    }

    /// The half-open byte range of the dimensions array.
    fn dims_range(&self) -> (usize, usize) {
        let start = self.dims.as_ptr() as usize;
        (start, start + std::mem::size_of_val(self.dims))
    }

    /// Why a `T` view is not possible, if it is not.
    fn check_view<T: NativeType>(&self) -> Result<(), String> {
        if self.dtype != T::DTYPE {
            return Err(format!(
                "wrong dtype for {}: expected {}, got {}",
                self.operand,
                T::DTYPE,
                self.dtype
            ));
        }
        if self.byte_size > 0 && !(self.data as usize).is_multiple_of(align_of::<T>()) {
            return Err(format!(
                "{} is not aligned for {} (address {:p})",
                self.operand,
                T::DTYPE,
                self.data
            ));
        }
        debug_assert_eq!(self.byte_size, self.element_count * size_of::<T>());
        Ok(())
    }

    /// The dimensions as an array of `RANK`, if the dtype is `T`'s, the rank is `RANK` and the
    /// data is aligned for `T`; else one message with both ("argument 1: expected F32 buffer of
    /// rank 2, got F32 buffer of rank 3").
    fn check_ranked<T: NativeType, const RANK: usize>(&self) -> Result<[i64; RANK], String> {
        let dims = <[i64; RANK]>::try_from(self.dims);
        match dims {
            Ok(dims) if self.dtype == T::DTYPE => {
                self.check_view::<T>()?;
                Ok(dims)
            }
            _ => Err(format!(
                "{}: expected {} buffer of rank {RANK}, got {} buffer of rank {} (dims {:?})",
                self.operand,
                T::DTYPE,
                self.dtype,
                self.rank(),
                self.dims
            )),
        }
    }

    fn data_ptr<T>(&self) -> *mut T {
        if self.byte_size == 0 {
            NonNull::<T>::dangling().as_ptr()
        } else {
            self.data.cast()
        }
    }
}

impl<P: Device> AnyBuffer<'_, P> {
    /// The device address of the data, e.g. for a GPU kernel launch. Never dereferenced here.
    pub fn device_ptr(&self) -> *mut c_void {
        self.data
    }
}

impl<'a> AnyBuffer<'a, Host> {
    /// A read-only typed view, if the dtype is `T`'s. Only for arguments.
    pub fn as_slice<T: NativeType>(&self) -> Result<&'a [T], String> {
        if let Operand::Result(_) = self.operand {
            return Err(format!(
                "{} is a result; use its writable view",
                self.operand
            ));
        }
        self.check_view::<T>()?;
        // SAFETY: the dtype matches `T` (every bit pattern valid), the pointer is aligned and
        // non-null (dangling only for zero elements), XLA keeps `element_count` elements alive
        // for `'a`, and no writable view of argument memory is ever created (results that would
        // overlap an argument are rejected at decode time).
        Ok(unsafe { std::slice::from_raw_parts(self.data_ptr::<T>(), self.element_count) })
    }
}

/// A writable buffer of any dtype: one of the call's results.
pub struct AnyResult<'a, P: Platform = Host> {
    buffer: AnyBuffer<'a, P>,
}

// SAFETY: a result is uniquely owned by whoever holds this value (decoding checked that no other
// view overlaps it), like a `&mut [u8]`, which is `Send`.
unsafe impl<P: Platform> Send for AnyResult<'_, P> {}

impl<P: Platform> fmt::Debug for AnyResult<'_, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.buffer.fmt(f)
    }
}

/// The accessors of a wrapper around one validated buffer (`self.$($field).+`), which gives its
/// description but no view of its data.
macro_rules! describe_buffer {
    ($($field:ident).+) => {
        /// The dtype of the elements.
        pub fn dtype(&self) -> DataType {
            self.$($field).+.dtype
        }

        /// The dimensions (empty for a scalar).
        pub fn dims(&self) -> &'a [i64] {
            self.$($field).+.dims
        }

        /// The number of elements: the product of the dimensions.
        pub fn element_count(&self) -> usize {
            self.$($field).+.element_count
        }

        /// Which argument or result this is, for messages.
        pub fn operand(&self) -> Operand {
            self.$($field).+.operand
        }
    };
}

impl<'a, P: Platform> AnyResult<'a, P> {
    describe_buffer!(buffer);
}

impl<P: Device> AnyResult<'_, P> {
    /// The device address of the data, e.g. for a GPU kernel launch. Never dereferenced here.
    pub fn device_ptr(&self) -> *mut c_void {
        self.buffer.data
    }
}

impl<'a> AnyResult<'a, Host> {
    /// A writable typed view for the life of this borrow.
    pub fn as_mut_slice<T: NativeType>(&mut self) -> Result<&mut [T], String> {
        self.buffer.check_view::<T>()?;
        // SAFETY: as in `AnyBuffer::as_slice`; in addition the memory overlaps no other view
        // (checked at decode time) and `&mut self` makes this borrow unique.
        Ok(unsafe {
            std::slice::from_raw_parts_mut(self.buffer.data_ptr::<T>(), self.buffer.element_count)
        })
    }

    /// A writable typed view for the rest of the call.
    pub fn into_mut_slice<T: NativeType>(self) -> Result<&'a mut [T], String> {
        self.buffer.check_view::<T>()?;
        // SAFETY: as in `as_mut_slice`; consuming `self` makes the view unique for `'a`.
        Ok(unsafe {
            std::slice::from_raw_parts_mut(self.buffer.data_ptr::<T>(), self.buffer.element_count)
        })
    }
}

/// An argument of the fixed dtype `T`, viewed in host memory (host bundles only).
#[derive(Debug, Clone, Copy)]
pub struct Buffer<'a, T: NativeType> {
    /// The elements, read-only.
    pub data: &'a [T],
    /// The dimensions.
    pub dims: &'a [i64],
}

/// A result of the fixed dtype `T`, viewed in host memory (host bundles only).
#[derive(Debug)]
pub struct ResultBuffer<'a, T: NativeType> {
    /// The elements, writable.
    pub data: &'a mut [T],
    /// The dimensions.
    pub dims: &'a [i64],
}

/// An argument of the fixed dtype `T` and rank `RANK`, viewed in host memory (host bundles
/// only), checked at decode like XLA's `ffi::Buffer<dtype, rank>`: a call with another dtype or
/// rank fails before the handler runs, with a message naming the argument, the dtype and both
/// ranks. `dims` is an array, so `let [rows, cols] = x.dims;` cannot fail.
#[derive(Debug, Clone, Copy)]
pub struct RankedBuffer<'a, T: NativeType, const RANK: usize> {
    /// The elements, read-only.
    pub data: &'a [T],
    /// The dimensions.
    pub dims: [i64; RANK],
}

/// A result of the fixed dtype `T` and rank `RANK`, viewed in host memory (host bundles only);
/// checked at decode like [`RankedBuffer`].
#[derive(Debug)]
pub struct RankedResult<'a, T: NativeType, const RANK: usize> {
    /// The elements, writable.
    pub data: &'a mut [T],
    /// The dimensions.
    pub dims: [i64; RANK],
}

/// An argument of a device bundle ([`Cuda`]) of the fixed dtype `T` and rank `RANK`, checked at
/// decode like [`RankedBuffer`]; its memory is the device's, so it gives an address typed `T`
/// rather than a slice.
pub struct DeviceBuffer<'a, P: Device, T: NativeType, const RANK: usize> {
    buffer: AnyBuffer<'a, P>,
    /// The dimensions.
    pub dims: [i64; RANK],
    _dtype: PhantomData<T>,
}

/// A result of a device bundle of the fixed dtype `T` and rank `RANK`, checked at decode like
/// [`RankedBuffer`]; an address typed `T` for the device to write.
pub struct DeviceResult<'a, P: Device, T: NativeType, const RANK: usize> {
    result: AnyResult<'a, P>,
    /// The dimensions.
    pub dims: [i64; RANK],
    _dtype: PhantomData<T>,
}

impl<P: Device, T: NativeType, const RANK: usize> DeviceBuffer<'_, P, T, RANK> {
    /// The device address of the elements, for a kernel launch. Never dereferenced here.
    pub fn device_ptr(&self) -> *const T {
        self.buffer.device_ptr().cast_const().cast()
    }

    /// The number of elements.
    pub fn element_count(&self) -> usize {
        self.buffer.element_count()
    }
}

impl<P: Device, T: NativeType, const RANK: usize> DeviceResult<'_, P, T, RANK> {
    /// The device address of the elements, for a kernel launch. Never dereferenced here.
    pub fn device_ptr(&self) -> *mut T {
        self.result.device_ptr().cast()
    }

    /// The number of elements.
    pub fn element_count(&self) -> usize {
        self.result.element_count()
    }
}

impl<P: Device, T: NativeType, const RANK: usize> fmt::Debug for DeviceBuffer<'_, P, T, RANK> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.buffer.fmt(f)
    }
}

impl<P: Device, T: NativeType, const RANK: usize> fmt::Debug for DeviceResult<'_, P, T, RANK> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.result.fmt(f)
    }
}

/// An argument that a result of the same call overwrites in place: the argument side of an
/// aliased pair (see [`InPlace`]). It gives the argument's dtype and dimensions but no view of
/// its data, which the handler reads and writes through the in-place result: taking it as any
/// readable buffer instead makes decoding refuse the pair (a `&[T]` and a `&mut [T]` over one
/// buffer would be undefined behaviour).
pub struct AliasedArg<'a, P: Platform = Host> {
    buffer: AnyBuffer<'a, P>,
}

impl<'a, P: Platform> AliasedArg<'a, P> {
    describe_buffer!(buffer);
}

impl<P: Platform> fmt::Debug for AliasedArg<'_, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AliasedArg({:?})", self.buffer)
    }
}

/// A result that XLA aliases with argument `ARG`: one buffer, which holds the argument's values
/// when the handler starts and must hold the result when it returns (an in-place update: an
/// optimizer step, an accumulator, a cache written in place).
///
/// The call site declares the pair (`jax.ffi.ffi_call(..., input_output_aliases={ARG: r})`,
/// or `rmsnorm_ffi.batched_ffi_op(..., input_output_aliases=...)`); the handler takes argument
/// `ARG` as an [`AliasedArg`]. Decoding checks both: a call site that passes two separate
/// buffers, or a handler that also takes argument `ARG` as a readable buffer (or takes its
/// arguments as an [`ArgsView`]), is a decode error. Under `jit`, a donated argument is updated
/// without a copy; a kept one is copied by XLA first, so the handler sees one buffer either way.
pub struct InPlace<'a, const ARG: usize, P: Platform = Host> {
    result: AnyResult<'a, P>,
}

impl<'a, const ARG: usize, P: Platform> InPlace<'a, ARG, P> {
    /// The argument this result aliases.
    pub const ARGUMENT: usize = ARG;

    describe_buffer!(result.buffer);

    /// The result, as any other: its device address or writable views.
    pub fn into_result(self) -> AnyResult<'a, P> {
        self.result
    }
}

impl<'a, const ARG: usize> InPlace<'a, ARG, Host> {
    /// The buffer as a writable typed view for the rest of the call, holding the argument's
    /// values until the handler writes them.
    pub fn into_mut_slice<T: NativeType>(self) -> Result<&'a mut [T], String> {
        self.result.into_mut_slice()
    }
}

impl<const ARG: usize, P: Device> InPlace<'_, ARG, P> {
    /// The device address of the buffer (the argument's, read and written in place).
    pub fn device_ptr(&self) -> *mut c_void {
        self.result.device_ptr()
    }
}

impl<const ARG: usize, P: Platform> fmt::Debug for InPlace<'_, ARG, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "InPlace<{ARG}>({:?})", self.result)
    }
}

/// [`InPlace`] viewed as elements of the fixed dtype `T` (host bundles only): `data` holds
/// argument `ARG`'s values when the handler starts; what the handler leaves there is the result.
#[derive(Debug)]
pub struct InPlaceBuffer<'a, T: NativeType, const ARG: usize> {
    /// The elements: the argument's on entry, the result's on return.
    pub data: &'a mut [T],
    /// The dimensions.
    pub dims: &'a [i64],
}

/// The validated argument list of a call frame.
pub struct ArgsView<'a, P: Platform = Host> {
    raw: &'a sys::XLA_FFI_Args,
    _platform: PhantomData<P>,
}

impl<P: Platform> Clone for ArgsView<'_, P> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<P: Platform> Copy for ArgsView<'_, P> {}

/// The validated result list of a call frame. Deliberately neither `Clone` nor `Copy`: a view
/// is consumed by the one decoder that takes each result once, so no two writable views of a
/// result can exist.
pub struct RetsView<'a, P: Platform = Host> {
    raw: &'a sys::XLA_FFI_Rets,
    args: ArgsView<'a, P>,
    /// Whether the handler's argument decoder gives no view of argument `i`'s data
    /// ([`DecodeArgs::hides_data`]): only such an argument may be aliased by an in-place result.
    hidden: fn(usize) -> bool,
}

/// Checks a `(struct_size, size, types, items)` list header shared by args, rets and attrs.
pub(crate) fn check_list(
    what: &str,
    struct_size: usize,
    min_struct_size: usize,
    size: i64,
    types_null: bool,
    items_null: bool,
) -> Result<(), String> {
    if struct_size < min_struct_size {
        return Err(format!(
            "unexpected {what} struct size: expected at least {min_struct_size}, got {struct_size}"
        ));
    }
    if !(0..=MAX_OPERANDS).contains(&size) {
        return Err(format!("invalid number of {what}: {size}"));
    }
    if size > 0 && (types_null || items_null) {
        return Err(format!("{size} {what} announced but the lists are null"));
    }
    Ok(())
}

impl<'a, P: Platform> ArgsView<'a, P> {
    /// # Safety
    /// `raw` must be a call frame's argument list, valid for `'a`, as XLA lays it out.
    pub(crate) unsafe fn new(raw: &'a sys::XLA_FFI_Args) -> Result<Self, String> {
        check_list(
            "arguments",
            raw.struct_size,
            sys::XLA_FFI_Args::STRUCT_SIZE,
            raw.size,
            raw.types.is_null(),
            raw.args.is_null(),
        )?;
        Ok(ArgsView {
            raw,
            _platform: PhantomData,
        })
    }

    /// The number of arguments.
    pub fn len(&self) -> usize {
        self.raw.size as usize
    }

    /// Whether the call has no arguments.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The `index`th argument, validated.
    pub fn get(&self, index: usize) -> Result<AnyBuffer<'a, P>, String> {
        if index >= self.len() {
            return Err(format!(
                "there is no argument {index} (the call has {})",
                self.len()
            ));
        }
        // SAFETY: `index < size` and the lists hold `size` entries (validated in `new`).
        let (ty, item) = unsafe { (*self.raw.types.add(index), *self.raw.args.add(index)) };
        if ty != sys::XLA_FFI_ArgType::BUFFER {
            return Err(format!("argument {index} has unsupported type {}", ty.0));
        }
        // SAFETY: XLA passes an `XLA_FFI_Buffer*` for every BUFFER argument.
        unsafe { AnyBuffer::from_raw(item, Operand::Argument(index)) }
    }
}

impl<'a, P: Platform> RetsView<'a, P> {
    /// # Safety
    /// `raw` must be a call frame's result list, valid for `'a`, as XLA lays it out.
    pub(crate) unsafe fn new(
        raw: &'a sys::XLA_FFI_Rets,
        args: ArgsView<'a, P>,
    ) -> Result<Self, String> {
        check_list(
            "results",
            raw.struct_size,
            sys::XLA_FFI_Rets::STRUCT_SIZE,
            raw.size,
            raw.types.is_null(),
            raw.rets.is_null(),
        )?;
        Ok(RetsView {
            raw,
            args,
            hidden: |_| false,
        })
    }

    /// The same view, for a handler whose argument decoder hides the data of the arguments
    /// `hidden` names (its [`DecodeArgs::hides_data`]).
    pub(crate) fn hiding(self, hidden: fn(usize) -> bool) -> Self {
        RetsView { hidden, ..self }
    }

    /// The number of results.
    pub fn len(&self) -> usize {
        self.raw.size as usize
    }

    /// Whether the call has no results.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn buffer(&self, index: usize) -> Result<AnyBuffer<'a, P>, String> {
        if index >= self.len() {
            return Err(format!(
                "there is no result {index} (the call has {})",
                self.len()
            ));
        }
        // SAFETY: `index < size` and the lists hold `size` entries (validated in `new`).
        let (ty, item) = unsafe { (*self.raw.types.add(index), *self.raw.rets.add(index)) };
        if ty != sys::XLA_FFI_RetType::BUFFER {
            return Err(format!("result {index} has unsupported type {}", ty.0));
        }
        // SAFETY: XLA passes an `XLA_FFI_Buffer*` for every BUFFER result.
        unsafe { AnyBuffer::from_raw(item, Operand::Result(index)) }
    }

    /// Checks the layout of the `index`th result (not its overlaps), handing nothing out.
    pub(crate) fn validate(&self, index: usize) -> Result<(), String> {
        self.buffer(index).map(|_| ())
    }

    /// The `index`th result, validated and checked not to overlap any argument or other result.
    ///
    /// Taking the same result twice is prevented by the decoders, which take each index once.
    pub(crate) fn take(&self, index: usize) -> Result<AnyResult<'a, P>, String> {
        self.take_as(index, None)
    }

    /// [`RetsView::take`] for a result that is declared in place over argument `in_place_of`
    /// (`Some`): it must be exactly that argument's buffer, whose data the handler's argument
    /// decoder hides, and overlap nothing else.
    pub(crate) fn take_as(
        &self,
        index: usize,
        in_place_of: Option<usize>,
    ) -> Result<AnyResult<'a, P>, String> {
        let buffer = self.buffer(index)?;
        if let Some(arg) = in_place_of {
            self.check_in_place(index, &buffer, arg)?;
        }
        let (start, end) = buffer.byte_range();
        if start < end {
            let hits = |(s, e): (usize, usize)| s < e && s < end && start < e;
            if hits(buffer.dims_range()) {
                return Err(format!(
                    "result {index} overlaps its own dimensions in memory"
                ));
            }
            for i in 0..self.args.len() {
                let Ok(other) = self.args.get(i) else {
                    continue;
                };
                // The aliased argument's data is the result's (checked above); its dimensions
                // are still a shared slice.
                if Some(i) != in_place_of && hits(other.byte_range()) {
                    return Err(if other.byte_range() == (start, end) {
                        format!(
                            "result {index} is argument {i}'s buffer: the call site aliases them \
                             (input_output_aliases); a handler that updates it in place takes \
                             result {index} as InPlace<{i}> and argument {i} as AliasedArg"
                        )
                    } else {
                        format!("result {index} overlaps argument {i} in memory")
                    });
                }
                if hits(other.dims_range()) {
                    return Err(format!(
                        "result {index} overlaps argument {i}'s dimensions in memory"
                    ));
                }
            }
            for j in (0..self.len()).filter(|&j| j != index) {
                if let Ok(other) = self.buffer(j) {
                    if hits(other.byte_range()) || hits(other.dims_range()) {
                        return Err(format!("result {index} overlaps result {j} in memory"));
                    }
                }
            }
        }
        Ok(AnyResult { buffer })
    }

    fn check_in_place(
        &self,
        index: usize,
        result: &AnyBuffer<'a, P>,
        arg: usize,
    ) -> Result<(), String> {
        let declared = format!("result {index} is declared in place over argument {arg}");
        if arg >= self.args.len() {
            return Err(format!(
                "{declared}, but the call has {} arguments",
                self.args.len()
            ));
        }
        if !(self.hidden)(arg) {
            return Err(format!(
                "{declared}, but the handler also takes argument {arg} as a readable buffer: \
                 take it as AliasedArg (its values are read through the result)"
            ));
        }
        let argument = self.args.get(arg)?;
        if (argument.dtype, argument.dims) != (result.dtype, result.dims) {
            return Err(format!(
                "{declared}, but they differ: argument {arg} is {} {:?}, result {index} {} {:?}",
                argument.dtype, argument.dims, result.dtype, result.dims
            ));
        }
        if result.byte_size > 0 && argument.data != result.data {
            return Err(format!(
                "{declared}, but the call site passes two separate buffers: declare the pair \
                 where the call is made (jax.ffi.ffi_call(..., input_output_aliases={{{arg}: \
                 {index}}}))"
            ));
        }
        Ok(())
    }
}

/// Decoding of one argument of a bundle for platform `P` from a validated buffer.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be an argument of a bundle whose platform is `{P}`",
    label = "not an argument type for `{P}` bundles",
    note = "typed slices (`Buffer`, `ResultBuffer`, `as_slice`) view host memory and exist only for \
            `Host` bundles; a device bundle takes `AnyBuffer<'a, {P}>` and passes its `device_ptr()` \
            to the device"
)]
pub trait FromArg<'a, P: Platform>: Sized {
    /// Whether this type gives no view of the argument's data ([`AliasedArg`]): only such an
    /// argument may be aliased by an in-place result.
    const HIDES_DATA: bool = false;
    /// How many arguments it takes from the list: one (every buffer type), zero or one
    /// (`Option<T>`), or all that are left ([`RemainingArgs`]).
    const ARITY: Arity = Arity::One;
    /// What the signature expects, for messages ("F32 buffer").
    fn expected() -> String;
    /// The argument as `Self`, or why it does not fit (e.g. a wrong dtype, misaligned data).
    fn from_arg(buffer: AnyBuffer<'a, P>) -> Result<Self, String>;
    /// `Self` from the list, at `index` (the tuple decoders call this; the count was checked
    /// against [`FromArg::ARITY`]). By default the argument at `index`.
    fn from_list(args: ArgsView<'a, P>, index: usize) -> Result<Self, String> {
        args.get(index).and_then(Self::from_arg)
    }
}

/// How many operands of the list one element of a handler's signature takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arity {
    /// Exactly one.
    One,
    /// One if the call has it, else none (`Option<T>`): after every [`Arity::One`].
    Optional,
    /// All the operands left ([`RemainingArgs`]): last.
    Rest,
}

/// Checks the count of operands `got` against a signature's `arities` (`what`: "arguments"):
/// the required ones, then optional ones, then at most one rest, last.
fn check_arity(what: &str, arities: &[Arity], got: usize, errors: &mut DecodeErrors) -> bool {
    let required = arities.iter().take_while(|&&a| a == Arity::One).count();
    let optional = arities[required..]
        .iter()
        .take_while(|&&a| a == Arity::Optional)
        .count();
    let rest = arities[required + optional..] == [Arity::Rest];
    if required + optional + usize::from(rest) != arities.len() {
        errors.push(format!(
            "the handler's {what} are declared out of order: required ones first, then optional \
             ones (Option), then at most one list of the rest, last"
        ));
        return false;
    }
    let most = required + optional;
    let expected = match (optional, rest) {
        (0, false) => required.to_string(),
        (_, false) => format!("{required} to {most}"),
        (_, true) => format!("at least {required}"),
    };
    if got < required || (!rest && got > most) {
        errors.push(format!(
            "wrong number of {what}: expected {expected}, got {got}"
        ));
        return false;
    }
    true
}

impl<'a, P: Platform> FromArg<'a, P> for AnyBuffer<'a, P> {
    fn expected() -> String {
        "buffer".into()
    }
    fn from_arg(buffer: AnyBuffer<'a, P>) -> Result<Self, String> {
        Ok(buffer)
    }
}

impl<'a, T: NativeType> FromArg<'a, Host> for Buffer<'a, T> {
    fn expected() -> String {
        format!("{} buffer", T::DTYPE)
    }
    fn from_arg(buffer: AnyBuffer<'a, Host>) -> Result<Self, String> {
        Ok(Buffer {
            data: buffer.as_slice::<T>()?,
            dims: buffer.dims(),
        })
    }
}

impl<'a, T: NativeType, const RANK: usize> FromArg<'a, Host> for RankedBuffer<'a, T, RANK> {
    fn expected() -> String {
        format!("{} buffer of rank {RANK}", T::DTYPE)
    }
    fn from_arg(buffer: AnyBuffer<'a, Host>) -> Result<Self, String> {
        let dims = buffer.check_ranked::<T, RANK>()?;
        Ok(RankedBuffer {
            data: buffer.as_slice::<T>()?,
            dims,
        })
    }
}

impl<'a, P: Device, T: NativeType, const RANK: usize> FromArg<'a, P>
    for DeviceBuffer<'a, P, T, RANK>
{
    fn expected() -> String {
        format!("{} buffer of rank {RANK}", T::DTYPE)
    }
    fn from_arg(buffer: AnyBuffer<'a, P>) -> Result<Self, String> {
        Ok(DeviceBuffer {
            dims: buffer.check_ranked::<T, RANK>()?,
            buffer,
            _dtype: PhantomData,
        })
    }
}

impl<'a, P: Platform> FromArg<'a, P> for AliasedArg<'a, P> {
    const HIDES_DATA: bool = true;
    fn expected() -> String {
        "buffer aliased by an in-place result".into()
    }
    fn from_arg(buffer: AnyBuffer<'a, P>) -> Result<Self, String> {
        Ok(AliasedArg { buffer })
    }
}

/// Decoding of one result of a bundle for platform `P`.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be a result of a bundle whose platform is `{P}`",
    label = "not a result type for `{P}` bundles",
    note = "typed slices (`Buffer`, `ResultBuffer`, `as_mut_slice`) view host memory and exist only \
            for `Host` bundles; a device bundle takes `AnyResult<'a, {P}>` and passes its \
            `device_ptr()` to the device"
)]
pub trait FromRet<'a, P: Platform>: Sized {
    /// The argument this result is declared in place over ([`InPlace`]), if any.
    const IN_PLACE_OF: Option<usize> = None;
    /// How many results it takes: one, or zero or one (`Option<T>`, after the required ones).
    const ARITY: Arity = Arity::One;
    /// The result as `Self`, or why it does not fit (e.g. a wrong dtype, misaligned data).
    fn from_ret(result: AnyResult<'a, P>) -> Result<Self, String>;
    /// `Self` from the list, at `index`; by default the result there, taken once.
    fn from_list(rets: &RetsView<'a, P>, index: usize) -> Result<Self, String> {
        rets.take_as(index, Self::IN_PLACE_OF)
            .and_then(Self::from_ret)
    }
}

impl<'a, P: Platform> FromRet<'a, P> for AnyResult<'a, P> {
    fn from_ret(result: AnyResult<'a, P>) -> Result<Self, String> {
        Ok(result)
    }
}

impl<'a, T: NativeType> FromRet<'a, Host> for ResultBuffer<'a, T> {
    fn from_ret(result: AnyResult<'a, Host>) -> Result<Self, String> {
        let dims = result.dims();
        Ok(ResultBuffer {
            data: result.into_mut_slice::<T>()?,
            dims,
        })
    }
}

impl<'a, T: NativeType, const RANK: usize> FromRet<'a, Host> for RankedResult<'a, T, RANK> {
    fn from_ret(result: AnyResult<'a, Host>) -> Result<Self, String> {
        let dims = result.buffer.check_ranked::<T, RANK>()?;
        Ok(RankedResult {
            data: result.into_mut_slice::<T>()?,
            dims,
        })
    }
}

impl<'a, P: Device, T: NativeType, const RANK: usize> FromRet<'a, P>
    for DeviceResult<'a, P, T, RANK>
{
    fn from_ret(result: AnyResult<'a, P>) -> Result<Self, String> {
        Ok(DeviceResult {
            dims: result.buffer.check_ranked::<T, RANK>()?,
            result,
            _dtype: PhantomData,
        })
    }
}

impl<'a, const ARG: usize, P: Platform> FromRet<'a, P> for InPlace<'a, ARG, P> {
    const IN_PLACE_OF: Option<usize> = Some(ARG);
    fn from_ret(result: AnyResult<'a, P>) -> Result<Self, String> {
        Ok(InPlace { result })
    }
}

impl<'a, T: NativeType, const ARG: usize> FromRet<'a, Host> for InPlaceBuffer<'a, T, ARG> {
    const IN_PLACE_OF: Option<usize> = Some(ARG);
    fn from_ret(result: AnyResult<'a, Host>) -> Result<Self, String> {
        let dims = result.dims();
        Ok(InPlaceBuffer {
            data: result.into_mut_slice::<T>()?,
            dims,
        })
    }
}

/// An optional argument: `Some` when the call has one at this place, `None` when the list is
/// shorter (XLA's `OptionalArg`). Optional arguments follow the required ones.
impl<'a, P: Platform, T: FromArg<'a, P>> FromArg<'a, P> for Option<T> {
    const HIDES_DATA: bool = T::HIDES_DATA;
    const ARITY: Arity = Arity::Optional;
    fn expected() -> String {
        format!("{} (optional)", T::expected())
    }
    fn from_arg(buffer: AnyBuffer<'a, P>) -> Result<Self, String> {
        T::from_arg(buffer).map(Some)
    }
    fn from_list(args: ArgsView<'a, P>, index: usize) -> Result<Self, String> {
        if index >= args.len() {
            return Ok(None);
        }
        T::from_list(args, index).map(Some)
    }
}

/// An optional result: `Some` when the call has one at this place (XLA's `OptionalRet`).
impl<'a, P: Platform, T: FromRet<'a, P>> FromRet<'a, P> for Option<T> {
    const IN_PLACE_OF: Option<usize> = T::IN_PLACE_OF;
    const ARITY: Arity = Arity::Optional;
    fn from_ret(result: AnyResult<'a, P>) -> Result<Self, String> {
        T::from_ret(result).map(Some)
    }
    fn from_list(rets: &RetsView<'a, P>, index: usize) -> Result<Self, String> {
        if index >= rets.len() {
            return Ok(None);
        }
        T::from_list(rets, index).map(Some)
    }
}

/// Every argument after the fixed ones of a handler's signature (XLA's `RemainingArgs`): the
/// last element of the argument tuple, as in `(Buffer<'a, f32>, RemainingArgs<'a>)`. Indices
/// are the list's own (0 is the first remaining argument); messages name the call's.
#[derive(Clone, Copy)]
pub struct RemainingArgs<'a, P: Platform = Host> {
    args: ArgsView<'a, P>,
    start: usize,
}

impl<'a, P: Platform> RemainingArgs<'a, P> {
    /// How many arguments remain (none when optional arguments before the list are absent too).
    pub fn len(&self) -> usize {
        self.args.len().saturating_sub(self.start)
    }

    /// Whether none remain.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The `index`th remaining argument (the call's argument `start + index`), validated.
    pub fn get(&self, index: usize) -> Result<AnyBuffer<'a, P>, String> {
        if index >= self.len() {
            return Err(format!(
                "there is no remaining argument {index} ({} remain after the {} fixed ones)",
                self.len(),
                self.start
            ));
        }
        self.args.get(self.start + index)
    }

    /// The `index`th remaining argument decoded as `T` (e.g. `Buffer<'a, f32>`).
    pub fn decode<T: FromArg<'a, P>>(&self, index: usize) -> Result<T, String> {
        self.get(index).and_then(T::from_arg)
    }
}

impl<P: Platform> fmt::Debug for RemainingArgs<'_, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "RemainingArgs({} from argument {})",
            self.len(),
            self.start
        )
    }
}

impl<'a, P: Platform> FromArg<'a, P> for RemainingArgs<'a, P> {
    const ARITY: Arity = Arity::Rest;
    fn expected() -> String {
        "the remaining arguments".into()
    }
    fn from_arg(buffer: AnyBuffer<'a, P>) -> Result<Self, String> {
        Err(format!(
            "{}: RemainingArgs decodes a list, not one buffer",
            buffer.operand()
        ))
    }
    fn from_list(args: ArgsView<'a, P>, index: usize) -> Result<Self, String> {
        Ok(RemainingArgs { args, start: index })
    }
}

/// Decoding of a handler's whole argument list: tuples of [`FromArg`] types, or [`ArgsView`]
/// itself for handlers that take a variable number of arguments.
pub trait DecodeArgs<'a, P: Platform>: Sized {
    /// Decodes the list, recording every problem in `errors`; `None` if any argument failed.
    fn decode(args: ArgsView<'a, P>, errors: &mut DecodeErrors) -> Option<Self>;

    /// Whether the decoded list gives no view of argument `index`'s data (an [`AliasedArg`]
    /// there), so that a result may alias it. [`ArgsView`] can view every argument: false.
    fn hides_data(index: usize) -> bool {
        let _ = index;
        false
    }
}

/// Decoding of a handler's whole result list: tuples of [`FromRet`] types.
pub trait DecodeRets<'a, P: Platform>: Sized {
    /// Decodes the list, recording every problem in `errors`; `None` if any result failed.
    fn decode(rets: RetsView<'a, P>, errors: &mut DecodeErrors) -> Option<Self>;
}

impl<'a, P: Platform> DecodeArgs<'a, P> for ArgsView<'a, P> {
    fn decode(args: ArgsView<'a, P>, _errors: &mut DecodeErrors) -> Option<Self> {
        Some(args)
    }
}

macro_rules! tuple_decoders {
    ($count:expr; $($name:ident : $idx:tt),*) => {
        impl<'a, P: Platform, $($name: FromArg<'a, P>),*> DecodeArgs<'a, P> for ($($name,)*) {
            #[allow(unused_variables)]
            fn decode(args: ArgsView<'a, P>, errors: &mut DecodeErrors) -> Option<Self> {
                let arities: [Arity; $count] = [$(<$name as FromArg<'a, P>>::ARITY),*];
                if !check_arity("arguments", &arities, args.len(), errors) {
                    return None;
                }
                let decoded = ($(
                    $name::from_list(args, $idx).map_err(|e| errors.push(e)).ok(),
                )*);
                Some(($(decoded.$idx?,)*))
            }

            fn hides_data(index: usize) -> bool {
                let hidden: [bool; $count] = [$(<$name as FromArg<'a, P>>::HIDES_DATA),*];
                hidden.get(index).copied().unwrap_or(false)
            }
        }

        impl<'a, P: Platform, $($name: FromRet<'a, P>),*> DecodeRets<'a, P> for ($($name,)*) {
            #[allow(unused_variables)]
            fn decode(rets: RetsView<'a, P>, errors: &mut DecodeErrors) -> Option<Self> {
                let arities: [Arity; $count] = [$(<$name as FromRet<'a, P>>::ARITY),*];
                if !check_arity("results", &arities, rets.len(), errors) {
                    return None;
                }
                let decoded = ($(
                    $name::from_list(&rets, $idx).map_err(|e| errors.push(e)).ok(),
                )*);
                Some(($(decoded.$idx?,)*))
            }
        }
    };
}

tuple_decoders!(0;);
tuple_decoders!(1; A: 0);
tuple_decoders!(2; A: 0, B: 1);
tuple_decoders!(3; A: 0, B: 1, C: 2);
tuple_decoders!(4; A: 0, B: 1, C: 2, D: 3);
tuple_decoders!(5; A: 0, B: 1, C: 2, D: 3, E: 4);
tuple_decoders!(6; A: 0, B: 1, C: 2, D: 3, E: 4, F: 5);
tuple_decoders!(7; A: 0, B: 1, C: 2, D: 3, E: 4, F: 5, G: 6);
tuple_decoders!(8; A: 0, B: 1, C: 2, D: 3, E: 4, F: 5, G: 6, H: 7);

/// Results of a handler whose result count varies (any number): every result is validated at
/// decode (all problems reported together), then each is taken out once. Up to 64 results it
/// allocates nothing; above, one bitmap.
pub struct ResultList<'a, P: Platform = Host> {
    rets: RetsView<'a, P>,
    taken: Taken,
}

/// Which results of a [`ResultList`] were taken.
enum Taken {
    Inline(u64),
    Heap(Vec<bool>),
}

impl<'a, P: Platform> ResultList<'a, P> {
    /// The number of results of the call, taken or not.
    pub fn len(&self) -> usize {
        self.rets.len()
    }

    /// Whether the call has no results.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The `index`th result; `None` if there is none or it was taken already.
    pub fn take(&mut self, index: usize) -> Option<AnyResult<'a, P>> {
        if index >= self.len() {
            return None;
        }
        let first = match &mut self.taken {
            Taken::Inline(bits) => {
                let was = *bits & (1 << index) == 0;
                *bits |= 1 << index;
                was
            }
            Taken::Heap(flags) => !std::mem::replace(&mut flags[index], true),
        };
        // Validated (and checked for overlaps) at decode; `buffer` only re-reads it.
        first
            .then(|| self.rets.buffer(index).ok())
            .flatten()
            .map(|buffer| AnyResult { buffer })
    }
}

impl<'a, P: Platform> DecodeRets<'a, P> for ResultList<'a, P> {
    fn decode(rets: RetsView<'a, P>, errors: &mut DecodeErrors) -> Option<Self> {
        let mut ok = true;
        for i in 0..rets.len() {
            if let Err(e) = rets.take(i) {
                errors.push(e);
                ok = false;
            }
        }
        let taken = if rets.len() <= 64 {
            Taken::Inline(0)
        } else {
            Taken::Heap(vec![false; rets.len()])
        };
        ok.then_some(ResultList { rets, taken })
    }
}
