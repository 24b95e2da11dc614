//! Dataset addresses: `s3://bucket/prefix/`, `gs://`, `az://container/`,
//! `http(s)://host/path`. Credentials never travel in an address: a URL
//! with a user, a password or a query string (where presigned URLs and
//! SAS tokens put theirs) is refused, without repeating what it held.

use std::fmt;

/// Which kind of store an address names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scheme {
    S3,
    Gcs,
    Azure,
    Http,
}

impl Scheme {
    /// Where this store's credentials come from, for messages.
    pub(crate) fn credentials_hint(self) -> &'static str {
        match self {
            Scheme::S3 => {
                "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN, web identity (AWS_WEB_IDENTITY_TOKEN_FILE) or the instance's metadata; ~/.aws profiles are not read"
            }
            Scheme::Gcs => {
                "GOOGLE_SERVICE_ACCOUNT (or GOOGLE_APPLICATION_CREDENTIALS), GOOGLE_BEARER_TOKEN or the instance's metadata"
            }
            Scheme::Azure => {
                "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_KEY or a workload identity"
            }
            Scheme::Http => "an HTTP server is read without credentials",
        }
    }
}

/// A parsed dataset address: the store (`scheme://host`) and the path
/// inside it (no leading `/`; a folder ends with `/`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteUrl {
    pub(crate) scheme: Scheme,
    /// `s3://bucket`, `https://host:port`: the store's root.
    pub root: String,
    /// The path under the root, without a leading `/`.
    pub path: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UrlError {
    #[error(
        "`{shown}`: credentials or tokens in a dataset URL are refused (they would show in logs and stats); remove the {what} and give them in the environment: {hint}"
    )]
    Credentials {
        shown: String,
        what: &'static str,
        hint: &'static str,
    },
    #[error(
        "`{0}`: unknown scheme; datasets are local paths or s3://, gs://, az://, http:// or https:// URLs"
    )]
    Scheme(String),
    #[error("`{0}`: not a URL ({1})")]
    Invalid(String, String),
    #[error("`{0}`: names no bucket or container")]
    NoBucket(String),
}

/// Whether `s` is a URL (of any scheme) rather than a local path.
pub(crate) fn is_url(s: &str) -> bool {
    s.split_once("://").is_some_and(|(scheme, _)| {
        !scheme.is_empty()
            && scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '+')
    })
}

/// The address with anything that may be a secret cut out: what a message
/// may show of a URL that was refused.
fn shown(s: &str) -> String {
    let s = s.split(['?', '#']).next().unwrap_or("");
    match s.split_once("://") {
        Some((scheme, rest)) => {
            let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
            let host = host.rsplit_once('@').map_or(host, |(_, h)| h);
            format!("{scheme}://{host}/{path}")
        }
        None => s.to_string(),
    }
}

impl RemoteUrl {
    pub fn parse(s: &str) -> Result<RemoteUrl, UrlError> {
        let (scheme_text, _) = s.split_once("://").unwrap_or(("", s));
        let scheme = match scheme_text.to_ascii_lowercase().as_str() {
            "s3" | "s3a" => Scheme::S3,
            "gs" => Scheme::Gcs,
            "az" | "abfs" | "abfss" | "azure" => Scheme::Azure,
            "http" | "https" => Scheme::Http,
            _ => return Err(UrlError::Scheme(shown(s))),
        };
        let secret = |what| UrlError::Credentials {
            shown: shown(s),
            what,
            hint: scheme.credentials_hint(),
        };
        // Checked on the raw text first: a message never parses (and
        // so never echoes) what a refused part held.
        if s.contains('?') {
            return Err(secret("query string"));
        }
        let u = url::Url::parse(s).map_err(|e| UrlError::Invalid(shown(s), e.to_string()))?;
        if !u.username().is_empty() || u.password().is_some() {
            return Err(secret("user and password"));
        }
        if u.fragment().is_some() {
            return Err(secret("fragment"));
        }
        let host = u.host_str().unwrap_or("");
        if host.is_empty() {
            return Err(UrlError::NoBucket(shown(s)));
        }
        let root = match u.port() {
            Some(p) => format!("{}://{host}:{p}", u.scheme()),
            None => format!("{}://{host}", u.scheme()),
        };
        // The path as written (percent-escapes undone: object keys are
        // bytes, and the store escapes them again on the wire).
        let raw = u.path().trim_start_matches('/');
        let path = percent_decode(raw);
        Ok(RemoteUrl { scheme, root, path })
    }

    /// The same store, another path.
    pub(crate) fn with_path(&self, path: &str) -> RemoteUrl {
        RemoteUrl {
            path: path.trim_start_matches('/').to_string(),
            ..self.clone()
        }
    }
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2]))
        {
            out.push(h * 16 + l);
            i += 3;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn hex(c: u8) -> Option<u8> {
    (c as char).to_digit(16).map(|d| d as u8)
}

impl fmt::Display for RemoteUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.root, self.path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_and_paths() {
        let u = RemoteUrl::parse("s3://bucket/train/x/").unwrap();
        assert_eq!(
            (u.scheme, u.root.as_str(), u.path.as_str()),
            (Scheme::S3, "s3://bucket", "train/x/")
        );
        let u = RemoteUrl::parse("http://127.0.0.1:8080/d/a%20b.tar").unwrap();
        assert_eq!(
            (u.root.as_str(), u.path.as_str()),
            ("http://127.0.0.1:8080", "d/a b.tar")
        );
        assert_eq!(u.to_string(), "http://127.0.0.1:8080/d/a b.tar");
        assert_eq!(RemoteUrl::parse("az://c/p").unwrap().scheme, Scheme::Azure);
        assert!(is_url("gs://b/p") && !is_url("/data/x") && !is_url("~/x"));
    }

    #[test]
    fn credentials_are_refused_without_being_repeated() {
        for (bad, what) in [
            ("s3://AKIAXXXX:SECRETKEY@bucket/p", "user and password"),
            ("https://user:SECRETKEY@host/p", "user and password"),
            (
                "https://host/p.tar?X-Amz-Signature=SECRETKEY",
                "query string",
            ),
            ("az://c/p?sig=SECRETKEY&sv=1", "query string"),
        ] {
            let e = RemoteUrl::parse(bad).unwrap_err();
            let text = e.to_string();
            assert!(text.contains(what), "{text}");
            assert!(!text.contains("SECRETKEY"), "{text}");
            assert!(text.contains("environment"), "{text}");
        }
        assert!(matches!(
            RemoteUrl::parse("ftp://h/p"),
            Err(UrlError::Scheme(_))
        ));
        assert!(matches!(
            RemoteUrl::parse("s3:///p"),
            Err(UrlError::NoBucket(_) | UrlError::Invalid(..))
        ));
    }
}
