//! Attributes: validated views of `XLA_FFI_Attrs` and their typed decoding.
//!
//! XLA passes each attribute as a tagged pointer: a scalar (`XLA_FFI_Scalar*`), a dense array
//! (`XLA_FFI_Array*`), a string (`XLA_FFI_ByteSpan*`) or a dictionary (a nested
//! `XLA_FFI_Attrs*`). [`Attrs`] validates the list; [`AttrValue`] is one decoded value;
//! [`FromAttr`] turns a value into a Rust type (dtypes match, or a float converts exactly);
//! [`crate::ffi_string_enum!`] declares an enum decoded from a string; and [`crate::ffi_attrs!`]
//! declares a struct that decodes a whole attribute list by name, reporting every missing,
//! mistyped and unexpected attribute at once.

use std::ffi::c_void;
use std::fmt;
use std::ptr;

use half::{bf16, f16};

use super::buffer::check_list;
use super::dtype::{DataType, NativeType};
use super::error::DecodeErrors;
use super::sys;

/// A validated attribute list (the call's, or a dictionary attribute).
#[derive(Clone, Copy)]
pub struct Attrs<'a> {
    raw: &'a sys::XLA_FFI_Attrs,
}

/// One attribute value.
#[derive(Clone, Copy)]
pub enum AttrValue<'a> {
    /// A scalar of one of XLA's dtypes.
    Scalar(Scalar),
    /// A dense array of one dtype.
    Array(ArrayAttr<'a>),
    /// Bytes as XLA passed them; [`FromAttr`] for `&str` checks UTF-8.
    String(&'a [u8]),
    /// A nested attribute list.
    Dictionary(Attrs<'a>),
}

/// A scalar attribute.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scalar {
    /// A boolean (PRED).
    Pred(bool),
    /// A signed 8-bit integer (S8).
    S8(i8),
    /// A signed 16-bit integer (S16).
    S16(i16),
    /// A signed 32-bit integer (S32).
    S32(i32),
    /// A signed 64-bit integer (S64).
    S64(i64),
    /// An unsigned 8-bit integer (U8).
    U8(u8),
    /// An unsigned 16-bit integer (U16).
    U16(u16),
    /// An unsigned 32-bit integer (U32).
    U32(u32),
    /// An unsigned 64-bit integer (U64).
    U64(u64),
    /// A 16-bit IEEE float (F16).
    F16(f16),
    /// A bfloat16 (BF16).
    BF16(bf16),
    /// A 32-bit IEEE float (F32).
    F32(f32),
    /// A 64-bit IEEE float (F64).
    F64(f64),
    /// A scalar of a dtype this layer does not read.
    Other(DataType),
}

/// A dense array attribute.
#[derive(Clone, Copy)]
pub struct ArrayAttr<'a> {
    dtype: DataType,
    len: usize,
    data: *const c_void,
    _life: std::marker::PhantomData<&'a ()>,
}

impl<'a> Attrs<'a> {
    /// # Safety
    /// `raw` must point to an attribute list laid out as XLA does, valid for `'a`: `size` entries
    /// in `types`, `names` and `attrs`, each name a readable byte span, each attribute pointing to
    /// the struct its type announces.
    pub(crate) unsafe fn from_raw(raw: *const sys::XLA_FFI_Attrs) -> Result<Self, String> {
        if raw.is_null() {
            return Err("null attribute list".into());
        }
        // SAFETY: non-null, and the caller guarantees at least `struct_size` readable bytes.
        let struct_size = unsafe { ptr::addr_of!((*raw).struct_size).read() };
        if struct_size < sys::XLA_FFI_Attrs::STRUCT_SIZE {
            return Err(format!(
                "unexpected attributes struct size: expected at least {}, got {struct_size}",
                sys::XLA_FFI_Attrs::STRUCT_SIZE
            ));
        }
        // SAFETY: struct_size covers the whole struct (checked above).
        let attrs = unsafe { &*raw };
        check_list(
            "attributes",
            attrs.struct_size,
            sys::XLA_FFI_Attrs::STRUCT_SIZE,
            attrs.size,
            attrs.types.is_null(),
            attrs.names.is_null() || attrs.attrs.is_null(),
        )?;
        Ok(Attrs { raw: attrs })
    }

