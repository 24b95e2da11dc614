//! Finding the samples of a dataset: an ImageFolder tree or
//! WebDataset-style tar shards, on disk or remote ([`remote`]: object
//! stores, HTTP). Listing happens once at stream start; the result is a
//! flat list of items addressable by index, so sampling, sharding across
//! hosts, parallel decoding, replay and resume work the same for every
//! form, and the bytes of item `i` are the same from each.

pub mod remote;
mod root;
pub(crate) use root::DatasetRoot;

use std::collections::HashSet;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::remote::{RemoteSet, check_size};

mod shard;
pub(crate) use shard::ShardError;
use shard::{index_shard, warn_cut, warn_unlabelled};

/// The extensions torchvision's ImageFolder accepts (compared
/// case-insensitively). The format is read from the bytes: files in a
/// format batchcast does not decode are listed but fail to decode, and
/// follow the stream's `on_error` policy.
pub(crate) const IMG_EXTENSIONS: &[&str] = &[
    "jpg", "jpeg", "png", "ppm", "bmp", "pgm", "tif", "tiff", "webp",
];

/// The image keys of a WebDataset sample: WebDataset's own image
/// extensions (ImageFolder's, and GIF, PBM, PNM).
pub(crate) const SHARD_IMAGE_KEYS: &[&str] = &[
    "jpg", "jpeg", "png", "ppm", "bmp", "pgm", "pbm", "pnm", "tif", "tiff", "webp", "gif",
];

#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    #[error("cannot read dataset folder {path}: {source}; check the path and its permissions")]
    Unreadable {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} has no class folders; an ImageFolder root holds one folder per class")]
    NoClasses { path: PathBuf },
    #[error(
        "class folder {path} holds no images (accepted extensions: {}); remove the folder or add images",
        IMG_EXTENSIONS.join(", ")
    )]
    EmptyClass { path: PathBuf },
    #[error("{what} matches no samples; check the path")]
    NoSamples { what: String },
    #[error("shard pattern `{pattern}`: {message}")]
    Pattern { pattern: String, message: String },
    #[error("shard {path}: {message}")]
    Shard { path: PathBuf, message: String },
    #[error(transparent)]
    Remote(#[from] crate::remote::RemoteError),
    #[error("{url}: {message}")]
    RemoteListing { url: String, message: String },
}

/// Where a sample's encoded image lives.
#[derive(Debug, Clone)]
pub(crate) enum Location {
    File(PathBuf),
    /// Object number `n` of a remote dataset.
    Object(u32),
    /// A member of shard number `shard`, `len` bytes at `offset`.
    Member {
        shard: u32,
        offset: u64,
        len: u64,
    },
}

#[derive(Debug, Clone)]
pub struct Item {
    pub(crate) loc: Location,
    pub label: i64,
}

#[derive(Debug)]
pub struct Dataset {
    /// `image_folder` or `webdataset`.
    pub format: &'static str,
    /// The root or pattern, for messages and the schema.
    pub root: String,
    pub classes: Vec<String>,
    pub items: Vec<Item>,
    /// Open shard files (WebDataset only), read with `pread`.
    shards: Vec<(PathBuf, File)>,
    /// Items of each shard, in file order: `items[shard_items[s]]`.
    pub(crate) shard_items: Vec<std::ops::Range<usize>>,
    /// A remote dataset's objects (its files, or its shards) and reader.
    pub remote: Option<Arc<RemoteSet>>,
}

