//! The preamble: the 8 bytes each side sends first (magic, protocol
//! version, release line), and what to say when two releases differ.

use super::{MAGIC, PROTOCOL_VERSION};
use crate::error::{Result, WireError};

/// A release's (major, minor), as the preamble carries it (from protocol
/// 13 on; earlier peers send zeros there, [`ReleaseLine::UNKNOWN`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ReleaseLine {
    pub major: u8,
    pub minor: u8,
}

impl ReleaseLine {
    /// What a peer before protocol 13 (release 0.1) sends.
    pub const UNKNOWN: ReleaseLine = ReleaseLine { major: 0, minor: 0 };

    /// This build's release line (the workspace's version).
    pub const OURS: ReleaseLine = ReleaseLine {
        major: parse_u8(env!("CARGO_PKG_VERSION_MAJOR")),
        minor: parse_u8(env!("CARGO_PKG_VERSION_MINOR")),
    };

    /// A pip requirement that installs this line (`==0.2.*`), or one that
    /// installs the releases before the preamble carried it.
    pub fn pip_spec(self) -> String {
        match self {
            ReleaseLine::UNKNOWN => "batchcast<0.2".into(),
            ReleaseLine { major, minor } => format!("batchcast=={major}.{minor}.*"),
        }
    }
}

impl std::fmt::Display for ReleaseLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            ReleaseLine::UNKNOWN => f.write_str("0.1 or earlier"),
            ReleaseLine { major, minor } => write!(f, "{major}.{minor}"),
        }
    }
}

/// A version component at compile time ("255" at most: the preamble's
/// byte; a bigger one fails the build).
const fn parse_u8(s: &str) -> u8 {
    let b = s.as_bytes();
    let mut v: u32 = 0;
    let mut i = 0;
    while i < b.len() {
        assert!(b[i].is_ascii_digit(), "a version component is digits");
        v = v * 10 + (b[i] - b'0') as u32;
        assert!(v <= 255, "a release's major and minor fit a byte");
        i += 1;
    }
    v as u8
}

/// The 8 bytes that open a connection in each direction: magic, protocol
/// version, release line. Every protocol keeps this shape, so two releases
/// can always tell each other apart and say which one to upgrade.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Preamble {
    pub version: u16,
    pub release: ReleaseLine,
}

/// Which end of a connection is speaking, for [`mismatch`]'s advice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Client,
    Broker,
}

impl Preamble {
    pub const LEN: usize = 8;

    pub fn ours() -> Preamble {
        Preamble {
            version: PROTOCOL_VERSION,
            release: ReleaseLine::OURS,
        }
    }

    pub fn to_bytes(self) -> [u8; Self::LEN] {
        let v = self.version.to_le_bytes();
        let r = self.release;
        [
            MAGIC[0], MAGIC[1], MAGIC[2], MAGIC[3], v[0], v[1], r.major, r.minor,
        ]
    }

    /// Parses a peer's preamble; wrong magic is [`WireError::NotABroker`].
    pub fn parse(bytes: [u8; Self::LEN]) -> Result<Preamble> {
        let magic = [bytes[0], bytes[1], bytes[2], bytes[3]];
        if magic != MAGIC {
            return Err(WireError::NotABroker { found: magic });
        }
        Ok(Preamble {
            version: u16::from_le_bytes([bytes[4], bytes[5]]),
            release: ReleaseLine {
                major: bytes[6],
                minor: bytes[7],
            },
        })
    }

    /// Errors unless the broker (`self`, as a client reads it) speaks our
    /// version; the error names both releases and which to upgrade.
    pub fn check(self) -> Result<()> {
        if self.version == PROTOCOL_VERSION {
            Ok(())
        } else {
            Err(WireError::VersionMismatch {
                ours: PROTOCOL_VERSION,
                theirs: self.version,
                message: mismatch(Preamble::ours(), self, Side::Client),
            })
        }
    }
}

/// Why `ours` (speaking as `side`) and `theirs` cannot talk, naming both
/// releases and protocols, and what to upgrade: the side with the older
/// protocol, never the newer one (a peer's numbers are only echoed, never
/// trusted for anything). A release to install is named only when it is
/// newer than the one it replaces: a peer may claim any numbers, and the
/// advice must never be a downgrade.
pub fn mismatch(ours: Preamble, theirs: Preamble, side: Side) -> String {
    let (client, broker) = match side {
        Side::Client => (ours, theirs),
        Side::Broker => (theirs, ours),
    };
    let said = format!(
        "the client is batchcast {} (protocol {}) and the broker batchcast {} (protocol {})",
        client.release, client.version, broker.release, broker.version
    );
    let (older, newer, what) = if client.version < broker.version {
        (client, broker, "the client")
    } else {
        (broker, client, "the broker")
    };
    let install = if newer.release > older.release {
        match what {
            "the client" => format!(
                ": pip install '{}' (Rust: the batchcast crate of that release)",
                newer.release.pip_spec()
            ),
            _ => format!(
                ": pip install '{}' puts that `batchcast` command on PATH",
                newer.release.pip_spec()
            ),
        }
    } else {
        format!(" (any release that speaks protocol {})", newer.version)
    };
    let whose = if what == "the client" {
        "the broker's"
    } else {
        "the client's"
    };
    format!("{said}, which cannot talk to each other: upgrade {what} to {whose} release{install}")
}
