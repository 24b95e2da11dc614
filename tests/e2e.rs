//! End-to-end tests: the real `batchcast` binary as broker, real consumer
//! processes (`batchcast consume`, built on the client library), real
//! sockets and shared memory. Every wait is bounded, so a deadlock fails a
//! test instead of hanging it.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use batchcast::mailbox::{ConsumerMailbox, Notice, Totals};
use batchcast::proto::{self, ClientMsg, ErrorCode, Preamble, Release, ServerMsg, StatsReply};
use batchcast_broker::config::StreamToml;
use batchcast_cli::harness;
use batchcast_cli::report::ConsumerReport;

use crate::common;

use common::{
    EXE, Env, Guard, LIMIT, command, expect_error, http_get, is_root, raw_exchange, raw_subscribe,
    report, run,
};

fn config(extra: &str, len: u64, batch: u64) -> String {
    let fields: [(&str, &str, &[u64]); 3] = [
        ("image", "u8", &[3, 16, 16]),
        ("label", "i64", &[]),
        ("weights", "f32", &[5]),
    ];
    StreamToml::synthetic("train", batch, len, &fields)
        .key("seed", 11)
        .key("slots", 6)
        .key("workers", 2)
        .raw(extra)
        .to_toml()
}

#[test]
fn four_consumers_get_every_batch_of_every_epoch_once_in_order_verified() {
    // 1000 samples, batches of 32, last batch short: 32 batches per epoch.
    let env = Env::start(&config(
        "epochs = 3\ndrop_last = false\nmin_consumers = 4",
        1000,
        32,
    ));
    // Two take batches through shared-memory mailboxes (the default), two
    // on the socket: the same bytes either way.
    let kids: Vec<_> = (0..4)
        .map(|i| {
            let name = format!("c{i}");
            let mut args = vec!["--verify", "--digest", "--window", "3", "--name", &name];
            if i % 2 == 1 {
                args.push("--no-mailbox");
            }
            env.consumer(&args)
        })
        .collect();
    let reports: Vec<ConsumerReport> = kids.into_iter().map(report).collect();
    for r in &reports {
        assert!(r.ok && r.ended, "{r:#?}");
        assert_eq!(r.batches, 3 * 32);
        assert_eq!(r.samples, 3 * 1000, "each epoch covers the dataset once");
        assert_eq!(r.verified_samples, 3000);
        assert_eq!(r.verify_failures, 0);
        assert_eq!(
            r.epochs
                .iter()
                .map(|e| (e.epoch, e.samples, e.complete))
                .collect::<Vec<_>>(),
            vec![(0, 1000, true), (1, 1000, true), (2, 1000, true)]
        );
    }
    let digests: Vec<_> = reports
        .iter()
        .map(|r| {
            r.epochs
                .iter()
                .map(|e| e.digest.clone())
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(
        digests.iter().all(|d| *d == digests[0]),
        "consumers saw different bytes"
    );
    assert_ne!(digests[0][0], digests[0][1], "epochs are reshuffled");
    let s = env.wait_for("all consumers to leave", |s| {
        s.streams[0].consumers.is_empty()
    });
    let st = &s.streams[0];
    assert_eq!(
        st.batches_produced, 96,
        "the pipeline ran once, not once per consumer"
    );
    assert_eq!(st.deliveries, 4 * 96);
    assert!(st.finished);
    assert_eq!(st.free_slots, st.slots);
}

#[test]
fn a_consumer_killed_while_holding_batches_does_not_stop_the_others() {
    let env = Env::start(&config("epochs = 3\nmin_consumers = 3", 600, 10));
    let a = env.consumer(&["--verify", "--name", "a"]);
    let b = env.consumer(&["--verify", "--name", "b"]);
    let victim = env.consumer(&[
        "--window",
        "4",
        "--hold",
        "3",
        "--sleep-ms",
        "20",
        "--name",
        "victim",
    ]);
    let victim_pid = victim.id();
    env.wait_for("the victim to hold batches", |s| {
        s.streams[0]
            .consumers
            .iter()
            .any(|c| c.name == "victim" && c.held >= 3)
    });
    harness::signal(victim_pid, nix::sys::signal::Signal::SIGKILL);
    for r in [report(a), report(b)] {
        assert!(r.ok && r.ended, "{r:#?}");
        assert_eq!(r.batches, 3 * 60);
        assert_eq!(r.verified_samples, 3 * 600);
    }
    let s = env.wait_for("every consumer to be gone", |s| {
        s.streams[0].consumers.is_empty()
    });
    let st = &s.streams[0];
    assert_eq!(st.in_use, 0, "the dead consumer's slots were reclaimed");
    assert_eq!(st.free_slots, st.slots);
    assert_eq!(st.departed, 3);
    drop(victim);
}

#[test]
fn a_slow_consumer_throttles_the_broker_without_memory_growth() {
    // Both start at the first batch, so delivered counts are comparable.
    let env = Env::start(&config("min_consumers = 2", 100_000, 8));
    let fast = env.consumer(&["--name", "fast", "--verify"]);
    let slow = env.consumer(&["--name", "slow", "--sleep-ms", "10", "--max-batches", "150"]);
    let first = env.wait_for("the slow consumer to get going", |s| {
        s.streams[0]
            .consumers
            .iter()
            .any(|c| c.name == "slow" && c.delivered >= 20)
    });
    let rss0 = harness::rss_kb(env.broker.pid()).unwrap();
    for _ in 0..20 {
        let s = env.stats();
        let st = &s.streams[0];
        if st.consumers.len() < 2 {
            break;
        }
        let d: Vec<u64> = st.consumers.iter().map(|c| c.delivered).collect();
        // The fast consumer can never be more than the slots ahead.
        assert!(
            d[0].abs_diff(d[1]) <= st.slots as u64,
            "consumers out of step: {d:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let r = report(slow);
    assert!(r.ok, "{r:#?}");
    let s = env.stats();
    let rss1 = harness::rss_kb(env.broker.pid()).unwrap();
    assert!(
        s.streams[0].producer_blocked_s > 0.0,
        "the pipeline was never throttled"
    );
    assert!(
        rss1 < rss0 + 2048,
        "broker RSS grew from {rss0} KiB to {rss1} KiB"
    );
    assert!(s.streams[0].batches_produced >= first.streams[0].batches_produced);
    let mut fast = fast;
    fast.kill().unwrap();
    fast.wait().unwrap();
}

/// An endless stream of 12 slots with a lag limit of 6: a mailbox
/// consumer (sent the ring ahead) that reads 2 ms a batch owes all of the
/// ring while the pipeline keeps ahead of it.
fn ahead_config() -> String {
    let fields: [(&str, &str, &[u64]); 2] = [("image", "u8", &[3, 8, 8]), ("label", "i64", &[])];
    StreamToml::synthetic("train", 40, 4000, &fields)
        .key("seed", 5)
        .key("slots", 12)
        .key("workers", 2)
        .key("lag_limit", 6)
        .to_toml()
}

#[test]
fn a_consumer_joining_beside_one_that_owes_the_ring_never_gets_it_detached() {
    // The newcomer skipped the batches the reader owed when it joined: the
    // reader is not behind it on those. (It was detached within 0.5 s.)
    let env = Env::start(&ahead_config());
    let reader = env.consumer(&[
        "--verify",
        "--sleep-ms",
        "2",
        "--max-batches",
        "1000",
        "--name",
        "reader",
    ]);
    env.wait_for("the reader to start", |s| {
        s.streams[0].consumers.iter().any(|c| c.delivered > 20)
    });
    let newcomer = env.consumer(&[
        "--verify",
        "--join",
        "immediate",
        "--sleep-ms",
        "2",
        "--max-batches",
        "300",
        "--name",
        "newcomer",
    ]);
    let r = report(reader);
    assert!(
        r.ok && r.batches == 1000 && r.verify_failures == 0,
        "{r:#?}"
    );
    // The newcomer reads at the same pace; scheduling jitter on a busy
    // machine may put it 7 behind (then it is told so, and nothing else).
    let n = report(newcomer);
    assert!(
        n.verify_failures == 0 && (n.ok || n.error_code.as_deref() == Some("LagLimit")),
        "{n:#?}"
    );
}

#[test]
fn a_newcomer_that_stalls_is_the_one_the_lag_limit_detaches() {
    // (The reader was detached in its place, and the stalled consumer
    // then handed out batches of other data after its pause.)
    let env = Env::start(&ahead_config());
    let reader = env.consumer(&[
        "--verify",
        "--sleep-ms",
        "2",
        "--max-batches",
        "1000",
        "--name",
        "reader",
    ]);
    env.wait_for("the reader to start", |s| {
        s.streams[0].consumers.iter().any(|c| c.delivered > 20)
    });
    let staller = env.consumer(&[
        "--verify",
        "--join",
        "immediate",
        "--stall-after",
        "3",
        "--stall-ms",
        "4000",
        "--max-batches",
        "10",
        "--reconnect-timeout",
        "0",
        "--name",
        "staller",
    ]);
    let r = report(reader);
    assert!(
        r.ok && r.batches == 1000 && r.verify_failures == 0,
        "{r:#?}"
    );
    let st = report(staller);
    assert_eq!(st.error_code.as_deref(), Some("LagLimit"), "{st:#?}");
    assert_eq!((st.batches, st.verify_failures), (3, 0), "{st:#?}");
}

#[test]
fn a_straggler_beyond_the_lag_limit_is_detached_with_a_clear_error() {
    let env = Env::start(&config("lag_limit = 3\nmin_consumers = 2", 100_000, 8));
    let slow = env.consumer(&["--name", "slow", "--sleep-ms", "50"]);
    let fast = env.consumer(&["--name", "fast", "--verify", "--max-batches", "400"]);
    let r = report(slow);
    assert!(!r.ok);
    assert_eq!(r.error_code.as_deref(), Some("LagLimit"), "{r:#?}");
    let msg = r.error.unwrap();
    assert!(
        msg.contains("lag_limit of 3") && msg.contains("behind"),
        "{msg}"
    );
    let f = report(fast);
    assert!(f.ok && f.batches == 400, "{f:#?}");
    let s = env.stats();
    assert_eq!(s.streams[0].detached, 1);
    assert!(env.log().contains("detached"), "the broker logs the detach");
}

#[test]
fn consumers_error_promptly_when_the_broker_is_killed() {
    // Both from the first batch: a second consumer that joined after it
    // would wait for the next epoch (12,500 batches at 2 ms).
    let mut env = Env::start(&config("min_consumers = 2", 100_000, 8));
    let kids: Vec<_> = (0..2)
        .map(|i| {
            // Without one (the default is 60 s) it fails as soon as it can.
            let name = format!("c{i}");
            env.consumer(&[
                "--sleep-ms",
                "2",
                "--name",
                &name,
                "--reconnect-timeout",
                "0",
            ])
        })
        .collect();
    env.wait_for("both consumers to receive batches", |s| {
        s.streams[0].consumers.len() == 2 && s.streams[0].consumers.iter().all(|c| c.delivered > 10)
    });
    let t0 = Instant::now();
    env.broker.kill().unwrap();
    for k in kids {
        let r = report(k);
        let noticed = t0.elapsed();
        assert!(
            r.error
                .as_deref()
                .is_some_and(|e| e.contains("broker closed")),
            "{r:#?}"
        );
        // Generous bound: detection is an EOF on the socket, typically < 10 ms.
        assert!(
            noticed < Duration::from_secs(3),
            "consumer took {noticed:?} to notice"
        );
    }
}

#[test]
fn sigterm_says_goodbye_to_every_consumer_and_removes_the_socket() {
    let env = Env::start(&format!(
        "{}\n{}",
        config("", 100_000, 8),
        config("", 500, 4).replace("name = \"train\"", "name = \"val\"")
    ));
    let stop = ["--sleep-ms", "1", "--reconnect-timeout", "0"];
    let t = env.consumer(&[&["--stream", "train"][..], &stop].concat());
    let v = env.consumer(&[&["--stream", "val", "--verify"][..], &stop].concat());
    let s = env.wait_for("a consumer on each stream", |s| {
        s.streams.iter().all(|st| st.consumers.len() == 1)
    });
    assert_eq!(
        s.streams
            .iter()
            .map(|s| s.name.as_str())
            .collect::<Vec<_>>(),
        vec!["train", "val"]
    );
    let socket = env.socket();
    let mut env = env;
    let status = env.broker.terminate(Duration::from_secs(10)).unwrap();
    assert!(status.success(), "broker exit status {status}");
    for r in [report(t), report(v)] {
        assert!(
            r.error.as_deref().is_some_and(|e| e.contains("Shutdown")),
            "{r:#?}"
        );
        assert_eq!(r.verify_failures, 0);
    }
    assert!(!socket.exists(), "socket file left behind");
}

/// Connects raw, sends `bytes`, returns the broker's preamble and first frame.
#[test]
fn bad_input_gets_a_clear_error_and_other_consumers_are_unaffected() {
    let env = Env::start(&config("", 100_000, 8));
    let good = env.consumer(&[
        "--verify",
        "--sleep-ms",
        "2",
        "--max-batches",
        "300",
        "--name",
        "good",
    ]);
    env.wait_for("the good consumer", |s| {
        s.streams[0].consumers.iter().any(|c| c.delivered > 0)
    });
    let sock = env.socket();
    let ours = Preamble::ours().to_bytes();

    let (pre, msg) = raw_exchange(&sock, b"GET / HTTP/1.1\r\n\r\n");
    assert_eq!(pre.version, proto::PROTOCOL_VERSION);
    expect_error(msg, ErrorCode::NotBatchcast, "not a batchcast client");

    // A client of a newer release: the refusal names both releases and
    // says to upgrade the broker.
    let mut v999 = ours;
    v999[4..6].copy_from_slice(&999u16.to_le_bytes());
    v999[6..8].copy_from_slice(&[9, 9]);
    let (_, msg) = raw_exchange(&sock, &v999);
    expect_error(
        msg.clone(),
        ErrorCode::VersionMismatch,
        "the client is batchcast 9.9 (protocol 999)",
    );
    let broker = format!(
        "the broker batchcast {} (protocol {})",
        proto::ReleaseLine::OURS,
        proto::PROTOCOL_VERSION
    );
    expect_error(msg.clone(), ErrorCode::VersionMismatch, &broker);
    expect_error(msg, ErrorCode::VersionMismatch, "upgrade the broker");
    // A client from before the preamble carried releases (protocol 12).
    let mut v12 = ours;
    v12[4..8].copy_from_slice(&[12, 0, 0, 0]);
    expect_error(
        raw_exchange(&sock, &v12).1,
        ErrorCode::VersionMismatch,
        "batchcast 0.1 or earlier (protocol 12)",
    );

    let mut garbage = ours.to_vec();
    garbage.extend_from_slice(&[5, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff]);
    expect_error(
        raw_exchange(&sock, &garbage).1,
        ErrorCode::MalformedFrame,
        "malformed frame",
    );

    let mut huge = ours.to_vec();
    huge.extend_from_slice(&u32::MAX.to_le_bytes());
    expect_error(
        raw_exchange(&sock, &huge).1,
        ErrorCode::FrameTooLarge,
        "exceeds the limit",
    );

    let r = report(env.consumer(&["--stream", "nope"]));
    assert_eq!(r.error_code.as_deref(), Some("UnknownStream"), "{r:#?}");
    assert!(r.error.unwrap().contains("this broker serves: train"));

    let r = report(env.consumer(&["--window", "7"]));
    assert_eq!(r.error_code.as_deref(), Some("InvalidRequest"), "{r:#?}");
    assert!(
        r.error
            .unwrap()
            .contains("window 7 exceeds the stream's 6 slots")
    );

    let typo = env.dir.path().join("typo.toml");
    std::fs::write(
        &typo,
        config("", 100, 8).replace("batch_size", "batch_szie"),
    )
    .unwrap();
    let out = run(command(EXE)
        .args(["serve", "--config"])
        .arg(&typo)
        .arg("--socket")
        .arg(env.dir.path().join("t.sock")));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("batch_szie") && err.contains("line 3"),
        "{err}"
    );

    let out = run(command(EXE)
        .args(["serve", "--config"])
        .arg(env.dir.path().join("broker.toml"))
        .arg("--socket")
        .arg(&sock));
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("already serving"),
        "a second broker on a live socket is refused"
    );

    let r = report(good);
    assert!(
        r.ok && r.batches == 300 && r.verified_samples == 300 * 8,
        "{r:#?}"
    );
}

#[test]
fn consumers_cannot_write_into_shared_batches() {
    let env = Env::start(&config("min_consumers = 2", 100_000, 8));
    let other = env.consumer(&["--verify", "--max-batches", "200", "--name", "other"]);
    let mut opts = batchcast::ConsumerOptions {
        socket: Some(env.socket()),
        ..Default::default()
    };
    opts.name = "writer".into();
    let mut me = batchcast::Consumer::connect(opts).unwrap();
    let (base, len) = me.arena();
    let batch = me.next().unwrap().unwrap();
    let image = batch.field("image").unwrap();
    let ptr = image.bytes().as_ptr();
    assert!(
        ptr >= base && ptr < base.wrapping_add(len),
        "the view points into the shared arena: zero-copy"
    );
    let page = (base as usize) as *mut libc::c_void;
    // SAFETY: asks the kernel to make our own mapping writable; it must
    // refuse (the arena is sealed), and if it did not, nothing is written.
    let rc = unsafe { libc::mprotect(page, 4096, libc::PROT_READ | libc::PROT_WRITE) };
    let errno = std::io::Error::last_os_error();
    assert_eq!(rc, -1, "a consumer could make the shared arena writable");
    assert_eq!(errno.raw_os_error(), Some(libc::EACCES), "{errno}");
    drop(batch);
    drop(me);
    let r = report(other);
    assert!(r.ok && r.verify_failures == 0, "{r:#?}");
}

/// Runs `batchcast serve` that must exit by itself (not serve, not hang):
/// its status and stderr. Bounded: a broker still running after LIMIT
/// fails the test.
fn serve_must_exit(config: Option<&Path>, socket: &Path) -> (std::process::ExitStatus, String) {
    let mut cmd = command(EXE);
    cmd.arg("serve");
    if let Some(c) = config {
        cmd.arg("--config").arg(c);
    }
    let out = run(cmd.arg("--socket").arg(socket));
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_socket_folder_another_user_could_write_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let open = dir.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&open, &link).unwrap();
    let mut cases = vec![(open.clone(), "mode 777"), (link, "symbolic link")];
    if is_root("a socket folder owned by another user") {
        let theirs = dir.path().join("theirs");
        std::fs::create_dir(&theirs).unwrap();
        std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o700)).unwrap();
        nix::unistd::chown(&theirs, Some(65534.into()), Some(65534.into())).unwrap();
        cases.push((theirs, "belongs to uid 65534"));
    }
    for (folder, why) in cases {
        let (status, err) = serve_must_exit(None, &folder.join("b.sock"));
        assert_eq!(status.code(), Some(1), "{why}: {status:?}\n{err}");
        assert!(
            err.contains("refusing the socket folder")
                && err.contains(why)
                && err.contains("chmod 700"),
            "{why}: {err}"
        );
    }
    // A sticky folder others may write (like /tmp) is fine.
    let sticky = dir.path().join("sticky");
    std::fs::create_dir(&sticky).unwrap();
    std::fs::set_permissions(&sticky, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let log = dir.path().join("sticky.log");
    let b = common::broker(None, &sticky.join("b.sock"), Some(&log)).unwrap();
    drop(b);
}

