//! The disk tier of the cache for remote sources (`cache_dir`): whole
//! objects and shard parts, as fetched, so that later epochs and a
//! restarted broker read only what is missing.
//!
//! Each entry is one file, named by a digest of its key (store, path,
//! ETag, size, byte range), holding a header (magic, key, length, CRC-32)
//! and the bytes. An entry is written to a temporary file and renamed
//! into place, so a reader sees a whole entry or none, and two brokers
//! sharing the folder at most both write the same entry. A read checks the
//! key, the length and the checksum: a torn, truncated or corrupt entry is
//! removed and fetched again, never served. Admission follows the memory
//! cache's MinIO policy: nothing is evicted; past `cache_dir_mib` the
//! tier stops admitting. A full disk (ENOSPC, EDQUOT) is said once and
//! ends admission; reads from the tier go on.
//!
//! The folder must belong to the broker's user and be writable by no one
//! else: an entry a stranger could write would be data another trainer
//! reads (the checksum catches damage, not forgery).

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use batchcast::proto::Digester;
use bytes::Bytes;

const MAGIC: &[u8; 8] = b"BCCACHE1";
/// Magic, key length, CRC, content length.
const HEADER: usize = 8 + 4 + 4 + 8;
/// Folder of entries, versioned with the format.
const ENTRIES: &str = "v1";

#[derive(Debug, thiserror::Error)]
pub enum DiskCacheError {
    #[error("cache_dir {path}: {source}; check the path and its permissions")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "cache_dir {path} {what}; a cache folder must belong to the broker's user (uid {uid}) and be writable by it alone, since what it holds is served to trainers"
    )]
    Unsafe {
        path: PathBuf,
        what: String,
        uid: u32,
    },
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DiskCounts {
    pub hits: u64,
    pub misses: u64,
    pub bytes: u64,
    pub budget: u64,
    /// Entries found torn or corrupt (removed, fetched again).
    pub corrupt: u64,
    /// Writes that failed (a full disk among them).
    pub(crate) write_errors: u64,
}

#[derive(Debug)]
pub struct DiskCache {
    dir: PathBuf,
    budget: u64,
    used: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    corrupt: AtomicU64,
    write_errors: AtomicU64,
    /// The disk filled: admit nothing more.
    full: AtomicBool,
    seq: AtomicU64,
}

impl DiskCache {
    /// Opens (making it if needed) the cache in `dir`, at most `budget`
    /// bytes; entries already there count against it.
    pub fn open(dir: &Path, budget: u64) -> Result<DiskCache, DiskCacheError> {
        let io = |source| DiskCacheError::Io {
            path: dir.into(),
            source,
        };
        let entries = dir.join(ENTRIES);
        std::fs::create_dir_all(&entries).map_err(io)?;
        let uid = nix::unistd::geteuid().as_raw();
        for d in [dir, entries.as_path()] {
            let m = std::fs::metadata(d).map_err(io)?;
            let unsafe_dir = |what: String| DiskCacheError::Unsafe {
                path: d.into(),
                what,
                uid,
            };
            if m.uid() != uid {
                return Err(unsafe_dir(format!("belongs to uid {}", m.uid())));
            }
            if m.permissions().mode() & 0o022 != 0 {
                return Err(unsafe_dir(format!(
                    "is writable by others (mode {:o})",
                    m.permissions().mode() & 0o777
                )));
            }
        }
        let mut used = 0;
        for e in std::fs::read_dir(&entries).map_err(io)? {
            let e = e.map_err(io)?;
            let name = e.file_name();
            let name = name.to_string_lossy();
            if name.starts_with(".tmp") {
                // A write that died with its broker (or is under way in
                // another: leave young ones alone).
                if e.metadata().is_ok_and(|m| {
                    m.modified()
                        .ok()
                        .and_then(|t| t.elapsed().ok())
                        .is_some_and(|a| a.as_secs() > 3600)
                }) {
                    let _ = std::fs::remove_file(e.path());
                }
                continue;
            }
            used += e.metadata().map(|m| m.len()).unwrap_or(0);
        }
        Ok(DiskCache {
            dir: entries,
            budget,
            used: AtomicU64::new(used),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            corrupt: AtomicU64::new(0),
            write_errors: AtomicU64::new(0),
            full: AtomicBool::new(false),
            seq: AtomicU64::new(0),
        })
    }

