//! Opening a store: `object_store`'s client for the URL's scheme, with
//! its own retries off (`fetch.rs` retries), on an HTTP client of ours
//! for every scheme ([`SameHost`]): redirects stay on the store's host,
//! and an error's body is read at most [`ERROR_BODY_MAX`] bytes far
//! (`object_store` reads it whole into its error text).

use std::sync::Arc;
use std::time::Duration;

use object_store::ObjectStore;

use super::url::{RemoteUrl, Scheme};
use super::{RemoteError, Settings};

/// Builds the client of the store `url` names, with no retries of its own.
pub(crate) fn open_store(
    url: &RemoteUrl,
    s: &Settings,
) -> Result<Arc<dyn ObjectStore>, RemoteError> {
    use object_store::{ClientOptions, RetryConfig};
    // The client's own timeout is a backstop: batchcast's (fetch.rs) ends
    // a try first, with a message naming `timeout_s`.
    let opts = ClientOptions::new()
        .with_timeout(s.limits.timeout + Duration::from_secs(1))
        .with_connect_timeout(s.limits.timeout.min(Duration::from_secs(5)))
        .with_pool_max_idle_per_host(s.limits.requests.max(1) as usize * 2);
    let no_retry = RetryConfig {
        max_retries: 0,
        retry_timeout: s.limits.stall,
        ..RetryConfig::default()
    };
    let err = |e: object_store::Error| RemoteError::Store {
        url: url.to_string(),
        message: e.to_string(),
        hint: url.scheme.credentials_hint(),
    };
    let full = format!("{}/", url.root);
    Ok(match url.scheme {
        Scheme::S3 => Arc::new(s3(full, s, opts, no_retry).map_err(err)?),
        Scheme::Gcs => {
            let mut b = object_store::gcp::GoogleCloudStorageBuilder::from_env()
                .with_url(full)
                .with_retry(no_retry)
                .with_skip_signature(s.anonymous);
            let mut opts = opts;
            if let Some(e) = &s.endpoint {
                // GCS's XML API at another address (a private endpoint).
                b = b.with_base_url(e.trim_end_matches('/'));
                opts = opts.with_allow_http(e.starts_with("http://"));
            }
            Arc::new(
                b.with_client_options(opts)
                    .with_http_connector(same_host(s))
                    .build()
                    .map_err(err)?,
            )
        }
        Scheme::Azure => {
            let mut b = object_store::azure::MicrosoftAzureBuilder::from_env()
                .with_url(full)
                .with_retry(no_retry)
                .with_skip_signature(s.anonymous);
            if let Some(e) = &s.endpoint {
                // The account's blob endpoint (a private endpoint, azurite).
                b = b.with_endpoint(e.trim_end_matches('/').to_string());
            }
            Arc::new(
                b.with_client_options(opts.with_allow_http(true))
                    .with_http_connector(same_host(s))
                    .build()
                    .map_err(err)?,
            )
        }
        Scheme::Http => Arc::new(
            object_store::http::HttpBuilder::new()
                .with_url(url.root.clone())
                .with_retry(no_retry)
                .with_client_options(opts.with_allow_http(true))
                .with_http_connector(same_host(s))
                .build()
                .map_err(err)?,
        ),
    })
}

/// An S3 (or compatible) store at `full`, its endpoint from the settings
/// or the environment.
fn s3(
    full: String,
    s: &Settings,
    opts: object_store::ClientOptions,
    retry: object_store::RetryConfig,
) -> object_store::Result<object_store::aws::AmazonS3> {
    let mut b = object_store::aws::AmazonS3Builder::from_env()
        .with_url(full)
        .with_retry(retry)
        .with_skip_signature(s.anonymous);
    let mut opts = opts;
    if let Some(e) = &s.endpoint {
        b = b.with_endpoint(e.clone());
        if e.starts_with("http://") {
            opts = opts.with_allow_http(true);
        }
    }
    b.with_client_options(opts)
        .with_http_connector(same_host(s))
        .build()
}