#[test]
fn a_client_refuses_a_socket_served_by_another_user() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    if !is_root("a socket served by another user") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let path = dir.path().join("b.sock");
    // Another user's process listening where the broker should be.
    let _impostor = Guard(command("python3")
        .args([
            "-c",
            "import socket, sys\ns = socket.socket(socket.AF_UNIX)\ns.bind(sys.argv[1])\ns.listen(8)\nwhile True:\n    s.accept()[0].close()",
        ])
        .arg(&path)
        .uid(65534)
        .gid(65534)
        .spawn()
        .unwrap());
    let t0 = Instant::now();
    while !path.exists() {
        assert!(t0.elapsed() < LIMIT, "the impostor never listened");
        std::thread::sleep(Duration::from_millis(10));
    }
    let opts = |uid: Option<u32>| batchcast::ConsumerOptions {
        socket: Some(path.clone()),
        stream: "train".into(),
        broker_uid: uid,
        ..Default::default()
    };
    let err = batchcast::Consumer::connect(opts(None)).unwrap_err();
    assert!(
        matches!(
            err,
            batchcast::Error::Impostor {
                uid: 65534,
                expected: 0,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string().contains("BATCHCAST_BROKER_UID=65534"),
        "{err}"
    );
    let stats = batchcast::StatsClient::connect(Some(path.clone())).unwrap_err();
    assert!(
        matches!(stats, batchcast::Error::Impostor { .. }),
        "{stats}"
    );
    // Told to expect that user, the client talks to it (which hangs up:
    // not waited for as a broker restarting, which would take the default
    // reconnect timeout's 60 s).
    let err = batchcast::Consumer::connect(batchcast::ConsumerOptions {
        reconnect_timeout: Duration::ZERO,
        ..opts(Some(65534))
    })
    .unwrap_err();
    assert!(!matches!(err, batchcast::Error::Impostor { .. }), "{err}");
}

#[test]
fn a_config_key_out_of_bounds_is_refused_naming_the_key_and_its_limit() {
    let dir = tempfile::tempdir().unwrap();
    for (key, line, limit) in [
        ("workers", "workers = 100000", "256"),
        ("min_consumers", "min_consumers = 4294967295", "1024"),
    ] {
        let cfg = dir.path().join(format!("{key}.toml"));
        let text = config("", 100, 8);
        let text = match key {
            "workers" => text.replace("workers = 2", line),
            _ => text.replace("workers = 2", &format!("workers = 2\n{line}")),
        };
        std::fs::write(&cfg, text).unwrap();
        let (status, err) = serve_must_exit(Some(&cfg), &dir.path().join(format!("{key}.sock")));
        assert_eq!(status.code(), Some(1), "{line}: {status:?}\n{err}");
        assert!(
            err.contains(&format!("{key} = ")) && err.contains(limit),
            "{line}: {err}"
        );
    }
}

#[test]
fn times_a_client_reports_are_clamped_to_its_own_connection_and_line() {
    let env = Env::start(&config("", 100_000, 8));
    let good = env.consumer(&["--verify", "--max-batches", "500", "--name", "good"]);
    for mailbox in [false, true] {
        let name = if mailbox {
            "forger-mailbox"
        } else {
            "forger-socket"
        };
        let (mut sock, welcome, mut fds) = raw_subscribe(
            &env.socket(),
            name,
            mailbox,
            batchcast::JoinPolicy::Immediate,
            None,
        );
        // Take a batch and release it claiming centuries of waiting; a
        // mailbox consumer releases one through its mailbox and one on the
        // socket, so both of its sums are huge.
        if mailbox {
            let spec = welcome.mailbox.expect("a mailbox was asked for");
            let mb = ConsumerMailbox::open(fds.remove(1), spec).unwrap();
            let t0 = Instant::now();
            let mut seqs = Vec::new();
            while seqs.len() < 2 {
                if let Some(Notice::Batch(b)) = mb.pop().unwrap() {
                    seqs.push(b.seq);
                }
                assert!(t0.elapsed() < LIMIT, "no batches");
                std::thread::sleep(Duration::from_millis(1));
            }
            let forged = Totals {
                wait_ns: u64::MAX,
                busy_ns: u64::MAX - 1,
                hold_ns: u64::MAX,
            };
            assert!(mb.push_release(proto::Unit::Shared(seqs[0]), forged));
            let r = ClientMsg::Release(Release {
                unit: proto::Unit::Shared(seqs[1]),
                wait_ns: u64::MAX,
                busy_ns: u64::MAX,
                taken: Default::default(),
            });
            sock.write_all(&proto::encode(&r).unwrap()).unwrap();
        } else {
            let seq = loop {
                match proto::read_frame::<ServerMsg>(&mut sock, &mut Vec::new()).unwrap() {
                    Some(ServerMsg::Batch(b)) => break b.seq,
                    Some(_) => {}
                    None => panic!("the broker closed the connection"),
                }
            };
            let r = ClientMsg::Release(Release {
                unit: proto::Unit::Shared(seq),
                wait_ns: u64::MAX,
                busy_ns: u64::MAX,
                taken: Default::default(),
            });
            sock.write_all(&proto::encode(&r).unwrap()).unwrap();
        }
        let s = env.wait_for("the forged release", |s| {
            s.streams[0]
                .consumers
                .iter()
                .chain(&s.streams[0].past_consumers)
                .any(|c| c.name == name && (c.wait_s > 0.0 || c.left.is_some()))
        });
        let all = s.streams[0]
            .consumers
            .iter()
            .chain(&s.streams[0].past_consumers);
        for c in all.filter(|c| c.name == name) {
            // Nobody waits, works or holds longer than it has been connected.
            for (what, v) in [("wait", c.wait_s), ("busy", c.busy_s), ("hold", c.hold_s)] {
                assert!(
                    v.is_finite() && v <= c.connected_s + 1e-3,
                    "{name}: {what}_s = {v} after {} s connected",
                    c.connected_s
                );
            }
        }
        drop(sock);
    }
    let r = report(good);
    assert!(
        r.ok && r.batches == 500,
        "the others are unaffected: {r:#?}"
    );
}

#[test]
fn stats_command_shows_streams_and_consumers() {
    let env = Env::start(&config("", 100_000, 8));
    let c = env.consumer(&[
        "--name",
        "stats-probe",
        "--sleep-ms",
        "5",
        "--max-batches",
        "100",
    ]);
    env.wait_for("the consumer", |s| {
        s.streams[0].consumers.iter().any(|c| c.delivered > 0)
    });
    let out = run(command(EXE).arg("stats").arg("--socket").arg(env.socket()));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("stream `train`")
            && text.contains("stats-probe")
            && text.contains("batches")
            && text.contains("units"),
        "{text}"
    );
    let out = run(command(EXE)
        .args(["stats", "--json"])
        .arg("--socket")
        .arg(env.socket()));
    let s: StatsReply = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(s.broker_pid, env.broker.pid());
    assert!(report(c).ok);
}

