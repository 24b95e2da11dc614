//! Datasets where they live: the same image folder and tar shards read
//! from local disk, from S3 servers (moto's, and moto's checking
//! signatures, started here), Azure's emulator, a plain HTTP server with
//! range requests (tests/support/objserver.py), a WebDAV server, and
//! through a fault-injecting proxy; every form's batches byte-identical
//! to the local ones.

use crate::common;

use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use batchcast::proto::{RemoteSourceStats, StatsReply};
use batchcast_cli::harness::{self, BrokerProcess};
use batchcast_cli::report::ConsumerReport;
use common::{EXE, LIMIT, command, http_get, python, repo};

/// A value no message, log or stats reply may ever show.
const SECRET: &str = "batchcast-test-secret-4f1d9c";

/// A server process the test started, killed when dropped.
struct Server {
    child: Child,
    port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// `tests/support/objserver.py ARGS`, which says its port first.
    fn objserver(args: &[&str]) -> Server {
        let mut child = command(python())
            .arg(repo().join("tests/support/objserver.py"))
            .args(args)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port = line
            .trim()
            .strip_prefix("listening ")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("objserver said {line:?}"));
        Server { child, port }
    }

    /// moto's S3 server on a free port.
    fn moto() -> Server {
        let port = free_port();
        let child = command(python())
            .args([
                "-m",
                "moto.server",
                "-H",
                "127.0.0.1",
                "-p",
                &port.to_string(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        Server::listening(child, port, "moto")
    }

    /// Azure's storage emulator (azurite, installed by scripts/setup) on a
    /// free port, its files in `dir`.
    fn azurite(dir: &Path) -> Server {
        let exe = repo().join(".venv/azurite/node_modules/.bin/azurite-blob");
        assert!(
            exe.exists(),
            "{} is missing: run `bash scripts/setup`",
            exe.display()
        );
        let port = free_port();
        let child = command(exe)
            .args(["--blobHost", "127.0.0.1", "--blobPort", &port.to_string()])
            .arg("--location")
            .arg(dir)
            .args(["--silent", "--skipApiVersionCheck"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        Server::listening(child, port, "azurite")
    }

    /// moto's S3 server checking request signatures (its IAM access
    /// control, which the plain [`Server::moto`] leaves off) against the
    /// key pair `s3_env` sets.
    fn s3_signed() -> Server {
        Server::objserver(&["s3-signed", "testing", SECRET])
    }

    /// A WebDAV server (WsgiDAV, installed by scripts/setup) publishing
    /// `root`: it lists a folder (PROPFIND), where plain HTTP cannot.
    fn webdav(root: &str) -> Server {
        let port = free_port();
        let child = command(python())
            .args(["-m", "wsgidav.server.server_cli", "-H", "127.0.0.1"])
            .args(["-p", &port.to_string(), "-r", root])
            .args(["--auth", "anonymous", "--no-config", "-q"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        Server::listening(child, port, "wsgidav")
    }

    /// `child`, once it listens on `port`.
    fn listening(child: Child, port: u16, what: &str) -> Server {
        let s = Server { child, port };
        let t0 = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(t0.elapsed() < LIMIT, "{what} did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        s
    }

    /// Sets the faults of an objserver (see its docstring); what it has
    /// served and injected so far.
    fn faults(&self, spec: &str) -> serde_json::Value {
        use std::io::{Read, Write};
        let mut c = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        write!(
            c,
            "POST /__faults HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{spec}",
            spec.len()
        )
        .unwrap();
        let mut answer = String::new();
        c.read_to_string(&mut answer).unwrap();
        let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {answer}"))
    }
}

/// The test's data: the image folder and shards on disk, and an S3
/// server holding both (under `train/`, `deny/` and `shards/`), started
/// and filled when a test first asks for it.
struct Data {
    dir: tempfile::TempDir,
    n: u64,
    shards: u64,
    s3: std::sync::OnceLock<Server>,
}

impl Data {
    fn new() -> Data {
        let dir = tempfile::tempdir().unwrap();
        let out = common::imgtool_made(
            dir.path(),
            &[
                &["make-folder", "@/ds", "--count", "1"],
                &["make-shards", "@/ds", "@/shards", "10"],
            ],
        );
        let n: u64 = out[0].trim().parse().unwrap();
        // The manifest a plain HTTP server needs: every file, any order.
        let mut files = Vec::new();
        walk(&dir.path().join("ds"), Path::new(""), &mut files);
        files.reverse();
        std::fs::write(dir.path().join("ds/MANIFEST"), files.join("\n") + "\n").unwrap();
        Data {
            dir,
            n,
            shards: n.div_ceil(10),
            s3: std::sync::OnceLock::new(),
        }
    }

    /// moto's S3 server with the folder and the shards.
    fn s3(&self) -> &Server {
        self.s3.get_or_init(|| {
            let s3 = Server::moto();
            self.load("s3-load", &s3.url(), &["train/", "deny/", "shards/"]);
            s3
        })
    }

    /// Uploads the folder and shards under `prefixes` (`shards/` the
    /// shards) with `objserver.py LOADER ENDPOINT data ...`.
    fn load(&self, loader: &str, endpoint: &str, prefixes: &[&str]) {
        let (ds, shards) = (self.p("ds"), self.p("shards"));
        let pairs: Vec<(&str, &str)> = prefixes
            .iter()
            .map(|p| (if *p == "shards/" { &shards } else { &ds }.as_str(), *p))
            .collect();
        load_dirs(loader, endpoint, &pairs);
    }

    fn p(&self, s: &str) -> String {
        self.dir.path().join(s).display().to_string()
    }

    fn shard_pattern(&self, root: &str) -> String {
        format!("{root}/shard-{{000000..{:06}}}.tar", self.shards - 1)
    }
}

/// Uploads `dir`'s files under `prefix` of bucket (container) `data`
/// (to an S3 server, with the key pair `s3_env` sets).
fn load_dir(loader: &str, endpoint: &str, dir: &str, prefix: &str) {
    load_dirs(loader, endpoint, &[(dir, prefix)]);
}

/// [`load_dir`] for each `(dir, prefix)`, in one process.
fn load_dirs(loader: &str, endpoint: &str, pairs: &[(&str, &str)]) {
    let mut cmd = s3_env(command(python()));
    cmd.args([
        repo().join("tests/support/objserver.py").to_str().unwrap(),
        loader,
        endpoint,
        "data",
    ]);
    for (dir, prefix) in pairs {
        cmd.args([dir, prefix]);
    }
    let out = common::run(&mut cmd);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn walk(dir: &Path, rel: &Path, out: &mut Vec<String>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let r = rel.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            walk(&e.path(), &r, out);
        } else {
            out.push(r.display().to_string());
        }
    }
}

const TRANSFORM: &str = "[stream.transform]\nresize = 32\ncenter_crop = 32\ndtype = \"u8\"\n";

/// A stream of two epochs (unless `extra` says) of batches of 8 over
/// `dataset` (its table), `extra` its other keys and tables.
fn stream(name: &str, dataset: &str, extra: &str) -> String {
    let epochs = if extra.lines().any(|l| l.trim_start().starts_with("epochs")) {
        ""
    } else {
        "epochs = 2"
    };
    format!(
        "[[stream]]\nname = \"{name}\"\nbatch_size = 8\nslots = 4\n{epochs}\n{extra}\n{dataset}\n{TRANSFORM}"
    )
}

fn folder_stream(name: &str, root: &str, extra: &str) -> String {
    stream(
        name,
        &format!("[stream.image_folder]\nroot = \"{root}\""),
        extra,
    )
}

fn shard_stream(name: &str, pattern: &str, extra: &str) -> String {
    stream(
        name,
        &format!("[stream.webdataset]\nshards = \"{pattern}\"\nshuffle_buffer = 16"),
        extra,
    )
}

/// The caches off, for a stream whose reads of every epoch a test counts:
/// at the defaults the broker keeps a remote dataset's files and decoded
/// images, and a later epoch reads little.
const UNCACHED: &str = "cache_mib = 0\ndecoded_cache_mib = 0";

fn remote(endpoint: &str, keys: &str) -> String {
    format!("[stream.remote]\nendpoint = \"{endpoint}\"\n{keys}\n")
}

/// A broker with S3 credentials in its environment (the secret among
/// them), its files in `dir`.
struct Broker {
    process: BrokerProcess,
    dir: PathBuf,
}

impl Broker {
    /// A broker with `config`, given the S3 server's credentials.
    fn start(dir: &Path, config: &str) -> Broker {
        Broker::start_with(dir, config, s3_env)
    }

    /// A broker with `config`, its environment set by `env`.
    fn start_with(dir: &Path, config: &str, env: impl FnOnce(Command) -> Command) -> Broker {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("broker.toml"), config).unwrap();
        let mut cmd = env(command(EXE));
        batchcast_cli::child::die_with_parent(&mut cmd);
        let process = BrokerProcess::spawn_with(
            cmd,
            Some(&dir.join("broker.toml")),
            &dir.join("b.sock"),
            Some(&dir.join("broker.log")),
        )
        .unwrap_or_else(|e| panic!("broker failed to start: {e}"));
        Broker {
            process,
            dir: dir.into(),
        }
    }

    fn consume(&self, args: &[&str]) -> ConsumerReport {
        let child = common::spawn_consumer(&self.dir.join("b.sock"), args);
        harness::wait_report(child, LIMIT).unwrap()
    }

    fn stats(&self) -> StatsReply {
        self.process.stats().unwrap()
    }

    fn remote(&self, stream: &str) -> RemoteSourceStats {
        let s = self.stats();
        let st = s.streams.iter().find(|s| s.name == stream).unwrap();
        st.source.as_ref().unwrap().remote.clone().unwrap()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("broker.log")).unwrap_or_default()
    }
}

fn s3_env(mut cmd: Command) -> Command {
    cmd.env("AWS_ACCESS_KEY_ID", "testing")
        .env("AWS_SECRET_ACCESS_KEY", SECRET)
        .env("AWS_REGION", "us-east-1")
        .env_remove("AWS_ENDPOINT_URL")
        .env_remove("AWS_PROFILE");
    cmd
}

fn epoch_digests(r: &ConsumerReport) -> Vec<Option<String>> {
    assert!(r.ok && r.ended, "{r:#?}");
    r.epochs.iter().map(|e| e.digest.clone()).collect()
}

fn no_secret(what: &str, text: &str) {
    assert!(
        !text.contains(SECRET),
        "{what} shows the secret key:\n{text}"
    );
}

#[test]
fn every_remote_form_gives_the_local_bytes_and_the_disk_tier_serves_a_restart() {
    let data = Data::new();
    let http = Server::objserver(&["files", &data.p("")]);
    let dav = Server::webdav(&data.p("ds"));
    let s3 = data.s3().url();
    let cache = data.p("cache");
    let cfg = [
        folder_stream("local", &data.p("ds"), ""),
        folder_stream(
            "s3",
            "s3://data/train/",
            &format!(
                "{UNCACHED}\n{}",
                remote(
                    &s3,
                    &format!("cache_dir = \"{cache}\"\ncache_dir_mib = 256\nread_ahead = 16"),
                )
            ),
        ),
        stream(
            "http",
            &format!(
                "[stream.image_folder]\nroot = \"{}/ds/\"\nmanifest = \"MANIFEST\"",
                http.url()
            ),
            UNCACHED,
        ),
        // No manifest: a WebDAV server lists the folder.
        stream(
            "webdav",
            &format!("[stream.image_folder]\nroot = \"{}/\"", dav.url()),
            "",
        ),
        shard_stream("local_shards", &data.shard_pattern(&data.p("shards")), ""),
        shard_stream(
            "s3_shards",
            &data.shard_pattern("s3://data/shards"),
            &format!(
                "{UNCACHED}\n{}",
                remote(&s3, "part_mib = 1\nread_ahead_mib = 8")
            ),
        ),
        shard_stream(
            "http_shards",
            &data.shard_pattern(&format!("{}/shards", http.url())),
            "[stream.remote]\npart_mib = 1",
        ),
        shard_stream(
            "s3_shards_kept",
            &data.shard_pattern("s3://data/shards"),
            &format!(
                "{UNCACHED}\n{}",
                remote(
                    &s3,
                    &format!(
                        "cache_dir = \"{}\"\ncache_dir_mib = 256\npart_mib = 1",
                        data.p("cache_shards")
                    ),
                )
            ),
        ),
    ]
    .join("\n");
    let dir = data.dir.path().join("b1");
    let mut b = Broker::start(&dir, &cfg);
    let digests = |b: &Broker, s: &str| epoch_digests(&b.consume(&["--stream", s, "--digest"]));
    let local = digests(&b, "local");
    assert_eq!(local.len(), 2);
    assert_ne!(local[0], local[1], "epochs are shuffled differently");
    assert_eq!(digests(&b, "s3"), local, "S3 folder = local folder");
    assert_eq!(
        digests(&b, "http"),
        local,
        "HTTP folder by manifest = local folder"
    );
    assert_eq!(
        digests(&b, "webdav"),
        local,
        "WebDAV folder, listed = local folder"
    );
    let local_shards = digests(&b, "local_shards");
    assert_eq!(
        digests(&b, "s3_shards"),
        local_shards,
        "S3 shards = local shards"
    );
    assert_eq!(
        digests(&b, "http_shards"),
        local_shards,
        "HTTP shards = local shards"
    );
    assert_eq!(
        digests(&b, "s3_shards_kept"),
        local_shards,
        "S3 shards with a disk tier = local shards"
    );

    let r = b.remote("s3");
    assert_eq!((r.failed, r.direct), (0, 0), "{r:#?}");
    assert_eq!(
        r.ahead_hits,
        2 * data.n,
        "every read from the window: {r:#?}"
    );
    // Each object went to S3 once in two epochs (and the listing): the
    // second epoch read the disk tier, or the window where the first
    // epoch's last samples come again among the second's first.
    assert_eq!(r.requests, data.n + 1, "{r:#?}");
    assert!(
        r.disk_hits > 0 && r.disk_hits <= data.n,
        "the second epoch read from the disk tier: {r:#?}"
    );
    // A dataset the window holds whole: the second epoch's reads come
    // from the first's fetches (the manifest, then each image once).
    let r = b.remote("http");
    assert_eq!(
        (r.requests, r.ahead_hits),
        (data.n + 1, 2 * data.n),
        "{r:#?}"
    );
    let r = b.remote("s3_shards");
    assert!(
        r.ahead_bytes <= 8 << 20,
        "the window holds at most read_ahead_mib: {r:#?}"
    );
    // Tar members read close together go out as one range request:
    // fewer requests than samples, the HEADs and the index's parts
    // included.
    assert_eq!(r.ahead_hits + r.direct, 2 * data.n, "{r:#?}");
    assert!(
        r.requests < r.ahead_hits,
        "members coalesced into fewer requests: {r:#?}"
    );
    no_secret("stats", &format!("{:?}", b.stats()));

    // A restarted broker takes the listing and every image from disk:
    // nothing goes to S3.
    b.process.terminate(LIMIT).unwrap();
    let mut b = Broker::start(&data.dir.path().join("b2"), &cfg);
    assert_eq!(digests(&b, "s3"), local);
    let r = b.remote("s3");
    assert_eq!(r.requests, 0, "nothing went to S3: {r:#?}");
    // Every read from the disk tier, but a sample read at the end of
    // one epoch and again early in the next: the window keeps it.
    assert_eq!(r.ahead_hits, 2 * data.n, "{r:#?}");
    assert!(r.disk_hits >= data.n && r.disk_hits <= 2 * data.n, "{r:#?}");
    // Shards too: their parts were kept when the shards were indexed, and
    // each member is cut from its part on disk.
    assert_eq!(digests(&b, "s3_shards_kept"), local_shards);
    let r = b.remote("s3_shards_kept");
    assert_eq!((r.requests, r.failed), (0, 0), "nothing went to S3: {r:#?}");
    assert!(
        r.disk_hits > 0 && r.disk_hits < 2 * data.n,
        "members read from their parts, each part once per run: {r:#?}"
    );
    assert!(b.log().contains("from the disk tier"), "{}", b.log());
    no_secret("the log", &b.log());
    // With listing_max_age_s = 0 it lists again (one request).
    b.process.terminate(LIMIT).unwrap();
    let relist = cfg.replace(
        "cache_dir_mib = 256",
        "cache_dir_mib = 256\nlisting_max_age_s = 0",
    );
    let b = Broker::start(&data.dir.path().join("b3"), &relist);
    assert_eq!(digests(&b, "s3"), local);
    let r = b.remote("s3");
    assert_eq!(r.requests, 1, "only the listing went to S3: {r:#?}");
}

/// azurite's documented development account key: not a secret, but the
/// broker treats it as one, so it must not show either.
const AZURITE_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

/// az:// against Azure's emulator (azurite) and gs:// against GCS's XML
/// API as an S3-compatible server speaks it (moto, with a bearer token
/// from the environment: GCS's XML API is S3's; no GCS emulator installs
/// from the registries here).
#[test]
fn azure_and_gcs_urls_give_the_local_bytes() {
    let data = Data::new();
    let az = Server::azurite(&data.dir.path().join("azurite"));
    let account = format!("{}/devstoreaccount1", az.url());
    data.load("az-load", &account, &["train/", "shards/"]);
    let cfg = [
        folder_stream("local", &data.p("ds"), ""),
        shard_stream("local_shards", &data.shard_pattern(&data.p("shards")), ""),
        folder_stream("az", "az://data/train/", &remote(&account, "")),
        shard_stream(
            "az_shards",
            &data.shard_pattern("az://data/shards"),
            &remote(&account, "part_mib = 1"),
        ),
        folder_stream("gs", "gs://data/train/", &remote(&data.s3().url(), "")),
        shard_stream(
            "gs_shards",
            &data.shard_pattern("gs://data/shards"),
            &remote(&data.s3().url(), "part_mib = 1"),
        ),
    ]
    .join("\n");
    let b = Broker::start_with(&data.dir.path().join("b"), &cfg, |mut cmd| {
        cmd.env("AZURE_STORAGE_ACCOUNT_NAME", "devstoreaccount1")
            .env("AZURE_STORAGE_ACCOUNT_KEY", AZURITE_KEY)
            .env("GOOGLE_BEARER_TOKEN", SECRET)
            .env_remove("AZURE_STORAGE_USE_EMULATOR")
            .env_remove("GOOGLE_SERVICE_ACCOUNT")
            .env_remove("GOOGLE_APPLICATION_CREDENTIALS");
        cmd
    });
    let digests = |s: &str| epoch_digests(&b.consume(&["--stream", s, "--digest"]));
    let local = digests("local");
    let local_shards = digests("local_shards");
    assert_eq!(digests("az"), local, "Azure folder = local folder");
    assert_eq!(
        digests("az_shards"),
        local_shards,
        "Azure shards = local shards"
    );
    assert_eq!(digests("gs"), local, "GCS folder = local folder");
    assert_eq!(
        digests("gs_shards"),
        local_shards,
        "GCS shards = local shards"
    );
    for s in ["az", "az_shards", "gs", "gs_shards"] {
        let r = b.remote(s);
        assert!(r.requests > 0 && r.failed == 0, "{s}: {r:#?}");
        assert!(r.url.starts_with(&s[..2]), "{s}: {}", r.url);
    }
    let shown = format!("{:?}\n{}", b.stats(), b.log());
    assert!(
        !shown.contains(AZURITE_KEY),
        "the account key shows:\n{shown}"
    );
    no_secret("stats and the log", &shown);

    // azurite checks signatures: another key is refused, by name, and
    // the key is not shown.
    let wrong = AZURITE_KEY.replace("Eby8", "Xby8");
    let stream = folder_stream("az", "az://data/train/", &remote(&account, "retries = 0"));
    let e = refusal(&b.dir, "az://data/train/", &stream, |mut cmd| {
        cmd.env("AZURE_STORAGE_ACCOUNT_NAME", "devstoreaccount1")
            .env("AZURE_STORAGE_ACCOUNT_KEY", &wrong);
        cmd
    });
    assert!(!e.contains(&wrong), "the key shows: {e}");
}

/// An S3 server that checks SigV4 signatures (moto's, with its access
/// control on; the plain one accepts any): the broker's signed listing,
/// GETs and range GETs are accepted and give the local bytes; a wrong
/// secret is refused, by name, and no secret shows.
#[test]
fn a_server_that_checks_signatures_accepts_the_brokers_and_refuses_a_wrong_secret() {
    let data = Data::new();
    let s3 = Server::s3_signed();
    data.load("s3-load", &s3.url(), &["train/", "shards/"]);
    let cfg = [
        folder_stream("local", &data.p("ds"), ""),
        shard_stream("local_shards", &data.shard_pattern(&data.p("shards")), ""),
        folder_stream("s3", "s3://data/train/", &remote(&s3.url(), "")),
        shard_stream(
            "s3_shards",
            &data.shard_pattern("s3://data/shards"),
            &remote(&s3.url(), "part_mib = 1"),
        ),
    ]
    .join("\n");
    let b = Broker::start(&data.dir.path().join("b"), &cfg);
    let digests = |s: &str| epoch_digests(&b.consume(&["--stream", s, "--digest"]));
    let local = digests("local");
    assert_eq!(digests("s3"), local, "S3 folder = local folder");
    assert_eq!(
        digests("s3_shards"),
        digests("local_shards"),
        "S3 shards = local shards"
    );
    for s in ["s3", "s3_shards"] {
        let r = b.remote(s);
        assert!(r.requests > 0 && r.failed == 0, "{s}: {r:#?}");
    }
    no_secret(
        "stats and the log",
        &format!("{:?}\n{}", b.stats(), b.log()),
    );

    // The endpoint from the environment (docs/remote-datasets.md), plain
    // HTTP as a cluster's MinIO or Ceph usually is: before, the broker
    // refused it ("HTTP error: builder error"), AWS_ALLOW_HTTP or not.
    let from_env = Broker::start_with(
        &data.dir.path().join("env"),
        &folder_stream("s3", "s3://data/train/", ""),
        |cmd| {
            let mut cmd = s3_env(cmd);
            cmd.env("AWS_ENDPOINT_URL", s3.url());
            cmd
        },
    );
    assert_eq!(
        epoch_digests(&from_env.consume(&["--stream", "s3", "--digest"])),
        local,
        "S3 at AWS_ENDPOINT_URL = local folder"
    );
    drop(from_env);

    let wrong = format!("{SECRET}-not");
    let stream = folder_stream("s3", "s3://data/train/", &remote(&s3.url(), "retries = 0"));
    let e = refusal(&b.dir, "s3://data/train/", &stream, |cmd| {
        let mut cmd = s3_env(cmd);
        cmd.env("AWS_SECRET_ACCESS_KEY", &wrong);
        cmd
    });
    no_secret("the refusal", &e);
}

/// Serves the one-stream config `stream` (in `dir`) with the environment
/// `env` gives the broker, which must refuse to start, naming `url` and
/// saying "access denied"; what it said.
fn refusal(dir: &Path, url: &str, stream: &str, env: impl FnOnce(Command) -> Command) -> String {
    let config = dir.join("refused.toml");
    std::fs::write(&config, stream).unwrap();
    let out = common::run(
        env(command(EXE))
            .args(["serve", "--config"])
            .arg(&config)
            .arg("--socket")
            .arg(dir.join("refused.sock")),
    );
    let e = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "a wrong credential was accepted: {e}"
    );
    assert!(e.contains(url) && e.contains("access denied"), "{e}");
    e
}

#[test]
fn faults_are_retried_slow_the_requests_or_become_bad_samples_by_url() {
    let data = Data::new();
    let proxy = Server::objserver(&["proxy", &data.s3().url()]);
    let via = proxy.url();
    let keys = "timeout_s = 2\nretries = 8\nstall_s = 30\nrequests = 16";
    let cfg = [
        folder_stream("local", &data.p("ds"), "epochs = 1"),
        folder_stream(
            "faulty",
            "s3://data/train/",
            &format!("epochs = 1\n{}", remote(&via, keys)),
        ),
        folder_stream(
            "denied",
            "s3://data/deny/",
            &format!("epochs = 1\n{}", remote(&via, keys)),
        ),
        folder_stream(
            "strict",
            "s3://data/deny/",
            &format!("epochs = 1\non_error = \"fail\"\n{}", remote(&via, keys)),
        ),
        folder_stream(
            "replaced",
            "s3://data/repl/",
            &format!("epochs = 1\n{}", remote(&data.s3().url(), "")),
        ),
    ]
    .join("\n");
    data.load("s3-load", &data.s3().url(), &["repl/"]);
    let b = Broker::start(&data.dir.path().join("b"), &cfg);
    let local = epoch_digests(&b.consume(&["--stream", "local", "--digest"]));

    // A burst of 503 SlowDown, resets and truncated answers: retried,
    // throttled, and the bytes are the local ones.
    proxy.faults(r#"{"status": {"count": 40, "code": 503}, "reset": 3, "truncate": 3}"#);
    let got = epoch_digests(&b.consume(&["--stream", "faulty", "--digest"]));
    assert_eq!(got[0], local[0]);
    let seen = proxy.faults("{}");
    assert_eq!(seen["status"], 40, "{seen}");
    let r = b.remote("faulty");
    assert!(
        r.throttled >= 40 && r.retries >= 46 && r.failed == 0,
        "{r:#?}"
    );
    assert!(
        r.concurrency < 16,
        "503s halved the requests in flight: {r:#?}"
    );

    // A 403 on one object: a bad sample, skipped and named by its URL.
    proxy.faults(r#"{"deny": "deny/cat/base_0.jpg"}"#);
    let r = b.consume(&["--stream", "denied"]);
    assert!(r.ok, "{r:#?}");
    let s = b.stats();
    let denied = s.streams.iter().find(|s| s.name == "denied").unwrap();
    assert_eq!(denied.source.as_ref().unwrap().skipped, 1, "{denied:#?}");
    let log = b.log();
    assert!(
        log.contains("s3://data/deny/cat/base_0.jpg") && log.contains("access denied"),
        "{log}"
    );
    // With on_error = "fail" the stream stops, saying which object.
    let r = b.consume(&["--stream", "strict"]);
    assert!(!r.ok, "{r:#?}");
    let why = format!("{r:?}");
    assert!(why.contains("s3://data/deny/cat/base_0.jpg"), "{why}");
    no_secret("the consumer's error", &why);

    // An object replaced after the listing: never its new bytes; a bad
    // sample named by URL (its ETag is not the one listed).
    let changed = data.dir.path().join("changed/cat");
    std::fs::create_dir_all(&changed).unwrap();
    let mut jpeg = std::fs::read(data.dir.path().join("ds/cat/base_0.jpg")).unwrap();
    jpeg.extend_from_slice(b"replaced");
    std::fs::write(changed.join("base_0.jpg"), jpeg).unwrap();
    load_dir("s3-load", &data.s3().url(), &data.p("changed"), "repl/");
    let r = b.consume(&["--stream", "replaced"]);
    assert!(r.ok, "{r:#?}");
    let s = b.stats();
    let replaced = s.streams.iter().find(|s| s.name == "replaced").unwrap();
    assert_eq!(
        replaced.source.as_ref().unwrap().skipped,
        1,
        "{replaced:#?}"
    );
    let log = b.log();
    assert!(
        log.contains("s3://data/repl/cat/base_0.jpg")
            && log.contains("changed since it was listed"),
        "{log}"
    );
    no_secret("the log", &log);
    no_secret("stats", &format!("{:?}", b.stats()));
}

#[test]
fn a_stall_is_bounded_and_shutdown_does_not_wait_for_requests() {
    let data = Data::new();
    let proxy = Server::objserver(&["proxy", &data.s3().url()]);
    let cfg = [
        folder_stream(
            "stalled",
            "s3://data/train/",
            &format!(
                "on_error = \"fail\"\n{}",
                remote(&proxy.url(), "timeout_s = 0.5\nretries = 2\nstall_s = 1.5")
            ),
        ),
        folder_stream(
            "slow",
            "s3://data/deny/",
            &remote(&proxy.url(), "timeout_s = 20\nstall_s = 60"),
        ),
    ]
    .join("\n");
    let mut b = Broker::start(&data.dir.path().join("b"), &cfg);
    // Every answer now takes 3 s: past the 0.5 s timeout, the stall bound
    // (1.5 s) ends the read and the stream, said in stats.
    proxy.faults(r#"{"delay_ms": 3000}"#);
    let t0 = Instant::now();
    let r = b.consume(&["--stream", "stalled"]);
    assert!(!r.ok, "{r:#?}");
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
    let s = b.stats();
    let st = s.streams.iter().find(|s| s.name == "stalled").unwrap();
    let failed = st.failed.clone().unwrap_or_default();
    assert!(
        failed.contains("gave up") && failed.contains("timeout_s"),
        "{failed}"
    );
    assert!(
        st.source
            .as_ref()
            .unwrap()
            .remote
            .as_ref()
            .unwrap()
            .last_error
            .is_some()
    );

    // A consumer waits on 3 s answers; the broker stops at once anyway.
    let mut c = common::spawn_consumer(
        &b.dir.join("b.sock"),
        &["--stream", "slow", "--reconnect-timeout", "0"],
    );
    std::thread::sleep(Duration::from_millis(800));
    let t0 = Instant::now();
    b.process.terminate(Duration::from_secs(20)).unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "shutdown took {:?}",
        t0.elapsed()
    );
    let _ = c.kill();
    let _ = c.wait();
}

#[test]
fn credentials_in_urls_and_unusable_remote_keys_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let serve_fails = |cfg: &str| {
        let path = dir.path().join("bad.toml");
        std::fs::write(&path, cfg).unwrap();
        let out = common::run(
            s3_env(command(EXE))
                .args(["serve", "--config"])
                .arg(&path)
                .arg("--socket")
                .arg(dir.path().join("bad.sock")),
        );
        assert!(!out.status.success(), "serve should refuse {cfg}");
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        no_secret("the refusal", &err);
        err
    };
    let e = serve_fails(&folder_stream(
        "x",
        &format!("s3://AKIA:{SECRET}@bucket/train/"),
        "",
    ));
    assert!(
        e.contains("AWS_SECRET_ACCESS_KEY") && e.contains("s3://bucket/train/"),
        "{e}"
    );
    let e = serve_fails(&shard_stream(
        "x",
        &format!("https://h/s-{{0..1}}.tar?X-Amz-Signature={SECRET}"),
        "",
    ));
    assert!(e.contains("query string"), "{e}");
    let e = serve_fails(&folder_stream("x", "/tmp", "[stream.remote]\nrequests = 4"));
    assert!(e.contains("local dataset"), "{e}");
    let e = serve_fails(&folder_stream(
        "x",
        "s3://b/p/",
        "[stream.remote]\nrequests = 0",
    ));
    assert!(e.contains("remote.requests"), "{e}");
    for (key, bad) in [("timeout_s", "nan"), ("listing_max_age_s", "-1.0")] {
        let e = serve_fails(&folder_stream(
            "x",
            "s3://b/p/",
            &format!("[stream.remote]\n{key} = {bad}"),
        ));
        assert!(e.contains(&format!("remote.{key}")), "{e}");
    }
    let e = serve_fails(&shard_stream(
        "x",
        "https://h/s-{0..1}.tar",
        "[stream.remote]\nendpoint = \"http://127.0.0.1:9000\"",
    ));
    assert!(e.contains("remote.endpoint"), "{e}");
    // A plain HTTP server cannot list: the message says to give a manifest.
    let http = Server::objserver(&["files", dir.path().to_str().unwrap()]);
    let e = serve_fails(&folder_stream("x", &format!("{}/", http.url()), ""));
    assert!(e.contains("manifest"), "{e}");
}

/// A hostile store (objserver's lies): nothing it declares is trusted for
/// an allocation. An image whose answer declares 2^40 bytes (then sends
/// 32 KiB), and one that really sends 64 MiB against max_file_bytes =
/// 1 MiB, are bad samples named by URL, refused before their bodies are
/// read; the broker and every other stream serve on. A tar shard whose
/// HEAD declares 64 GiB is refused at start by name (not an abort).
#[test]
fn a_store_declaring_huge_sizes_cannot_abort_the_broker_or_make_it_download_them() {
    let data = Data::new();
    let http = Server::objserver(&["files", &data.p("")]);
    let keys = "timeout_s = 2\nretries = 1\nstall_s = 5";
    let cfg = [
        folder_stream("local", &data.p("ds"), "epochs = 1"),
        stream(
            "lied",
            &format!(
                "[stream.image_folder]\nroot = \"{}/ds/\"\nmanifest = \"MANIFEST\"",
                http.url()
            ),
            &format!("epochs = 1\nmax_file_bytes = 1048576\n[stream.remote]\n{keys}\nrequests = 4"),
        ),
    ]
    .join("\n");
    let mut b = Broker::start(&data.dir.path().join("b"), &cfg);
    http.faults(
        r#"{"lies": [
            {"path": "ds/cat/base_0.jpg", "methods": ["GET"], "length": 1099511627776, "send": 32768},
            {"path": "ds/dog/base_0.jpg", "methods": ["GET"], "send": 67108864}
        ]}"#,
    );
    let r = b.consume(&["--stream", "lied"]);
    assert!(r.ok && r.ended, "{r:#?}");
    let seen = http.faults("{}");
    assert!(seen["lies"].as_u64().unwrap() >= 2, "{seen}");
    // Refused from the header: what the server got out before the broker
    // closed is what socket buffers hold, not 64 MiB.
    let sent = seen["lie_bytes"].as_u64().unwrap();
    assert!(sent < 16 << 20, "the broker read {sent} bytes of lies");
    let s = b.stats();
    let lied = s.streams.iter().find(|s| s.name == "lied").unwrap();
    assert_eq!(lied.source.as_ref().unwrap().skipped, 2, "{lied:#?}");
    let log = b.log();
    for name in ["ds/cat/base_0.jpg", "ds/dog/base_0.jpg"] {
        assert!(
            log.contains(&format!("{}/{name}", http.url())) && log.contains("max_file_bytes"),
            "{name} not named as too large:\n{log}"
        );
    }
    // The broker lives on, and the other stream serves.
    assert!(b.process.try_wait().unwrap().is_none(), "{log}");
    let local = epoch_digests(&b.consume(&["--stream", "local", "--digest"]));
    assert!(local.len() == 1 && local[0].is_some(), "{local:?}");

    // Shards: a HEAD declaring 64 GiB; the shard's parts come from the
    // real file (short of what was declared).
    http.faults(
        r#"{"lies": [{"path": "shard-000000.tar", "methods": ["HEAD"], "length": 68719476736}]}"#,
    );
    let dir = data.dir.path().join("shards-start");
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("b.toml");
    let url = format!("{}/shards/shard-000000.tar", http.url());
    std::fs::write(
        &config,
        shard_stream(
            "lying_shards",
            &data.shard_pattern(&format!("{}/shards", http.url())),
            &format!("[stream.remote]\n{keys}"),
        ),
    )
    .unwrap();
    let out = common::run_within(
        command(EXE)
            .args(["serve", "--config"])
            .arg(&config)
            .arg("--socket")
            .arg(dir.join("b.sock")),
        LIMIT,
    );
    let e = String::from_utf8_lossy(&out.stderr).into_owned();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        out.status.signal(),
        None,
        "the broker died of a signal: {e}"
    );
    assert!(!out.status.success(), "{e}");
    assert!(e.contains(&url) && e.contains("for a range of"), "{e}");
}

/// A store's answer is bounded and stripped before it reaches anyone: a
/// 403 whose 2 MB body echoes the request's headers (the session token,
/// the access key id) under `on_error = "fail"` tells the trainer the
/// stream failed and why; the failed stream stays in stats and `/readyz`
/// names it; no credential reaches the log, stats or the trainer.
#[test]
fn a_store_echoing_credentials_in_a_huge_error_reaches_no_one_and_the_failure_is_said() {
    const TOKEN: &str = "session-token-4f1d9c-never-shown";
    const KEY_ID: &str = "AKIDLEAKCHECK0001";
    let data = Data::new();
    let proxy = Server::objserver(&["proxy", &data.s3().url()]);
    let cfg = folder_stream(
        "strict",
        "s3://data/train/",
        &format!(
            "epochs = 1\non_error = \"fail\"\n{}",
            remote(&proxy.url(), "timeout_s = 2\nretries = 1\nstall_s = 5")
        ),
    );
    let dir = data.dir.path().join("b");
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("broker.toml");
    std::fs::write(&config, &cfg).unwrap();
    let log = dir.join("broker.log");
    let mut broker = s3_env(command(EXE));
    broker
        .env("AWS_SESSION_TOKEN", TOKEN)
        .env("AWS_ACCESS_KEY_ID", KEY_ID)
        .env("NO_COLOR", "1")
        .args(["serve", "--metrics", "127.0.0.1:0", "--config"])
        .arg(&config)
        .arg("--socket")
        .arg(dir.join("b.sock"))
        .stderr(std::fs::File::create(&log).unwrap());
    batchcast_cli::child::die_with_parent(&mut broker);
    let mut broker = common::Guard(broker.spawn().unwrap());
    let addr = common::metrics_address(&log, &mut broker.0);
    proxy.faults(
        r#"{"lies": [{"path": "train/cat/base_0.jpg", "methods": ["GET"], "status": 403, "echo": true, "pad": 2000000}]}"#,
    );
    let r = harness::wait_report(
        common::spawn_consumer(&dir.join("b.sock"), &["--stream", "strict"]),
        LIMIT,
    )
    .unwrap();
    assert!(!r.ok, "{r:#?}");
    let told = format!("{r:?}");
    assert!(
        told.contains("s3://data/train/cat/base_0.jpg") && told.contains("access denied"),
        "the trainer was not told why: {told}"
    );
    assert!(!told.contains("shutting down"), "{told}");
    let stats = batchcast::StatsClient::connect(Some(dir.join("b.sock")))
        .unwrap()
        .fetch()
        .unwrap();
    let st = stats.streams.iter().find(|s| s.name == "strict");
    let failed = st.and_then(|s| s.failed.clone()).unwrap_or_default();
    assert!(failed.contains("cat/base_0.jpg"), "{stats:#?}");
    assert!(
        failed.len() < 2_000,
        "{} bytes of failure text",
        failed.len()
    );
    let ready = http_get(&addr, "/readyz");
    assert!(
        ready.starts_with("HTTP/1.1 503") && ready.contains("stream `strict` failed"),
        "{ready}"
    );
    let json = serde_json::to_string(&stats).unwrap();
    let logged = std::fs::read_to_string(&log).unwrap();
    for (what, text) in [
        ("the trainer's error", &told),
        ("stats", &json),
        ("/readyz", &ready),
        ("the log", &logged),
    ] {
        for secret in [TOKEN, KEY_ID, SECRET] {
            assert!(!text.contains(secret), "{what} shows {secret}:\n{text}");
        }
    }
}

/// A manifest lists no ETags: the version of each object's first read is
/// pinned, so an object replaced on the server later is a bad sample named
/// by URL (for this broker's life), never other bytes in a later epoch.
/// The caches are off here: one that kept the object (the defaults keep
/// remote files and decoded images) serves it as first read, without
/// asking the server again.
#[test]
fn an_object_replaced_behind_a_manifest_is_refused_not_served_changed() {
    let data = Data::new();
    let http = Server::objserver(&["files", &data.p("")]);
    let cfg = stream(
        "by_manifest",
        &format!(
            "[stream.image_folder]\nroot = \"{}/ds/\"\nmanifest = \"MANIFEST\"",
            http.url()
        ),
        &format!("epochs = 3\n{UNCACHED}\n[stream.remote]\nread_ahead = 0"),
    );
    let b = Broker::start(&data.dir.path().join("b"), &cfg);
    let first = b.consume(&["--stream", "by_manifest", "--max-epochs", "1"]);
    assert!(first.ok, "{first:#?}");
    // Replaced on the server: other bytes, another size and time.
    let victim = data.dir.path().join("ds/cat/base_0.jpg");
    let mut jpeg = std::fs::read(&victim).unwrap();
    jpeg.extend_from_slice(b"replaced");
    std::thread::sleep(Duration::from_millis(20));
    std::fs::write(&victim, jpeg).unwrap();
    let later = b.consume(&["--stream", "by_manifest"]);
    assert!(later.ok && later.ended, "{later:#?}");
    let s = b.stats();
    let st = s.streams.iter().find(|s| s.name == "by_manifest").unwrap();
    // Once in each epoch it read (it joins at an epoch's start).
    assert_eq!(
        st.source.as_ref().unwrap().skipped,
        later.epochs.len() as u64,
        "{st:#?}\n{later:#?}"
    );
    let log = b.log();
    assert!(
        log.contains(&format!("{}/ds/cat/base_0.jpg", http.url()))
            && log.contains("when first read"),
        "{log}"
    );
}

/// A server's redirect is followed only within the dataset's own host: a
/// 302 to another host (here `localhost`, serving an image of its own) is
/// a bad sample named by URL, never fetched and decoded as the sample.
#[test]
fn a_redirect_to_another_host_is_refused_not_followed() {
    let data = Data::new();
    let http = Server::objserver(&["files", &data.p("")]);
    let elsewhere = Server::objserver(&["files", &data.p("ds")]);
    let cfg = stream(
        "redirected",
        &format!(
            "[stream.image_folder]\nroot = \"{}/ds/\"\nmanifest = \"MANIFEST\"",
            http.url()
        ),
        "epochs = 1\n[stream.remote]\ntimeout_s = 2\nretries = 2\nstall_s = 5",
    );
    let b = Broker::start(&data.dir.path().join("b"), &cfg);
    // Another host's image, a real one: followed, it would decode.
    let target = format!("http://localhost:{}/dog/base_0.jpg", elsewhere.port);
    http.faults(&format!(
        r#"{{"lies": [{{"path": "ds/cat/base_0.jpg", "redirect": "{target}"}}]}}"#
    ));
    let r = b.consume(&["--stream", "redirected"]);
    assert!(r.ok && r.ended, "{r:#?}");
    assert_eq!(
        elsewhere.faults("{}")["requests"],
        0,
        "the other host was asked"
    );
    let s = b.stats();
    let st = s.streams.iter().find(|s| s.name == "redirected").unwrap();
    assert_eq!(st.source.as_ref().unwrap().skipped, 1, "{st:#?}");
    let log = b.log();
    assert!(
        log.contains(&format!("{}/ds/cat/base_0.jpg", http.url()))
            && log.contains("redirected to another host"),
        "{log}"
    );
}

/// Object stores get the same client as plain HTTP: an S3 answer
/// redirecting elsewhere (here `localhost`, serving a real image) is a bad
/// sample named by URL and the other host is never asked; an error whose
/// body is 64 MiB is read no further than its first 64 KiB (object_store
/// read it whole into its error's text), a bad sample too.
#[test]
fn an_object_stores_redirect_elsewhere_is_not_followed_nor_a_huge_error_read() {
    let data = Data::new();
    let proxy = Server::objserver(&["proxy", &data.s3().url()]);
    let elsewhere = Server::objserver(&["files", &data.p("ds")]);
    let cfg = folder_stream(
        "s3",
        "s3://data/train/",
        &format!(
            "epochs = 1\n{}",
            remote(&proxy.url(), "timeout_s = 2\nretries = 1\nstall_s = 5")
        ),
    );
    let b = Broker::start(&data.dir.path().join("b"), &cfg);
    let target = format!("http://localhost:{}/dog/base_0.jpg", elsewhere.port);
    proxy.faults(&format!(
        r#"{{"lies": [
            {{"path": "train/cat/base_0.jpg", "methods": ["GET"], "redirect": "{target}"}},
            {{"path": "train/dog/base_0.jpg", "methods": ["GET"], "status": 404, "pad": 67108864}}
        ]}}"#
    ));
    let r = b.consume(&["--stream", "s3"]);
    assert!(r.ok && r.ended, "{r:#?}");
    assert_eq!(
        elsewhere.faults("{}")["requests"],
        0,
        "the other host was asked"
    );
    let seen = proxy.faults("{}");
    let sent = seen["lie_bytes"].as_u64().unwrap();
    assert!(
        seen["lies"].as_u64().unwrap() >= 2 && sent < 16 << 20,
        "the broker read {sent} bytes of errors: {seen}"
    );
    let s = b.stats();
    let st = s.streams.iter().find(|s| s.name == "s3").unwrap();
    assert_eq!(st.source.as_ref().unwrap().skipped, 2, "{st:#?}");
    let log = b.log();
    assert!(
        log.contains("s3://data/train/cat/base_0.jpg")
            && log.contains("redirected to another host"),
        "{log}"
    );
}

