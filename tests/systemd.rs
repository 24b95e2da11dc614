//! The broker as a per-host service: started by socket activation with
//! Debian's real `systemd-socket-activate` and restarted (SIGTERM, then
//! SIGKILL) under running consumers while the socket stays open, as
//! systemd's `Restart=always` with a `.socket` unit does; readiness and
//! stopping told to the service manager (`NOTIFY_SOCKET`); and the
//! activation variables it refuses, by name.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use batchcast::StatsClient;
use batchcast::proto::StatsReply;
use batchcast_broker::config::StreamToml;
use batchcast_cli::report::ConsumerReport;
use nix::sys::signal::Signal;

use crate::common;

use common::{EXE, LIMIT, command, report, skip};

const ACTIVATE: &str = "/usr/bin/systemd-socket-activate";

/// 300 samples an epoch in batches of 10, 3 epochs, shuffled.
fn config() -> String {
    let fields: [(&str, &str, &[u64]); 2] = [("image", "u8", &[3, 8, 8]), ("label", "i64", &[])];
    StreamToml::synthetic("train", 10, 300, &fields)
        .epochs(3)
        .key("seed", 31)
        .key("slots", 12)
        .key("max_batch_size", 16)
        .key("workers", 2)
        .key("min_consumers", 1)
        .fill("full")
        .to_toml()
}

fn digests(r: &ConsumerReport) -> Vec<(u64, Option<String>)> {
    r.epochs
        .iter()
        .map(|e| (e.epoch, e.digest.clone()))
        .collect()
}

fn stats(socket: &Path) -> Option<StatsReply> {
    StatsClient::connect(Some(socket.to_path_buf()))
        .and_then(|mut c| c.fetch())
        .ok()
}