    /// The number of attributes.
    pub fn len(&self) -> usize {
        self.raw.size as usize
    }

    /// Whether the list has no attributes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The name of the `index`th attribute, as bytes.
    pub fn name(&self, index: usize) -> Result<&'a [u8], String> {
        if index >= self.len() {
            return Err(format!("there is no attribute {index}"));
        }
        // SAFETY: `index < size`; `names` holds `size` pointers (validated in `from_raw`).
        let span = unsafe { *self.raw.names.add(index) };
        if span.is_null() {
            return Err(format!("attribute {index} has a null name"));
        }
        // SAFETY: XLA passes a valid byte span for every name.
        let span = unsafe { span.read() };
        byte_span(span).ok_or_else(|| format!("attribute {index} has a null name"))
    }

    /// The `index`th attribute's value.
    pub fn value(&self, index: usize) -> Result<AttrValue<'a>, String> {
        let name = self.name(index)?;
        let name = String::from_utf8_lossy(name);
        // SAFETY: `index < size` (checked by `name`); the lists hold `size` entries.
        let (ty, item) = unsafe { (*self.raw.types.add(index), *self.raw.attrs.add(index)) };
        if item.is_null() {
            return Err(format!("attribute `{name}` is a null pointer"));
        }
        match ty {
            sys::XLA_FFI_AttrType::SCALAR => {
                // SAFETY: a SCALAR attribute points to an `XLA_FFI_Scalar`.
                let scalar = unsafe { item.cast::<sys::XLA_FFI_Scalar>().read() };
                // SAFETY: `value` points to one element of `dtype` (XLA's layout).
                unsafe { Scalar::from_raw(scalar) }
                    .map(AttrValue::Scalar)
                    .map_err(|e| format!("attribute `{name}`: {e}"))
            }
            sys::XLA_FFI_AttrType::ARRAY => {
                // SAFETY: an ARRAY attribute points to an `XLA_FFI_Array`.
                let array = unsafe { item.cast::<sys::XLA_FFI_Array>().read() };
                ArrayAttr::from_raw(array)
                    .map(AttrValue::Array)
                    .map_err(|e| format!("attribute `{name}`: {e}"))
            }
            sys::XLA_FFI_AttrType::STRING => {
                // SAFETY: a STRING attribute points to an `XLA_FFI_ByteSpan`.
                let span = unsafe { item.cast::<sys::XLA_FFI_ByteSpan>().read() };
                byte_span(span)
                    .map(AttrValue::String)
                    .ok_or_else(|| format!("attribute `{name}` is a string with a null pointer"))
            }
            sys::XLA_FFI_AttrType::DICTIONARY => {
                // SAFETY: a DICTIONARY attribute points to a nested `XLA_FFI_Attrs`, laid out
                // like the outer list.
                unsafe { Attrs::from_raw(item.cast()) }
                    .map(AttrValue::Dictionary)
                    .map_err(|e| format!("attribute `{name}`: {e}"))
            }
            other => Err(format!("attribute `{name}` has unknown type {}", other.0)),
        }
    }

    /// The index of the attribute called `name`.
    pub fn find(&self, name: &str) -> Option<usize> {
        (0..self.len()).find(|&i| self.name(i).ok() == Some(name.as_bytes()))
    }

    /// The value of the attribute called `name`.
    pub fn get(&self, name: &str) -> Option<Result<AttrValue<'a>, String>> {
        self.find(name).map(|i| self.value(i))
    }
}

/// The bytes of a span, or `None` for a null pointer with a non-zero length.
fn byte_span<'a>(span: sys::XLA_FFI_ByteSpan) -> Option<&'a [u8]> {
    if span.len == 0 {
        return Some(&[]);
    }
    if span.ptr.is_null() || span.len > isize::MAX as usize {
        return None;
    }
    // SAFETY: XLA's byte spans point to `len` readable bytes for the life of the call frame.
    Some(unsafe { std::slice::from_raw_parts(span.ptr.cast::<u8>(), span.len) })
}

