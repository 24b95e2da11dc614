//! Hostile and careless clients against the real broker binary: idle
//! connections, connection floods from another user, a listener that never
//! answers, signals while all of that goes on. Every wait is bounded, so a
//! stall fails a test instead of hanging it. Parts that need a second user
//! run as root (as CI does) and say SKIPPED elsewhere.

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use batchcast::proto::{self, ClientMsg, ErrorCode, Hello, Intent, Preamble, ServerMsg};
use batchcast::{Consumer, ConsumerOptions, Error, StatsClient};
use batchcast_broker::config::StreamToml;
use batchcast_cli::harness::{self, BrokerProcess};

use crate::common;

use common::{Env, Guard, LIMIT, command, is_root, report, run};

/// A uid with no other role here.
const GUEST: u32 = 65534;
const STRANGER: u32 = 65533;

fn stream_config(broker: &str) -> String {
    let body = StreamToml::synthetic("train", 4, 64, &[("x", "u8", &[16])])
        .epochs(1)
        .key("slots", 4)
        .to_toml();
    format!("[broker]\n{broker}\n{body}")
}

/// A connection that says hello as a stats client and then nothing: the
/// broker's first answer (stats, or the reason it refused).
fn idle_stats(socket: &Path) -> (UnixStream, ServerMsg) {
    let mut s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let hello = ClientMsg::Hello(Hello {
        name: "idle".into(),
        pid: std::process::id(),
        intent: Intent::Stats,
    });
    let mut out = Preamble::ours().to_bytes().to_vec();
    out.extend_from_slice(&proto::encode(&hello).unwrap());
    let _ = s.write_all(&out);
    let mut pre = [0u8; Preamble::LEN];
    s.read_exact(&mut pre).unwrap();
    let mut buf = Vec::new();
    let first = proto::read_frame::<ServerMsg>(&mut s, &mut buf)
        .unwrap()
        .expect("the broker closed without a word");
    (s, first)
}

/// Runs `f` on a thread and fails the test if it has not returned within
/// `limit` (the thread is left behind: the point is that it hung).
fn within<T: Send + 'static>(
    limit: Duration,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("{what} did not return within {limit:?}"))
}

fn consumer_options(socket: &Path, timeout: Duration) -> ConsumerOptions {
    ConsumerOptions {
        socket: Some(socket.into()),
        stream: "train".into(),
        connect_timeout: timeout,
        ..Default::default()
    }
}

#[test]
fn connections_past_the_limit_get_a_clear_refusal_and_never_hang_a_client() {
    // An idle timeout far longer than the test: the refusals below cannot
    // depend on how fast a loaded machine opens 24 connections.
    let env = Env::start(&stream_config(
        "max_connections = 24\nmax_connections_per_uid = 8\nidle_timeout_s = 600",
    ));
    let socket = env.socket();
    // The owner's own careless program: 24 stats connections that ask once
    // and then nothing, the whole limit. (The broker counts a connection
    // until it has seen it close: the harness's own stats probes may still
    // count for a moment under load, so a refusal then is asked again.)
    let idle: Vec<_> = (0..24)
        .map(|_| {
            let t0 = Instant::now();
            loop {
                let (s, first) = idle_stats(&socket);
                match first {
                    ServerMsg::Stats(_) => break s,
                    ServerMsg::Error(e)
                        if e.code == ErrorCode::Busy && t0.elapsed() < Duration::from_secs(10) =>
                    {
                        std::thread::sleep(Duration::from_millis(50))
                    }
                    other => panic!("{other:?}"),
                }
            }
        })
        .collect();
    // A consumer is told at once, not after its connect timeout (30 s),
    // and not never (before: it blocked in the handshake for good).
    let t0 = Instant::now();
    let s2 = socket.clone();
    let err = within(
        Duration::from_secs(60),
        "a consumer at the limit",
        move || Consumer::connect(consumer_options(&s2, Duration::from_secs(30))).unwrap_err(),
    );
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "it waited {:?}",
        t0.elapsed()
    );
    assert_eq!(err.code(), Some(ErrorCode::Busy), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("24 connections (max_connections)") && text.contains("close idle ones"),
        "{text}"
    );
    let s2 = socket.clone();
    let err = within(Duration::from_secs(60), "stats at the limit", move || {
        StatsClient::connect(Some(s2)).unwrap_err()
    });
    assert_eq!(err.code(), Some(ErrorCode::Busy), "{err}");
    // Their places go to the consumer once they close.
    drop(idle);
    let kid = env.consumer(&["--verify"]);
    let r = report(kid);
    assert!(r.ok && r.ended && r.batches == 16, "{r:#?}");
}

