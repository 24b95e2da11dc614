//! Element types of fields, named as numpy and PyTorch name them. A leaf
//! module: the error type and the schema both use it.

use serde::{Deserialize, Serialize};

use crate::parse::ParseError;

/// Element type of a field, named as in numpy / PyTorch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    U64,
    I64,
    F16,
    Bf16,
    F32,
    F64,
    Bool,
}

impl DType {
    /// Every dtype, in the order of the enum.
    pub const ALL: [DType; 13] = [
        DType::U8,
        DType::I8,
        DType::U16,
        DType::I16,
        DType::U32,
        DType::I32,
        DType::U64,
        DType::I64,
        DType::F16,
        DType::Bf16,
        DType::F32,
        DType::F64,
        DType::Bool,
    ];

    /// Size of one element in bytes.
    pub fn size(self) -> u64 {
        match self {
            DType::U8 | DType::I8 | DType::Bool => 1,
            DType::U16 | DType::I16 | DType::F16 | DType::Bf16 => 2,
            DType::U32 | DType::I32 | DType::F32 => 4,
            DType::U64 | DType::I64 | DType::F64 => 8,
        }
    }

    /// The lowercase name used in configs and by numpy (`"u8"`, `"bf16"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::U8 => "u8",
            DType::I8 => "i8",
            DType::U16 => "u16",
            DType::I16 => "i16",
            DType::U32 => "u32",
            DType::I32 => "i32",
            DType::U64 => "u64",
            DType::I64 => "i64",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::Bool => "bool",
        }
    }
}

impl std::str::FromStr for DType {
    type Err = ParseError;

    /// The names [`DType::name`] gives (`"u8"`, `"bf16"`, ...).
    fn from_str(s: &str) -> Result<DType, ParseError> {
        DType::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| {
                ParseError::new(
                    "dtype",
                    s,
                    "one of u8, i8, u16, i16, u32, i32, u64, i64, f16, bf16, f32, f64, bool",
                )
            })
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_parses_back_and_a_wrong_one_lists_them() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
        }
        let e = "float".parse::<DType>().unwrap_err().to_string();
        assert!(e.contains("`float`") && e.contains("bf16"), "{e}");
    }
}