#[test]
fn a_gpu_subscription_the_broker_cannot_serve_is_refused_and_host_consumers_go_on() {
    let env = Env::start(&config("gpu_slots = 2", 100_000, 8));
    let host = env.consumer(&["--verify", "--max-batches", "200", "--name", "host"]);
    // A GPU no host has (on a machine without CUDA the driver is missing
    // first; either way the broker names the device and the way out).
    let gpu_hello = |window| {
        let hello = proto::ClientMsg::Hello(proto::Hello {
            name: "gpu".into(),
            pid: std::process::id(),
            intent: proto::Intent::Consume(proto::ConsumeRequest {
                join: batchcast::JoinPolicy::NextEpoch,
                device: Some(proto::DeviceRequest {
                    uuid: [0xee; 16],
                    ordinal: 0,
                    name: "no such GPU".into(),
                }),
                mailbox: false,
                ..common::consume_request(window)
            }),
        });
        let mut bytes = Preamble::ours().to_bytes().to_vec();
        bytes.extend_from_slice(&proto::encode(&hello).unwrap());
        raw_exchange(&env.socket(), &bytes).1
    };
    // A window the GPU arena cannot hold is refused before the broker
    // touches a GPU (nothing is allocated for a subscription it refuses).
    expect_error(
        gpu_hello(3),
        ErrorCode::InvalidRequest,
        "exceeds the 2 device slots",
    );
    expect_error(
        gpu_hello(2),
        ErrorCode::DeviceUnavailable,
        "cannot deliver to cuda:0",
    );
    let s = env.stats();
    assert!(s.streams[0].gpus.is_empty(), "{:?}", s.streams[0].gpus);
    assert!(
        s.streams[0].consumers.iter().all(|c| c.device.is_none()),
        "the refused consumer left no trace"
    );
    let r = report(host);
    assert!(r.ok && r.batches == 200 && r.verify_failures == 0, "{r:#?}");
}

