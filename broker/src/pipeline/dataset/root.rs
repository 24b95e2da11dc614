//! Where a dataset is: a local path or a URL, told apart once, when the
//! stream is planned; everything after takes the parsed form.

use std::path::Path;

use crate::remote::url::{RemoteUrl, UrlError, is_url};

/// A dataset's root (an image folder) or shard pattern (tar shards), as
/// the config gave it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum DatasetRoot {
    /// A path on this host, a leading `~/` expanded to `$HOME`.
    Local(String),
    /// An address in an object store or on an HTTP server.
    Remote(RemoteUrl),
}

impl DatasetRoot {
    /// `text` as a local path, or, when it has a scheme (`s3://`, …), as
    /// a URL: a refused URL (unknown scheme, credentials in it) is an
    /// error here, not a local path of that name.
    pub fn parse(text: &str) -> Result<DatasetRoot, UrlError> {
        Ok(if is_url(text) {
            DatasetRoot::Remote(RemoteUrl::parse(text)?)
        } else {
            DatasetRoot::Local(expand_home(text))
        })
    }

    pub fn remote(&self) -> Option<&RemoteUrl> {
        match self {
            DatasetRoot::Remote(u) => Some(u),
            DatasetRoot::Local(_) => None,
        }
    }
}

/// A leading `~/` in a dataset path is the user's home folder (`$HOME`).
fn expand_home(path: &str) -> String {
    match (path.strip_prefix("~/"), std::env::var_os("HOME")) {
        (Some(rest), Some(home)) => Path::new(&home).join(rest).to_string_lossy().into_owned(),
        _ => path.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_root_is_local_or_remote_once_and_a_bad_url_is_not_a_path() {
        assert_eq!(
            DatasetRoot::parse("/data/train").unwrap(),
            DatasetRoot::Local("/data/train".into())
        );
        let r = DatasetRoot::parse("s3://bucket/train/").unwrap();
        assert_eq!(r.remote().unwrap().root, "s3://bucket");
        assert_eq!(
            DatasetRoot::parse("https://host:8080/x/")
                .unwrap()
                .remote()
                .unwrap()
                .root,
            "https://host:8080"
        );
        assert!(matches!(
            DatasetRoot::parse("ftp://host/x"),
            Err(UrlError::Scheme(_))
        ));
        assert!(matches!(
            DatasetRoot::parse("s3://user:secret@bucket/x"),
            Err(UrlError::Credentials { .. })
        ));
    }
}