impl Dataset {
    pub fn len(&self) -> u64 {
        self.items.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Where item `index` lives, for messages.
    pub fn describe(&self, index: u64) -> String {
        match (&self.items[index as usize].loc, &self.remote) {
            (Location::File(p), _) => p.display().to_string(),
            (Location::Object(o), Some(r)) => r.describe(*o),
            (Location::Member { shard, offset, .. }, Some(r)) => {
                format!("{} (member at byte {offset})", r.describe(*shard))
            }
            (Location::Member { shard, offset, .. }, None) => {
                format!(
                    "{} (member at byte {offset})",
                    self.shards[*shard as usize].0.display()
                )
            }
            (Location::Object(o), None) => format!("object {o}"),
        }
    }

    /// The name of item `index` in its dataset (a path, an object key,
    /// or a shard member's place), for the stream's digest.
    pub(crate) fn item_name(&self, index: u64) -> String {
        match (&self.items[index as usize].loc, &self.remote) {
            (Location::File(p), _) => p.to_string_lossy().into_owned(),
            (Location::Object(o), Some(r)) => r.objects[*o as usize].path.clone(),
            (Location::Member { shard, offset, len }, _) => format!("{shard}:{offset}:{len}"),
            (Location::Object(o), None) => o.to_string(),
        }
    }

    /// The pipeline reads at `lead` (a position in its sequence) the
    /// samples `upcoming` next: a remote dataset fetches ahead of it. A
    /// sample named twice stays twice: each is a read at its position.
    pub fn want(&self, lead: u64, upcoming: impl Iterator<Item = u64>) {
        let Some(r) = &self.remote else {
            return;
        };
        let limit = r.read_ahead_units();
        let mut units = Vec::with_capacity(limit);
        let mut seen = HashSet::with_capacity(limit);
        for i in upcoming {
            let (o, range) = match &self.items[i as usize].loc {
                Location::Object(o) => (*o, None),
                Location::Member { shard, offset, len } => (*shard, Some(*offset..*offset + *len)),
                // Not in a remote dataset; the positions after it would
                // be misplaced.
                Location::File(_) => break,
            };
            let u = r.unit_of(o, range);
            if !seen.contains(&u.0) && seen.len() >= limit {
                break;
            }
            seen.insert(u.0);
            units.push(u);
        }
        r.want(lead, &units);
    }

    /// Ends the remote reads in progress (the stream stops).
    pub fn close(&self) {
        if let Some(r) = &self.remote {
            r.close();
        }
    }

    /// The encoded bytes of item `index`, at most `max_bytes` of them: a
    /// larger sample, or an entry that is not a regular file (a FIFO, a
    /// device, a link to one), is an error, which the pipeline's `on_error`
    /// policy handles like any bad file. Nothing is read before its size
    /// is known, and opening never blocks.
    pub fn read(&self, index: u64, buf: &mut Vec<u8>, max_bytes: u64) -> std::io::Result<()> {
        buf.clear();
        match &self.items[index as usize].loc {
            Location::File(p) => {
                let (f, len) = open_regular(p)?;
                check_size(len, max_bytes)?;
                buf.reserve(len as usize);
                // Bounded even if the file grew since it was measured.
                f.take(max_bytes.saturating_add(1)).read_to_end(buf)?;
                check_size(buf.len() as u64, max_bytes)?;
            }
            Location::Member { shard, offset, len } => {
                check_size(*len, max_bytes)?;
                if let Some(r) = &self.remote {
                    return r.read(*shard, Some(*offset..*offset + *len), buf, max_bytes);
                }
                buf.resize(*len as usize, 0);
                self.shards[*shard as usize].1.read_exact_at(buf, *offset)?;
            }
            Location::Object(o) => {
                let Some(r) = &self.remote else {
                    return Err(std::io::Error::other("an object of no remote dataset"));
                };
                if let Some(size) = r.objects[*o as usize].size {
                    check_size(size, max_bytes)?;
                }
                return r.read(*o, None, buf, max_bytes);
            }
        }
        Ok(())
    }

    /// Lists `root/<class>/**/<file>` as torchvision's ImageFolder does:
    /// classes are the sorted names of the folders directly under `root`
    /// (label = position), files are found recursively (following links),
    /// folder by folder in sorted order, each folder's files sorted.
    pub fn image_folder(root: &Path) -> Result<Dataset, DatasetError> {
        let unreadable = |path: &Path, source| DatasetError::Unreadable {
            path: path.into(),
            source,
        };
        let mut classes = Vec::new();
        for entry in std::fs::read_dir(root).map_err(|e| unreadable(root, e))? {
            let entry = entry.map_err(|e| unreadable(root, e))?;
            // `metadata` follows links, as `os.scandir(...).is_dir()` does.
            if std::fs::metadata(entry.path()).is_ok_and(|m| m.is_dir()) {
                classes.push(entry.file_name());
            }
        }
        classes.sort();
        if classes.is_empty() {
            return Err(DatasetError::NoClasses { path: root.into() });
        }
        let mut items = Vec::new();
        for (label, class) in classes.iter().enumerate() {
            let dir = root.join(class);
            let mut folders = Vec::new();
            walk(&dir, &mut folders).map_err(|(p, e)| unreadable(&p, e))?;
            folders.sort_by(|a, b| a.0.as_os_str().cmp(b.0.as_os_str()));
            let before = items.len();
            for (_, files) in folders {
                for f in files {
                    items.push(Item {
                        loc: Location::File(f),
                        label: label as i64,
                    });
                }
            }
            if items.len() == before {
                return Err(DatasetError::EmptyClass { path: dir });
            }
        }
        Ok(Dataset {
            format: "image_folder",
            root: root.display().to_string(),
            classes: classes
                .iter()
                .map(|c| c.to_string_lossy().into_owned())
                .collect(),
            items,
            shards: Vec::new(),
            shard_items: Vec::new(),
            remote: None,
        })
    }

    /// Indexes WebDataset-style tar shards: members grouped into samples by
    /// their key (the path up to the first `.` of the file name), the image
    /// under one of `SHARD_IMAGE_KEYS`, the label under `.cls` (a decimal
    /// integer). Only tar headers and labels are read here; image bytes are
    /// read later, by offset.
    /// A sample without a label is left out (said once), or with
    /// `strict` refused.
    pub fn webdataset(
        pattern: &str,
        paths: &[PathBuf],
        strict: bool,
    ) -> Result<Dataset, DatasetError> {
        let mut items = Vec::new();
        let mut shards = Vec::new();
        let mut shard_items = Vec::new();
        let mut unlabelled = Vec::new();
        for path in paths {
            let shard_err = |e: ShardError| DatasetError::Shard {
                path: path.clone(),
                message: e.to_string(),
            };
            let (file, len) = open_regular(path).map_err(|e| DatasetError::Unreadable {
                path: path.clone(),
                source: e,
            })?;
            let shard = shards.len() as u32;
            let before = items.len();
            let (left, cut) =
                index_shard(&file, shard, len, strict, &mut items).map_err(shard_err)?;
            if let Some(why) = cut {
                warn_cut(&path.display().to_string(), &why);
            }
            unlabelled.push((path.display().to_string(), left));
            shard_items.push(before..items.len());
            shards.push((path.clone(), file));
        }
        warn_unlabelled(pattern, &unlabelled);
        if items.is_empty() {
            return Err(DatasetError::NoSamples {
                what: format!("shard pattern `{pattern}`"),
            });
        }
        Ok(Dataset {
            format: "webdataset",
            root: pattern.to_string(),
            classes: Vec::new(),
            items,
            shards,
            shard_items,
            remote: None,
        })
    }
}

type Folder = (PathBuf, Vec<PathBuf>);

/// Collects every folder under `dir` (itself included) with its sorted image
/// files.
fn walk(dir: &Path, out: &mut Vec<Folder>) -> Result<(), (PathBuf, std::io::Error)> {
    let mut files = Vec::new();
    let mut subdirs = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| (dir.to_path_buf(), e))? {
        let entry = entry.map_err(|e| (dir.to_path_buf(), e))?;
        let path = entry.path();
        let Ok(meta) = std::fs::metadata(&path) else {
            continue; // a dangling link
        };
        if meta.is_dir() {
            subdirs.push(path);
        } else if has_image_extension(&path) {
            files.push(path);
        }
    }
    files.sort();
    out.push((dir.to_path_buf(), files));
    for d in subdirs {
        walk(&d, out)?;
    }
    Ok(())
}