/// The HTTP client of every store, sized by the dataset's settings.
fn same_host(s: &Settings) -> SameHost {
    SameHost {
        timeout: s.limits.timeout + Duration::from_secs(1),
        idle: s.limits.requests.max(1) as usize * 2,
    }
}

/// The most of an error answer's body read (`object_store` puts it in its
/// error's text, which `redact::store_text` then cuts to a line): a store
/// answering 403 with gigabytes is read this far and no further.
pub(crate) const ERROR_BODY_MAX: usize = 64 << 10;

/// What a redirect to another host is refused with (`fetch::judge` reads
/// it: refused for good, not tried again).
pub(crate) const CROSS_HOST: &str = "redirected to another host, which is not followed";

/// The client of every store: `object_store`'s settings that matter here
/// (no decompression: lengths and ranges are the bytes'), redirects
/// followed only within the store's own scheme, host and port (at most
/// 5): a redirect elsewhere is a bad sample named by URL, never fetched
/// and decoded as one (an S3 bucket in another region than the one set
/// answers so: the refusal names the host, and `region` fixes it); and
/// error answers' bodies read at most [`ERROR_BODY_MAX`] bytes far. Plain
/// `http://` is not refused here: the URL, `endpoint` or the environment
/// (`AWS_ENDPOINT_URL`) chose it; so `allow_http` in the client options,
/// which this client does not read, changes nothing.
#[derive(Debug)]
struct SameHost {
    timeout: Duration,
    idle: usize,
}

impl object_store::client::HttpConnector for SameHost {
    fn connect(
        &self,
        _: &object_store::ClientOptions,
    ) -> object_store::Result<object_store::client::HttpClient> {
        let policy = reqwest::redirect::Policy::custom(|a| {
            let to = (
                a.url().scheme(),
                a.url().host_str(),
                a.url().port_or_known_default(),
            );
            let first = a
                .previous()
                .first()
                .map(|f| (f.scheme(), f.host_str(), f.port_or_known_default()));
            if first != Some(to) {
                let whither = format!("{}://{}", to.0, to.1.unwrap_or("?"));
                a.error(format!("{CROSS_HOST} ({whither})"))
            } else if a.previous().len() > 5 {
                a.stop()
            } else {
                a.follow()
            }
        });
        let client = reqwest::Client::builder()
            .user_agent(concat!("batchcast/", env!("CARGO_PKG_VERSION")))
            .timeout(self.timeout)
            .connect_timeout(self.timeout.min(Duration::from_secs(5)))
            .pool_max_idle_per_host(self.idle)
            .no_gzip()
            .no_brotli()
            .no_zstd()
            .no_deflate()
            .redirect(policy)
            .build()
            .map_err(|e| object_store::Error::Generic {
                store: "HTTP",
                source: Box::new(e),
            })?;
        let inner = object_store::client::HttpClient::new(client);
        Ok(object_store::client::HttpClient::new(CappedErrors(inner)))
    }
}

/// Passes answers through, but an error's body only up to
/// [`ERROR_BODY_MAX`] bytes (the rest is never read: the connection
/// closes with it).
#[derive(Debug)]
struct CappedErrors(object_store::client::HttpClient);

#[async_trait::async_trait]
impl object_store::client::HttpService for CappedErrors {
    async fn call(
        &self,
        req: object_store::client::HttpRequest,
    ) -> Result<object_store::client::HttpResponse, object_store::client::HttpError> {
        use futures::StreamExt;
        let res = self.0.execute(req).await?;
        let status = res.status();
        if status.is_success() || status.is_redirection() || status.is_informational() {
            return Ok(res);
        }
        let (parts, body) = res.into_parts();
        let mut chunks = body.bytes_stream();
        let mut kept = Vec::new();
        while kept.len() < ERROR_BODY_MAX {
            match chunks.next().await {
                Some(Ok(chunk)) => {
                    let room = ERROR_BODY_MAX - kept.len();
                    kept.extend_from_slice(&chunk[..chunk.len().min(room)]);
                }
                // What came is the error's text; the status says enough.
                Some(Err(_)) | None => break,
            }
        }
        Ok(object_store::client::HttpResponse::from_parts(
            parts,
            bytes::Bytes::from(kept).into(),
        ))
    }
}