/// A plain HTTP server of the test's folder (`objserver.py files`, with
/// `args`) read through a manifest by a stream `http` beside the local
/// folder's `local`, `epochs` epochs each: asserts the local bytes and no
/// failure, and gives the broker, the server, the stream's counts and the
/// data (its folder kept while the test holds it).
fn read_from_small_server(args: &[&str], epochs: u64) -> (Broker, Server, RemoteSourceStats, Data) {
    let data = Data::new();
    let root = data.p("");
    let http = Server::objserver(&[&["files", root.as_str()], args].concat());
    let epochs = format!("epochs = {epochs}");
    let cfg = [
        folder_stream("local", &data.p("ds"), &epochs),
        stream(
            "http",
            &format!(
                "[stream.image_folder]\nroot = \"{}/ds/\"\nmanifest = \"MANIFEST\"",
                http.url()
            ),
            &epochs,
        ),
    ]
    .join("\n");
    let b = Broker::start(&data.dir.path().join("b"), &cfg);
    let digests = |s: &str| epoch_digests(&b.consume(&["--stream", s, "--digest"]));
    let local = digests("local");
    assert_eq!(digests("http"), local, "HTTP = local folder");
    let r = b.remote("http");
    eprintln!(
        "objserver.py files {args:?}: {} requests, {} retries, {} at once at the end",
        r.requests, r.retries, r.concurrency
    );
    assert_eq!(r.failed, 0, "{r:#?}");
    // Near what the server takes: the gate starts at 8 and, capped below
    // the requests at once that met a fault or a slow answer, probes one
    // more every 5 s without one, so a run slowed by a busy machine ends
    // a few higher (10 seen beside the rest of the suite). Before the
    // gate: 96 to 128.
    assert!(
        r.concurrency <= 16,
        "requests at once: {} (the server takes 4): {r:#?}",
        r.concurrency
    );
    (b, http, r, data)
}

