//! What a stream's data is made from, digested part by part
//! ([`StreamDigest`]): a consumer resuming (from a checkpoint, or after a
//! broker restart) sends the digest it was served under, and a broker
//! whose stream now makes other data refuses it, naming the parts that
//! changed, instead of serving it silently.
//!
//! The digest is of the stream's description as the broker resolved it
//! (what the config says, the dataset's listing, the fields), not of the
//! broker's code: an upgrade that changes what a transform computes from
//! the same description is not seen. It is a check against mistakes, not
//! an authentication: anyone may claim any digest (a forged one is
//! refused, or served like any resume).

use std::fmt;

use serde::{Deserialize, Serialize};

/// A stream's description, a 64-bit FNV-1a digest per part.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct StreamDigest {
    /// The dataset: its kind, where it is and its listing (every sample's
    /// file or tar member, and its label), or a synthetic stream's spec.
    pub source: u64,
    /// The order and split: shuffle, seed, shuffle buffer, rank,
    /// world_size, uneven, samples per epoch.
    pub order: u64,
    /// The transforms, as the config writes them (`[stream.transform]`).
    pub transform: u64,
    /// The fields: names, dtypes and per-sample shapes (a layout change is
    /// a shape change).
    pub fields: u64,
}

impl StreamDigest {
    /// The parts in which `other` differs from this one, by name.
    pub fn changes(&self, other: &StreamDigest) -> Vec<&'static str> {
        let parts = [
            ("source", self.source, other.source),
            ("order", self.order, other.order),
            ("transform", self.transform, other.transform),
            ("fields", self.fields, other.fields),
        ];
        parts
            .into_iter()
            .filter(|(_, a, b)| a != b)
            .map(|(name, ..)| name)
            .collect()
    }

    /// What each part means, for messages.
    pub fn describe(part: &str) -> &'static str {
        match part {
            "source" => "the dataset (its files, labels or synthetic spec)",
            "order" => "the order or split (shuffle, seed, rank, world_size, uneven)",
            "transform" => "the transforms",
            "fields" => "the fields (names, dtypes, shapes or layout)",
            _ => "an unknown part",
        }
    }
}

/// `source:…/order:…/transform:…/fields:…`, 16 hex digits each; parsed
/// back by [`str::parse`].
impl fmt::Display for StreamDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "source:{:016x}/order:{:016x}/transform:{:016x}/fields:{:016x}",
            self.source, self.order, self.transform, self.fields
        )
    }
}

/// A digest that is not `source:HEX/order:HEX/transform:HEX/fields:HEX`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "`{0}` is not a stream digest (source:HEX/order:HEX/transform:HEX/fields:HEX, as a consumer's state gives)"
)]
pub struct BadDigest(pub String);

impl std::str::FromStr for StreamDigest {
    type Err = BadDigest;

    fn from_str(s: &str) -> Result<StreamDigest, BadDigest> {
        let bad = || BadDigest(s.chars().take(120).collect());
        let mut parts = [0u64; 4];
        let mut fields = s.split('/');
        for (slot, name) in parts
            .iter_mut()
            .zip(["source", "order", "transform", "fields"])
        {
            let (key, hex) = fields
                .next()
                .and_then(|f| f.split_once(':'))
                .ok_or_else(bad)?;
            if key != name || hex.len() != 16 {
                return Err(bad());
            }
            *slot = u64::from_str_radix(hex, 16).map_err(|_| bad())?;
        }
        if fields.next().is_some() {
            return Err(bad());
        }
        let [source, order, transform, fields] = parts;
        Ok(StreamDigest {
            source,
            order,
            transform,
            fields,
        })
    }
}

/// FNV-1a, 64 bits: a stable digest (the same in every build and on
/// every host), which is all a description check needs.
#[derive(Debug, Clone, Copy)]
pub struct Digester(u64);

impl Default for Digester {
    fn default() -> Self {
        Digester(0xcbf2_9ce4_8422_2325)
    }
}

impl Digester {
    pub fn bytes(&mut self, bytes: &[u8]) -> &mut Self {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
        self
    }

    /// A number, as 8 little-endian bytes.
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }

    /// A string, length first (so `"ab" + "c"` differs from `"a" + "bc"`).
    pub fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64).bytes(s.as_bytes())
    }

    pub fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_digest_prints_and_parses_back_and_names_what_changed() {
        let a = StreamDigest {
            source: 1,
            order: u64::MAX,
            transform: 0xabc,
            fields: 7,
        };
        let text = a.to_string();
        assert_eq!(text.parse::<StreamDigest>(), Ok(a));
        let b = StreamDigest {
            transform: 0xabd,
            fields: 8,
            ..a
        };
        assert_eq!(a.changes(&b), ["transform", "fields"]);
        assert!(a.changes(&a).is_empty());
        for bad in [
            "",
            "source:1",
            &text.replace("order", "orders"),
            &format!("{text}/x:0"),
            &text.replace("source:0000000000000001", "source:zz00000000000001"),
        ] {
            assert!(bad.parse::<StreamDigest>().is_err(), "{bad}");
        }
    }

    #[test]
    fn the_digest_is_fnv1a_and_strings_are_delimited() {
        // FNV-1a 64 of "a" (the published test vector).
        assert_eq!(
            Digester::default().bytes(b"a").finish(),
            0xaf63_dc4c_8601_ec8c
        );
        let ab_c = Digester::default().str("ab").str("c").finish();
        let a_bc = Digester::default().str("a").str("bc").finish();
        assert_ne!(ab_c, a_bc);
    }
}