#[test]
fn consume_cli_without_a_gpu_says_so_and_points_to_the_host_path() {
    let env = Env::start(&config("", 1000, 8));
    // (On a GPU host this consumer would simply work: gpu.sh covers that.)
    if std::path::Path::new("/dev/nvidiactl").exists() {
        common::skip(
            "a `--device cuda:0` consumer refused without a driver",
            "this host has a GPU; bench/gpu.sh covers it there",
        );
    } else {
        let r = report(env.consumer(&["--device", "cuda:0"]));
        assert!(!r.ok, "{r:#?}");
        let err = r.error.unwrap_or_default();
        assert!(
            err.contains("no CUDA driver") && err.contains("device=\"cpu\""),
            "{err}"
        );
    }
    let out = run(command(EXE)
        .args(["consume", "--device", "tpu:0", "--socket"])
        .arg(env.socket()));
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cuda:N"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A broker started with `serve --metrics 127.0.0.1:0` on `cfg` in `dir`:
/// its process, socket and metrics address.
fn broker_with_metrics(dir: &Path, cfg: &str) -> (Guard, PathBuf, String) {
    let path = dir.join("broker.toml");
    std::fs::write(&path, cfg).unwrap();
    let log = dir.join("broker.log");
    let sock = dir.join("b.sock");
    let mut broker = Guard(
        command(EXE)
            .args(["serve", "--metrics", "127.0.0.1:0", "--config"])
            .arg(&path)
            .arg("--socket")
            .arg(&sock)
            .env("NO_COLOR", "1")
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let addr = common::metrics_address(&log, &mut broker.0);
    (broker, sock, addr)
}

/// `serve --metrics`: Prometheus text with the same numbers as stats.
#[test]
fn the_broker_serves_prometheus_metrics_that_match_its_stats() {
    let dir = tempfile::tempdir().unwrap();
    let (mut broker, sock, addr) = broker_with_metrics(dir.path(), &config("epochs = 1", 256, 32));
    let consumer = common::spawn_consumer(
        &sock,
        &[
            "--name",
            "scraped",
            "--hold",
            "1",
            "--window",
            "2",
            "--max-batches",
            "8",
        ],
    );
    let r = report(consumer);
    assert_eq!(r.batches, 8);
    let get = |path: &str| http_get(&addr, path);
    let body = get("/metrics");
    assert!(body.starts_with("HTTP/1.1 200 OK"), "{body}");
    assert!(
        body.contains("# TYPE batchcast_stream_deliveries_total counter"),
        "{body}"
    );
    assert!(
        body.contains("batchcast_stream_slots{stream=\"train\"} 6"),
        "{body}"
    );
    assert!(
        body.contains("# TYPE batchcast_consumer_taken_samples_total counter"),
        "{body}"
    );
    let stats = batchcast::StatsClient::connect(Some(sock.clone()))
        .unwrap()
        .fetch()
        .unwrap();
    let st = &stats.streams[0];
    assert!(
        body.contains(&format!(
            "batchcast_stream_batches_produced_total{{stream=\"train\"}} {}",
            st.batches_produced
        )),
        "{body}\n{st:?}"
    );
    assert!(get("/other").starts_with("HTTP/1.1 404"));
    grafana_asks_only_for_what_is_served(&body);
    // Probes: alive, and ready (no stream failed).
    let live = get("/healthz");
    assert!(
        live.starts_with("HTTP/1.1 200 OK") && live.ends_with("ok: 1 streams\n"),
        "{live}"
    );
    let ready = get("/readyz");
    assert!(
        ready.starts_with("HTTP/1.1 200 OK") && ready.ends_with("ready: 1 streams\n"),
        "{ready}"
    );
    harness::signal(broker.id(), nix::sys::signal::Signal::SIGTERM);
    harness::wait_timeout(&mut broker.0, LIMIT).unwrap();
}

/// Every metric the Grafana dashboard (`deploy/grafana/batchcast.json`)
/// queries is one `body` (a broker's `/metrics`) declares, and every
/// panel queries something.
fn grafana_asks_only_for_what_is_served(body: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/grafana/batchcast.json");
    let dash: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let mut asked = std::collections::BTreeSet::new();
    for panel in dash["panels"].as_array().unwrap() {
        let targets = panel["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{panel}");
        for t in targets {
            let expr = t["expr"].as_str().unwrap();
            let mut rest = expr;
            while let Some(at) = rest.find("batchcast_") {
                let name: String = rest[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                rest = &rest[at + name.len()..];
                asked.insert(name);
            }
        }
    }
    assert!(
        asked.contains("batchcast_consumer_wait_seconds_total"),
        "{asked:?}"
    );
    for name in &asked {
        assert!(
            body.contains(&format!("# TYPE {name} ")),
            "the dashboard asks for {name}, which /metrics does not serve"
        );
    }
}

/// The metrics address is open to anyone who can reach it: 1,000 idle
/// connections hold at most `MAX_CONNECTIONS` of the broker's descriptors
/// (the rest are answered 503 and closed), idle ones are closed after
/// `REQUEST_WITHIN`, and the Unix socket's clients (stats, trainers) are
/// served throughout; once the flood ends the probes answer again.
#[test]
fn a_flood_of_idle_metrics_connections_takes_no_descriptors_from_trainers() {
    use batchcast_broker::metrics::{MAX_CONNECTIONS, REQUEST_WITHIN};
    let dir = tempfile::tempdir().unwrap();
    let (mut broker, sock, addr) = broker_with_metrics(dir.path(), &config("", 256, 32));
    let fds = |pid: u32| {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .count()
    };
    let before = fds(broker.id());
    let mut flood = Vec::new();
    for _ in 0..1000 {
        match std::net::TcpStream::connect(&addr) {
            Ok(c) => flood.push(c),
            Err(e) => panic!("connect {}: {e}", flood.len()),
        }
    }
    std::thread::sleep(Duration::from_millis(300));
    let held = fds(broker.id());
    assert!(
        held <= before + MAX_CONNECTIONS + 8,
        "1,000 idle connections hold {held} descriptors (from {before})"
    );
    // The Unix socket's clients are served during the flood.
    let stats = batchcast::StatsClient::connect(Some(sock.clone()))
        .unwrap()
        .fetch()
        .unwrap();
    assert_eq!(stats.streams.len(), 1);
    let r = report(common::spawn_consumer(&sock, &["--max-batches", "4"]));
    assert_eq!(r.batches, 4, "{r:#?}");
    // A probe during the flood is answered at once (503 busy, or closed),
    // never left hanging.
    let t0 = Instant::now();
    let mut probe = std::net::TcpStream::connect(&addr).unwrap();
    probe
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let _ = write!(probe, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
    let mut busy = String::new();
    let answered = probe.read_to_string(&mut busy);
    assert!(
        answered.is_ok_and(|_| busy.starts_with("HTTP/1.1 "))
            || t0.elapsed() < Duration::from_secs(5),
        "{busy:?} after {:?}",
        t0.elapsed()
    );
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    // Idle seats are given back; after the flood the probes answer 200.
    drop(flood);
    std::thread::sleep(REQUEST_WITHIN + Duration::from_millis(500));
    assert!(fds(broker.id()) <= before + 8, "seats not given back");
    assert!(http_get(&addr, "/healthz").starts_with("HTTP/1.1 200 OK"));
    harness::signal(broker.id(), nix::sys::signal::Signal::SIGTERM);
    harness::wait_timeout(&mut broker.0, LIMIT).unwrap();
}

/// `/readyz` says 503 once a stream failed, naming it and why; `/healthz`
/// still says the broker is alive (other streams serve on).
#[test]
fn readiness_fails_naming_a_failed_stream_while_liveness_holds() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("images/cats");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::write(root.join("broken.jpg"), b"not a jpeg at all").unwrap();
    let cfg = format!(
        "{}\n[[stream]]\nname = \"photos\"\nbatch_size = 1\non_error = \"fail\"\n[stream.image_folder]\nroot = \"{}\"\n[stream.transform]\nresize = [8, 8]\ndtype = \"u8\"\n",
        config("epochs = 1", 64, 8),
        root.parent().unwrap().display()
    );
    let (mut broker, sock, addr) = broker_with_metrics(dir.path(), &cfg);
    assert!(http_get(&addr, "/readyz").starts_with("HTTP/1.1 200 OK"));
    let r = report(common::spawn_consumer(&sock, &["--stream", "photos"]));
    assert!(!r.ok, "{r:#?}");
    let t0 = Instant::now();
    let ready = loop {
        let ready = http_get(&addr, "/readyz");
        if !ready.starts_with("HTTP/1.1 200") || t0.elapsed() > LIMIT {
            break ready;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        ready.starts_with("HTTP/1.1 503")
            && ready.contains("stream `photos` failed: ")
            && ready.contains("broken.jpg"),
        "{ready}"
    );
    assert!(http_get(&addr, "/healthz").starts_with("HTTP/1.1 200 OK"));
    let r = report(common::spawn_consumer(&sock, &["--max-batches", "2"]));
    assert!(r.ok, "the other stream serves on: {r:#?}");
    harness::signal(broker.id(), nix::sys::signal::Signal::SIGTERM);
    harness::wait_timeout(&mut broker.0, LIMIT).unwrap();
}

/// Runs `f` on a thread and waits for it at most `LIMIT` (a client that
/// would block forever fails the test instead of hanging it).
fn bounded<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(LIMIT)
        .unwrap_or_else(|_| panic!("timed out: {what}"))
}

#[test]
fn a_mailbox_consumer_keeps_to_its_window_and_gives_back_what_it_never_read() {
    // The broker sends mailbox consumers every batch at once; the client
    // keeps the window. 4 slots, 2 epochs of 6 batches.
    let mut cfg = config("epochs = 2\nmin_consumers = 2", 48, 8);
    cfg = cfg.replace("slots = 6", "slots = 4");
    let env = Env::start(&cfg);
    let opts = |name: &str, window: u32| batchcast::ConsumerOptions {
        socket: Some(env.socket()),
        stream: "train".into(),
        window,
        name: name.into(),
        mailbox: true,
        ..Default::default()
    };
    let mut a = batchcast::Consumer::connect(opts("holder", 2)).unwrap();
    let b = batchcast::Consumer::connect(opts("reader", 1)).unwrap();
    assert!(a.welcome().mailbox.is_some() && b.welcome().mailbox.is_some());
    let first = a.next().unwrap().unwrap();
    let second = a.next().unwrap().unwrap();
    // Holding its whole window, it gets no third batch, though the broker
    // has sent it one: an error after a short grace, not a hang.
    match a.next_event() {
        Err(batchcast::Error::WindowFull { held: 2 }) => {}
        other => panic!("expected WindowFull with 2 held, got {other:?}"),
    }
    // Released one: the next batch is the one after `second`, nothing lost.
    drop(first);
    let third = a.next().unwrap().unwrap();
    assert_eq!(
        (third.epoch(), third.index()),
        (second.epoch(), second.index() + 1)
    );
    drop(second);
    // Leaving while the program still holds `third`: the connection stays
    // open for it, but the batches sent and never read are given back. The
    // slots are a ring: the other consumer reads on until the ring comes
    // round to `third`'s slot, and to the end once it is released.
    drop(a);
    let reader = std::thread::spawn(move || {
        let mut b = b;
        let mut got = Vec::new();
        for batch in b.by_ref() {
            let batch = batch.unwrap_or_else(|e| panic!("reader after {got:?}: {e}"));
            got.push((batch.epoch(), batch.index()));
        }
        got
    });
    // (The broker takes back what was sent and never read once it has
    // read the holder's leaving: a busy machine once showed the reader at
    // the held slot before that, the holder still counting 3.)
    let s = env.wait_for(
        "the reader to reach the held slot, the unread taken back",
        |s| {
            let c = &s.streams[0].consumers;
            c.iter().any(|c| c.name == "reader" && c.delivered == 2 + 4)
                && c.iter().any(|c| c.name == "holder" && c.held == 1)
        },
    );
    let holder = s.streams[0]
        .consumers
        .iter()
        .find(|c| c.name == "holder")
        .expect("the holder is still connected");
    assert_eq!(
        holder.held, 1,
        "only the batch its program holds: {holder:?}"
    );
    assert!(!reader.is_finished(), "the ring cannot pass the held slot");
    drop(third);
    env.wait_for("the holder to leave", |s| {
        s.streams[0].consumers.iter().all(|c| c.name != "holder")
    });
    let got = bounded("the other consumer to read both epochs", move || {
        reader.join().unwrap()
    });
    let want: Vec<(u64, u64)> = (0..2).flat_map(|e| (0..6).map(move |i| (e, i))).collect();
    assert_eq!(got, want);
    env.wait_for("both to leave", |s| s.streams[0].consumers.is_empty());
}

/// A client meeting a broker of another release (played by a listener that
/// answers with a newer preamble: nothing else can run a different
/// release here) refuses it with both releases named and what to upgrade.
#[test]
fn a_broker_of_another_release_is_refused_naming_both_releases() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("newer.sock");
    let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let next = proto::ReleaseLine {
        major: proto::ReleaseLine::OURS.major,
        minor: proto::ReleaseLine::OURS.minor + 1,
    };
    let newer = Preamble {
        version: proto::PROTOCOL_VERSION + 1,
        release: next,
    };
    let fake = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut pre = [0u8; 8];
        s.read_exact(&mut pre).unwrap();
        s.write_all(&newer.to_bytes()).unwrap();
        // Stay open until the client gives up, so it fails on the preamble
        // alone and not on a closed socket.
        let _ = s.read(&mut [0u8; 64]);
        Preamble::parse(pre).unwrap()
    });
    let kid = common::spawn_consumer(&socket, &[]);
    let r = harness::wait_report(kid, LIMIT).unwrap();
    let client = fake.join().unwrap();
    assert_eq!(
        client,
        Preamble::ours(),
        "the client announces its own release"
    );
    let err = r.error.expect("the client refuses the broker");
    for needle in [
        &format!(
            "the client is batchcast {} (protocol {})",
            proto::ReleaseLine::OURS,
            proto::PROTOCOL_VERSION
        ),
        &format!(
            "the broker batchcast {next} (protocol {})",
            proto::PROTOCOL_VERSION + 1
        ),
        "upgrade the client",
        &format!("pip install '{}'", next.pip_spec()),
    ] {
        assert!(err.contains(needle), "`{err}` lacks `{needle}`");
    }
}