impl Scalar {
    /// # Safety
    /// `raw.value` must be null or point to one readable element of `raw.dtype`.
    unsafe fn from_raw(raw: sys::XLA_FFI_Scalar) -> Result<Scalar, String> {
        let dtype = DataType::from_raw(raw.dtype);
        if raw.value.is_null() {
            return Err(format!("{dtype} scalar has a null value pointer"));
        }
        let p = raw.value;
        // SAFETY (all reads): `p` points to one element of `dtype` (the caller's contract);
        // `read_unaligned` makes no alignment assumption.
        let value = unsafe {
            match dtype {
                DataType::Pred => Scalar::Pred(p.cast::<u8>().read() != 0),
                DataType::S8 => Scalar::S8(p.cast::<i8>().read_unaligned()),
                DataType::S16 => Scalar::S16(p.cast::<i16>().read_unaligned()),
                DataType::S32 => Scalar::S32(p.cast::<i32>().read_unaligned()),
                DataType::S64 => Scalar::S64(p.cast::<i64>().read_unaligned()),
                DataType::U8 => Scalar::U8(p.cast::<u8>().read_unaligned()),
                DataType::U16 => Scalar::U16(p.cast::<u16>().read_unaligned()),
                DataType::U32 => Scalar::U32(p.cast::<u32>().read_unaligned()),
                DataType::U64 => Scalar::U64(p.cast::<u64>().read_unaligned()),
                DataType::F16 => Scalar::F16(p.cast::<f16>().read_unaligned()),
                DataType::BF16 => Scalar::BF16(p.cast::<bf16>().read_unaligned()),
                DataType::F32 => Scalar::F32(p.cast::<f32>().read_unaligned()),
                DataType::F64 => Scalar::F64(p.cast::<f64>().read_unaligned()),
                other => Scalar::Other(other),
            }
        };
        Ok(value)
    }

    /// The dtype of the scalar.
    pub fn dtype(&self) -> DataType {
        match self {
            Scalar::Pred(_) => DataType::Pred,
            Scalar::S8(_) => DataType::S8,
            Scalar::S16(_) => DataType::S16,
            Scalar::S32(_) => DataType::S32,
            Scalar::S64(_) => DataType::S64,
            Scalar::U8(_) => DataType::U8,
            Scalar::U16(_) => DataType::U16,
            Scalar::U32(_) => DataType::U32,
            Scalar::U64(_) => DataType::U64,
            Scalar::F16(_) => DataType::F16,
            Scalar::BF16(_) => DataType::BF16,
            Scalar::F32(_) => DataType::F32,
            Scalar::F64(_) => DataType::F64,
            Scalar::Other(d) => *d,
        }
    }
}

/// The value alone ("0.1", "true", "-3"); `<S4>` for a dtype this layer does not read.
impl fmt::Display for Scalar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scalar::Pred(v) => write!(f, "{v}"),
            Scalar::S8(v) => write!(f, "{v}"),
            Scalar::S16(v) => write!(f, "{v}"),
            Scalar::S32(v) => write!(f, "{v}"),
            Scalar::S64(v) => write!(f, "{v}"),
            Scalar::U8(v) => write!(f, "{v}"),
            Scalar::U16(v) => write!(f, "{v}"),
            Scalar::U32(v) => write!(f, "{v}"),
            Scalar::U64(v) => write!(f, "{v}"),
            Scalar::F16(v) => write!(f, "{v}"),
            Scalar::BF16(v) => write!(f, "{v}"),
            Scalar::F32(v) => write!(f, "{v}"),
            Scalar::F64(v) => write!(f, "{v}"),
            Scalar::Other(d) => write!(f, "<{d}>"),
        }
    }
}

