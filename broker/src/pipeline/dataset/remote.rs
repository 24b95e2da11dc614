//! Listing remote datasets into the same items as local ones.
//!
//! * An image folder under a prefix: every object below it, classes from
//!   the next path component, ordered as [`Dataset::image_folder`] orders
//!   a local tree (classes sorted; folder by folder in byte order of their
//!   paths; each folder's files sorted), so item `i` is the same image in
//!   both. From a manifest where the server cannot list (plain HTTP).
//! * Tar shards by brace pattern: each shard's size and ETag (a HEAD),
//!   then its bytes in parts (from the disk tier when it holds them, else
//!   by concurrent range requests) to read the tar headers. A restarted
//!   broker with a disk tier indexes from disk.
//!
//! With a disk tier, the listing (or the shards' sizes and ETags) is kept
//! there and used by a broker started within `listing_max_age_s`.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use futures::StreamExt;

use super::{
    Dataset, DatasetError, Item, Location, ShardError, expand_pattern, has_image_extension,
    index_shard,
};
use crate::remote::fetch::{self, Fetcher};
use crate::remote::url::{RemoteUrl, Scheme};
use crate::remote::{Object, RemoteSet, Settings, disk::DiskCache, listing, open_store};

fn listing_err(url: &RemoteUrl, message: impl Into<String>) -> DatasetError {
    DatasetError::RemoteListing {
        url: url.to_string(),
        message: message.into(),
    }
}

fn open(url: &RemoteUrl, s: &Settings) -> Result<(Arc<Fetcher>, Option<DiskCache>), DatasetError> {
    let store = open_store(url, s)?;
    let fetcher = Arc::new(Fetcher::new(store, url.clone(), s.limits));
    let disk = match &s.cache_dir {
        Some(d) if s.cache_dir_bytes > 0 => {
            Some(DiskCache::open(d, s.cache_dir_bytes).map_err(crate::remote::RemoteError::from)?)
        }
        _ => None,
    };
    Ok((fetcher, disk))
}

/// A file of a remote folder: its path under the folder's prefix, size
/// and version, where known.
type Listed = Object;

fn listed_file(path: String, size: Option<u64>, version: String) -> Listed {
    Object {
        path,
        size,
        version,
    }
}

/// The listing under `key` from the disk tier when it holds a young
/// enough one, else `list()`'s, then kept there.
fn listing_of(
    disk: Option<&DiskCache>,
    key: &str,
    url: &RemoteUrl,
    s: &Settings,
    list: impl FnOnce() -> Result<Vec<Listed>, DatasetError>,
) -> Result<Vec<Listed>, DatasetError> {
    if let Some((objects, age)) = disk.and_then(|d| listing::cached(d, key, s.listing_max_age)) {
        tracing::info!(
            "{url}: {} objects as listed {} s ago, from the disk tier (listing_max_age_s = {} lists again after that; 0 always)",
            objects.len(),
            age.as_secs(),
            s.listing_max_age.as_secs()
        );
        return Ok(objects);
    }
    let objects = list()?;
    if let Some(d) = disk
        && !s.listing_max_age.is_zero()
    {
        listing::keep(d, key, &objects);
    }
    Ok(objects)
}

/// An image folder at `root` (a URL), listed or read from `manifest`.
pub fn image_folder(
    url: &RemoteUrl,
    manifest: Option<&str>,
    s: &Settings,
) -> Result<Dataset, DatasetError> {
    let (fetcher, disk) = open(url, s)?;
    let mut prefix = url.path.clone();
    if !prefix.is_empty() && !prefix.ends_with('/') {
        prefix.push('/');
    }
    let key = format!("listing\n{url}\n{}", manifest.unwrap_or(""));
    let entries = listing_of(disk.as_ref(), &key, url, s, || match manifest {
        Some(m) => from_manifest(&fetcher, url, &prefix, m),
        None => listed(&fetcher, url, &prefix),
    })?;
    let (names, objects, items) = ordered(url, &prefix, entries)?;
    let set = RemoteSet::new(fetcher, objects, None, s, disk);
    Ok(Dataset {
        format: "image_folder",
        root: url.to_string(),
        classes: names,
        items,
        shards: Vec::new(),
        shard_items: Vec::new(),
        remote: Some(Arc::new(set)),
    })
}

/// The files a manifest names (a URL, or a name under the folder).
fn from_manifest(
    fetcher: &Arc<Fetcher>,
    url: &RemoteUrl,
    prefix: &str,
    m: &str,
) -> Result<Vec<Listed>, DatasetError> {
    let murl = if crate::remote::url::is_url(m) {
        RemoteUrl::parse(m).map_err(crate::remote::RemoteError::from)?
    } else {
        url.with_path(&format!("{prefix}{m}"))
    };
    if murl.root != url.root {
        return Err(listing_err(
            &murl,
            "the manifest must be on the same server as the root",
        ));
    }
    let f = fetcher.clone();
    let path = murl.path.clone();
    let (bytes, _) = fetch::wait(async move { f.get(&path, None, MAX_MANIFEST_BYTES).await })
        .map_err(crate::remote::RemoteError::from)?;
    let text = String::from_utf8(bytes.to_vec())
        .map_err(|_| listing_err(&murl, "the manifest is not UTF-8 text"))?;
    Ok(text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| listed_file(l.trim_start_matches("./").to_string(), None, String::new()))
        .collect())
}