    fn path_of(&self, key: &str) -> PathBuf {
        let d = Digester::default().str(key).finish();
        let d2 = Digester::default().str("batchcast").str(key).finish();
        self.dir.join(format!("{d:016x}{d2:016x}"))
    }

    /// The entry for `key`, if a whole and sound one is there.
    pub fn get(&self, key: &str) -> Option<Bytes> {
        let found = self.find(key);
        let counter = if found.is_some() {
            &self.hits
        } else {
            &self.misses
        };
        counter.fetch_add(1, Ordering::Relaxed);
        found
    }

    /// A record about the dataset (a listing), not counted as a hit or a
    /// miss of the data.
    pub(crate) fn get_record(&self, key: &str) -> Option<Bytes> {
        self.find(key)
    }

    /// Keeps record `bytes` under `key` in place of the one there.
    pub(crate) fn put_record(&self, key: &str, bytes: &[u8]) {
        self.store(key, bytes, true);
    }

    fn find(&self, key: &str) -> Option<Bytes> {
        let path = self.path_of(key);
        let found = match File::open(&path) {
            Ok(f) => Some(read_entry(f, key)),
            Err(_) => None,
        };
        match found {
            Some(Ok(b)) => Some(b),
            Some(Err(why)) => {
                tracing::warn!(
                    "cache entry {} is unsound ({why}); fetching it again",
                    path.display()
                );
                self.corrupt.fetch_add(1, Ordering::Relaxed);
                if let Ok(m) = std::fs::metadata(&path)
                    && std::fs::remove_file(&path).is_ok()
                {
                    self.release(m.len());
                }
                None
            }
            None => None,
        }
    }

    fn release(&self, bytes: u64) {
        let _ = self
            .used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| {
                Some(u.saturating_sub(bytes))
            });
    }

    /// Keeps `bytes` under `key` if they fit the budget.
    pub fn put(&self, key: &str, bytes: &[u8]) {
        self.store(key, bytes, false);
    }

    /// Writes an entry (`replace`: in place of the one there, else only
    /// where there is none).
    fn store(&self, key: &str, bytes: &[u8], replace: bool) {
        if self.full.load(Ordering::Relaxed) {
            return;
        }
        let size = (HEADER + key.len() + bytes.len()) as u64;
        let reserved = self
            .used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| {
                (u + size <= self.budget).then_some(u + size)
            })
            .is_ok();
        if !reserved {
            return;
        }
        let path = self.path_of(key);
        let old = std::fs::metadata(&path).ok().map(|m| m.len());
        if old.is_some() && !replace {
            self.used.fetch_sub(size, Ordering::Relaxed);
            return;
        }
        let tmp = self.dir.join(format!(
            ".tmp-{}-{}",
            std::process::id(),
            self.seq.fetch_add(1, Ordering::Relaxed)
        ));
        let written = write_entry(&tmp, key, bytes).and_then(|()| std::fs::rename(&tmp, &path));
        if written.is_ok()
            && let Some(old) = old
        {
            self.release(old);
        }
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            self.used.fetch_sub(size, Ordering::Relaxed);
            self.write_errors.fetch_add(1, Ordering::Relaxed);
            let disk_full = matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT));
            if disk_full && !self.full.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    "cache_dir {}: the disk is full; the cache admits nothing more (reads from it go on)",
                    self.dir.display()
                );
            } else if !disk_full {
                tracing::warn!(
                    "cache_dir {}: cannot write an entry: {e}",
                    self.dir.display()
                );
            }
        }
    }

    pub fn counts(&self) -> DiskCounts {
        DiskCounts {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            bytes: self.used.load(Ordering::Relaxed),
            budget: self.budget,
            corrupt: self.corrupt.load(Ordering::Relaxed),
            write_errors: self.write_errors.load(Ordering::Relaxed),
        }
    }
}