impl<'a> ArrayAttr<'a> {
    fn from_raw(raw: sys::XLA_FFI_Array) -> Result<Self, String> {
        let dtype = DataType::from_raw(raw.dtype);
        let bytes = dtype
            .bytes_for(raw.size)
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| {
                format!(
                    "{dtype} array of {} elements is not representable",
                    raw.size
                )
            })?;
        if bytes > 0 && raw.data.is_null() {
            return Err(format!(
                "{dtype} array of {} elements has a null data pointer",
                raw.size
            ));
        }
        Ok(ArrayAttr {
            dtype,
            len: raw.size,
            data: raw.data,
            _life: std::marker::PhantomData,
        })
    }

    /// The dtype of the elements.
    pub fn dtype(&self) -> DataType {
        self.dtype
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The elements, if the dtype is `T`'s.
    pub fn as_slice<T: NativeType>(&self) -> Result<&'a [T], String> {
        if self.dtype != T::DTYPE {
            return Err(format!(
                "expected {} array, got {} array",
                T::DTYPE,
                self.dtype
            ));
        }
        if self.len == 0 {
            return Ok(&[]);
        }
        if !(self.data as usize).is_multiple_of(std::mem::align_of::<T>()) {
            return Err(format!("{} array data is misaligned", self.dtype));
        }
        // SAFETY: the dtype matches `T` (every bit pattern valid), the pointer is non-null
        // (checked in `from_raw`) and aligned, and XLA keeps `len` elements alive for `'a`.
        Ok(unsafe { std::slice::from_raw_parts(self.data.cast::<T>(), self.len) })
    }
}

impl AttrValue<'_> {
    /// A short description of the value's kind, for messages ("F64 scalar", "S64 array").
    pub fn kind(&self) -> String {
        match self {
            AttrValue::Scalar(s) => format!("{} scalar", s.dtype()),
            AttrValue::Array(a) => format!("{} array", a.dtype()),
            AttrValue::String(_) => "string".into(),
            AttrValue::Dictionary(_) => "dictionary".into(),
        }
    }

    /// The kind with the value where it is short, for mismatch messages: "F64 scalar 0.1",
    /// `string "fsat"` (so that a misspelt enum name or an inexact float is visible in the
    /// error; strings longer than 64 characters are cut).
    pub fn describe(&self) -> String {
        match self {
            AttrValue::Scalar(Scalar::Other(d)) => format!("{d} scalar"),
            AttrValue::Scalar(s) => format!("{} scalar {s}", s.dtype()),
            AttrValue::String(bytes) => {
                let text = String::from_utf8_lossy(bytes);
                match text.char_indices().nth(64) {
                    Some((cut, _)) => format!("string {:?}...", &text[..cut]),
                    None => format!("string {text:?}"),
                }
            }
            other => other.kind(),
        }
    }
}

impl fmt::Debug for Attrs<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut map = f.debug_map();
        for i in 0..self.len() {
            let name = self.name(i).map(String::from_utf8_lossy);
            let kind = self.value(i).map(|v| v.kind());
            map.entry(&name, &kind);
        }
        map.finish()
    }
}

/// Decoding of one attribute value into a Rust type. Dtypes must match, with one exception
/// for floats: JAX passes a Python float as an F64 scalar, so `f32` also takes an F64 scalar
/// whose value F32 holds exactly (`0.5` is, `0.1` is not) and `f64` takes any F32 scalar (widening
/// is exact). A value that would be rounded is refused with the fix in the message, never
/// silently rounded.
pub trait FromAttr<'a>: Sized {
    /// What is expected, for messages ("F32 scalar").
    fn expected() -> String;
    /// The value as `Self`, or `None` if its kind, dtype or value does not fit.
    fn from_attr(value: AttrValue<'a>) -> Option<Self>;
    /// The value to use when the attribute is absent; `None` makes it required.
    fn when_missing() -> Option<Self> {
        None
    }
    /// Why `value` did not decode (after [`FromAttr::from_attr`] returned `None`): by default
    /// "expected F32 scalar, got string \"fast\"", the value included
    /// ([`AttrValue::describe`]). Override it to name the fix.
    fn mismatch(value: AttrValue<'a>) -> String {
        format!("expected {}, got {}", Self::expected(), value.describe())
    }
}