/// `lag_limit` bounds the consumer that holds the others, never one that
/// cannot get batches because of it: beside a reader taking a batch per
/// 100 ms on a ring of 16 with `lag_limit = 8`, a trainer that joins
/// gets its batches, and the slow reader finishes too: neither is
/// detached (the joiner never held the ring; the slow one, which paces
/// it, keeps within 8 of the least behind). The docs' example for
/// groups is in `tests/groups.rs`.
#[test]
fn the_lag_limit_detaches_the_slow_reader_not_the_joiner_it_holds() {
    let fields: [(&str, &str, &[u64]); 2] = [("image", "u8", &[3, 8, 8]), ("label", "i64", &[])];
    let body = StreamToml::synthetic("train", 8, 100_000, &fields)
        .key("seed", 3)
        .key("slots", 16)
        .key("workers", 2)
        .key("lag_limit", 8)
        .to_toml();
    let env = Env::start(&body);
    let slow = env.consumer(&["--name", "slow", "--sleep-ms", "100", "--max-batches", "60"]);
    env.wait_for("the slow reader to read", |s| {
        s.streams[0].consumers.iter().any(|c| c.delivered >= 2)
    });
    // One joins at once (paced by the slow reader, as lockstep is), one
    // waits for the next epoch (owed nothing meanwhile).
    let waiting = env.consumer(&["--name", "waiting", "--max-batches", "1"]);
    let joiner = env.consumer(&[
        "--name",
        "joiner",
        "--join",
        "immediate",
        "--verify",
        "--max-batches",
        "30",
    ]);
    let j = report(joiner);
    assert!(j.ok && j.batches == 30 && j.verify_failures == 0, "{j:#?}");
    let s = report(slow);
    assert!(s.ok && s.batches == 60, "{s:#?}");
    assert_eq!(env.stats().streams[0].detached, 0);
    let mut waiting = waiting;
    common::sigkill(&mut waiting);
}