/// Stats from `socket` once `pred` holds; past `LIMIT`, fails with the
/// service manager's `log` (what the brokers it started said).
fn wait_for(
    socket: &Path,
    log: &Path,
    what: &str,
    pred: impl Fn(&StatsReply) -> bool,
) -> StatsReply {
    let t0 = Instant::now();
    loop {
        if let Some(s) = stats(socket).filter(|s| pred(s)) {
            return s;
        }
        if t0.elapsed() >= LIMIT {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            panic!("timed out waiting for {what}:\n{text}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `systemd-socket-activate` holding `socket` and, from the first
/// connection on, a shell that plays the service manager's
/// `Restart=always`: it starts `batchcast serve` on the socket (fd 3,
/// `LISTEN_PID` its own) again whenever it exits, until `stop` exists.
fn manager(socket: &Path, cfg: &Path, log: &Path, stop: &Path) -> Child {
    let restart = r#"while [ ! -e "$3" ]; do bash -c 'export LISTEN_PID=$$; exec "$0" serve --config "$1"' "$1" "$2"; done"#;
    let log = std::fs::File::create(log).unwrap();
    let mut cmd = command(ACTIVATE);
    batchcast_cli::child::die_with_parent(&mut cmd);
    cmd.arg("-l")
        .arg(socket)
        .args(["bash", "-c", restart, "manager", EXE])
        .arg(cfg)
        .arg(stop)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap()
}

#[test]
fn socket_activated_brokers_restart_under_consumers_without_an_error() {
    if !Path::new(ACTIVATE).exists() {
        skip(
            "socket activation under systemd-socket-activate",
            "no /usr/bin/systemd-socket-activate (Debian's systemd package; scripts/setup installs it)",
        );
        return;
    }
    let reference = {
        let env = common::Env::start(&config());
        let a = env.consumer(&["--digest", "--resume", "0:0"]);
        let b = env.consumer(&["--digest", "--resume", "0:0", "--batch-size", "16"]);
        let (a, b) = (report(a), report(b));
        assert!(a.ok && b.ok, "{a:#?}\n{b:#?}");
        digests(&a)
    };
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("broker.toml");
    std::fs::write(&cfg, config()).unwrap();
    let socket = dir.path().join("b.sock");
    let stop = dir.path().join("stop");
    let log = dir.path().join("manager.log");
    let mut mgr = manager(&socket, &cfg, &log, &stop);
    let t0 = Instant::now();
    while !socket.exists() {
        assert!(t0.elapsed() < LIMIT, "systemd-socket-activate never bound");
        std::thread::sleep(Duration::from_millis(10));
    }
    // The first connection, made while no broker runs, starts one. A
    // stats client gives a handshake 2 s, which a broker started under the
    // suite's load on 2 cores can miss (CI did once): the first answer is
    // awaited, as a person would ask again.
    wait_for(&socket, &log, "a socket-activated broker", |s| {
        s.streams.len() == 1
    });
    let mut kids = Vec::new();
    let ride = ["--digest", "--sleep-ms", "10", "--resume", "0:0"];
    kids.push(common::spawn_consumer(
        &socket,
        &[&ride[..], &["--name", "a"]].concat(),
    ));
    kids.push(common::spawn_consumer(
        &socket,
        &[
            &ride[..],
            &["--name", "b", "--batch-size", "16", "--no-mailbox"],
        ]
        .concat(),
    ));
    let mut pids = Vec::new();
    for signal in [Signal::SIGTERM, Signal::SIGKILL] {
        let s = wait_for(&socket, &log, "both consumers to read on", |s| {
            s.streams[0].consumers.len() == 2
                && s.streams[0].consumers.iter().all(|c| c.delivered >= 10)
        });
        pids.push(s.broker_pid);
        harness_signal(s.broker_pid, signal);
        // The socket stays: the broker leaves the manager's file alone,
        // and connections queue on it until the next broker takes them.
        assert!(socket.exists(), "the socket file went with the broker");
    }
    let reports: Vec<ConsumerReport> = kids.into_iter().map(report).collect();
    let last = stats(&socket).map(|s| s.broker_pid);
    std::fs::write(&stop, "").unwrap();
    if let Some(pid) = last {
        harness_signal(pid, Signal::SIGTERM);
    }
    let _ = mgr.kill();
    let _ = mgr.wait();
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    for r in &reports {
        assert!(r.ok && r.ended, "{r:#?}\n{text}");
        assert_eq!(r.reconnects, 2, "{r:#?}");
        assert_eq!(digests(r), reference, "{r:#?}");
    }
    assert!(
        last.is_some_and(|p| !pids.contains(&p)) && pids[0] != pids[1],
        "three brokers served ({pids:?}, then {last:?})"
    );
    assert!(
        text.matches("socket activation: serving").count() >= 3,
        "every broker served the inherited socket:\n{text}"
    );
}

fn harness_signal(pid: u32, signal: Signal) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), signal);
    // Gone before the next look at its stats (a new one answers then).
    let t0 = Instant::now();
    while Path::new(&format!("/proc/{pid}")).exists() && t0.elapsed() < LIMIT {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        if stat
            .rsplit(')')
            .next()
            .is_some_and(|s| s.trim_start().starts_with('Z'))
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn readiness_and_stopping_are_told_to_the_service_manager() {
    let dir = tempfile::tempdir().unwrap();
    let notify: PathBuf = dir.path().join("notify");
    let manager = UnixDatagram::bind(&notify).unwrap();
    manager.set_read_timeout(Some(LIMIT)).unwrap();
    let cfg = dir.path().join("broker.toml");
    std::fs::write(&cfg, config()).unwrap();
    let mut cmd = command(EXE);
    cmd.env("NOTIFY_SOCKET", &notify);
    batchcast_cli::child::die_with_parent(&mut cmd);
    let socket = dir.path().join("b.sock");
    let mut broker = batchcast_cli::harness::BrokerProcess::spawn_with(
        cmd,
        Some(&cfg),
        &socket,
        Some(&dir.path().join("broker.log")),
    )
    .unwrap();
    let mut buf = [0u8; 512];
    let n = manager.recv(&mut buf).unwrap();
    let ready = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(
        ready.starts_with("READY=1\n") && ready.contains("serving 1 stream(s)"),
        "{ready}"
    );
    // Ready means serving: a client is answered at once.
    assert!(stats(&socket).is_some());
    broker.terminate(LIMIT).unwrap();
    let n = manager.recv(&mut buf).unwrap();
    let stopping = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(stopping.starts_with("STOPPING=1"), "{stopping}");
}

/// What a service manager may pass that the broker refuses, naming it:
/// several sockets, or a descriptor 3 that is no listening Unix socket.
#[test]
fn activation_the_broker_cannot_serve_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("export LISTEN_FDS=2", "passed 2 sockets"),
        (
            "export LISTEN_FDS=1; exec 3</dev/null",
            "not a listening Unix stream socket",
        ),
    ];
    for (setup, want) in cases {
        let script = format!(r#"export LISTEN_PID=$$; {setup}; exec "$0" serve --socket "$1""#);
        let out = common::run(
            command("bash")
                .args(["-c", &script, EXE])
                .arg(dir.path().join("b.sock")),
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(want),
            "{setup}: {err}"
        );
    }
    // Variables meant for another process are not ours: served as usual.
    let mut cmd = command(EXE);
    cmd.env("LISTEN_PID", "1").env("LISTEN_FDS", "1");
    let socket = dir.path().join("own.sock");
    let mut broker = batchcast_cli::harness::BrokerProcess::spawn_with(
        cmd,
        None,
        &socket,
        Some(&dir.path().join("own.log")),
    )
    .unwrap();
    assert!(stats(&socket).is_some());
    broker.terminate(LIMIT).unwrap();
    assert!(!socket.exists(), "its own socket file is removed");
}

/// The shipped units as systemd reads them: `systemd-analyze verify` says
/// nothing about them (it warns, exit 0, of an unknown key: a misspelt
/// copy shows the check sees one). Only `ExecStart`'s path is this
/// build's, as the unit's `/usr/local/bin/batchcast` is not installed here.
#[test]
fn the_shipped_units_pass_systemd_analyze_verify() {
    const ANALYZE: &str = "/usr/bin/systemd-analyze";
    if !Path::new(ANALYZE).exists() {
        skip(
            "systemd-analyze verify of deploy/'s units",
            "no /usr/bin/systemd-analyze (Debian's systemd package; scripts/setup installs it)",
        );
        return;
    }
    let deploy = common::repo().join("deploy");
    let service = std::fs::read_to_string(deploy.join("batchcast.service")).unwrap();
    let socket = std::fs::read_to_string(deploy.join("batchcast.socket")).unwrap();
    let installed = "ExecStart=/usr/local/bin/batchcast ";
    assert!(service.contains(installed), "{service}");
    let service = service.replace(installed, &format!("ExecStart={EXE} "));
    let verify = |socket: &str| {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("batchcast.service"), &service).unwrap();
        std::fs::write(dir.path().join("batchcast.socket"), socket).unwrap();
        let out = common::run(
            command(ANALYZE)
                .args(["verify", "./batchcast.socket", "./batchcast.service"])
                .current_dir(dir.path()),
        );
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.success(), text)
    };
    let (ok, text) = verify(&socket);
    assert!(ok && text.trim().is_empty(), "{text}");
    let (_, text) = verify(&socket.replace("Backlog=", "Backlg="));
    assert!(text.contains("Unknown key 'Backlg'"), "{text}");
}