#[test]
fn idle_connections_are_closed_with_the_reason_and_a_stats_client_asks_again() {
    let env = Env::start(&stream_config("idle_timeout_s = 2"));
    let socket = env.socket();
    // Closed after idle_timeout_s with the reason (read within 10 s).
    for _ in 0..3 {
        let (mut s, first) = idle_stats(&socket);
        assert!(matches!(first, ServerMsg::Stats(_)), "{first:?}");
        match proto::read_frame::<ServerMsg>(&mut s, &mut Vec::new()) {
            Ok(Some(ServerMsg::Error(e))) => {
                assert_eq!(e.code, ErrorCode::Idle, "{e:?}");
                assert!(e.message.contains("idle_timeout_s"), "{e:?}");
            }
            other => panic!("an idle stats connection got {other:?}"),
        }
    }
    // A StatsClient left idle until the broker closed its connection (seen
    // in the broker's count of open ones) asks again on a new connection
    // by itself.
    let held = || env.stats().connections.held;
    // Settled: the connections closed above are no longer counted.
    let mut alone = held();
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(50));
        alone = alone.min(held());
    }
    let mut stats = StatsClient::connect(Some(socket.clone())).unwrap();
    // Counted once the broker has seen it (and has seen the stats
    // connections of the counts before close: they may lag a moment).
    let t0 = Instant::now();
    while held() != alone + 1 {
        assert!(
            t0.elapsed() < LIMIT,
            "the stats client's connection was never counted"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let t0 = Instant::now();
    while held() > alone {
        assert!(t0.elapsed() < LIMIT, "the idle connection was never closed");
        std::thread::sleep(Duration::from_millis(100));
    }
    let s = stats.fetch().unwrap();
    assert_eq!(s.streams.len(), 1);
}

#[test]
fn a_listener_that_never_answers_fails_the_handshake_within_the_connect_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("silent.sock");
    // Accepts (the kernel does, from the backlog) and never says a word.
    let _silent = UnixListener::bind(&path).unwrap();
    let p = path.clone();
    let t0 = Instant::now();
    let err = within(
        Duration::from_secs(30),
        "a consumer's handshake",
        move || Consumer::connect(consumer_options(&p, Duration::from_secs(3))).unwrap_err(),
    );
    let waited = t0.elapsed();
    assert!(
        matches!(err, Error::HandshakeTimeout { .. }),
        "after {waited:?}: {err}"
    );
    assert!(err.to_string().contains("did not answer within"), "{err}");
    // A producer and a stats client are bounded the same way.
    let p = path.clone();
    let err = within(Duration::from_secs(30), "a stats handshake", move || {
        StatsClient::connect(Some(p)).unwrap_err()
    });
    assert!(matches!(err, Error::HandshakeTimeout { .. }), "{err}");
}

/// The broker ends within a couple of seconds of SIGINT or SIGTERM however
/// many connections are open and whatever state they are in.
#[test]
fn sigint_and_sigterm_end_the_broker_promptly_whatever_the_connections_do() {
    for signal in [
        nix::sys::signal::Signal::SIGINT,
        nix::sys::signal::Signal::SIGTERM,
    ] {
        let env = Env::start(&stream_config("max_connections = 32\nidle_timeout_s = 600"));
        let socket = env.socket();
        // Connections up to the limit (room left for the consumer and the
        // test's stats): stats clients asking nothing, and raw connections
        // that never finish their preamble.
        let mut held: Vec<UnixStream> = (0..15).map(|_| idle_stats(&socket).0).collect();
        for _ in 0..15 {
            let mut s = UnixStream::connect(&socket).unwrap();
            s.write_all(b"BC").unwrap();
            held.push(s);
        }
        // And one consumer in the middle of its epoch, holding its window.
        // It fails at once (no --reconnect-timeout: it would wait 60 s).
        let kid = env.consumer(&["--sleep-ms", "500", "--reconnect-timeout", "0"]);
        env.wait_for("the consumer to hold a batch", |s| {
            s.streams[0].consumers.iter().any(|c| c.held > 0)
        });
        let mut env = env;
        let t0 = Instant::now();
        harness::signal(env.broker.pid(), signal);
        let status = within_exit(&mut env.broker, Duration::from_secs(10));
        let took = t0.elapsed();
        assert!(
            status.is_some(),
            "{signal:?}: the broker still ran after 10 s"
        );
        eprintln!(
            "{signal:?} to exit: {took:?} with {} connections",
            held.len() + 1
        );
        // docs/protocol.md: promptly, whatever the connections do. Waiting on any of
        // them would take the handshake's 10 s or the idle 600 s.
        assert!(took < Duration::from_secs(5), "{signal:?}: {took:?}");
        assert!(!socket.exists(), "the socket file is removed");
        drop(held);
        let r = report(kid);
        assert!(!r.ok, "the consumer is told the broker went away: {r:#?}");
        let why = r.error.unwrap_or_default();
        assert!(why.contains("Shutdown"), "told it shut down: {why}");
    }
}

/// docs/protocol.md: a connection that has not said hello within 10 s is closed
/// (and counted), whether it sent part of a preamble or nothing.
#[test]
fn a_silent_handshake_is_closed_after_ten_seconds() {
    let env = Env::start(&stream_config("idle_timeout_s = 600"));
    let socket = env.socket();
    let t0 = Instant::now();
    let waiters: Vec<_> = [&b""[..], &b"BC"[..]]
        .into_iter()
        .map(|sent| {
            let mut s = UnixStream::connect(&socket).unwrap();
            s.write_all(sent).unwrap();
            s.set_read_timeout(Some(LIMIT)).unwrap();
            std::thread::spawn(move || {
                // Whatever it says first, the broker then closes.
                let mut rest = Vec::new();
                let _ = s.read_to_end(&mut rest);
                t0.elapsed()
            })
        })
        .collect();
    for w in waiters {
        let closed = w.join().unwrap();
        assert!(
            closed >= Duration::from_secs(9) && closed < Duration::from_secs(30),
            "closed after {closed:?}"
        );
    }
    let s = env.stats();
    assert_eq!(s.connections.handshakes_refused, 2);
}

fn within_exit(b: &mut BrokerProcess, limit: Duration) -> Option<std::process::ExitStatus> {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if let Some(s) = b.try_wait().unwrap() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}

/// A broker of `config` whose socket other users can reach (its folder is
/// 0711: they may enter it, not write in it): its folder, socket, process.
fn shared_broker(config: &str) -> (tempfile::TempDir, std::path::PathBuf, BrokerProcess) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let cfg = dir.path().join("b.toml");
    std::fs::write(&cfg, config).unwrap();
    let socket = dir.path().join("b.sock");
    let log = dir.path().join("broker.log");
    let broker = common::broker(Some(&cfg), &socket, Some(&log)).unwrap();
    (dir, socket, broker)
}

