//! `batchcast feed` against strangers on its port and makers that go
//! silent, at its defaults: the real binaries (`make`, `feed`, a host
//! broker, a consumer) and raw TCP connections for the hostile side.

use std::io::{BufRead, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use batchcast_broker::config::StreamToml;
use batchcast_cli::harness;
use batchcast_cli::report::ConsumerReport;

use crate::common;
use common::{EXE, Env, LIMIT, command, run};

const TOKEN: &str = "0123456789abcdef0123456789abcdef";

/// A synthetic stream of 64 samples in batches of 4, two epochs (what
/// `make` makes the same way on any node).
fn config(env: &Env) -> std::path::PathBuf {
    let body = StreamToml::synthetic("fed", 4, 64, &[("x", "u8", &[64])])
        .epochs(2)
        .key("slots", 4)
        .to_toml();
    let path = env.path("stream.toml");
    std::fs::write(&path, body).unwrap();
    path
}

fn schema(env: &Env, config: &Path) -> std::path::PathBuf {
    let out = run(command(EXE)
        .args(["make", "--schema", "--stream", "fed", "--config"])
        .arg(config));
    assert!(out.status.success(), "{out:?}");
    let path = env.path("schema.json");
    std::fs::write(&path, out.stdout).unwrap();
    path
}

/// `batchcast feed` for `makers` makers into the host broker of `env`:
/// the child and the address it listens on.
fn feed(env: &Env, schema: &Path, makers: &str) -> (Child, String) {
    let mut child = env.own(
        command(EXE)
            .args(["feed", "--listen", "127.0.0.1:0", "--min-consumers", "1"])
            .args(["--makers", makers, "--schema"])
            .arg(schema)
            .arg("--socket")
            .arg(env.socket())
            .env("BATCHCAST_FEED_TOKEN", TOKEN)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line.strip_prefix("listening ").unwrap().trim().to_string();
    (child, addr)
}

fn consumer(env: &Env) -> Child {
    env.consumer(&["--stream", "fed", "--digest", "--connect-timeout", "60"])
}

/// Strangers on the feed's port (thirty that connect and say nothing, one
/// that drips its hello a byte a second and never ends it) hold neither
/// the maker nor the stream: each connection has 5 s from its accept for
/// its whole hello, hellos are read side by side, and the maker, which
/// says hello at once, is let in while they wait. (Read one at a time
/// with 5 s a read, as before, they held the feed for minutes: its
/// consumer's 60 s connect timeout ran out first.)
#[test]
fn strangers_on_a_feeds_port_hold_neither_its_maker_nor_its_stream() {
    let env = Env::bare();
    let config = config(&env);
    let schema = schema(&env, &config);
    let want = own_digests(&env, &config);
    let (feeder, addr) = feed(&env, &schema, "1");
    let dripper = {
        let addr = addr.clone();
        std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            let t0 = Instant::now();
            for b in b"batchcast-make 1 ".iter().cycle() {
                if t0.elapsed() > LIMIT {
                    return false;
                }
                if s.write_all(&[*b]).is_err() {
                    return true; // the feed dropped it
                }
                std::thread::sleep(Duration::from_secs(1));
            }
            unreachable!()
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    let idle: Vec<TcpStream> = (0..30)
        .map(|_| TcpStream::connect(&addr).unwrap())
        .collect();
    let maker = env.own(
        command(EXE)
            .args(["make", "--stream", "fed", "--connect", &addr, "--config"])
            .arg(&config)
            .env("BATCHCAST_FEED_TOKEN", TOKEN)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let got = common::report(consumer(&env));
    assert!(got.ok && got.ended, "{got:#?}\n{}", env.what_they_said());
    assert_eq!(common::digests(&got), want, "the stream's own epochs");
    let out = feeder.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(maker.wait_with_output().unwrap().status.success());
    // The strangers were dropped, each within its hello's time.
    for mut s in idle {
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        assert_eq!(
            s.read(&mut [0u8; 8]).unwrap_or(0),
            0,
            "a stranger was let in"
        );
    }
    assert!(
        dripper.join().unwrap(),
        "the dripping stranger was never dropped"
    );
}

/// The config's epochs served by a broker of its own (what the feed must
/// deliver): their digests.
fn own_digests(env: &Env, config: &Path) -> Vec<(u64, Option<String>)> {
    let own = env.path("own.sock");
    let _broker = common::broker(Some(config), &own, Some(&env.path("own.log"))).unwrap();
    let r = common::report(env.consumer_on(&own, &["--stream", "fed", "--digest"]));
    assert!(r.ok && r.epochs.len() == 2, "{r:#?}");
    common::digests(&r)
}

/// A maker that says hello, sends a batch's header and 100 of its bytes
/// and then nothing (a stopped or cut-off node) fails the stream at the
/// feed's default deadline, naming the maker, and the consumer is told;
/// before, both waited forever.
#[test]
fn a_maker_that_goes_silent_mid_batch_fails_the_stream_naming_it() {
    let env = Env::bare();
    let config = config(&env);
    let schema = schema(&env, &config);
    // Batch 0 of epoch 0, as a real maker makes it (header and bytes).
    let mut made = command(EXE)
        .args(["make", "--stream", "fed", "--config"])
        .arg(&config)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    made.stdin.take().unwrap().write_all(b"0 0 1\n").unwrap();
    let batch = made.wait_with_output().unwrap().stdout;
    assert_eq!(batch.len(), 16 + 4 * 64, "{}", batch.len());
    let (feeder, addr) = feed(&env, &schema, "1");
    let mut silent = TcpStream::connect(&addr).unwrap();
    writeln!(silent, "batchcast-make 1 {TOKEN}").unwrap();
    let reader = consumer(&env);
    let mut request = String::new();
    std::io::BufReader::new(silent.try_clone().unwrap())
        .read_line(&mut request)
        .unwrap();
    assert!(request.starts_with("0 0 "), "{request:?}");
    silent.write_all(&batch[..16 + 100]).unwrap();
    let t0 = Instant::now();
    let (status, said) = wait_with_stderr(feeder);
    assert!(!status.success(), "{said}");
    let local = silent.local_addr().unwrap().to_string();
    assert!(
        said.contains("batch 0 of epoch 0 from the maker at")
            && said.contains(&local)
            && said.contains("then nothing within its deadline"),
        "{said}"
    );
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_secs(15),
        "failed after {waited:?}: sooner than the default deadline"
    );
    let r: ConsumerReport = harness::wait_report(reader, LIMIT).unwrap();
    assert!(
        !r.ok
            && r.error
                .as_deref()
                .is_some_and(|e| e.contains("then nothing within its deadline")),
        "{r:#?}"
    );
}

/// Waits (at most [`LIMIT`], then kills) for a child started with piped
/// stderr: its exit status and what it said there.
fn wait_with_stderr(mut child: Child) -> (std::process::ExitStatus, String) {
    let mut err = child.stderr.take().unwrap();
    let said = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let status = harness::wait_timeout(&mut child, LIMIT).unwrap();
    (status, said.join().unwrap())
}

/// A request whose INDEX + COUNT overflows, or lies past the epoch, ends
/// `batchcast make` with the reason, never a panic.
#[test]
fn make_refuses_a_request_that_overflows_with_the_reason() {
    let env = Env::bare();
    let config = config(&env);
    for (request, reason) in [
        ("0 18446744073709551615 2\n", "lie past any epoch"),
        ("0 2 18446744073709551615\n", "lie past any epoch"),
        ("0 99 1\n", "is not in stream `fed`"),
    ] {
        let mut made = command(EXE)
            .args(["make", "--stream", "fed", "--config"])
            .arg(&config)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        made.stdin
            .take()
            .unwrap()
            .write_all(request.as_bytes())
            .unwrap();
        let out = made.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(reason) && !err.contains("panicked"),
            "{request:?}: {err}"
        );
    }
}