macro_rules! scalar_from_attr {
    ($($ty:ty => $variant:ident),* $(,)?) => {$(
        impl<'a> FromAttr<'a> for $ty {
            fn expected() -> String {
                format!("{} scalar", DataType::$variant)
            }
            fn from_attr(value: AttrValue<'a>) -> Option<Self> {
                match value {
                    AttrValue::Scalar(Scalar::$variant(v)) => Some(v),
                    _ => None,
                }
            }
        }
    )*};
}

scalar_from_attr! {
    bool => Pred, i8 => S8, i16 => S16, i32 => S32, i64 => S64,
    u8 => U8, u16 => U16, u32 => U32, u64 => U64,
    f16 => F16, bf16 => BF16,
}

/// `v` as an `f32` if that loses nothing (NaN stays NaN; infinities are exact).
fn f32_exactly(v: f64) -> Option<f32> {
    let narrow = v as f32;
    (v.is_nan() || f64::from(narrow) == v).then_some(narrow)
}

impl<'a> FromAttr<'a> for f32 {
    fn expected() -> String {
        format!("{} scalar", DataType::F32)
    }
    fn from_attr(value: AttrValue<'a>) -> Option<Self> {
        match value {
            AttrValue::Scalar(Scalar::F32(v)) => Some(v),
            // A Python float: taken when F32 holds it exactly.
            AttrValue::Scalar(Scalar::F64(v)) => f32_exactly(v),
            _ => None,
        }
    }
    fn mismatch(value: AttrValue<'a>) -> String {
        match value {
            AttrValue::Scalar(Scalar::F64(v)) => format!(
                "expected {}, got F64 scalar {v}, which F32 cannot hold exactly: pass \
                 np.float32({v}) to round it",
                Self::expected()
            ),
            other => format!("expected {}, got {}", Self::expected(), other.describe()),
        }
    }
}

impl<'a> FromAttr<'a> for f64 {
    fn expected() -> String {
        format!("{} scalar", DataType::F64)
    }
    fn from_attr(value: AttrValue<'a>) -> Option<Self> {
        match value {
            AttrValue::Scalar(Scalar::F64(v)) => Some(v),
            AttrValue::Scalar(Scalar::F32(v)) => Some(f64::from(v)),
            _ => None,
        }
    }
}

impl<'a> FromAttr<'a> for Scalar {
    fn expected() -> String {
        "scalar".into()
    }
    fn from_attr(value: AttrValue<'a>) -> Option<Self> {
        match value {
            AttrValue::Scalar(s) => Some(s),
            _ => None,
        }
    }
}

impl<'a> FromAttr<'a> for &'a str {
    fn expected() -> String {
        "UTF-8 string".into()
    }
    fn from_attr(value: AttrValue<'a>) -> Option<Self> {
        match value {
            AttrValue::String(bytes) => std::str::from_utf8(bytes).ok(),
            _ => None,
        }
    }
}

impl<'a> FromAttr<'a> for String {
    fn expected() -> String {
        "UTF-8 string".into()
    }
    fn from_attr(value: AttrValue<'a>) -> Option<Self> {
        <&str>::from_attr(value).map(str::to_owned)
    }
}

impl<'a, T: NativeType> FromAttr<'a> for &'a [T] {
    fn expected() -> String {
        format!("{} array", T::DTYPE)
    }
    fn from_attr(value: AttrValue<'a>) -> Option<Self> {
        match value {
            AttrValue::Array(a) => a.as_slice::<T>().ok(),
            _ => None,
        }
    }
}

impl<'a> FromAttr<'a> for Attrs<'a> {
    fn expected() -> String {
        "dictionary".into()
    }
    fn from_attr(value: AttrValue<'a>) -> Option<Self> {
        match value {
            AttrValue::Dictionary(d) => Some(d),
            _ => None,
        }
    }
}

impl<'a> FromAttr<'a> for AttrValue<'a> {
    fn expected() -> String {
        "attribute".into()
    }
    fn from_attr(value: AttrValue<'a>) -> Option<Self> {
        Some(value)
    }
}