/// Another user's flood: connections that say nothing, beyond its share,
/// and a user outside the allow list. Run as those users by a child.
#[test]
fn another_users_connection_flood_is_held_to_its_share_and_checked_before_any_read() {
    if !is_root("connection floods from a second and a third user") {
        return;
    }
    let (_dir, socket, broker) = shared_broker(&stream_config(&format!(
        "allow_uids = [{GUEST}]\nmax_connections = 64\nmax_connections_per_uid = 16\nidle_timeout_s = 600"
    )));
    // Each connection waits half a second for a word: admitted ones hear
    // nothing (they have not said hello), refused ones hear the reason.
    // The child keeps its connections until it is killed.
    let flood = |uid: u32, n: usize| {
        let child = command("python3")
            .args([
                "-c",
                r#"
import socket, sys, time
path, n = sys.argv[1], int(sys.argv[2])
conns = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    conns.append(s)
time.sleep(0.5)
quiet, refused, reasons = 0, 0, set()
for s in conns:
    s.settimeout(0.5)
    try:
        data = s.recv(4096)
    except socket.timeout:
        quiet += 1
        continue
    refused += 1
    for word in (b"max_connections_per_uid", b"not allowed"):
        if word in data:
            reasons.add(word.decode())
print(quiet, refused, ",".join(sorted(reasons)), flush=True)
sys.stdin.read()  # until the test closes it, or ends
"#,
            ])
            .arg(&socket)
            .arg(n.to_string())
            .uid(uid)
            .gid(uid)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut child = Guard(child);
        let mut line = String::new();
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        std::io::BufRead::read_line(&mut out, &mut line).unwrap();
        (child, line.trim().to_string())
    };
    let (guest, seen) = flood(GUEST, 100);
    assert_eq!(seen, "16 84 max_connections_per_uid");
    let (stranger, seen) = flood(STRANGER, 10);
    assert_eq!(seen, "0 10 not allowed");
    // The owner, while the guest holds its share, is served in full.
    let kid = common::spawn_consumer(&socket, &["--verify"]);
    let r = harness::wait_report(kid, LIMIT).unwrap();
    assert!(r.ok && r.ended && r.batches == 16, "{r:#?}");
    drop((guest, stranger));
    drop(broker);
}

/// A producer request for `stream` whose arena is `mib` MiB (4 slots).
fn big_request(env_socket: &Path, stream: &str, mib: u64) -> batchcast::ProducerOptions {
    let field = batchcast::Field {
        name: "x".into(),
        dtype: batchcast::DType::U8,
        shape: vec![1 << 20],
        aux: false,
    };
    let mut o = batchcast::ProducerOptions::new(stream, vec![field], mib / 4, 10);
    o.socket = Some(env_socket.into());
    o.request.slots = 4;
    o.name = "big-producer".into();
    o
}

#[test]
fn registrations_are_held_to_the_memory_budget_listed_while_pending_and_time_out() {
    let env = Env::start(
        "[broker]\nmemory_mib = 256\nmax_connections = 32\nregistration_timeout_s = 3\n",
    );
    let socket = env.socket();
    let mib = 1u64 << 20;
    let s = env.stats();
    // The frame buffers of every connection are reserved at start.
    assert_eq!(s.memory.budget_bytes, 256 * mib);
    assert_eq!(s.memory.frame_buffers_bytes, 32 * (64 * 1024 + 4096));
    // A registration that never acquires: it holds its arena, and stats
    // says so (before: nowhere, and for ever).
    let a = batchcast::Producer::register(big_request(&socket, "a", 128)).unwrap();
    let s = env.stats();
    assert_eq!(s.pending.len(), 1, "{:#?}", s.pending);
    let p = &s.pending[0];
    assert_eq!(
        (p.name.as_str(), p.producer.as_str()),
        ("a", "big-producer")
    );
    assert_eq!(p.arena_bytes, 128 * mib);
    assert_eq!(p.uid, nix::unistd::getuid().as_raw());
    assert_eq!(s.memory.arenas_bytes, 128 * mib);
    // One that does not fit is refused with the numbers, before anything
    // is allocated.
    let err = batchcast::Producer::register(big_request(&socket, "b", 128)).unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::Busy), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("an arena of 128 MiB for stream `b`")
            && text.contains("of 256 MiB in use")
            && text.contains("memory_mib"),
        "{text}"
    );
    assert_eq!(env.stats().memory.refused, 1);
    // The first registration times out without an Acquire and its arena
    // goes back to the budget.
    let s = env.wait_for("the registration to time out", |s| s.pending.is_empty());
    assert_eq!(s.memory.arenas_bytes, 0, "{:#?}", s.memory);
    let mut a = a;
    let err = a.acquire().unwrap_err();
    assert!(err.to_string().contains("not acquired within 3 s"), "{err}");
    // Now the second fits.
    let mut b = batchcast::Producer::register(big_request(&socket, "b", 128)).unwrap();
    // Its first Acquire opens it (slots wait for a consumer).
    let got = b.acquire_timeout(Duration::from_millis(100)).unwrap();
    assert_eq!(got, batchcast::Acquired::Pending);
    let s = env.wait_for("`b` to open", |s| s.streams.iter().any(|st| st.name == "b"));
    assert!(s.pending.is_empty());
    assert_eq!(s.memory.arenas_bytes, 128 * mib);
}