/// A small plain HTTP server that takes 4 connections at once and resets
/// any more (as Python's `http.server` or a small nginx, overwhelmed),
/// read with the defaults (`requests = 128`): the broker starts at a few
/// requests at once and halves them on each reset, so it reads every
/// image (the local bytes) with no failure, and its log says the store's
/// requests were retried. Before, it opened 128 at once and said nothing.
#[test]
fn a_server_taking_few_connections_at_once_is_read_whole_and_the_log_says_so() {
    let (b, http, r, _data) = read_from_small_server(&["--max-connections", "4"], 1);
    let log = b.log();
    assert!(
        log.contains("requests to the store fail and are retried"),
        "{log}"
    );
    // The broker's idle connections hold the server's 4 until it is gone.
    drop(b);
    std::thread::sleep(std::time::Duration::from_millis(500));
    let seen = http.faults("{}");
    let over = seen["over"].as_u64().unwrap_or(0);
    assert!(r.retries > 0 && over > 0, "{r:#?} {seen}");
    // Capped at what the server takes, it retried a few: 7 to 9 of about
    // 95 requests on an idle machine, 13-14 beside three busy loops and 24
    // of 112 once in CI (the HTTP client opens a fresh connection when a
    // finished one is not yet back in its pool, and the server counts
    // that one too); fewer than one in 3 asserted. Before the cap, 197
    // retries for 285 requests (more than two in 3).
    assert!(r.retries * 3 < r.requests, "{r:#?}");
}