impl<'a, T: FromAttr<'a>> FromAttr<'a> for Option<T> {
    fn expected() -> String {
        T::expected()
    }
    fn from_attr(value: AttrValue<'a>) -> Option<Self> {
        T::from_attr(value).map(Some)
    }
    fn when_missing() -> Option<Self> {
        Some(None)
    }
    fn mismatch(value: AttrValue<'a>) -> String {
        T::mismatch(value)
    }
}

/// What a string enum expects, for messages: `one of "fast", "exact" (string)`.
pub fn describe_names(names: &[&str]) -> String {
    let quoted: Vec<String> = names.iter().map(|n| format!("{n:?}")).collect();
    format!("one of {} (string)", quoted.join(", "))
}

/// Declares an enum decoded from a string attribute by name: a misspelt name is refused with
/// the name received and every accepted one ("wrong type for attribute `mode`: expected one of
/// \"fast\", \"exact\" (string), got string \"fsat\""). Each variant also gets
/// `Enum::NAMES`, `name()` and `parse()`, for messages and for parsing elsewhere.
///
/// ```
/// xla_ffi_bundles::ffi_string_enum! {
///     /// How an example op rounds.
///     pub enum Rounding {
///         /// Round to nearest.
///         Nearest = "nearest",
///         /// Round toward zero.
///         TowardZero = "toward_zero",
///     }
/// }
/// assert_eq!(Rounding::parse("nearest"), Some(Rounding::Nearest));
/// assert_eq!(Rounding::TowardZero.name(), "toward_zero");
/// xla_ffi_bundles::ffi_attrs! {
///     /// Attributes of the example op.
///     pub struct ExampleAttrs {
///         pub rounding: Rounding,
///     }
/// }
/// ```
#[macro_export]
macro_rules! ffi_string_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $text:literal ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        $vis enum $name { $( $(#[$vmeta])* $variant ),+ }

        impl $name {
            /// The accepted names, in declaration order.
            pub const NAMES: &'static [&'static str] = &[$($text),+];

            /// The name this variant is passed as.
            pub fn name(self) -> &'static str {
                match self { $( $name::$variant => $text ),+ }
            }

            /// The variant called `name`, if any.
            pub fn parse(name: &str) -> ::std::option::Option<Self> {
                match name {
                    $( $text => ::std::option::Option::Some($name::$variant), )+
                    _ => ::std::option::Option::None,
                }
            }
        }

        impl<'__a> $crate::ffi::attrs::FromAttr<'__a> for $name {
            fn expected() -> ::std::string::String {
                $crate::ffi::attrs::describe_names(Self::NAMES)
            }
            fn from_attr(
                value: $crate::ffi::attrs::AttrValue<'__a>,
            ) -> ::std::option::Option<Self> {
                <&str as $crate::ffi::attrs::FromAttr<'__a>>::from_attr(value)
                    .and_then(Self::parse)
            }
        }
    };
}

/// An integer scalar's value, whatever its width and signedness (`None` for any other value):
/// what [`crate::ffi_int_enum!`] matches, since a Python `int` arrives as S64 and `np.int32(1)` as S32.
pub fn integer_value(value: AttrValue<'_>) -> Option<i128> {
    match value {
        AttrValue::Scalar(s) => match s {
            Scalar::S8(v) => Some(v.into()),
            Scalar::S16(v) => Some(v.into()),
            Scalar::S32(v) => Some(v.into()),
            Scalar::S64(v) => Some(v.into()),
            Scalar::U8(v) => Some(v.into()),
            Scalar::U16(v) => Some(v.into()),
            Scalar::U32(v) => Some(v.into()),
            Scalar::U64(v) => Some(v.into()),
            _ => None,
        },
        _ => None,
    }
}

/// What an integer enum expects, for messages: `one of 0 (fast), 1 (exact) (integer)`.
pub fn describe_values(values: &[(i128, &str)]) -> String {
    let each: Vec<String> = values.iter().map(|(v, n)| format!("{v} ({n})")).collect();
    format!("one of {} (integer)", each.join(", "))
}

