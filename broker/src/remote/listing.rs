//! Listings kept in the disk tier: a remote folder's objects (or a shard
//! pattern's sizes and ETags) as last listed, so a restarted broker need
//! not list a large bucket again while the listing is younger than
//! `listing_max_age_s`. Each object keeps its version (ETag), which reads
//! check (a changed object is an error, never other bytes) and the
//! stream's digest covers (a resume across a changed dataset is refused).
//!
//! Format: magic, the listing's time (Unix seconds), the count, then per
//! object its path, size (0: unknown, else size + 1) and version, strings
//! as a u32 length and UTF-8 bytes; the disk tier's checksum covers it.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::Object;
use super::disk::DiskCache;

const MAGIC: &[u8; 8] = b"BCLIST01";

/// The listing under `key` if the disk tier holds one younger than
/// `max_age`, with its age.
pub(crate) fn cached(
    disk: &DiskCache,
    key: &str,
    max_age: Duration,
) -> Option<(Vec<Object>, Duration)> {
    if max_age.is_zero() {
        return None;
    }
    let bytes = disk.get_record(key)?;
    let (at, objects) = decode(&bytes)?;
    let age = now_s().saturating_sub(at);
    (age < max_age.as_secs()).then(|| (objects, Duration::from_secs(age)))
}

/// Keeps `objects` as the listing under `key`, listed now.
pub fn keep(disk: &DiskCache, key: &str, objects: &[Object]) {
    disk.put_record(key, &encode(now_s(), objects));
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn encode(at: u64, objects: &[Object]) -> Vec<u8> {
    let mut out = Vec::with_capacity(24 + objects.len() * 64);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&at.to_le_bytes());
    out.extend_from_slice(&(objects.len() as u64).to_le_bytes());
    let string = |out: &mut Vec<u8>, s: &str| {
        out.extend_from_slice(&(s.len() as u32).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    };
    for o in objects {
        string(&mut out, &o.path);
        out.extend_from_slice(&o.size.map_or(0, |s| s + 1).to_le_bytes());
        string(&mut out, &o.version);
    }
    out
}

/// The listing's time and objects; `None` for bytes that are not one.
fn decode(bytes: &[u8]) -> Option<(u64, Vec<Object>)> {
    let mut r = Reader(bytes);
    if r.take(8)? != MAGIC {
        return None;
    }
    let at = r.u64()?;
    let n = r.u64()?;
    // Each object takes at least 16 bytes: no count can ask for more.
    let mut objects = Vec::with_capacity(n.min(bytes.len() as u64 / 16) as usize);
    for _ in 0..n {
        let path = r.string()?;
        let size = r.u64()?.checked_sub(1);
        let version = r.string()?;
        objects.push(Object {
            path,
            size,
            version,
        });
    }
    r.0.is_empty().then_some((at, objects))
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }

    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }

    fn string(&mut self) -> Option<String> {
        let n = u32::from_le_bytes(self.take(4)?.try_into().ok()?) as usize;
        String::from_utf8(self.take(n)?.to_vec()).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(path: &str, size: Option<u64>, version: &str) -> Object {
        Object {
            path: path.into(),
            size,
            version: version.into(),
        }
    }

    #[test]
    fn listings_round_trip_and_damage_is_not_a_listing() {
        let objects = vec![
            obj("cat/1.jpg", Some(0), "\"e1\""),
            obj("dog/é.jpg", None, ""),
            obj("dog/2.jpg", Some(123_456), "mtime:2026-11-25T07:00:00Z"),
        ];
        let bytes = encode(42, &objects);
        assert_eq!(decode(&bytes), Some((42, objects)));
        for cut in [0, 7, 20, bytes.len() - 1] {
            assert_eq!(decode(&bytes[..cut]), None, "cut at {cut}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(decode(&longer), None);
        // A count no bytes back is refused without allocating for it.
        let mut huge = encode(1, &[]);
        huge[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(decode(&huge), None);
    }

    #[test]
    fn a_listing_is_used_while_young_and_zero_never_uses_one() {
        let dir = tempfile::tempdir().unwrap();
        let disk = DiskCache::open(dir.path(), 1 << 20).unwrap();
        let objects = vec![obj("a/1.jpg", Some(3), "\"x\"")];
        assert!(cached(&disk, "k", Duration::from_secs(60)).is_none());
        keep(&disk, "k", &objects);
        let (got, age) = cached(&disk, "k", Duration::from_secs(60)).unwrap();
        assert_eq!(got, objects);
        assert!(age < Duration::from_secs(60));
        assert!(cached(&disk, "k", Duration::ZERO).is_none());
        assert!(cached(&disk, "other", Duration::from_secs(60)).is_none());
        // An old listing is not used.
        disk.put_record("k", &encode(now_s() - 120, &objects));
        assert!(cached(&disk, "k", Duration::from_secs(60)).is_none());
    }
}