/// A server that keeps the connections past its 4 waiting (1.5 s, as a
/// full accept queue keeps a client waiting for the SYN retry) fails
/// nothing, so no fault slows the requests: an answer that took over a
/// second, many times the usual, counts as one. With the defaults every
/// image arrives (the local bytes), the requests at once end near what
/// the server takes, and the log says the store keeps requests waiting.
/// Before, 128 at once stayed (96 seen), every round of them waiting.
#[test]
fn a_server_keeping_connections_waiting_is_read_with_fewer_at_once_and_the_log_says_so() {
    let (b, _http, r, _data) =
        read_from_small_server(&["--max-connections", "4", "--over", "wait"], 2);
    assert_eq!(r.retries, 0, "{r:#?}");
    let log = b.log();
    assert!(log.contains("keeps requests waiting"), "{log}");
}

/// Issue 72's promise on a remote image folder (an S3 store), at the
/// defaults (no `pace`, no `hold_limit_s`): a trainer stopped for 10 s
/// that holds no batch keeps a steady one waiting at most the 2 s hold
/// limit, then is cut to replay; continued, it reads every epoch with the
/// local folder's bytes (what it missed fetched and decoded again for it).
/// Before (a 30 s default) the steady one waited the whole stop.
#[test]
fn at_the_defaults_a_stopped_trainer_of_a_remote_stream_holds_the_others_at_most_2_s() {
    let data = Data::new();
    let keys = remote(&data.s3().url(), "");
    let cfg = [
        folder_stream("local", &data.p("ds"), "epochs = 6"),
        folder_stream(
            "s3",
            "s3://data/train/",
            // In the stream's order: the digests compared are in order
            // (a rotated epoch holds the same samples in another).
            &format!("epochs = 6\nmin_consumers = 2\nrotate_epochs = false\n{keys}"),
        ),
    ]
    .join("\n");
    assert!(
        !cfg.contains("hold_limit") && !cfg.contains("pace"),
        "{cfg}"
    );
    let dir = data.dir.path().join("b");
    let b = Broker::start(&dir, &cfg);
    let socket = dir.join("b.sock");
    let whole = common::digests(&b.consume(&["--stream", "local", "--digest"]));
    assert_eq!(whole.len(), 6, "{whole:?}");
    let mut steady = common::spawn_consumer(
        &socket,
        &[
            "--stream",
            "s3",
            "--digest",
            "--sleep-ms",
            "5",
            "--name",
            "steady",
        ],
    );
    let stopped = common::spawn_consumer(
        &socket,
        &[
            "--stream",
            "s3",
            "--digest",
            "--stop-after",
            "2",
            "--name",
            "stopped",
        ],
    );
    common::wait_stopped(stopped.id());
    let t0 = Instant::now();
    let stop = Duration::from_secs(10);
    while t0.elapsed() < stop && steady.try_wait().unwrap().is_none() {
        std::thread::sleep(Duration::from_millis(20));
    }
    let finished = t0.elapsed();
    std::thread::sleep(stop.saturating_sub(t0.elapsed()));
    harness::signal(stopped.id(), nix::sys::signal::Signal::SIGCONT);
    let steady = harness::wait_report(steady, LIMIT).unwrap();
    let stopped = harness::wait_report(stopped, LIMIT).unwrap();
    // The bound 2 s, and the steady one's remaining work (1.2-2 s
    // measured); slack for a loaded machine. Held all along: the stop's
    // 10 s.
    eprintln!(
        "steady finished {finished:?} after the stop (of {} images an epoch)",
        data.n
    );
    assert!(
        finished < Duration::from_secs(7),
        "steady finished {finished:?} after the stop: {}",
        b.log()
    );
    assert_eq!(common::digests(&steady), whole, "{steady:#?}");
    assert_eq!(common::digests(&stopped), whole, "{stopped:#?}");
    assert!(stopped.replayed_batches > 0, "{stopped:#?}");
}