/// Declares an enum decoded from an integer attribute by value (XLA's C++ enums decoded from
/// their underlying integer), of any integer dtype: a Python `int` and `np.int32(1)` both
/// decode. A value with no variant is refused with every accepted value and its name ("wrong
/// type for attribute `mode`: expected one of 0 (Fast), 1 (Exact) (integer), got S64 scalar
/// 7"). Each enum also gets `Enum::VALUES`, `value()` and `from_value()`.
///
/// ```
/// xla_ffi_bundles::ffi_int_enum! {
///     /// How an example op reduces.
///     pub enum Reduction {
///         /// The sum.
///         Sum = 0,
///         /// The mean.
///         Mean = 1,
///     }
/// }
/// assert_eq!(Reduction::from_value(1), Some(Reduction::Mean));
/// assert_eq!(Reduction::Sum.value(), 0);
/// ```
#[macro_export]
macro_rules! ffi_int_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $value:literal ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        $vis enum $name { $( $(#[$vmeta])* $variant ),+ }

        impl $name {
            /// The accepted values and their variants' names, in declaration order.
            pub const VALUES: &'static [(i128, &'static str)] =
                &[$(($value, stringify!($variant))),+];

            /// The integer this variant is passed as.
            pub fn value(self) -> i128 {
                match self { $( $name::$variant => $value ),+ }
            }

            /// The variant whose value is `value`, if any.
            pub fn from_value(value: i128) -> ::std::option::Option<Self> {
                $( if value == $value { return ::std::option::Option::Some($name::$variant); } )+
                ::std::option::Option::None
            }
        }

        impl<'__a> $crate::ffi::attrs::FromAttr<'__a> for $name {
            fn expected() -> ::std::string::String {
                $crate::ffi::attrs::describe_values(Self::VALUES)
            }
            fn from_attr(
                value: $crate::ffi::attrs::AttrValue<'__a>,
            ) -> ::std::option::Option<Self> {
                $crate::ffi::attrs::integer_value(value).and_then(Self::from_value)
            }
        }
    };
}

/// Decodes the attribute `name` as `T`, recording a message on failure.
pub fn decode_field<'a, T: FromAttr<'a>>(
    attrs: Attrs<'a>,
    name: &str,
    errors: &mut DecodeErrors,
) -> Option<T> {
    match attrs.get(name) {
        None => {
            let value = T::when_missing();
            if value.is_none() {
                errors.push(format!("missing attribute `{name}` ({})", T::expected()));
            }
            value
        }
        Some(Err(e)) => {
            errors.push(e);
            None
        }
        Some(Ok(value)) => {
            let decoded = T::from_attr(value);
            if decoded.is_none() {
                errors.push(format!(
                    "wrong type for attribute `{name}`: {}",
                    T::mismatch(value)
                ));
            }
            decoded
        }
    }
}

/// A dictionary attribute decoded as `T` (an [`crate::ffi_attrs!`] struct nested in another): every
/// problem inside it, joined, or what the value was if it is no dictionary.
pub fn decode_nested<'a, T: DecodeAttrs<'a>>(value: AttrValue<'a>) -> Result<T, String> {
    let AttrValue::Dictionary(inner) = value else {
        return Err(format!("expected dictionary, got {}", value.describe()));
    };
    let mut errors = DecodeErrors::new();
    let decoded = T::decode(inner, &mut errors);
    match decoded {
        Some(v) if errors.is_empty() => Ok(v),
        _ => Err(format!(
            "in the dictionary: {}",
            errors.messages().join("; ")
        )),
    }
}

/// Records every attribute whose name is not in `known`.
pub fn reject_unknown(attrs: Attrs<'_>, known: &[&str], errors: &mut DecodeErrors) {
    for i in 0..attrs.len() {
        match attrs.name(i) {
            Ok(name) if known.iter().any(|k| k.as_bytes() == name) => {}
            Ok(name) => errors.push(format!(
                "unexpected attribute `{}` (expected: {})",
                String::from_utf8_lossy(name),
                if known.is_empty() {
                    "none".to_string()
                } else {
                    known.join(", ")
                }
            )),
            Err(e) => errors.push(e),
        }
    }
}