pub(crate) fn has_image_extension(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| IMG_EXTENSIONS.iter().any(|x| x.eq_ignore_ascii_case(e)))
}

/// Expands one `{000000..000099}` range in a shard pattern, keeping the
/// width of zero-padded numbers. A pattern without braces names one file.
pub(crate) fn expand_pattern(pattern: &str) -> Result<Vec<PathBuf>, DatasetError> {
    let bad = |message: &str| DatasetError::Pattern {
        pattern: pattern.into(),
        message: message.into(),
    };
    let Some(open) = pattern.find('{') else {
        return Ok(vec![PathBuf::from(pattern)]);
    };
    let close = pattern[open..]
        .find('}')
        .map(|c| open + c)
        .ok_or_else(|| bad("`{` without `}`"))?;
    let inner = &pattern[open + 1..close];
    let (a, b) = inner
        .split_once("..")
        .ok_or_else(|| bad("expected a range like {000000..000099}"))?;
    let (lo, hi): (u64, u64) = match (a.parse(), b.parse()) {
        (Ok(lo), Ok(hi)) if lo <= hi => (lo, hi),
        _ => return Err(bad("the range must be two ascending decimal numbers")),
    };
    if hi - lo >= 1_000_000 {
        return Err(bad("more than a million shards"));
    }
    let width = if a.starts_with('0') { a.len() } else { 0 };
    let (head, tail) = (&pattern[..open], &pattern[close + 1..]);
    if tail.contains('{') {
        return Err(bad("only one {a..b} range is supported"));
    }
    Ok((lo..=hi)
        .map(|n| PathBuf::from(format!("{head}{n:0width$}{tail}")))
        .collect())
}

