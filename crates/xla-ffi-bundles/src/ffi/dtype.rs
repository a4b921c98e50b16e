//! Element types of buffers and attributes.

use std::fmt;

use half::{bf16, f16};

use super::sys::XLA_FFI_DataType as Raw;

/// An XLA primitive type. `Other` keeps values this crate does not know, so that decoding a
/// buffer of a newer dtype gives a clear error instead of undefined behaviour.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DataType {
    /// XLA's invalid type (no element size; never a valid buffer).
    Invalid,
    /// Boolean (PRED), one byte per element.
    Pred,
    /// 1-bit signed integer (S1).
    S1,
    /// 2-bit signed integer (S2).
    S2,
    /// 4-bit signed integer (S4).
    S4,
    /// 8-bit signed integer (S8).
    S8,
    /// 16-bit signed integer (S16).
    S16,
    /// 32-bit signed integer (S32).
    S32,
    /// 64-bit signed integer (S64).
    S64,
    /// 1-bit unsigned integer (U1).
    U1,
    /// 2-bit unsigned integer (U2).
    U2,
    /// 4-bit unsigned integer (U4).
    U4,
    /// 8-bit unsigned integer (U8).
    U8,
    /// 16-bit unsigned integer (U16).
    U16,
    /// 32-bit unsigned integer (U32).
    U32,
    /// 64-bit unsigned integer (U64).
    U64,
    /// 16-bit IEEE float (F16).
    F16,
    /// 32-bit IEEE float (F32).
    F32,
    /// 64-bit IEEE float (F64).
    F64,
    /// 16-bit bfloat16 (BF16).
    BF16,
    /// 64-bit complex: two F32s (C64).
    C64,
    /// 128-bit complex: two F64s (C128).
    C128,
    /// XLA's token, which orders side effects and holds no data (TOKEN).
    Token,
    /// 8-bit float with 5 exponent and 2 mantissa bits, IEEE-like (F8E5M2).
    F8E5M2,
    /// 8-bit float with 3 exponent and 4 mantissa bits, IEEE-like (F8E3M4).
    F8E3M4,
    /// 8-bit float with 4 exponent and 3 mantissa bits, IEEE-like (F8E4M3).
    F8E4M3,
    /// 8-bit float with 4 exponent and 3 mantissa bits, finite only: no infinities (F8E4M3FN).
    F8E4M3FN,
    /// 8-bit float with 4 exponent and 3 mantissa bits, exponent bias 11, finite, no negative
    /// zero (F8E4M3B11FNUZ).
    F8E4M3B11FNUZ,
    /// 8-bit float with 5 exponent and 2 mantissa bits, finite, no negative zero (F8E5M2FNUZ).
    F8E5M2FNUZ,
    /// 8-bit float with 4 exponent and 3 mantissa bits, finite, no negative zero (F8E4M3FNUZ).
    F8E4M3FNUZ,
    /// 4-bit float with 2 exponent bits and 1 mantissa bit, finite only (F4E2M1FN).
    F4E2M1FN,
    /// 8-bit exponent-only float (a power-of-two scale), unsigned and finite (F8E8M0FNU).
    F8E8M0FNU,
    /// A dtype this crate does not know, with its C value.
    Other(i32),
}

macro_rules! dtype_table {
    ($($variant:ident => $raw:ident, $name:literal, $bits:expr;)*) => {
        impl DataType {
            /// The dtype of a C value.
            pub fn from_raw(raw: Raw) -> DataType {
                match raw {
                    $( Raw::$raw => DataType::$variant, )*
                    Raw(other) => DataType::Other(other),
                }
            }

            /// The C value of this dtype.
            pub fn to_raw(self) -> Raw {
                match self {
                    $( DataType::$variant => Raw::$raw, )*
                    DataType::Other(other) => Raw(other),
                }
            }

            /// XLA's name for the dtype ("F32", "BF16", ...).
            pub fn name(self) -> &'static str {
                match self {
                    $( DataType::$variant => $name, )*
                    DataType::Other(_) => "UNKNOWN",
                }
            }

            /// Bits per element, or `None` for types without a fixed element size.
            pub fn bit_width(self) -> Option<usize> {
                match self {
                    $( DataType::$variant => $bits, )*
                    DataType::Other(_) => None,
                }
            }
        }
    };
}