#[test]
fn a_frame_larger_than_a_client_may_send_is_refused_before_it_is_buffered() {
    let env = Env::start(&stream_config(""));
    let mut s = UnixStream::connect(env.socket()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // A preamble, then a frame header claiming 512 KiB (the wire allows 1
    // MiB; before, the broker waited to buffer all of it).
    s.write_all(&Preamble::ours().to_bytes()).unwrap();
    s.write_all(&(512u32 << 10).to_le_bytes()).unwrap();
    let mut pre = [0u8; Preamble::LEN];
    s.read_exact(&mut pre).unwrap();
    let mut buf = Vec::new();
    match proto::read_frame::<ServerMsg>(&mut s, &mut buf) {
        Ok(Some(ServerMsg::Error(e))) => {
            assert_eq!(e.code, ErrorCode::FrameTooLarge, "{e:?}");
            assert!(e.message.contains("at most 65536 bytes"), "{e:?}");
        }
        other => panic!("{other:?}"),
    }
}

/// The guest's side of the tenant test below: run by it as uid 65534 in a
/// child process (a copy of this test binary); does nothing otherwise.
/// Run only by its parent test, as a child process (`--ignored`).
#[test]
#[ignore = "the child side of another test, which runs it"]
fn guest_side_of_the_tenant_test() {
    let (Ok(socket), Ok(prefix)) = (
        std::env::var("BATCHCAST_TEST_GUEST_SOCKET"),
        std::env::var("BATCHCAST_TEST_GUEST_PREFIX"),
    ) else {
        return;
    };
    let socket = std::path::PathBuf::from(socket);
    // The owner's names, configured or not, are not the guest's to take.
    for name in ["train", "ext"] {
        let err = batchcast::Producer::register(big_request(&socket, name, 4)).unwrap_err();
        assert_eq!(err.code(), Some(ErrorCode::NotAllowed), "{name}: {err}");
        assert!(
            err.to_string()
                .contains(&format!("may only register streams named `{prefix}...`")),
            "{err}"
        );
    }
    // Under its prefix it may, and the stream is its own.
    let mine = format!("{prefix}ext");
    let mut p = batchcast::Producer::register(big_request(&socket, &mine, 4)).unwrap();
    assert_eq!(
        p.acquire_timeout(Duration::from_millis(100)).unwrap(),
        batchcast::Acquired::Pending
    );
    let mut stats = StatsClient::connect(Some(socket.clone())).unwrap();
    let s = stats.fetch().unwrap();
    let st = s.streams.iter().find(|st| st.name == mine).unwrap();
    assert_eq!(st.owner_uid, GUEST);
    // It controls its own stream, not the owner's.
    stats.set_min_consumers(&mine, 2).unwrap();
    let err = stats.set_min_consumers("train", u32::MAX).unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::NotAllowed), "{err}");
    assert!(err.to_string().contains("only its owner (uid 0)"), "{err}");
    // A group is named within its uid: the guest's `dp` is its own (both
    // ranks, world 2 as it says), not the owner's (whose rank 0 is held),
    // and its members cannot fix the owner's world.
    let seat = |rank, world| {
        let mut req = common::consume_request(2);
        req.stream = "grouped".into();
        req.group = Some(Box::new(proto::Seat {
            name: "dp".into(),
            rank,
            world,
            replicate: 1,
        }));
        hello_keep(&socket, "guest member", Intent::Consume(req))
    };
    let mut held = Vec::new();
    for rank in [0, 1] {
        match seat(rank, 2) {
            (s, ServerMsg::Welcome(_)) => held.push(s),
            (_, other) => panic!("the guest's own rank {rank}: {other:?}"),
        }
    }
    match seat(2, 3) {
        (_, ServerMsg::Error(e)) => assert!(e.message.contains("has world 2"), "{e:?}"),
        (_, other) => panic!("{other:?}"),
    }
    // The owner seats its rank 1 while the guest's `dp` is held.
    hold_until_told("seated", held);
}

/// A guest side's end: says `said` to its parent ([`Guest`]), keeps the
/// connections `held` open until its stdin closes, then says it is done.
fn hold_until_told(said: &str, held: Vec<UnixStream>) {
    println!("{said}");
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    drop(held);
    println!("guest done");
}

#[test]
fn a_guest_can_neither_take_a_stream_name_nor_control_another_users_stream() {
    let body = StreamToml::synthetic("train", 4, 64, &[("x", "u8", &[16])])
        .epochs(1)
        .key("slots", 4)
        .key("min_consumers", 2)
        .to_toml();
    let grouped = StreamToml::synthetic("grouped", 4, 64, &[("x", "u8", &[16])])
        .key("slots", 8)
        .key("min_consumers", 10)
        .to_toml();
    let (dir, socket, broker) = shared_broker(&format!(
        "[broker]\nallow_uids = [{GUEST}]\n{body}\n{grouped}"
    ));
    let me = nix::unistd::getuid().as_raw();
    if is_root("a guest registering and controlling streams") {
        // The owner's group, rank 0 of 2 seated.
        let mut req = common::consume_request(2);
        req.stream = "grouped".into();
        req.group = Some(Box::new(proto::Seat {
            name: "dp".into(),
            rank: 0,
            world: 2,
            replicate: 1,
        }));
        let _member = common::raw_subscribe_with(&socket, "owner member", req);
        let prefix = nix::unistd::User::from_uid(GUEST.into())
            .unwrap()
            .map_or_else(|| format!("u{GUEST}"), |u| u.name)
            + ".";
        let mut guest = Guest::start(
            dir.path(),
            "guest_side_of_the_tenant_test",
            &[
                ("BATCHCAST_TEST_GUEST_SOCKET", socket.as_os_str()),
                ("BATCHCAST_TEST_GUEST_PREFIX", prefix.as_ref()),
            ],
        );
        guest.line_starting("seated");
        req_rank1_of_dp(&socket);
        guest.finish();
    }
    // The owner's stream still waits for its two consumers (not for
    // 4294967295) and says whose it is.
    let c = Consumer::connect(consumer_options(&socket, Duration::from_secs(10))).unwrap();
    assert_eq!(c.welcome().owner_uid, me);
    drop(c);
    let kids: Vec<_> = (0..2)
        .map(|_| common::spawn_consumer(&socket, &["--verify"]))
        .collect();
    for kid in kids {
        let r = harness::wait_report(kid, LIMIT).unwrap();
        assert!(r.ok && r.ended && r.batches == 16, "{r:#?}");
    }
    let s = broker.stats().unwrap();
    let train = s.streams.iter().find(|st| st.name == "train").unwrap();
    assert_eq!(train.owner_uid, me);
    drop(broker);
}

