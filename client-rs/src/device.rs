//! Where a consumer wants its batches: host memory or one GPU. A leaf
//! module; what the broker needs to know of a GPU ([`Device::request`])
//! is asked of the driver in `gpu`.

use std::fmt;
use std::str::FromStr;

use crate::parse::ParseError;

/// `CU_STREAM_LEGACY`: the legacy default CUDA stream, as DLPack's `stream=1`.
pub const LEGACY_STREAM: u64 = 1;
/// `CU_STREAM_PER_THREAD`, as DLPack's `stream=2`.
pub const PER_THREAD_STREAM: u64 = 2;

/// `cpu` (the default) or `cuda:N`, N being this process's device ordinal
/// (as PyTorch numbers them, after `CUDA_VISIBLE_DEVICES`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    #[default]
    Cpu,
    Cuda(u32),
}

impl FromStr for Device {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Device, ParseError> {
        let t = s.trim().to_ascii_lowercase();
        match t.as_str() {
            "cpu" => Ok(Device::Cpu),
            "cuda" | "gpu" => Ok(Device::Cuda(0)),
            _ => t
                .strip_prefix("cuda:")
                .and_then(|n| n.parse::<u32>().ok())
                .map(Device::Cuda)
                .ok_or_else(|| {
                    ParseError::new(
                        "device",
                        s,
                        "`cpu`, `cuda` or `cuda:N` (N a device ordinal)",
                    )
                }),
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl Device {
    pub fn is_cuda(&self) -> bool {
        matches!(self, Device::Cuda(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_what_torch_users_write() {
        assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda(0));
        assert_eq!(" CUDA:3 ".parse::<Device>().unwrap(), Device::Cuda(3));
        assert_eq!(Device::Cuda(3).to_string(), "cuda:3");
        for bad in ["cuda:", "cuda:-1", "tpu", "cuda:x", ""] {
            let e = bad.parse::<Device>().unwrap_err().to_string();
            assert!(e.contains("cuda:N"), "{bad}: {e}");
        }
    }
}