/// The largest manifest read (about 10 million paths): a store
/// declaring more is refused before its body is read.
const MAX_MANIFEST_BYTES: u64 = 1 << 30;

/// Every object under `prefix`, by listing the store.
fn listed(
    fetcher: &Arc<Fetcher>,
    url: &RemoteUrl,
    prefix: &str,
) -> Result<Vec<Listed>, DatasetError> {
    let f = fetcher.clone();
    let p = prefix.to_string();
    let listed = match fetch::wait(async move { f.list(&p).await }) {
        Ok(l) => l,
        Err(e) if url.scheme == Scheme::Http => {
            return Err(listing_err(
                url,
                format!(
                    "cannot list ({e}); a plain HTTP server cannot list a folder (WebDAV servers can): give `manifest = \"MANIFEST\"`, a file of `class/name.jpg` lines"
                ),
            ));
        }
        Err(e) => return Err(crate::remote::RemoteError::from(e).into()),
    };
    Ok(listed
        .into_iter()
        .filter_map(|m| {
            let path = m.location.to_string();
            let rel = path.strip_prefix(prefix)?.to_string();
            Some(listed_file(rel, Some(m.size), fetch::version_of(&m)))
        })
        .collect())
}

/// Class names, objects and items.
type Ordered = (Vec<String>, Vec<Object>, Vec<Item>);

/// Classes, objects and items in a local walk's order.
fn ordered(url: &RemoteUrl, prefix: &str, entries: Vec<Listed>) -> Result<Ordered, DatasetError> {
    // class -> folder -> files
    let mut classes: BTreeMap<String, BTreeMap<String, Vec<Listed>>> = BTreeMap::new();
    for entry in entries {
        let rel = entry.path.as_str();
        let Some((class, rest)) = rel.split_once('/') else {
            continue; // a file beside the class folders
        };
        if class.is_empty() || rest.is_empty() {
            continue;
        }
        let folders = classes.entry(class.to_string()).or_default();
        if !has_image_extension(Path::new(rest)) {
            continue;
        }
        let dir = rel
            .rfind('/')
            .map_or(String::new(), |i| rel[..i].to_string());
        folders.entry(dir).or_default().push(entry);
    }
    if classes.is_empty() {
        return Err(DatasetError::NoSamples {
            what: format!("{url} (no class folders below it)"),
        });
    }
    let (mut names, mut objects, mut items) = (Vec::new(), Vec::new(), Vec::new());
    for (label, (class, folders)) in classes.into_iter().enumerate() {
        let before = items.len();
        for (_, mut files) in folders {
            files.sort_by(|a, b| a.path.cmp(&b.path));
            for Object {
                path: rel,
                size,
                version,
            } in files
            {
                items.push(Item {
                    loc: Location::Object(objects.len() as u32),
                    label: label as i64,
                });
                objects.push(Object {
                    path: format!("{prefix}{rel}"),
                    size,
                    version,
                });
            }
        }
        if items.len() == before {
            return Err(DatasetError::EmptyClass {
                path: url
                    .with_path(&format!("{prefix}{class}"))
                    .to_string()
                    .into(),
            });
        }
        names.push(class);
    }
    Ok((names, objects, items))
}

/// Tar shards by brace pattern (a URL): indexed from their bytes.
pub fn webdataset(url: &RemoteUrl, s: &Settings, strict: bool) -> Result<Dataset, DatasetError> {
    let (fetcher, disk) = open(url, s)?;
    let key = format!("shards\n{url}");
    let objects = listing_of(disk.as_ref(), &key, url, s, || {
        shard_objects(&fetcher, url, s)
    })?;
    let requests = s.limits.requests.max(1) as usize;
    let set = Arc::new(RemoteSet::new(
        fetcher,
        objects,
        Some(s.part_bytes.max(1)),
        s,
        disk,
    ));
    // Shards are indexed a few at a time, each from a few parts in
    // flight: at most the read-ahead window's bytes (or one part per
    // shard) are held, whatever sizes the store declared.
    let n = set.objects.len();
    let at_once = n.clamp(1, 8);
    let part = s.part_bytes.max(1);
    let ahead = ((s.read_ahead_bytes / part) as usize / at_once).clamp(1, requests);
    let me = set.clone();
    let shards = fetch::wait(async move {
        futures::stream::iter((0..n as u32).map(|o| index_remote(me.clone(), o, ahead, strict)))
            .buffered(at_once)
            .collect::<Vec<_>>()
            .await
    });
    let mut items = Vec::new();
    let mut shard_items = Vec::with_capacity(n);
    let mut unlabelled = Vec::new();
    for (o, r) in shards.into_iter().enumerate() {
        let (listed, left, cut) = r.map_err(|e| DatasetError::Shard {
            path: set.describe(o as u32).into(),
            message: e.to_string(),
        })?;
        if let Some(why) = cut {
            super::warn_cut(&set.describe(o as u32), &why);
        }
        let before = items.len();
        items.extend(listed);
        shard_items.push(before..items.len());
        unlabelled.push((set.describe(o as u32), left));
    }
    super::warn_unlabelled(&url.to_string(), &unlabelled);
    if items.is_empty() {
        return Err(DatasetError::NoSamples {
            what: format!("shard pattern `{url}`"),
        });
    }
    Ok(Dataset {
        format: "webdataset",
        root: url.to_string(),
        classes: Vec::new(),
        items,
        shards: Vec::new(),
        shard_items,
        remote: Some(set),
    })
}