/// A raw hello as a stats client named `name`: the broker's first answer.
fn hello_named(socket: &Path, name: &str) -> ServerMsg {
    hello_with(socket, name, Intent::Stats)
}

/// A consume request for the stream named `stream`: the broker's answer.
fn consume_named(socket: &Path, stream: &str) -> ServerMsg {
    let mut req = common::consume_request(2);
    req.stream = stream.into();
    hello_with(socket, "trainer", Intent::Consume(req))
}

fn hello_with(socket: &Path, name: &str, intent: Intent) -> ServerMsg {
    hello_keep(socket, name, intent).1
}

fn refused_with(msg: ServerMsg, needle: &str) {
    match msg {
        ServerMsg::Error(e) => {
            assert_eq!(e.code, ErrorCode::InvalidRequest, "{e:?}");
            assert!(
                e.message.contains(needle),
                "`{}` lacks `{needle}`",
                e.message
            );
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// Names are bounded at hello (length and characters), so consumers that
/// come and go with the longest names allowed leave a stats reply that is
/// still answered; a flood of refused preambles is counted in stats and
/// logs a few lines, not one per connection.
#[test]
fn names_are_bounded_stats_always_answers_and_refusals_do_not_flood_the_log() {
    let body = StreamToml::synthetic("train", 4, 64, &[("x", "u8", &[16])])
        .epochs(100_000)
        .key("slots", 4)
        .to_toml();
    let env = Env::start(&body);
    let sock = env.socket();

    refused_with(hello_named(&sock, &"x".repeat(60_000)), "at most 128 bytes");
    refused_with(hello_named(&sock, "trainer\u{1b}[2J"), "control character");
    // A right-to-left override would make a stats line read backwards.
    refused_with(
        hello_named(&sock, "trainer\u{202e}0x4"),
        "control character",
    );
    // A stream's name asked for is bounded too: it is logged and answered.
    let forged = format!("{}\n2026-11-26T00:00:00Z ERROR forged", "s".repeat(60_000));
    refused_with(consume_named(&sock, &forged), "at most 128 bytes");
    refused_with(
        consume_named(&sock, "train\nERROR forged"),
        "control character",
    );
    assert!(!env.log().contains("forged"), "{}", env.log());
    let longest = "n".repeat(proto::MAX_NAME_BYTES);
    assert!(matches!(hello_named(&sock, &longest), ServerMsg::Stats(_)));

    // Consumers with the longest names come and go (more than stats keeps).
    let n = proto::PAST_CONSUMERS + 44;
    for _ in 0..n {
        let (s, _, _) = common::raw_subscribe(
            &sock,
            &longest,
            true,
            batchcast::JoinPolicy::Immediate,
            None,
        );
        drop(s);
    }
    let s = env.wait_for("every consumer to have left", |s| {
        s.streams[0].departed == n as u64 && s.streams[0].consumers.is_empty()
    });
    let train = &s.streams[0];
    assert_eq!(train.past_consumers.len(), proto::PAST_CONSUMERS);
    assert!(train.past_consumers.iter().all(|c| c.name == longest));
    let bytes = proto::encode(&ServerMsg::Stats(Box::new(s.clone()))).unwrap();
    assert!(
        bytes.len() <= proto::MAX_STATS_BYTES,
        "{} bytes",
        bytes.len()
    );

    // A flood of preambles of another protocol: each refused, counted,
    // and a few logged.
    let flood = 300;
    let t0 = Instant::now();
    let mut other = Preamble::ours().to_bytes();
    other[4..6].copy_from_slice(&999u16.to_le_bytes());
    for _ in 0..flood {
        let mut c = UnixStream::connect(&sock).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c.write_all(&other).unwrap();
        let mut pre = [0u8; Preamble::LEN];
        c.read_exact(&mut pre).unwrap();
        let msg = proto::read_frame::<ServerMsg>(&mut c, &mut Vec::new()).unwrap();
        assert!(
            matches!(msg, Some(ServerMsg::Error(ref e)) if e.code == ErrorCode::VersionMismatch),
            "{msg:?}"
        );
    }
    let s = env.wait_for("the refusals to be counted", |s| {
        s.connections.handshakes_refused >= flood
    });
    // The five bad names are refused after the handshake.
    assert_eq!(s.connections.handshakes_refused, flood);
    assert_eq!(s.connections.requests_refused, flood + 5);
    let logged = env
        .log()
        .lines()
        .filter(|l| l.contains("cannot talk to each other"))
        .count();
    // At most 10 a window of 10 s, however long a loaded machine took.
    let windows = t0.elapsed().as_secs() / 10 + 2;
    assert!(
        logged >= 1 && logged as u64 <= 10 * windows,
        "{logged} refusal lines logged for {flood} refusals in {windows} windows"
    );
}

/// The registering side of the test below, run by it in a child process
/// (a copy of this test binary: its own memory map, as a real producer
/// has); does nothing otherwise. Two rounds of two 1 GiB registrations,
/// each acquired (sealed, opened) and then left (freed).
/// Run only by its parent test, as a child process (`--ignored`).
#[test]
#[ignore = "the child side of another test, which runs it"]
fn large_registrations_side() {
    let Ok(socket) = std::env::var("BATCHCAST_TEST_BIG_SOCKET") else {
        return;
    };
    let socket = std::path::PathBuf::from(socket);
    for round in 0..2 {
        let producers: Vec<_> = (0..2)
            .map(|i| {
                let socket = socket.clone();
                std::thread::spawn(move || {
                    let name = format!("big{round}-{i}");
                    let mut p =
                        batchcast::Producer::register(big_request(&socket, &name, 1024)).unwrap();
                    let _ = p.acquire_timeout(Duration::from_millis(100)).unwrap();
                })
            })
            .collect();
        for p in producers {
            p.join().unwrap();
        }
    }
    println!("registrations done");
}

/// Large producer registrations (arenas allocated, sealed, opened and
/// freed) never hold up the server's other connections: stats calls and
/// new consumers keep being answered promptly meanwhile.
#[test]
fn large_registrations_do_not_stall_other_clients() {
    let env = Env::start(&format!(
        "[broker]\nmemory_mib = 4096\n{}",
        StreamToml::synthetic("train", 4, 64, &[("x", "u8", &[16])])
            .key("slots", 4)
            .to_toml()
    ));
    let socket = env.socket();
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
    let stop = Arc::new(AtomicBool::new(false));
    // 0: the quiet phase, which measures what a round trip costs on this
    // machine now, load included; then 1, 2: the registrations, at most
    // twice (below).
    let phase = Arc::new(AtomicU32::new(0));
    let quiet_calls = Arc::new(AtomicU32::new(0));
    // Other clients: stats round trips and consumers subscribing, timed,
    // each with its phase.
    let watcher = {
        let (socket, stop, phase, quiet_calls) = (
            socket.clone(),
            stop.clone(),
            phase.clone(),
            quiet_calls.clone(),
        );
        std::thread::spawn(move || {
            let mut calls: Vec<(u32, [Duration; 2])> = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let phase = phase.load(Ordering::Relaxed);
                let t0 = Instant::now();
                let mut c = StatsClient::connect(Some(socket.clone())).unwrap();
                c.fetch().unwrap();
                let stats = t0.elapsed();
                let t0 = Instant::now();
                let consumer =
                    Consumer::connect(consumer_options(&socket, Duration::from_secs(10)));
                assert!(consumer.is_ok(), "{:?}", consumer.err());
                calls.push((phase, [stats, t0.elapsed()]));
                if phase == 0 {
                    quiet_calls.fetch_add(1, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            calls
        })
    };
    let t0 = Instant::now();
    while quiet_calls.load(Ordering::Relaxed) < 20 {
        assert!(t0.elapsed() < LIMIT, "the quiet phase never ended");
        std::thread::sleep(Duration::from_millis(20));
    }
    let exe = std::env::current_exe().unwrap();
    let register = |n: u32| {
        phase.store(n, Ordering::Relaxed);
        let out = run(command(&exe)
            .args([
                "--exact",
                &qualified("large_registrations_side"),
                "--ignored",
                "--nocapture",
            ])
            .env("BATCHCAST_TEST_BIG_SOCKET", &socket)
            .stdin(Stdio::null()));
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && text.contains("registrations done"),
            "{text}"
        );
        env.wait_for("the arenas to go back", |s| {
            s.memory.arenas_bytes < (1 << 20)
        });
        std::thread::sleep(Duration::from_millis(200));
    };
    // Faulting 1 GiB arenas in while serving stalled every connection at
    // each registration (the memory map lock): here stats calls and
    // subscriptions waited 1.1 s and 0.8 s beyond the allowance below, 1.9 s
    // in all, for these four; answered at once, a round trip takes about
    // 10 ms. What is counted: the time calls took beyond 100 ms plus three
    // times the slowest of the quiet phase, both kinds together. A burst of
    // load on a shared machine may delay a call or two (0.53 s was seen
    // once, under a compiler's link; 1.02 s in all twice in the full suite,
    // with pytest and rustdoc beside it and 4 GiB more to allocate): a
    // stall that is the broker's comes back every time, so the
    // registrations run twice, and the better of the two rounds counts.
    let judge = |calls: &[(u32, [Duration; 2])], n: u32| {
        let quiet = |k: usize| {
            calls
                .iter()
                .filter(|c| c.0 == 0)
                .map(|c| c.1[k])
                .max()
                .unwrap_or_default()
        };
        let during: Vec<[Duration; 2]> = calls.iter().filter(|c| c.0 == n).map(|c| c.1).collect();
        let mut stalled = Duration::ZERO;
        let mut seen = vec![format!("{} calls of each", during.len())];
        for (k, what) in ["stats", "subscription"].iter().enumerate() {
            let allowed = Duration::from_millis(100) + 3 * quiet(k);
            let beyond: Duration = during.iter().map(|t| t[k].saturating_sub(allowed)).sum();
            let worst = during.iter().map(|t| t[k]).max().unwrap_or_default();
            seen.push(format!(
                "{what}: the slowest {worst:?} ({:?} at worst before), {beyond:?} beyond {allowed:?} in all",
                quiet(k)
            ));
            stalled += beyond;
        }
        (during.len(), stalled, seen)
    };
    // Both rounds are measured; the better counts.
    register(1);
    register(2);
    let attempts = [1u32, 2];
    stop.store(true, Ordering::Relaxed);
    let calls = watcher.join().unwrap();
    let results: Vec<_> = attempts.iter().map(|&n| judge(&calls, n)).collect();
    for (n, stalled, seen) in &results {
        eprintln!("registrations: {n} calls, {stalled:?} beyond the allowance: {seen:?}");
        assert!(*n > 5, "{n} calls during the registrations");
    }
    let (_, stalled, seen) = results.iter().min_by_key(|r| r.1).unwrap();
    assert!(
        *stalled < Duration::from_secs(1),
        "calls waited {stalled:?} in all during the registrations (the better of two rounds): {seen:?}"
    );
}

/// The guest's side of the budget test below: as uid 65534, join the
/// owner's stream with `join="now"` again and again (each a replay arena
/// in the budget under its uid, kept by an open connection that reads
/// nothing) until refused; say how many, then hold them until told.
#[test]
#[ignore = "the child side of another test, which runs it"]
fn guest_side_of_the_budget_test() {
    let Ok(socket) = std::env::var("BATCHCAST_TEST_GUEST_SOCKET") else {
        return;
    };
    let socket = std::path::PathBuf::from(socket);
    let mut held = Vec::new();
    let refusal = loop {
        assert!(held.len() < 60, "never refused: the budget is not held");
        let mut req = common::consume_request(2);
        req.join = batchcast::JoinPolicy::Now;
        match hello_keep(&socket, "guest joiner", Intent::Consume(req)) {
            (s, ServerMsg::Welcome(_)) => held.push(s),
            (_, ServerMsg::Error(e)) => break e,
            (_, other) => panic!("{other:?}"),
        }
    };
    assert_eq!(refusal.code, ErrorCode::Busy, "{refusal:?}");
    assert!(
        refusal
            .message
            .contains("does not fit the broker's memory budget"),
        "{refusal:?}"
    );
    hold_until_told(&format!("held {}", held.len()), held);
}

/// A guest's replay arenas take at most the guests' three quarters of
/// what the broker's own reservations leave: with `memory_mib = 256` (of
/// which every connection's frame buffers are reserved at start) a guest
/// joining again and again is refused at its share, and the owner's
/// trainers, a plain one (a mailbox) and a `join="now"` one (a replay
/// arena), are still served. Before, the owner's quarter had gone to the
/// frame buffers and both were refused `Busy`.
#[test]
fn a_guests_replay_arenas_leave_the_owner_its_quarter_of_the_budget() {
    if !is_root("a guest filling the memory budget") {
        return;
    }
    let body = StreamToml::synthetic("train", 4, 1_000_000, &[("x", "u8", &[1 << 18])])
        .key("slots", 8)
        .key("workers", 2)
        .raw("pace = \"decoupled\"")
        .to_toml();
    let (dir, socket, broker) = shared_broker(&format!(
        "[broker]\nmemory_mib = 256\nallow_uids = [{GUEST}]\n{body}"
    ));
    let steady = Guard(common::spawn_consumer(
        &socket,
        &["--sleep-ms", "20", "--max-batches", "100000"],
    ));
    let t0 = Instant::now();
    while broker.stats().unwrap().streams[0].batches_produced < 4 {
        assert!(t0.elapsed() < LIMIT, "the stream never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut guest = Guest::start(
        dir.path(),
        "guest_side_of_the_budget_test",
        &[("BATCHCAST_TEST_GUEST_SOCKET", socket.as_os_str())],
    );
    let line = guest.line_starting("held ");
    let held: u32 = line["held ".len()..].trim().parse().unwrap();
    assert!(held >= 2, "{line}");
    // The guests hold their share, no more: every decoupled consumer has
    // a replay arena of one size, the steady reader's the owner's, the
    // others the guest's (whose mailboxes count too).
    let m = broker.stats().unwrap().memory;
    let guests = m.replay_bytes / u64::from(held + 1) * u64::from(held);
    assert!(
        guests > 0 && guests <= (m.budget_bytes - m.frame_buffers_bytes) / 4 * 3,
        "{m:#?}"
    );
    // The owner's trainers are served beside them.
    let plain = common::spawn_consumer(
        &socket,
        &["--verify", "--join", "immediate", "--max-batches", "20"],
    );
    let joiner = common::spawn_consumer(
        &socket,
        &["--verify", "--join", "now", "--max-batches", "20"],
    );
    for kid in [plain, joiner] {
        let r = harness::wait_report(kid, LIMIT).unwrap();
        assert!(r.ok && r.batches == 20 && r.verify_failures == 0, "{r:#?}");
    }
    guest.finish();
    drop(steady);
}

/// The owner's rank 1 of its group `dp` on stream `grouped`, seated.
fn req_rank1_of_dp(socket: &Path) {
    let mut req = common::consume_request(2);
    req.stream = "grouped".into();
    req.group = Some(Box::new(proto::Seat {
        name: "dp".into(),
        rank: 1,
        world: 2,
        replicate: 1,
    }));
    drop(common::raw_subscribe_with(socket, "owner member 1", req));
}

/// A test's guest side: a copy of this test binary (one the guest can
/// read) running the ignored test `test` as uid 65534, expecting the
/// broker's user as a real guest would; it says what it did on stdout
/// and waits for its stdin to close before it lets go.
struct Guest {
    child: Guard,
    out: std::io::BufReader<std::process::ChildStdout>,
}

impl Guest {
    fn start(dir: &Path, test: &str, env: &[(&str, &std::ffi::OsStr)]) -> Guest {
        let exe = dir.join("hostile-test");
        if !exe.exists() {
            std::fs::copy(std::env::current_exe().unwrap(), &exe).unwrap();
            std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let mut cmd = command(&exe);
        cmd.args(["--exact", &qualified(test), "--ignored", "--nocapture"])
            .env(
                "BATCHCAST_BROKER_UID",
                nix::unistd::getuid().as_raw().to_string(),
            )
            .uid(GUEST)
            .gid(GUEST)
            .current_dir(dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        // Another test's child, forked while this copy was open for
        // writing, holds that fd until it execs: the copy cannot be run
        // until then (ETXTBSY), for a moment.
        let t0 = Instant::now();
        let child = loop {
            match cmd.spawn() {
                Err(e)
                    if e.kind() == std::io::ErrorKind::ExecutableFileBusy
                        && t0.elapsed() < Duration::from_secs(10) =>
                {
                    std::thread::sleep(Duration::from_millis(20));
                }
                other => break other.unwrap(),
            }
        };
        let mut child = Guard(child);
        let out = std::io::BufReader::new(child.0.stdout.take().unwrap());
        Guest { child, out }
    }

    /// The first line it prints that starts with `prefix`.
    fn line_starting(&mut self, prefix: &str) -> String {
        let mut line = String::new();
        while !line.starts_with(prefix) {
            line.clear();
            let n = std::io::BufRead::read_line(&mut self.out, &mut line).unwrap();
            assert!(n > 0, "the guest side ended before saying `{prefix}`");
        }
        line
    }

    /// Lets it go; it must end well.
    fn finish(mut self) {
        drop(self.child.0.stdin.take());
        let mut rest = String::new();
        self.out.read_to_string(&mut rest).unwrap();
        let status = self.child.0.wait().unwrap();
        assert!(status.success() && rest.contains("guest done"), "{rest}");
    }
}

/// A hello with `intent` on a connection of its own: the connection,
/// kept open, and the broker's first answer.
fn hello_keep(socket: &Path, name: &str, intent: Intent) -> (UnixStream, ServerMsg) {
    let mut s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let hello = ClientMsg::Hello(Hello {
        name: name.into(),
        pid: std::process::id(),
        intent,
    });
    let mut out = Preamble::ours().to_bytes().to_vec();
    out.extend_from_slice(&proto::encode(&hello).unwrap());
    s.write_all(&out).unwrap();
    let mut pre = [0u8; Preamble::LEN];
    s.read_exact(&mut pre).unwrap();
    let msg = proto::read_frame::<ServerMsg>(&mut s, &mut Vec::new())
        .unwrap()
        .expect("the broker closed without a word");
    (s, msg)
}

/// A test of this file as the test binary names it (`--exact`): every
/// file of tests/ is a module of one binary.
fn qualified(test: &str) -> String {
    let module = module_path!().split_once("::").map_or("", |(_, m)| m);
    format!("{module}::{test}")
}

/// A consumer's hello claiming another process's pid (1, or the
/// broker's): stats show the pid the kernel gave the connection
/// (SO_PEERCRED), which is what doctor reads /proc for, never the claim.
#[test]
fn stats_show_the_kernels_pid_not_the_one_a_hello_claims() {
    let env = Env::start(&stream_config(""));
    let broker_pid = env.broker.pid();
    let _liars: Vec<_> = [("claims-init", 1), ("claims-broker", broker_pid)]
        .into_iter()
        .map(|(name, pid)| {
            common::raw_subscribe_claiming(&env.socket(), name, pid, common::consume_request(2))
        })
        .collect();
    let st = env.wait_for("both liars subscribed", |s| {
        s.streams.iter().flat_map(|s| &s.consumers).count() == 2
    });
    for c in st.streams.iter().flat_map(|s| &s.consumers) {
        assert_eq!(
            c.pid,
            std::process::id(),
            "{} is shown with the pid it claimed",
            c.name
        );
    }
}

/// A user the socket's mode keeps out (the broker never sees the
/// attempt) is told so: the mode and owner of the socket or of its
/// folder, and what admits another user (`allow_uids`, `allow_gids`),
/// not asked whether a broker runs.
#[test]
fn a_user_the_sockets_mode_keeps_out_is_told_why() {
    if !is_root("running a consumer as another uid") {
        return;
    }
    let env = Env::start(&stream_config(""));
    let bin = tempfile::tempdir().unwrap();
    std::fs::set_permissions(bin.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let exe = bin.path().join("batchcast");
    std::fs::copy(common::EXE, &exe).unwrap();
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    let as_guest = || {
        let out = run(command(&exe)
            .args([
                "consume",
                "--stream",
                "train",
                "--connect-timeout",
                "1",
                "--socket",
            ])
            .arg(env.socket())
            .uid(GUEST)
            .gid(GUEST));
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    // The socket's folder is the broker owner's alone (0700).
    let dir = env.socket().parent().unwrap().to_path_buf();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    let said = as_guest();
    assert!(
        said.contains(&format!("you (uid {GUEST}) may not open"))
            && said.contains("its folder")
            && said.contains("mode 700")
            && said.contains("allow_uids"),
        "{said}"
    );
    assert!(!said.contains("is `batchcast serve` running"), "{said}");
    // The folder open, the socket owner-only (0600).
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let said = as_guest();
    assert!(
        said.contains("mode 600, owned by uid 0") && said.contains("allow_gids"),
        "{said}"
    );
}