fn write_entry(path: &Path, key: &str, bytes: &[u8]) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)?;
    let mut head = Vec::with_capacity(HEADER + key.len());
    head.extend_from_slice(MAGIC);
    head.extend_from_slice(&(key.len() as u32).to_le_bytes());
    head.extend_from_slice(&crc32fast::hash(bytes).to_le_bytes());
    head.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    head.extend_from_slice(key.as_bytes());
    f.write_all(&head)?;
    f.write_all(bytes)?;
    Ok(())
}

/// Why a cache entry on disk is not used (it is fetched again).
#[derive(Debug, thiserror::Error)]
enum EntryError {
    #[error("unreadable: {0}")]
    Io(#[from] std::io::Error),
    #[error("shorter than its header")]
    Short,
    #[error("not a batchcast cache entry")]
    NotAnEntry,
    #[error("{len} bytes, its header says {says}")]
    Length { len: u64, says: u64 },
    #[error("another entry's key (a digest collision)")]
    OtherKey,
    #[error("checksum mismatch")]
    Checksum,
}

fn read_entry(mut f: File, key: &str) -> Result<Bytes, EntryError> {
    let len = f.metadata()?.len();
    let mut head = [0u8; HEADER];
    f.read_exact(&mut head).map_err(|_| EntryError::Short)?;
    if &head[..8] != MAGIC {
        return Err(EntryError::NotAnEntry);
    }
    let word = |a: usize| u32::from_le_bytes(head[a..a + 4].try_into().unwrap_or_default());
    let key_len = word(8) as usize;
    let crc = word(12);
    let content = u64::from_le_bytes(head[16..24].try_into().unwrap_or_default());
    let says = ((HEADER + key_len) as u64).saturating_add(content);
    if says != len {
        return Err(EntryError::Length { len, says });
    }
    let mut stored_key = vec![0u8; key_len];
    f.read_exact(&mut stored_key)?;
    if stored_key != key.as_bytes() {
        return Err(EntryError::OtherKey);
    }
    let mut bytes = vec![0u8; content as usize];
    f.read_exact(&mut bytes)?;
    if crc32fast::hash(&bytes) != crc {
        return Err(EntryError::Checksum);
    }
    Ok(Bytes::from(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_and_damage_is_never_served() {
        let dir = tempfile::tempdir().unwrap();
        let c = DiskCache::open(dir.path(), 1 << 20).unwrap();
        assert!(c.get("k1").is_none());
        c.put("k1", b"hello");
        assert_eq!(c.get("k1").as_deref(), Some(&b"hello"[..]));
        // A flipped byte, then a truncation: refused, removed, a miss.
        let p = c.path_of("k1");
        let mut raw = std::fs::read(&p).unwrap();
        let last = raw.len() - 1;
        raw[last] ^= 1;
        std::fs::write(&p, &raw).unwrap();
        assert!(c.get("k1").is_none());
        assert!(!p.exists());
        c.put("k1", b"hello");
        let raw = std::fs::read(&p).unwrap();
        std::fs::write(&p, &raw[..raw.len() - 2]).unwrap();
        assert!(c.get("k1").is_none());
        assert_eq!(c.counts().corrupt, 2);
        // A restarted broker finds what is there and counts it.
        c.put("k2", &[7u8; 1000]);
        let again = DiskCache::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(again.get("k2").as_deref(), Some(&[7u8; 1000][..]));
        assert!(again.counts().bytes >= 1000);
    }

    /// An entry whose header lies (a bad magic, lengths that do not add up
    /// to the file's, lengths near the integers' ends, another entry's
    /// key) is refused before anything it claims is allocated, removed,
    /// counted, and fetched again: never served, never a panic.
    #[test]
    fn a_forged_header_is_refused_and_never_served() {
        let dir = tempfile::tempdir().unwrap();
        let c = DiskCache::open(dir.path(), 1 << 20).unwrap();
        let key = "k";
        let header = |magic: &[u8; 8], key_len: u32, crc: u32, content: u64| {
            let mut h = Vec::new();
            h.extend_from_slice(magic);
            h.extend_from_slice(&key_len.to_le_bytes());
            h.extend_from_slice(&crc.to_le_bytes());
            h.extend_from_slice(&content.to_le_bytes());
            h
        };
        let body = b"payload";
        let crc = crc32fast::hash(body);
        let with = |mut h: Vec<u8>, rest: &[&[u8]]| {
            for r in rest {
                h.extend_from_slice(r);
            }
            h
        };
        let forged: Vec<(&str, Vec<u8>, &str)> = vec![
            ("short", MAGIC[..5].to_vec(), "shorter than its header"),
            (
                "bad magic",
                with(header(b"NOTCACHE", 1, crc, 7), &[b"k", body]),
                "not a batchcast cache entry",
            ),
            (
                "a key of 4 GiB",
                with(header(MAGIC, u32::MAX, crc, 7), &[b"k", body]),
                "its header says",
            ),
            (
                "content of u64::MAX bytes",
                with(header(MAGIC, 1, crc, u64::MAX), &[b"k", body]),
                "its header says",
            ),
            (
                "lengths adding up past the file",
                with(header(MAGIC, 1, crc, 8), &[b"k", body]),
                "its header says",
            ),
            (
                "another entry's key",
                with(header(MAGIC, 1, crc, 7), &[b"x", body]),
                "another entry's key",
            ),
            (
                "a checksum of other bytes",
                with(header(MAGIC, 1, crc ^ 1, 7), &[b"k", body]),
                "checksum mismatch",
            ),
        ];
        for (n, (what, raw, says)) in forged.iter().enumerate() {
            let p = c.path_of(key);
            std::fs::write(&p, raw).unwrap();
            let why = read_entry(File::open(&p).unwrap(), key).unwrap_err();
            assert!(why.to_string().contains(says), "{what}: {why}");
            assert!(c.get(key).is_none(), "{what} was served");
            assert!(!p.exists(), "{what} was left in place");
            assert_eq!(c.counts().corrupt, n as u64 + 1, "{what}");
        }
        // The same bytes under an honest header are served.
        std::fs::write(
            c.path_of(key),
            with(header(MAGIC, 1, crc, 7), &[b"k", body]),
        )
        .unwrap();
        assert_eq!(c.get(key).as_deref(), Some(&body[..]));
    }

    #[test]
    fn records_are_replaced_and_not_counted_as_data() {
        let dir = tempfile::tempdir().unwrap();
        let c = DiskCache::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(c.get_record("listing"), None);
        c.put_record("listing", b"first");
        c.put_record("listing", b"second, longer");
        assert_eq!(
            c.get_record("listing").as_deref(),
            Some(&b"second, longer"[..])
        );
        let n = c.counts();
        assert_eq!((n.hits, n.misses), (0, 0));
        assert_eq!(n.bytes, (HEADER + "listing".len() + 14) as u64);
    }

    #[test]
    fn the_budget_stops_admission() {
        let dir = tempfile::tempdir().unwrap();
        let c = DiskCache::open(dir.path(), 200).unwrap();
        c.put("a", &[1u8; 100]);
        c.put("b", &[2u8; 100]); // does not fit beside the first
        assert!(c.get("a").is_some() && c.get("b").is_none());
    }

    #[test]
    fn a_folder_others_may_write_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = DiskCache::open(dir.path(), 1 << 20)
            .unwrap_err()
            .to_string();
        assert!(e.contains("writable by others"), "{e}");
    }
}