/// An `s3://` source under everything a local one supports: a trainer
/// joining now (the epoch's start replayed from the store), one resuming
/// from a position, both beside a steady one on a decoupled stream, and a
/// broker SIGKILLed under them: each rides through and reads what it
/// would from the local folder, byte for byte (the same digests).
#[test]
fn a_remote_source_is_replayed_resumed_and_rides_through_a_restart_with_the_local_bytes() {
    let data = Data::new();
    let keys = remote(&data.s3().url(), "");
    let cfg = [
        folder_stream("local", &data.p("ds"), ""),
        folder_stream(
            "s3",
            "s3://data/train/",
            // In the stream's order: the digests compared are in order
            // (a rotated epoch holds the same samples in another).
            &format!("pace = \"decoupled\"\nrotate_epochs = false\n{keys}"),
        ),
    ]
    .join("\n");
    let dir = data.dir.path().join("b");
    let mut b = Broker::start(&dir, &cfg);
    let socket = dir.join("b.sock");
    let consumer = |stream: &str, args: &[&str]| {
        let mut a = vec!["--stream", stream, "--digest", "--reconnect-timeout", "60"];
        a.extend_from_slice(args);
        common::spawn_consumer(&socket, &a)
    };
    let report = |c| harness::wait_report(c, LIMIT).unwrap();
    let whole = common::digests(&report(consumer("local", &[])));
    let resumed = common::digests(&report(consumer("local", &["--resume", "1:16"])));
    assert_eq!(whole.len(), 2, "{whole:?}");
    let wait_for = |b: &Broker, what: &str, pred: &dyn Fn(&StatsReply) -> bool| {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !pred(&b.stats()) {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let s3 = |s: &StatsReply| s.streams.iter().find(|st| st.name == "s3").cloned();
    let steady = consumer("s3", &["--sleep-ms", "40", "--name", "steady"]);
    wait_for(&b, "the steady reader to be mid-epoch", &|s| {
        s3(s).is_some_and(|st| st.consumers.iter().any(|c| c.batches >= 4))
    });
    let joiner = consumer(
        "s3",
        &["--join", "now", "--sleep-ms", "20", "--name", "joiner"],
    );
    let resumer = consumer(
        "s3",
        &["--resume", "1:16", "--sleep-ms", "20", "--name", "resumer"],
    );
    wait_for(&b, "all three to read", &|s| {
        s3(s).is_some_and(|st| {
            st.consumers.len() == 3 && st.consumers.iter().all(|c| c.batches >= 1)
        })
    });
    b.process.kill().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    b = Broker::start(&dir, &cfg);
    let (steady, joiner, resumer) = (report(steady), report(joiner), report(resumer));
    common::assert_rode_through(&steady, 1, &whole, data.n);
    assert!(joiner.replayed_batches > 0, "{joiner:#?}");
    common::assert_rode_through(&joiner, 1, &whole, data.n);
    assert!(
        resumer.ok && resumer.ended && resumer.reconnects == 1,
        "{resumer:#?}"
    );
    assert_eq!(common::digests(&resumer), resumed, "{resumer:#?}");
    drop(b);
}

/// An object a manifest names and the store no longer has (404) is a bad
/// sample named by URL, end to end: with `on_error = "skip"` the stream
/// reads on (replaced by the next good sample, counted, logged once with
/// its URL) and every batch is whole; with `"fail"` every consumer is told
/// which object. Not tried again (a 404 is final).
#[test]
fn a_missing_object_is_a_bad_sample_named_by_url() {
    let data = Data::new();
    let mut manifest = std::fs::read_to_string(data.p("ds/MANIFEST")).unwrap();
    manifest.push_str("cat/gone.jpg\n");
    std::fs::write(data.p("ds/MANIFEST-gone"), &manifest).unwrap();
    let http = Server::objserver(&["files", &data.p("")]);
    let over_http = |name: &str, extra: &str| {
        stream(
            name,
            &format!(
                "[stream.image_folder]\nroot = \"{}/ds/\"\nmanifest = \"MANIFEST-gone\"",
                http.url()
            ),
            extra,
        )
    };
    let cfg = [
        over_http("skip", "epochs = 1"),
        over_http("fail", "epochs = 1\non_error = \"fail\""),
    ]
    .join("\n");
    let b = Broker::start(&data.dir.path().join("b"), &cfg);
    let url = format!("{}/ds/cat/gone.jpg", http.url());
    let r = b.consume(&["--stream", "skip"]);
    assert!(r.ok && r.ended, "{r:#?}");
    assert_eq!(r.samples, data.n + 1, "every place filled: {r:#?}");
    let s = b.stats();
    let st = s.streams.iter().find(|st| st.name == "skip").unwrap();
    let src = st.source.as_ref().unwrap();
    assert_eq!(src.skipped, 1, "{src:#?}");
    let remote = src.remote.as_ref().unwrap();
    assert_eq!(remote.retries, 0, "a 404 is final: {remote:#?}");
    let log = b.log();
    let lines = log.lines().filter(|l| l.contains(&url)).count();
    assert_eq!(lines, 1, "logged once: {log}");
    let r = b.consume(&["--stream", "fail"]);
    assert!(!r.ok, "{r:#?}");
    let why = r.error.unwrap_or_default();
    assert!(why.contains(&url), "{why}");
}

/// A tar shard cut short in the store (an upload that died halfway) is
/// read up to its last whole sample: what the cut took is left out, said
/// once in the log with the shard's URL, and the stream serves the rest;
/// with `on_error = "fail"` the broker refuses the stream at start,
/// naming the shard. Before, it refused it either way.
#[test]
fn a_truncated_shard_loses_only_what_was_cut_and_says_so() {
    let data = Data::new();
    let last = format!("shards/shard-{:06}.tar", data.shards - 1);
    let path = data.p(&last);
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len / 2 + 100)
        .unwrap();
    let http = Server::objserver(&["files", &data.p("")]);
    let pattern = data.shard_pattern(&format!("{}/shards", http.url()));
    let url = format!("{}/{last}", http.url());
    let b = Broker::start(
        &data.dir.path().join("b"),
        &shard_stream("skip", &pattern, "epochs = 1"),
    );
    let r = b.consume(&["--stream", "skip"]);
    assert!(r.ok && r.ended, "{r:#?}");
    // The last shard holds at most 10 samples; the cut took some of them.
    assert!(r.samples < data.n && r.samples >= data.n - 10, "{r:#?}");
    let log = b.log();
    let said: Vec<&str> = log.lines().filter(|l| l.contains(&url)).collect();
    assert!(said.len() == 1 && said[0].contains("cut short"), "{log}");
    let cfg = data.dir.path().join("fail.toml");
    std::fs::write(
        &cfg,
        shard_stream("fail", &pattern, "epochs = 1\non_error = \"fail\""),
    )
    .unwrap();
    let out = common::run(
        command(EXE)
            .args(["serve", "--config"])
            .arg(&cfg)
            .arg("--socket")
            .arg(data.dir.path().join("fail.sock")),
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&url) && err.contains("corrupt tar header"),
        "{err}"
    );
}