/// Opens `path` (following links) without blocking, and only if it is a
/// regular file: opening a FIFO for reading would wait for a writer, and a
/// device (`/dev/zero`) never ends. The type and size come from the opened
/// file itself, so a link swapped meanwhile cannot slip past. Returns the
/// file and its size.
pub(crate) fn open_regular(path: &Path) -> std::io::Result<(File, u64)> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let meta = f.metadata()?;
    if !meta.is_file() {
        let kind = meta.file_type();
        use std::os::unix::fs::FileTypeExt;
        let what = if kind.is_fifo() {
            "a FIFO"
        } else if kind.is_char_device() || kind.is_block_device() {
            "a device"
        } else if kind.is_socket() {
            "a socket"
        } else if kind.is_dir() {
            "a folder"
        } else {
            "not a regular file"
        };
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("it is {what}; only regular files are read"),
        ));
    }
    Ok((f, meta.len()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use shard::split_key;

    #[test]
    fn reads_are_bounded_and_an_unbounded_limit_reads_everything() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("c")).unwrap();
        std::fs::write(dir.path().join("c/a.jpg"), [7u8; 100]).unwrap();
        let ds = Dataset::image_folder(dir.path()).unwrap();
        let mut buf = Vec::new();
        for max in [100, 1 << 20, u64::MAX] {
            ds.read(0, &mut buf, max).unwrap();
            assert_eq!(buf, [7u8; 100], "max_bytes = {max}");
        }
        let err = ds.read(0, &mut buf, 99).unwrap_err().to_string();
        assert!(err.contains("more than max_file_bytes = 99"), "{err}");
    }

    /// A tar of `n` samples (`k.jpg` of 100 bytes and `k.cls`).
    fn shard_of(n: u32) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for k in 0..n {
            for (ext, data) in [("jpg", vec![7u8; 100]), ("cls", b"3".to_vec())] {
                let mut h = tar::Header::new_gnu();
                h.set_size(data.len() as u64);
                h.set_mode(0o644);
                h.set_cksum();
                b.append_data(&mut h, format!("{k:04}.{ext}"), &data[..])
                    .unwrap();
            }
        }
        b.into_inner().unwrap()
    }

    /// A sample with no label is a bad sample: left out under
    /// `on_error = "skip"` (the broker starts), refused by name under
    /// "fail" (it stopped the broker from starting either way).
    #[test]
    fn a_sample_without_a_label_is_left_out_or_refused_as_on_error_says() {
        let mut b = tar::Builder::new(Vec::new());
        for (name, data) in [
            ("0000.jpg", &[7u8; 100][..]),
            ("0000.cls", b"1"),
            ("0001.jpg", &[7u8; 100][..]),
            ("0002.jpg", &[7u8; 100][..]),
            ("0002.cls", b"2"),
        ] {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_cksum();
            b.append_data(&mut h, name, data).unwrap();
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.tar");
        std::fs::write(&path, b.into_inner().unwrap()).unwrap();
        let ds = Dataset::webdataset("s.tar", std::slice::from_ref(&path), false).unwrap();
        let labels: Vec<i64> = ds.items.iter().map(|i| i.label).collect();
        assert_eq!(labels, [1, 2]);
        let err = Dataset::webdataset("s.tar", &[path], true)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`0001` has an image but no .cls label"),
            "{err}"
        );
    }

    #[test]
    fn a_member_declaring_more_than_the_shard_holds_is_named_not_the_end() {
        let mut shard = shard_of(32);
        let mut items = Vec::new();
        index_shard(
            std::io::Cursor::new(&shard),
            0,
            shard.len() as u64,
            true,
            &mut items,
        )
        .unwrap();
        assert_eq!(items.len(), 32);
        // The first image's header says 8 GiB less a byte (the largest
        // octal size), then its checksum again.
        let h = &mut shard[..512];
        h[124..136].copy_from_slice(b"77777777777\0");
        h[148..156].copy_from_slice(b"        ");
        let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
        h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
        let len = shard.len() as u64;
        let err = index_shard(std::io::Cursor::new(&shard), 0, len, true, &mut Vec::new())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`0000.jpg` declares 8589934591 bytes")
                && err.contains("past the shard's end"),
            "{err}"
        );
    }

    #[test]
    fn a_shard_cut_short_keeps_its_whole_samples_unless_strict() {
        let shard = shard_of(32);
        let mut whole = Vec::new();
        let n = shard.len() as u64;
        index_shard(std::io::Cursor::new(&shard), 0, n, true, &mut whole).unwrap();
        // Cut 10 bytes into the 17th sample's image.
        let Location::Member { offset, .. } = whole[16].loc else {
            panic!("{:?}", whole[16].loc)
        };
        let cut = &shard[..offset as usize + 10];
        let len = cut.len() as u64;
        let mut items = Vec::new();
        let (_, why) = index_shard(std::io::Cursor::new(cut), 0, len, false, &mut items).unwrap();
        assert_eq!(items.len(), 16, "the samples before the cut");
        assert!(why.is_some_and(|w| w.contains("past the shard's end")));
        // Every sample kept lies whole within what is there.
        for it in &items {
            let Location::Member { offset, len: n, .. } = it.loc else {
                panic!("{:?}", it.loc)
            };
            assert!(offset + n <= len);
        }
        let err = index_shard(std::io::Cursor::new(cut), 0, len, true, &mut Vec::new());
        assert!(err.is_err());
    }

    #[test]
    fn shard_patterns_expand_with_their_width() {
        let v = expand_pattern("/d/shard-{000008..000011}.tar").unwrap();
        assert_eq!(v.len(), 4);
        assert_eq!(v[0], PathBuf::from("/d/shard-000008.tar"));
        assert_eq!(v[3], PathBuf::from("/d/shard-000011.tar"));
        assert_eq!(expand_pattern("/d/x.tar").unwrap().len(), 1);
        for bad in ["/d/{1..", "/d/{3..1}.tar", "/d/{a..b}", "/d/{1..2}{1..2}"] {
            assert!(expand_pattern(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn keys_split_at_the_first_dot_of_the_file_name() {
        assert_eq!(split_key("a.b/x.seg.jpg"), ("a.b/x", "seg.jpg"));
        assert_eq!(split_key("x.cls"), ("x", "cls"));
        assert_eq!(split_key("noext"), ("noext", ""));
    }
}