/// `key=` of a unit file's lines.
fn unit_key<'a>(unit: &'a str, key: &str) -> &'a str {
    unit.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
        .unwrap_or_else(|| panic!("no {key}= in the unit"))
}

/// The shipped socket unit and broker config reach the users they are
/// meant to: the socket made as the unit says (its mode and group, by
/// `systemd-socket-activate` and then set as systemd sets them), the
/// broker on the shipped `[broker]` section. A member of the socket's
/// group (a supplementary group, as `usermod -aG` makes it) reads the
/// stream; another user cannot open the socket, and were it world-open,
/// the broker would still refuse them. (`nogroup` stands in for the
/// unit's `batchcast`, which this host does not have.)
#[test]
fn the_shipped_socket_unit_admits_its_groups_members_and_no_one_else() {
    if !Path::new(ACTIVATE).exists() || !common::is_root("the socket group test") {
        return;
    }
    const MEMBER: u32 = 65533;
    const OUTSIDER: u32 = 65532;
    let deploy = common::repo().join("deploy");
    let unit = std::fs::read_to_string(deploy.join("batchcast.socket")).unwrap();
    let mode = u32::from_str_radix(unit_key(&unit, "SocketMode"), 8).unwrap();
    let group = unit_key(&unit, "SocketGroup");
    let listen = unit_key(&unit, "ListenStream");
    assert_eq!(mode, 0o660, "the socket is its group's, not everyone's");
    let shipped = std::fs::read_to_string(deploy.join("broker.toml")).unwrap();
    let cfg =
        batchcast_broker::config::Config::parse(&shipped, &deploy.join("broker.toml")).unwrap();
    assert_eq!(
        cfg.broker.allow_groups,
        [group],
        "the config admits the unit's group"
    );
    assert_eq!(cfg.broker.socket.as_deref(), Some(Path::new(listen)));
    let nogroup = nix::unistd::Group::from_name("nogroup").unwrap().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let open = std::fs::Permissions::from_mode(0o755);
    std::fs::set_permissions(dir.path(), open.clone()).unwrap();
    let socket = dir.path().join("b.sock");
    let broker_part = shipped.split("[[stream]]").next().unwrap();
    let config = broker_part
        .replace(&format!("\"{group}\""), "\"nogroup\"")
        .replace(listen, socket.to_str().unwrap())
        + &StreamToml::synthetic("train", 10, 100, &[("x", "u8", &[16])])
            .epochs(1)
            .to_toml();
    let cfg = dir.path().join("broker.toml");
    std::fs::write(&cfg, config).unwrap();
    let (stop, log) = (dir.path().join("stop"), dir.path().join("manager.log"));
    let mut mgr = manager(&socket, &cfg, &log, &stop);
    let t0 = Instant::now();
    while !socket.exists() {
        assert!(t0.elapsed() < LIMIT, "systemd-socket-activate never bound");
        std::thread::sleep(Duration::from_millis(10));
    }
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(mode)).unwrap();
    std::os::unix::fs::chown(&socket, None, Some(nogroup.gid.as_raw())).unwrap();
    // The consumer, as a user other than root: a copy others may run.
    let exe = dir.path().join("batchcast");
    std::fs::copy(EXE, &exe).unwrap();
    std::fs::set_permissions(&exe, open).unwrap();
    let consume_as = |uid: u32, groups: &str| {
        let out = common::run(
            command("setpriv")
                .args([
                    &format!("--reuid={uid}"),
                    &format!("--regid={uid}"),
                    groups,
                    "--",
                ])
                .arg(&exe)
                .args(["consume", "--json", "--verify", "--socket"])
                .arg(&socket)
                .env("BATCHCAST_BROKER_UID", "0")
                .current_dir(dir.path()),
        );
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr)
    };
    let member = consume_as(MEMBER, &format!("--groups={}", nogroup.gid));
    let r: ConsumerReport = serde_json::from_str(member.lines().next().unwrap_or_default())
        .unwrap_or_else(|e| panic!("{e}: {member}"));
    assert!(r.ok && r.ended && r.batches == 10, "{r:#?}");
    let outsider = consume_as(OUTSIDER, "--clear-groups");
    // Kept out by the file's mode (the broker never sees it): told so,
    // with the mode and what admits another user.
    assert!(
        outsider.contains("may not open the broker's socket")
            && outsider.contains("mode 660")
            && outsider.contains("allow_groups"),
        "{outsider}"
    );
    // Defence in depth: with the file world-open the broker still refuses.
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    let outsider = consume_as(OUTSIDER, "--clear-groups");
    assert!(outsider.contains("not allowed"), "{outsider}");
    std::fs::write(&stop, "").unwrap();
    if let Some(s) = stats(&socket) {
        harness_signal(s.broker_pid, Signal::SIGTERM);
    }
    let _ = mgr.kill();
    let _ = mgr.wait();
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        !text.contains("only its owner"),
        "no warning about the socket's reach:\n{text}"
    );
}