/// Two brokers sharing one disk-tier folder (`cache_dir`), reading one
/// bucket at once: entries either writes are whole (key, length, CRC-32),
/// so each broker serves the local bytes, a second run of each is served
/// from the disk, and nothing in the folder is found torn.
#[test]
fn two_brokers_sharing_a_disk_tier_folder_serve_the_local_bytes() {
    let data = Data::new();
    let cache = data.p("shared-cache");
    let keys = remote(
        &data.s3().url(),
        &format!("cache_dir = \"{cache}\"\ncache_dir_mib = 256"),
    );
    let cfg = [
        folder_stream("local", &data.p("ds"), "epochs = 1"),
        folder_stream("s3", "s3://data/train/", &format!("epochs = 1\n{keys}")),
    ]
    .join("\n");
    let local = {
        let b = Broker::start(&data.dir.path().join("l"), &cfg);
        epoch_digests(&b.consume(&["--stream", "local", "--digest"]))
    };
    let brokers: Vec<Broker> = ["a", "b"]
        .iter()
        .map(|n| Broker::start(&data.dir.path().join(n), &cfg))
        .collect();
    // Both at once, into the same folder.
    let kids: Vec<_> = brokers
        .iter()
        .map(|b| common::spawn_consumer(&b.dir.join("b.sock"), &["--stream", "s3", "--digest"]))
        .collect();
    for kid in kids {
        let r = harness::wait_report(kid, LIMIT).unwrap();
        assert_eq!(epoch_digests(&r), local, "{r:#?}");
    }
    for b in &brokers {
        let r = b.remote("s3");
        assert_eq!(
            (r.failed, r.disk_corrupt, r.disk_write_errors),
            (0, 0, 0),
            "{r:#?}"
        );
    }
    drop(brokers);
    // Started again on the shared folder: served from the disk.
    let again = Broker::start(&data.dir.path().join("c"), &cfg);
    assert_eq!(
        epoch_digests(&again.consume(&["--stream", "s3", "--digest"])),
        local
    );
    let r = again.remote("s3");
    assert!(r.disk_hits >= data.n && r.disk_corrupt == 0, "{r:#?}");
}