dtype_table! {
    Invalid => INVALID, "INVALID", None;
    Pred => PRED, "PRED", Some(8);
    S1 => S1, "S1", Some(1);
    S2 => S2, "S2", Some(2);
    S4 => S4, "S4", Some(4);
    S8 => S8, "S8", Some(8);
    S16 => S16, "S16", Some(16);
    S32 => S32, "S32", Some(32);
    S64 => S64, "S64", Some(64);
    U1 => U1, "U1", Some(1);
    U2 => U2, "U2", Some(2);
    U4 => U4, "U4", Some(4);
    U8 => U8, "U8", Some(8);
    U16 => U16, "U16", Some(16);
    U32 => U32, "U32", Some(32);
    U64 => U64, "U64", Some(64);
    F16 => F16, "F16", Some(16);
    F32 => F32, "F32", Some(32);
    F64 => F64, "F64", Some(64);
    BF16 => BF16, "BF16", Some(16);
    C64 => C64, "C64", Some(64);
    C128 => C128, "C128", Some(128);
    Token => TOKEN, "TOKEN", Some(0);
    F8E5M2 => F8E5M2, "F8E5M2", Some(8);
    F8E3M4 => F8E3M4, "F8E3M4", Some(8);
    F8E4M3 => F8E4M3, "F8E4M3", Some(8);
    F8E4M3FN => F8E4M3FN, "F8E4M3FN", Some(8);
    F8E4M3B11FNUZ => F8E4M3B11FNUZ, "F8E4M3B11FNUZ", Some(8);
    F8E5M2FNUZ => F8E5M2FNUZ, "F8E5M2FNUZ", Some(8);
    F8E4M3FNUZ => F8E4M3FNUZ, "F8E4M3FNUZ", Some(8);
    F4E2M1FN => F4E2M1FN, "F4E2M1FN", Some(4);
    F8E8M0FNU => F8E8M0FNU, "F8E8M0FNU", Some(8);
}

impl DataType {
    /// Bytes taken by `count` elements, rounding sub-byte types up; `None` on overflow or for
    /// types without a fixed element size.
    pub fn bytes_for(self, count: usize) -> Option<usize> {
        let bits = self.bit_width()?;
        count.checked_mul(bits)?.checked_add(7).map(|b| b / 8)
    }

    /// The accepted dtypes as an error message names them: "F32", or "one of F32, BF16".
    pub fn describe_accepted(accepted: &[DataType]) -> String {
        let names: Vec<&str> = accepted.iter().map(|d| d.name()).collect();
        match names.as_slice() {
            [one] => one.to_string(),
            many => format!("one of {}", many.join(", ")),
        }
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DataType::Other(raw) => write!(f, "UNKNOWN({raw})"),
            known => f.write_str(known.name()),
        }
    }
}

/// A Rust type whose values can be viewed in place in an XLA buffer or array of [`Self::DTYPE`].
///
/// Implemented only for plain-old-data types for which every bit pattern is a valid value, so a
/// typed view of any buffer of the right dtype is sound.
pub trait NativeType: Copy + Send + Sync + 'static + private::Sealed {
    /// The dtype of this Rust type's values.
    const DTYPE: DataType;
}

mod private {
    pub trait Sealed {}
}

macro_rules! native {
    ($($ty:ty => $dtype:ident),* $(,)?) => {
        $(
            impl private::Sealed for $ty {}
            impl NativeType for $ty { const DTYPE: DataType = DataType::$dtype; }
        )*
    };
}

native! {
    i8 => S8, i16 => S16, i32 => S32, i64 => S64,
    u8 => U8, u16 => U16, u32 => U32, u64 => U64,
    f16 => F16, bf16 => BF16, f32 => F32, f64 => F64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_round_trip_and_names() {
        for (name, value) in Raw::VALUES {
            let dtype = DataType::from_raw(Raw(*value));
            assert_eq!(dtype.to_raw(), Raw(*value));
            assert_eq!(format!("XLA_FFI_DataType_{}", dtype.name()), *name);
        }
        assert_eq!(DataType::from_raw(Raw(999)), DataType::Other(999));
        assert_eq!(DataType::Other(999).to_string(), "UNKNOWN(999)");
    }

    #[test]
    fn byte_sizes() {
        assert_eq!(DataType::F32.bytes_for(3), Some(12));
        assert_eq!(DataType::BF16.bytes_for(3), Some(6));
        assert_eq!(DataType::S4.bytes_for(3), Some(2));
        assert_eq!(DataType::F64.bytes_for(usize::MAX), None);
        assert_eq!(DataType::Other(7).bytes_for(1), None);
    }
}