/// Decoding of a handler's whole attribute list.
pub trait DecodeAttrs<'a>: Sized {
    /// Decodes the list, recording every problem in `errors` (any recorded problem fails
    /// the call, even if a value is returned).
    fn decode(attrs: Attrs<'a>, errors: &mut DecodeErrors) -> Option<Self>;
}

/// Takes the attribute list as it is (for handlers that read attributes by hand).
impl<'a> DecodeAttrs<'a> for Attrs<'a> {
    fn decode(attrs: Attrs<'a>, _errors: &mut DecodeErrors) -> Option<Self> {
        Some(attrs)
    }
}

/// Ignores attributes. Stages other than the one that reads them use this: XLA passes the same
/// attributes to every stage of a bundle.
impl<'a> DecodeAttrs<'a> for () {
    fn decode(_attrs: Attrs<'a>, _errors: &mut DecodeErrors) -> Option<Self> {
        Some(())
    }
}

/// Declares a struct decoded from an attribute list by field name. Every attribute must be
/// known, every non-`Option` field present, every dtype exact (a float may be the other width
/// when the value converts exactly, see [`FromAttr`]); all failures are reported together.
///
/// ```
/// xla_ffi_bundles::ffi_attrs! {
///     /// Attributes of an example op.
///     pub struct ExampleAttrs {
///         pub scale: f32,
///         pub row_len: i64,
///         pub mode: Option<i32>,
///     }
/// }
/// ```
#[macro_export]
macro_rules! ffi_attrs {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident <$lt:lifetime> {
            $( $(#[$fmeta:meta])* $fvis:vis $field:ident : $ty:ty ),* $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone)]
        $vis struct $name<$lt> { $( $(#[$fmeta])* $fvis $field : $ty ),* }

        impl<$lt> $crate::ffi::attrs::DecodeAttrs<$lt> for $name<$lt> {
            $crate::ffi_attrs!(@decode $lt, $name { $($field : $ty),* });
        }

        $crate::ffi_attrs!(@nested $lt, $name<$lt>);
    };
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident {
            $( $(#[$fmeta:meta])* $fvis:vis $field:ident : $ty:ty ),* $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone)]
        $vis struct $name { $( $(#[$fmeta])* $fvis $field : $ty ),* }

        impl<'__a> $crate::ffi::attrs::DecodeAttrs<'__a> for $name {
            $crate::ffi_attrs!(@decode '__a, $name { $($field : $ty),* });
        }

        $crate::ffi_attrs!(@nested '__a, $name);
    };
    // The struct as the value of a dictionary attribute (a nested struct field).
    (@nested $lt:lifetime, $ty:ty) => {
        impl<$lt> $crate::ffi::attrs::FromAttr<$lt> for $ty {
            fn expected() -> ::std::string::String {
                ::std::format!("dictionary ({})", stringify!($ty))
            }
            fn from_attr(
                value: $crate::ffi::attrs::AttrValue<$lt>,
            ) -> ::std::option::Option<Self> {
                $crate::ffi::attrs::decode_nested(value).ok()
            }
            fn mismatch(value: $crate::ffi::attrs::AttrValue<$lt>) -> ::std::string::String {
                match $crate::ffi::attrs::decode_nested::<Self>(value) {
                    ::std::result::Result::Err(why) => why,
                    ::std::result::Result::Ok(_) => ::std::string::String::new(),
                }
            }
        }
    };
    (@decode $lt:lifetime, $name:ident { $($field:ident : $ty:ty),* }) => {
        #[allow(unused_variables)]
        fn decode(
            attrs: $crate::ffi::attrs::Attrs<$lt>,
            errors: &mut $crate::ffi::error::DecodeErrors,
        ) -> ::std::option::Option<Self> {
            $crate::ffi::attrs::reject_unknown(attrs, &[$(stringify!($field)),*], errors);
            $( let $field = $crate::ffi::attrs::decode_field::<$ty>(
                attrs, stringify!($field), errors); )*
            ::std::option::Option::Some($name { $( $field: $field? ),* })
        }
    };
}