/// A tmpfs mounted at `dir` (mode 0700, `kib` KiB) for the life of the
/// guard, unmounted when dropped (the test passed or failed).
struct Mounted(PathBuf);

impl Mounted {
    fn tmpfs(dir: &Path, kib: u64) -> Option<Mounted> {
        std::fs::create_dir_all(dir).unwrap();
        let out = command("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={kib}k,mode=0700"),
                "tmpfs",
            ])
            .arg(dir)
            .output()
            .ok()?;
        out.status.success().then(|| Mounted(dir.into()))
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = command("umount").arg(&self.0).status();
    }
}

/// A disk tier on a full disk: a folder on a filesystem that holds about a
/// third of the dataset. Every epoch has the local bytes, the full disk
/// is said once in the log and counted (`disk_write_errors`), what was
/// written before it filled is read back whole, and nothing failed.
#[test]
fn a_disk_tier_on_a_full_disk_serves_the_local_bytes_and_says_so_once() {
    if !common::is_root("a disk tier on a full disk (a small tmpfs)") {
        return;
    }
    let data = Data::new();
    let mut files = Vec::new();
    walk(&data.dir.path().join("ds"), Path::new(""), &mut files);
    let bytes: u64 = files
        .iter()
        .map(|f| {
            std::fs::metadata(data.dir.path().join("ds").join(f))
                .unwrap()
                .len()
        })
        .sum();
    let cache = data.dir.path().join("full-cache");
    let kib = (bytes / 3 / 1024).max(16);
    let Some(_mounted) = Mounted::tmpfs(&cache, kib) else {
        common::skip("a disk tier on a full disk", "mount -t tmpfs failed here");
        return;
    };
    let keys = remote(
        &data.s3().url(),
        &format!("cache_dir = \"{}\"\ncache_dir_mib = 1024", cache.display()),
    );
    let cfg = [
        folder_stream("local", &data.p("ds"), "epochs = 2"),
        folder_stream("s3", "s3://data/train/", &format!("epochs = 2\n{keys}")),
    ]
    .join("\n");
    let b = Broker::start(&data.dir.path().join("b"), &cfg);
    let local = epoch_digests(&b.consume(&["--stream", "local", "--digest"]));
    let r = b.consume(&["--stream", "s3", "--digest"]);
    assert!(r.ok && r.ended, "{r:#?}");
    assert_eq!(epoch_digests(&r), local, "{r:#?}");
    let s = b.remote("s3");
    assert_eq!((s.failed, s.disk_corrupt), (0, 0), "{s:#?}");
    assert!(s.disk_write_errors > 0, "the disk filled: {s:#?}");
    let log = b.log();
    assert_eq!(log.matches("the disk is full").count(), 1, "{log}");
    drop(b);
    // Started again: what fitted is read from the disk, the rest fetched.
    let again = Broker::start(&data.dir.path().join("c"), &cfg);
    let r = again.consume(&["--stream", "s3", "--digest"]);
    assert_eq!(epoch_digests(&r), local, "{r:#?}");
    let s = again.remote("s3");
    assert!(s.disk_hits > 0 && s.disk_corrupt == 0, "{s:#?}");
}