/// `batchcast consume` that reads nothing and fails says only why (no
/// "0 batches" summary before the error); with --json the report comes
/// as always, for a program.
#[test]
fn a_consumer_that_fails_before_any_batch_prints_only_the_error() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nobody.sock");
    let out = common::run(common::command(common::EXE).args([
        "consume",
        "--stream",
        "train",
        "--connect-timeout",
        "0",
        "--socket",
        socket.to_str().unwrap(),
    ]));
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(!out.status.success());
    assert!(stdout.trim().is_empty(), "{stdout}");
    assert!(stderr.contains("cannot connect"), "{stderr}");
    let out = common::run(common::command(common::EXE).args([
        "consume",
        "--json",
        "--stream",
        "train",
        "--connect-timeout",
        "0",
        "--socket",
        socket.to_str().unwrap(),
    ]));
    let report: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).unwrap();
    assert_eq!(report["batches"], 0, "{report}");
}

/// `batchcast demo --synthetic` says what its comparison shows (the
/// mechanics: synthetic batches cost nothing to make, so sharing saves
/// little) and where sharing pays (the image demo), beside its verdict.
#[test]
fn the_synthetic_demo_says_what_its_comparison_shows() {
    let out = common::run(common::command(common::EXE).args([
        "demo",
        "--synthetic",
        "--consumers",
        "2",
        "--epochs",
        "1",
        "--step-ms",
        "1",
    ]));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{said}");
    assert!(said.contains("shared vs baseline"), "{said}");
    assert!(
        said.contains("synthetic batches cost next to nothing to make")
            && said.contains("`batchcast demo` without --synthetic"),
        "{said}"
    );
}

