//! The host-memory stand-in for a GPU: a test setting, read once per
//! process from `BATCHCAST_TEST_GPU`, under which `cuda:N` means a GPU
//! made of host memory. The broker then serves such a consumer from a
//! device arena that is a sealed memfd (copied into by a copy engine of
//! its own thread, as a GPU's), and the consumer maps it read-only; every
//! decision about what a device consumer receives runs as on a GPU host.
//!
//! Both sides must be started with it: a consumer asks for a stand-in GPU
//! by its UUID ([`uuid`]), and a broker started without the setting
//! refuses that UUID. It is an environment variable of each process, never
//! a message, so no client can turn it on in a broker.
//!
//! Values: `1` (or `host`): on; `fail-at=N`: on, and in the broker each
//! stand-in GPU fails at its copy `N` (from 0), as a device that faults
//! mid-run does; unset, empty or `0`: off.

use std::sync::OnceLock;

use crate::parse::ParseError;

/// The environment variable that selects it.
pub const ENV: &str = "BATCHCAST_TEST_GPU";

/// The name a stand-in GPU goes by in requests and stats.
pub const NAME: &str = "host-memory stand-in";

/// A stand-in GPU's UUID starts with these bytes; the ordinal follows.
const PREFIX: &[u8; 12] = b"host-memory:";

/// The setting, when on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Setting {
    /// The copy (from 0) at which each stand-in GPU fails.
    pub fail_at: Option<u64>,
}

impl Setting {
    /// Parses a value of [`ENV`]: `None` when it is off.
    pub fn parse(value: &str) -> Result<Option<Setting>, ParseError> {
        let v = value.trim();
        match v {
            "" | "0" => Ok(None),
            "1" | "host" => Ok(Some(Setting::default())),
            _ => v
                .strip_prefix("fail-at=")
                .and_then(|n| n.parse::<u64>().ok())
                .map(|n| Some(Setting { fail_at: Some(n) }))
                .ok_or_else(|| ParseError::new(ENV, value, "`1`, `fail-at=N` or `0`")),
        }
    }
}

/// This process's setting, read from [`ENV`] once.
pub fn setting() -> Result<Option<Setting>, ParseError> {
    static SETTING: OnceLock<Result<Option<Setting>, ParseError>> = OnceLock::new();
    SETTING
        .get_or_init(|| Setting::parse(&std::env::var(ENV).unwrap_or_default()))
        .clone()
}

/// The UUID of stand-in GPU `ordinal`.
pub fn uuid(ordinal: u32) -> [u8; 16] {
    let mut u = [0; 16];
    u[..12].copy_from_slice(PREFIX);
    u[12..].copy_from_slice(&ordinal.to_le_bytes());
    u
}

/// Which stand-in GPU a UUID names, if it names one.
pub fn ordinal_of(uuid: &[u8; 16]) -> Option<u32> {
    let (prefix, n) = uuid.split_at(12);
    (prefix == PREFIX).then(|| u32::from_le_bytes(n.try_into().expect("4 bytes")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_and_uuids() {
        assert_eq!(Setting::parse("").unwrap(), None);
        assert_eq!(Setting::parse("0").unwrap(), None);
        assert_eq!(Setting::parse(" 1 ").unwrap(), Some(Setting::default()));
        assert_eq!(
            Setting::parse("fail-at=3").unwrap(),
            Some(Setting { fail_at: Some(3) })
        );
        for bad in ["yes", "fail-at=", "fail-at=-1"] {
            let e = Setting::parse(bad).unwrap_err().to_string();
            assert!(e.contains(ENV) && e.contains("fail-at=N"), "{bad}: {e}");
        }
        assert_eq!(ordinal_of(&uuid(7)), Some(7));
        assert_eq!(ordinal_of(&[0; 16]), None);
        assert_ne!(uuid(0), uuid(1));
    }
}