/// Indexes shard `o` from its parts as they arrive (`ahead` of them in
/// flight, then read by the tar index on a blocking thread): the shard
/// is never held whole.
async fn index_remote(
    set: Arc<RemoteSet>,
    o: u32,
    ahead: usize,
    strict: bool,
) -> Result<(Vec<Item>, Vec<String>, Option<String>), ShardError> {
    let len = set.listed_size(o).unwrap_or(0);
    let (tx, rx) = tokio::sync::mpsc::channel(ahead);
    let feeder = {
        let set = set.clone();
        tokio::spawn(async move {
            // Parts are named as they are fetched: a shard listed at
            // 64 GiB that is not costs the parts actually read.
            let units = {
                let set = set.clone();
                (0u64..).map_while(move |i| set.part(o, i))
            };
            let mut fetches = futures::stream::iter(units)
                .map(|u| set.clone().fetch_unit(u))
                .buffered(ahead);
            while let Some(r) = fetches.next().await {
                let failed = r.is_err();
                if tx.send(r).await.is_err() || failed {
                    break;
                }
            }
        })
    };
    let indexed = tokio::task::spawn_blocking(move || {
        let mut items = Vec::new();
        index_shard(PartReader::new(rx, len), o, len, strict, &mut items)
            .map(|(left, cut)| (items, left, cut))
    })
    .await?;
    feeder.abort();
    indexed
}

/// A shard's bytes as its parts arrive, read by the tar index: reads go
/// forward through the parts; a seek (tar skips member bodies) only moves
/// the position forward.
struct PartReader {
    parts: tokio::sync::mpsc::Receiver<Result<bytes::Bytes, fetch::FetchError>>,
    part: bytes::Bytes,
    /// The shard offset of `part[0]`.
    at: u64,
    pos: u64,
    len: u64,
}

impl PartReader {
    fn new(
        parts: tokio::sync::mpsc::Receiver<Result<bytes::Bytes, fetch::FetchError>>,
        len: u64,
    ) -> PartReader {
        PartReader {
            parts,
            part: bytes::Bytes::new(),
            at: 0,
            pos: 0,
            len,
        }
    }
}

impl std::io::Read for PartReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.pos >= self.at + self.part.len() as u64 {
            if self.pos >= self.len {
                return Ok(0);
            }
            match self.parts.blocking_recv() {
                None => return Ok(0),
                Some(Err(e)) => return Err(e.into()),
                Some(Ok(p)) => {
                    self.at += self.part.len() as u64;
                    self.part = p;
                }
            }
        }
        let from = (self.pos - self.at) as usize;
        let n = buf.len().min(self.part.len() - from);
        buf[..n].copy_from_slice(&self.part[from..from + n]);
        self.pos += n as u64;
        Ok(n)
    }
}

impl std::io::Seek for PartReader {
    fn seek(&mut self, to: std::io::SeekFrom) -> std::io::Result<u64> {
        use std::io::SeekFrom;
        let target = match to {
            SeekFrom::Start(p) => Some(p),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
            SeekFrom::End(d) => self.len.checked_add_signed(d),
        };
        match target {
            Some(t) if t >= self.at => {
                self.pos = t;
                Ok(t)
            }
            _ => Err(std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                "a remote shard is indexed front to back",
            )),
        }
    }
}

/// The shards a pattern names, with their sizes and versions (a HEAD
/// each, `requests` at a time).
fn shard_objects(
    fetcher: &Arc<Fetcher>,
    url: &RemoteUrl,
    s: &Settings,
) -> Result<Vec<Object>, DatasetError> {
    let requests = s.limits.requests.max(1) as usize;
    let paths: Vec<String> = expand_pattern(&url.path)?
        .into_iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let f = fetcher.clone();
    let heads = fetch::wait(async move {
        futures::stream::iter(paths.into_iter().map(|p| {
            let f = f.clone();
            async move { f.head(&p).await.map(|m| (p, m)) }
        }))
        .buffered(requests)
        .collect::<Vec<_>>()
        .await
    });
    let mut objects = Vec::with_capacity(heads.len());
    for h in heads {
        let (path, m) = h.map_err(crate::remote::RemoteError::from)?;
        objects.push(listed_file(path, Some(m.size), fetch::version_of(&m)));
    }
    Ok(objects)
}