/// Pipeline threads matched to demand (`workers` left out, the default):
/// allowed every core (`[broker] max_cpu_share = 1`), a stream read by a
/// trainer taking a batch every 20 ms keeps its threads waiting for slots,
/// so one works and the rest are parked, said in `stats` and `batchcast
/// stats`; the bytes are those of a stream of a fixed thread. (Growth and
/// the pool shared by streams are on a simulated clock:
/// `stream/autoscale.rs`'s tests.)
#[test]
fn at_the_defaults_pipeline_threads_follow_the_trainers_demand() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
    let fields: [(&str, &str, &[u64]); 2] = [("image", "u8", &[3, 32, 32]), ("label", "i64", &[])];
    let stream = |name: &str, extra: &str| {
        StreamToml::synthetic(name, 32, 4000, &fields)
            .key("seed", 5)
            .key("slots", 6)
            .epochs(2)
            .raw(extra)
            .to_toml()
    };
    let env = Env::start(&format!(
        "[broker]\nmax_cpu_share = 1.0\n\n{}\n{}",
        stream("auto", ""),
        stream("fixed", "workers = 1")
    ));
    let slow = env.consumer(&["--stream", "auto", "--digest", "--sleep-ms", "20"]);
    let by = |s: &StatsReply| {
        s.streams
            .iter()
            .find(|x| x.name == "auto")
            .cloned()
            .unwrap()
    };
    let st = by(&env.wait_for("the threads the trainer needs", |s| {
        let st = by(s);
        st.batches_produced > 0 && st.workers_active == 1
    }));
    assert!(st.workers_auto && st.workers == cores, "{st:#?}");
    let table = run(command(EXE).args(["stats", "--socket"]).arg(env.socket()));
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(
        table.contains(&format!("1 of {cores} threads working")),
        "{table}"
    );
    let fixed = by_name(&env.stats(), "fixed");
    assert!(
        !fixed.workers_auto && fixed.workers_active == 1,
        "{fixed:#?}"
    );
    let r = env.report(slow);
    assert!(r.ok && r.ended, "{r:#?}");
    let f = env.report(env.consumer(&["--stream", "fixed", "--digest"]));
    assert_eq!(
        common::digests(&r),
        common::digests(&f),
        "the bytes whatever the number of threads"
    );
}

fn by_name(s: &StatsReply, name: &str) -> proto::StreamStats {
    s.streams.iter().find(|x| x.name == name).cloned().unwrap()
}
