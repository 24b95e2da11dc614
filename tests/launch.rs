//! `batchcast launch` end to end: the real launcher starting the real
//! broker and real trainer processes (`batchcast consume`, a Rust client),
//! then reading what it wrote. Every wait is bounded.

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use batchcast_broker::config::StreamToml;
use batchcast_cli::harness;
use batchcast_cli::report::ConsumerReport;
use batchcast_cli::report::{Summary, exit};

use crate::common;

use common::{EXE, LIMIT};

/// A synthetic stream: `epochs` epochs of 16 batches of 32.
fn stream(epochs: u64, extra: &str) -> String {
    let fields: [(&str, &str, &[u64]); 2] = [("image", "u8", &[3, 16, 16]), ("label", "i64", &[])];
    StreamToml::synthetic("train", 32, 512, &fields)
        .fill("full")
        .epochs(epochs)
        .key("shuffle", true)
        .key("seed", 11)
        .key("slots", 6)
        .raw(extra)
        .to_toml()
}

fn launch(dir: &Path, sweep: &str, extra_args: &[&str]) -> (Output, Option<Summary>) {
    let file = dir.join("sweep.toml");
    std::fs::write(&file, sweep).unwrap();
    let run = dir.join("run");
    let output = common::run(
        common::command(EXE)
            .arg("launch")
            .arg(&file)
            .arg("--run-dir")
            .arg(&run)
            .args(extra_args),
    );
    let summary = std::fs::read_to_string(run.join("summary.json"))
        .ok()
        .map(|s| serde_json::from_str(&s).unwrap());
    (output, summary)
}

fn text(o: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The trainer's own account: `consume --json` ends its log with it.
fn own_report(log: &Path) -> ConsumerReport {
    let s = std::fs::read_to_string(log).unwrap();
    let line = s
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| {
            panic!("{} has no report:\n{s}", log.display());
        });
    serde_json::from_str(line).unwrap()
}

#[test]
fn three_trainers_run_to_completion_and_the_summary_agrees_with_what_they_received() {
    let dir = tempfile::tempdir().unwrap();
    let sweep = format!(
        r#"{}
[[trainer]]
name = "t"
copies = 3
command = ["{{batchcast}}", "consume", "--json", "--verify", "--sleep-ms", "{{ms}}"]
grid = {{ ms = [2] }}
env = {{ TRAINER_INDEX = "{{index}}" }}
"#,
        stream(3, "")
    );
    let (out, summary) = launch(dir.path(), &sweep, &[]);
    assert!(out.status.success(), "{}", text(&out));
    let summary = summary.expect("summary.json");
    assert_eq!(summary.exit_code, exit::OK);
    let run = &summary.shared;
    assert_eq!(run.trainers.len(), 3);
    assert!(!run.interrupted && run.failed == 0);
    let broker = &run.brokers[0];
    assert!(broker.started);
    assert_eq!(broker.batches_produced, 48, "3 epochs × 16 batches");
    let mut batches = 0;
    assert_eq!(run.trainers.len(), 3, "{run:?}");
    for t in &run.trainers {
        assert_eq!(t.state, "done", "{t:?}");
        assert_eq!(t.exit_code, Some(0));
        assert_eq!(t.measured_by, "broker");
        let own = own_report(&t.log);
        assert!(own.ok && own.ended, "{own:?}");
        assert_eq!(own.name, t.name, "the launcher names trainers");
        assert_eq!(
            (t.batches, t.samples),
            (own.batches, own.samples),
            "{}: the broker's count vs what the trainer received",
            t.name
        );
        assert_eq!(t.samples, 3 * 512);
        assert_eq!(own.verified_samples, 3 * 512);
        // Each step sleeps 2 ms, so at least that much busy time per
        // batch after an epoch's first was reported to the broker.
        assert!(
            t.busy_s >= 0.002 * (t.batches - 3) as f64,
            "{}: busy {} s over {} batches",
            t.name,
            t.busy_s,
            t.batches
        );
        // The stall share is the trainer's wait over its loop time.
        let loop_s = t.wait_s + t.busy_s;
        assert!(t.wait_s >= 0.0 && loop_s > 0.0, "{t:?}");
        assert!(
            (t.stall_pct - 100.0 * t.wait_s / loop_s).abs() < 1e-6,
            "{t:?}"
        );
        batches += t.batches;
    }
    assert_eq!(broker.deliveries, batches);
    assert_eq!(run.samples, 3 * 3 * 512);
    // CPU is accounted: the run's covers what each trainer says it spent
    // (their own getrusage, taken before they exit) and its broker's
    // (clock ticks: 0 for a broker this idle is possible).
    let trainers_cpu: f64 = run.trainers.iter().map(|t| own_report(&t.log).cpu_s).sum();
    let broker_cpu = run.brokers[0].cpu_s;
    assert!(trainers_cpu > 0.0 && broker_cpu >= 0.0, "{run:?}");
    assert!(
        run.cpu_s >= trainers_cpu + broker_cpu - 0.02,
        "{trainers_cpu} {run:?}"
    );
    let per_sample = run.cpu_ms_per_sample.expect("samples were made");
    assert!(
        (per_sample - 1000.0 * run.cpu_s / run.samples as f64).abs() < 1e-6,
        "{run:?}"
    );
    // The per-copy environment reached each trainer (its name and index).
    let stdout = String::from_utf8_lossy(&out.stdout);
    for name in ["t-0", "t-1", "t-2"] {
        assert!(stdout.contains(name), "{stdout}");
    }
    assert!(stdout.contains("shared run"), "{stdout}");
    assert!(
        dir.path().join("run/shared/broker.log").exists()
            && dir.path().join("run/shared/broker.toml").exists()
    );
}

#[test]
fn a_crashing_trainer_is_marked_failed_its_slots_come_back_and_the_others_finish() {
    let dir = tempfile::tempdir().unwrap();
    // A broker of the test's own, reused by the launch, so its stats can
    // be read after the trainers are gone.
    let cfg = dir.path().join("broker.toml");
    std::fs::write(&cfg, stream(2, "min_consumers = 3")).unwrap();
    let sock = dir.path().join("b.sock");
    let broker = common::broker(Some(&cfg), &sock, Some(&dir.path().join("b.log"))).unwrap();
    let sweep = format!(
        r#"[launch]
socket = "{}"

[[trainer]]
name = "ok"
copies = 2
command = ["{{batchcast}}", "consume", "--json", "--verify", "--sleep-ms", "1"]

[[trainer]]
name = "crash"
command = ["{{batchcast}}", "consume", "--json", "--window", "4", "--hold", "2", "--abort-after", "5"]
"#,
        sock.display()
    );
    let (out, summary) = launch(dir.path(), &sweep, &[]);
    assert_eq!(out.status.code(), Some(exit::FAILED), "{}", text(&out));
    let summary = summary.expect("summary.json");
    let t = |n: &str| {
        summary
            .shared
            .trainers
            .iter()
            .find(|t| t.name == n)
            .unwrap()
    };
    let crash = t("crash");
    assert_eq!(crash.state, "failed");
    assert_eq!(crash.signal, Some(libc::SIGABRT), "{crash:?}");
    assert!(
        crash
            .log_tail
            .as_deref()
            .is_some_and(|l| l.contains("aborting")),
        "{crash:?}"
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("crash FAILED"),
        "{}",
        text(&out)
    );
    for n in ["ok-0", "ok-1"] {
        let ok = t(n);
        assert_eq!(ok.state, "done");
        assert_eq!(ok.samples, 2 * 512, "{n} got every sample of both epochs");
        assert!(own_report(&ok.log).ok);
    }
    // Nothing is held any more: the crashed trainer's slots were reclaimed.
    let stats = broker.stats().unwrap();
    let st = &stats.streams[0];
    assert_eq!(
        (st.in_use, st.free_slots, st.consumers.len()),
        (0, st.slots, 0),
        "{st:#?}"
    );
    let gone = st
        .past_consumers
        .iter()
        .find(|c| c.name == "crash")
        .unwrap();
    assert_eq!(gone.left.as_deref(), Some("disconnected"));
    assert!(
        !summary.shared.brokers[0].started,
        "the test's broker was reused"
    );
}

#[test]
fn stop_all_stops_the_others_when_one_fails_and_a_trainer_that_never_subscribed_does_not_block_the_stream()
 {
    let dir = tempfile::tempdir().unwrap();
    // `early` fails before subscribing: the stream waits for 3 consumers,
    // so the launcher must start it for the other two.
    let sweep = format!(
        r#"[launch]
on_failure = "continue"
{}
[[trainer]]
name = "early"
command = ["sh", "-c", "echo cannot find my dataset; exit 7"]

[[trainer]]
name = "ok"
copies = 2
command = ["{{batchcast}}", "consume", "--json", "--sleep-ms", "1"]
"#,
        stream(2, "")
    );
    let (out, summary) = launch(dir.path(), &sweep, &[]);
    assert_eq!(out.status.code(), Some(exit::FAILED), "{}", text(&out));
    let s = summary.unwrap();
    let early = &s.shared.trainers[0];
    assert_eq!((early.state.as_str(), early.exit_code), ("failed", Some(7)));
    assert!(
        early
            .log_tail
            .as_deref()
            .unwrap()
            .contains("cannot find my dataset")
    );
    for t in &s.shared.trainers[1..] {
        assert_eq!(t.state, "done", "{}", text(&out));
        assert_eq!(t.samples, 2 * 512);
    }

    // The same with stop-all and a trainer that crashes mid-run: the others
    // are stopped, and the exit code says so.
    let sweep = format!(
        r#"[launch]
on_failure = "stop-all"
grace_s = 5
{}
[[trainer]]
name = "slow"
copies = 2
command = ["{{batchcast}}", "consume", "--json", "--sleep-ms", "20"]

[[trainer]]
name = "crash"
command = ["{{batchcast}}", "consume", "--abort-after", "3"]
"#,
        stream(1000, "")
    );
    let (out, summary) = launch(dir.path(), &sweep, &[]);
    assert_eq!(out.status.code(), Some(exit::STOPPED), "{}", text(&out));
    let s = summary.unwrap();
    let states: Vec<&str> = s.shared.trainers.iter().map(|t| t.state.as_str()).collect();
    assert_eq!(states, ["stopped", "stopped", "failed"], "{}", text(&out));
}

/// Starts `batchcast launch` on `sweep` with its run folder `dir/run`,
/// output discarded; returns the launcher and the run folder's path (which
/// every process of the run mentions).
fn launch_in_background(dir: &Path, sweep: &str) -> (common::Guard, String) {
    let file = dir.join("sweep.toml");
    std::fs::write(&file, sweep).unwrap();
    let run = dir.join("run");
    let child = common::command(EXE)
        .arg("launch")
        .arg(&file)
        .arg("--run-dir")
        .arg(&run)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    (common::Guard(child), run.display().to_string())
}

/// Starts `batchcast launch` on `sweep` with its run folder `dir/run`,
/// its output in `dir/launch.out`, `extra` arguments after.
fn launch_to_file(dir: &Path, sweep: &str, extra: &[&str]) -> common::Guard {
    let file = dir.join("sweep.toml");
    std::fs::write(&file, sweep).unwrap();
    common::Guard(
        common::command(EXE)
            .arg("launch")
            .arg(&file)
            .arg("--run-dir")
            .arg(dir.join("run"))
            .args(extra)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(dir.join("launch.out")).unwrap())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// Waits (bounded) for a launcher [`launch_to_file`] started: its exit
/// status, its output and its summary.
fn finish_launch(dir: &Path, launcher: &mut common::Guard) -> (ExitStatus, String, Summary) {
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = launcher.0.try_wait().unwrap() {
            break s;
        }
        assert!(t0.elapsed() < LIMIT, "the launcher did not end");
        std::thread::sleep(Duration::from_millis(50));
    };
    let stdout = std::fs::read_to_string(dir.join("launch.out")).unwrap();
    let summary = std::fs::read_to_string(dir.join("run/summary.json"))
        .map(|s| serde_json::from_str(&s).unwrap())
        .unwrap_or_else(|e| panic!("no summary ({e}):\n{stdout}"));
    (status, stdout, summary)
}

/// Processes whose command line or environment mentions `needle`.
fn processes_mentioning(needle: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.chars().all(|c| c.is_ascii_digit()) || name == std::process::id().to_string() {
            continue;
        }
        for f in ["cmdline", "environ"] {
            if let Ok(b) = std::fs::read(entry.path().join(f))
                && String::from_utf8_lossy(&b).contains(needle)
            {
                let cmd = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
                found.push(format!(
                    "{name}: {}",
                    String::from_utf8_lossy(&cmd).replace('\0', " ")
                ));
                break;
            }
        }
    }
    found
}

/// Entries of /dev/shm that batchcast could have made (its arenas are
/// memfds, so none; a GPU host's other users add their own meanwhile).
fn shm_entries() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| p.to_string_lossy().contains("batchcast"))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn sigint_stops_every_trainer_and_the_broker_and_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let sweep = format!(
        r#"[launch]
grace_s = 10
{}
[[trainer]]
name = "long"
copies = 3
command = ["{{batchcast}}", "consume", "--sleep-ms", "20"]
"#,
        stream(100_000, "")
    );
    let shm_before = shm_entries();
    let (mut child, needle) = launch_in_background(dir.path(), &sweep);
    // Wait until the launcher, the broker and all three trainers are up,
    // then until every trainer has received batches (asking the broker,
    // whose socket its command line names).
    let t0 = Instant::now();
    while processes_mentioning(&needle).len() < 5 {
        assert!(t0.elapsed() < LIMIT, "{:?}", processes_mentioning(&needle));
        std::thread::sleep(Duration::from_millis(50));
    }
    let socket = processes_mentioning(&needle)
        .iter()
        .find_map(|p| {
            let args: Vec<&str> = p.split(' ').collect();
            let i = args.iter().position(|a| *a == "--socket")?;
            args.get(i + 1).map(PathBuf::from)
        })
        .expect("the broker's command line names its socket");
    loop {
        let st = batchcast::StatsClient::connect(Some(socket.clone()))
            .and_then(|mut c| c.fetch())
            .map(|s| {
                s.streams[0]
                    .consumers
                    .iter()
                    .filter(|c| c.delivered > 0)
                    .count()
            });
        if st.as_ref().is_ok_and(|n| *n == 3) {
            break;
        }
        assert!(t0.elapsed() < LIMIT, "trainers never got batches: {st:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    harness::signal(child.id(), nix::sys::signal::Signal::SIGINT);
    let status = harness::wait_timeout(&mut child.0, LIMIT).unwrap();
    assert_eq!(status.code(), Some(exit::INTERRUPTED));
    assert_eq!(processes_mentioning(&needle), Vec::<String>::new());
    assert_eq!(shm_entries(), shm_before, "nothing new in /dev/shm");
    let s: Summary =
        serde_json::from_str(&std::fs::read_to_string(run.join("summary.json")).unwrap()).unwrap();
    assert!(s.shared.interrupted);
    assert_eq!(s.shared.trainers.len(), 3, "{:?}", s.shared.trainers);
    for t in &s.shared.trainers {
        // SIGTERM ends `consume` cleanly or by the signal; either way the
        // launcher stopped it, and it received something first.
        assert_eq!(t.state, "stopped", "{t:?}");
        assert!(t.batches > 0, "{t:?}");
    }
}

#[test]
fn a_launcher_killed_outright_takes_its_broker_and_trainers_with_it() {
    let dir = tempfile::tempdir().unwrap();
    // `sleeper` would never notice the broker going away: only the kernel
    // can tell it that the launcher died.
    let sweep = format!(
        r#"{}
[[trainer]]
name = "orphan"
command = ["{{batchcast}}", "consume", "--sleep-ms", "20"]

[[trainer]]
name = "sleeper"
command = ["sh", "-c", "exec sleep 1000"]
"#,
        stream(100_000, "min_consumers = 1")
    );
    let (mut child, needle) = launch_in_background(dir.path(), &sweep);
    let t0 = Instant::now();
    while processes_mentioning(&needle).len() < 4 {
        assert!(t0.elapsed() < LIMIT, "{:?}", processes_mentioning(&needle));
        std::thread::sleep(Duration::from_millis(50));
    }
    // No chance to clean up: the children learn it from the kernel.
    child.kill().unwrap();
    child.wait().unwrap();
    let t0 = Instant::now();
    while !processes_mentioning(&needle).is_empty() {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "still running after the launcher died: {:?}",
            processes_mentioning(&needle)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Its broker's socket was in the run folder (nothing outside it), and
    // the broker, told by the kernel, removed it.
    let sockets: Vec<_> = std::fs::read_dir(Path::new(&needle).join("shared/sockets"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert_eq!(sockets, Vec::<PathBuf>::new());
}

#[test]
fn bad_sweep_files_are_refused_before_anything_starts() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            format!("{}\n[[trainer]]\nname = \"a\"\n", stream(1, "")),
            "missing field `command`",
        ),
        (
            format!(
                "{}\n[[trainer]]\nname = \"a\"\ncommand = [\"true\"]\ncopise = 2\n",
                stream(1, "")
            ),
            "unknown field `copise`",
        ),
        (
            format!(
                "socket = \"/tmp/b.sock\"\n{}\n[[trainer]]\nname = \"a\"\ncommand = [\"true\"]\n",
                stream(1, "")
            ),
            "`socket` at the top of the file is a key of the [launch] section",
        ),
        (
            format!(
                "{}\n[[trainer]]\nname = \"a\"\ncommand = [\"true\"]\ngpu = 7\n",
                stream(1, "")
            ),
            "GPU 7 does not exist",
        ),
        (
            format!(
                "{}\n[[trainer]]\nname = \"a\"\ncommand = [\"true\", \"--lr\", \"{{lr}}\"]\n",
                stream(1, "")
            ),
            "{lr}, which is not defined",
        ),
        (
            format!(
                "{}\n[[trainer]]\nname = \"a\"\ncommand = [\"true\"]\nstream = \"val\"\n",
                stream(1, "")
            ),
            "stream `val`, which the broker config does not define",
        ),
        (
            format!(
                "{}\n[[trainer]]\nname = \"a\"\ncommand = [\"no-such-trainer-program\"]\n",
                stream(1, "")
            ),
            "`no-such-trainer-program` is not next to",
        ),
        (
            "[[trainer]]\nname = \"a\"\ncommand = [\"true\"]\n".to_string(),
            "no broker to use",
        ),
        (
            format!(
                "[launch]\nbroker_restarts = 101\n{}\n[[trainer]]\nname = \"a\"\ncommand = [\"true\"]\n",
                stream(1, "")
            ),
            "broker_restarts = 101: at most 100",
        ),
        (
            "[launch]\nsocket = \"/tmp/b.sock\"\nbroker_restarts = 1\n[[trainer]]\nname = \"a\"\ncommand = [\"true\"]\n".to_string(),
            "broker_restarts applies to a broker the run starts",
        ),
    ];
    for (sweep, expect) in cases {
        let (out, summary) = launch(dir.path(), &sweep, &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{}", text(&out));
        assert!(err.contains(expect), "expected {expect:?} in:\n{err}");
        assert!(
            err.contains("sweep.toml"),
            "the error names the file: {err}"
        );
        assert!(summary.is_none());
        assert!(
            !dir.path().join("run").exists(),
            "nothing was started or written"
        );
    }
}

#[test]
fn baseline_runs_each_trainer_with_a_private_broker_and_compares() {
    let dir = tempfile::tempdir().unwrap();
    let sweep = format!(
        r#"{}
[[trainer]]
name = "t"
copies = 2
command = ["{{batchcast}}", "consume", "--json", "--verify"]
"#,
        stream(2, "")
    );
    let (out, summary) = launch(dir.path(), &sweep, &["--baseline"]);
    assert!(out.status.success(), "{}", text(&out));
    let s = summary.unwrap();
    let base = s.baseline.as_ref().expect("a baseline run");
    assert_eq!(base.brokers.len(), 2, "one private broker per trainer");
    for b in &base.brokers {
        assert_eq!((b.batches_produced, b.deliveries), (32, 32));
    }
    for t in &base.trainers {
        assert_eq!((t.state.as_str(), t.samples), ("done", 2 * 512));
        assert!(own_report(&t.log).ok);
    }
    assert_eq!(s.shared.brokers[0].batches_produced, 32);
    let c = s.comparison.as_ref().unwrap();
    // The comparison is made of the two runs' own numbers.
    let shared = &s.shared;
    assert!(shared.wall_s > 0.0 && base.wall_s > 0.0);
    assert!(
        (c.speedup - base.wall_s / shared.wall_s).abs() < 1e-9,
        "{c:?}"
    );
    assert!(
        (c.throughput_ratio - shared.samples_per_s / base.samples_per_s).abs() < 1e-9,
        "{c:?}"
    );
    assert_eq!(
        (shared.samples, base.samples),
        (2 * 2 * 512, 2 * 2 * 512),
        "both runs read the same samples"
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("shared vs baseline"), "{stdout}");
}

#[test]
fn a_batch_size_grid_gives_each_trainer_its_own_batch_size_over_one_stream() {
    let dir = tempfile::tempdir().unwrap();
    let fields: [(&str, &str, &[u64]); 2] = [("image", "u8", &[3, 16, 16]), ("label", "i64", &[])];
    let stream = StreamToml::synthetic("train", 32, 512, &fields)
        .epochs(2)
        .key("seed", 3)
        .key("slots", 12)
        .to_toml();
    let sweep = format!(
        r#"{stream}
[[trainer]]
name = "bs"
command = ["{{batchcast}}", "consume", "--json", "--verify", "--digest"]
grid = {{ batch_size = [16, 32, 48] }}
"#
    );
    let (out, summary) = launch(dir.path(), &sweep, &[]);
    assert!(out.status.success(), "{}", text(&out));
    let run = summary.expect("summary.json").shared;
    assert_eq!(
        run.brokers[0].batches_produced, 32,
        "2 epochs × 16 units, made once for every size"
    );
    let mut digests = Vec::new();
    for (t, size) in run.trainers.iter().zip([16u64, 32, 48]) {
        let own = own_report(&t.log);
        assert!(own.ok && own.ended, "{own:?}");
        assert_eq!(own.batches, 2 * 512u64.div_ceil(size), "{}", t.name);
        assert_eq!(
            t.batches, own.batches,
            "{}: the launcher counts its own batches",
            t.name
        );
        assert_eq!((t.samples, own.verified_samples), (2 * 512, 2 * 512));
        digests.push(
            own.epochs
                .iter()
                .map(|e| e.digest.clone())
                .collect::<Vec<_>>(),
        );
    }
    assert!(digests.windows(2).all(|w| w[0] == w[1]), "{digests:?}");
}

/// The broker's account of a trainer that decoupled pace cut and
/// replayed to counts every sample it received (replayed ones too, shown
/// apart), live and in the summary, and never goes backwards.
#[test]
fn a_cut_and_replayed_trainer_is_counted_whole_live_and_in_the_summary() {
    let dir = tempfile::tempdir().unwrap();
    let sweep = format!(
        r#"{}
[[trainer]]
name = "fast"
copies = 2
command = ["{{batchcast}}", "consume", "--json", "--verify", "--sleep-ms", "1"]

[[trainer]]
name = "cut"
command = ["{{batchcast}}", "consume", "--json", "--verify", "--sleep-ms", "1", "--stall-after", "10", "--stall-ms", "6000"]
"#,
        stream(3, "pace = \"decoupled\"")
    );
    let (out, summary) = launch(dir.path(), &sweep, &[]);
    assert!(out.status.success(), "{}", text(&out));
    let run = summary.expect("summary.json").shared;
    assert_eq!(run.trainers.len(), 3, "two fast copies and the cut one");
    for t in &run.trainers {
        let own = own_report(&t.log);
        assert!(own.ok && own.verified_samples == own.samples, "{own:?}");
        assert_eq!(
            (t.batches, t.samples),
            (own.batches, own.samples),
            "{}: the summary vs what the trainer received",
            t.name
        );
        assert_eq!(t.samples, 3 * 512);
        assert_eq!(t.replayed, own.replayed_batches * 32, "{}", t.name);
    }
    let cut = run.trainers.iter().find(|t| t.name == "cut").unwrap();
    assert!(cut.replayed > 0, "it was cut and replayed to: {cut:?}");
    assert_eq!(
        run.samples,
        run.trainers.iter().map(|t| t.samples).sum::<u64>()
    );
    // The live lines (every 5 s in a pipe): its count never goes back.
    let stdout = String::from_utf8_lossy(&out.stdout);
    let counts: Vec<u64> = stdout
        .lines()
        .filter(|l| l.starts_with('[') && l.contains(" cut "))
        .filter_map(|l| l.split(" batches ").nth(1)?.split(' ').next()?.parse().ok())
        .collect();
    assert!(!counts.is_empty(), "{stdout}");
    assert!(counts.windows(2).all(|w| w[0] <= w[1]), "{counts:?}");
}

/// A baseline trainer on its own loader is seen while it runs, from the
/// report it rewrites every 2 s (as `examples/train_torch.py` does), its
/// rate held between rewrites (it read 0 samples/s between them, in most
/// of the table's refreshes).
#[test]
fn a_baseline_trainer_reports_progress_while_it_runs() {
    let dir = tempfile::tempdir().unwrap();
    // (Braces doubled: the sweep file's placeholders are in braces.)
    let script = r#"for i in 1 2 3 4 5 6 7 8; do printf '{{"samples": %d, "batches": %d}}' $((i * 64)) $i > "$BATCHCAST_REPORT.tmp" && mv "$BATCHCAST_REPORT.tmp" "$BATCHCAST_REPORT"; sleep 2; done"#;
    let sweep = format!(
        r#"{}
[[trainer]]
name = "own"
command = ["{{batchcast}}", "consume", "--json", "--max-batches", "4"]
baseline_command = ["sh", "-c", {script:?}]
"#,
        stream(1, "")
    );
    let (out, summary) = launch(dir.path(), &sweep, &["--baseline"]);
    assert!(out.status.success(), "{}", text(&out));
    let base = summary.unwrap().baseline.expect("a baseline run");
    let t = &base.trainers[0];
    assert_eq!((t.measured_by.as_str(), t.samples), ("report", 8 * 64));
    // A live line from the middle of its run shows it moving.
    let stdout = String::from_utf8_lossy(&out.stdout);
    let live: Vec<u64> = stdout
        .lines()
        .filter(|l| l.starts_with('[') && l.contains(" own "))
        .filter_map(|l| l.split(" batches ").nth(1)?.split(' ').next()?.parse().ok())
        .collect();
    assert!(
        live.iter().any(|&b| (1..8).contains(&b)),
        "no progress seen while it ran: {live:?}\n{stdout}"
    );
    // Every line of it running, past its first report, shows it moving.
    let rates: Vec<f64> = stdout
        .lines()
        .filter(|l| l.starts_with('[') && l.contains(" own running "))
        .filter(|l| !l.contains(" batches 0 ") && !l.contains(" batches 1 "))
        .filter_map(|l| {
            l.split(" samples/s")
                .next()?
                .rsplit(' ')
                .next()?
                .parse()
                .ok()
        })
        .collect();
    assert!(
        !rates.is_empty() && rates.iter().all(|&r| r > 0.0),
        "{rates:?}\n{stdout}"
    );
}

/// docs/sweeps.md: Ctrl-C stops the trainers with SIGTERM, SIGKILLs one still
/// running after `grace_s`, and a second Ctrl-C does so at once.
#[test]
fn a_trainer_that_ignores_sigterm_is_killed_after_grace_s_or_at_a_second_ctrl_c() {
    for (grace_s, ctrl_c) in [(1, 1), (60, 2)] {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        let sweep = format!(
            r#"[launch]
grace_s = {grace_s}
{}
[[trainer]]
name = "polite"
command = ["{{batchcast}}", "consume", "--sleep-ms", "20"]

[[trainer]]
name = "stubborn"
command = ["sh", "-c", "trap '' TERM; echo ready; while true; do sleep 0.1; done"]
"#,
            stream(100_000, "min_consumers = 1")
        );
        let (mut child, needle) = launch_in_background(dir.path(), &sweep);
        let stubborn_log = run.join("shared/stubborn.log");
        let t0 = Instant::now();
        while !std::fs::read_to_string(&stubborn_log).is_ok_and(|l| l.contains("ready")) {
            assert!(t0.elapsed() < LIMIT, "{:?}", processes_mentioning(&needle));
            std::thread::sleep(Duration::from_millis(50));
        }
        let t0 = Instant::now();
        harness::signal(child.id(), nix::sys::signal::Signal::SIGINT);
        if ctrl_c == 2 {
            // Once the polite trainer has gone (the SIGTERM was sent), the
            // second Ctrl-C.
            let polite = || {
                processes_mentioning(&needle)
                    .into_iter()
                    .any(|p| p.contains(" consume "))
            };
            while polite() {
                assert!(t0.elapsed() < LIMIT, "the polite trainer never stopped");
                std::thread::sleep(Duration::from_millis(20));
            }
            harness::signal(child.id(), nix::sys::signal::Signal::SIGINT);
        }
        let status = harness::wait_timeout(&mut child.0, LIMIT).unwrap();
        let took = t0.elapsed();
        assert_eq!(status.code(), Some(exit::INTERRUPTED));
        // After the grace (1 s), or well before it (60 s) on a second Ctrl-C.
        let (at_least, below) = match ctrl_c {
            1 => (Duration::from_secs(1), Duration::from_secs(30)),
            _ => (Duration::ZERO, Duration::from_secs(30)),
        };
        assert!(
            took >= at_least && took < below,
            "grace_s {grace_s}: {took:?}"
        );
        let s: Summary =
            serde_json::from_str(&std::fs::read_to_string(run.join("summary.json")).unwrap())
                .unwrap();
        let stubborn = s
            .shared
            .trainers
            .iter()
            .find(|t| t.name == "stubborn")
            .unwrap();
        assert_eq!(stubborn.signal, Some(9), "SIGKILLed: {stubborn:?}");
        let polite = s
            .shared
            .trainers
            .iter()
            .find(|t| t.name == "polite")
            .unwrap();
        assert_ne!(polite.signal, Some(9), "stopped by its SIGTERM: {polite:?}");
        assert_eq!(processes_mentioning(&needle), Vec::<String>::new());
    }
}

/// Item 9 of the sweep review: an external broker (`[launch] socket =`)
/// SIGKILLed and started again twice under a decoupled sweep of batch
/// sizes 32/64/128, one trainer stalled long enough to be cut and
/// replayed, one joining now a moment late. The view names each restart;
/// each trainer's live counts never go back, never pass what it took in
/// the end, and move on after each restart (they froze, and fell back,
/// when the view summed the current broker's records); the summary's
/// counts are each trainer's own.
#[test]
fn counts_carry_across_broker_restarts_cuts_and_late_joins_live_and_in_the_summary() {
    let fields: [(&str, &str, &[u64]); 2] = [("image", "u8", &[3, 16, 16]), ("label", "i64", &[])];
    let config = StreamToml::synthetic("train", 32, 512, &fields)
        .fill("full")
        .epochs(24)
        .key("shuffle", true)
        .key("seed", 11)
        .key("max_batch_size", 128)
        .raw("pace = \"decoupled\"")
        .to_toml();
    let mut env = common::Env::start(&config);
    let dir = tempfile::tempdir().unwrap();
    let consume = r#""{batchcast}", "consume", "--json", "--verify", "--reconnect-timeout", "60""#;
    let sweep = format!(
        r#"[launch]
socket = "{socket}"

[[trainer]]
name = "b32"
command = [{consume}, "--batch-size", "32", "--sleep-ms", "20"]

[[trainer]]
name = "b64"
command = [{consume}, "--batch-size", "64", "--sleep-ms", "40", "--stall-after", "20", "--stall-ms", "1500"]

[[trainer]]
name = "b128"
command = [{consume}, "--batch-size", "128", "--sleep-ms", "80"]

[[trainer]]
name = "late"
command = ["sh", "-c", "sleep 1; exec \"$0\" consume --json --verify --reconnect-timeout 60 --join now --batch-size 32 --sleep-ms 20", "{{batchcast}}"]
"#,
        socket = env.socket().display()
    );
    let mut launcher = launch_to_file(dir.path(), &sweep, &["--status-every", "1"]);
    // Killed twice once all four read.
    for round in 1..=2u64 {
        env.wait_for("every trainer reading", |s| {
            let c = &s.streams[0].consumers;
            c.len() == 4 && c.iter().all(|c| c.taken.batches >= 4)
        });
        std::thread::sleep(Duration::from_millis(500 * round));
        env.restart_broker(true);
    }
    let (status, stdout, summary) = finish_launch(dir.path(), &mut launcher);
    assert!(status.success(), "{status}\n{stdout}");
    let shared = &summary.shared;
    assert_eq!(shared.brokers[0].restarts, 2, "{stdout}");
    let restarts: Vec<usize> = stdout
        .lines()
        .enumerate()
        .filter(|(_, l)| l.contains("restarted (pid"))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(restarts.len(), 2, "the view names each restart:\n{stdout}");
    assert_eq!(shared.trainers.len(), 4);
    for t in &shared.trainers {
        let own = own_report(&t.log);
        assert!(
            own.ok && own.verified_samples == own.samples && own.reconnects == 2,
            "{own:?}"
        );
        assert_eq!(
            (t.batches, t.samples),
            (own.batches, own.samples),
            "{}: the summary vs what the trainer took\n{stdout}",
            t.name
        );
        // Its live lines: (line number, batches, replayed).
        let live: Vec<(usize, u64, u64)> = stdout
            .lines()
            .enumerate()
            .filter(|(_, l)| l.starts_with('[') && l.contains(&format!("] {} ", t.name)))
            .filter_map(|(i, l)| {
                let field =
                    |k: &str| -> Option<u64> { l.split(k).nth(1)?.split(' ').next()?.parse().ok() };
                Some((i, field(" batches ")?, field(" replayed ")?))
            })
            .collect();
        assert!(
            live.windows(2)
                .all(|w| w[0].1 <= w[1].1 && w[0].2 <= w[1].2),
            "{}: never back: {live:?}",
            t.name
        );
        assert!(
            live.iter().all(|l| l.1 <= own.batches),
            "{}: {live:?}",
            t.name
        );
        // After each restart the table moves on.
        for &r in &restarts {
            let before = live.iter().rev().find(|l| l.0 < r).map_or(0, |l| l.1);
            assert!(
                live.iter().any(|l| l.0 > r && l.1 > before) || own.batches == before,
                "{}: frozen after the restart at line {r}: {live:?}\n{stdout}",
                t.name
            );
        }
    }
    // The stalled one was cut to replay. (The late joiner reads rotated
    // epochs: it replays nothing where the ring still held its epoch's
    // start and it led the ride through each restart, so its count is
    // checked above, never back, not here.)
    let b64 = shared.trainers.iter().find(|t| t.name == "b64").unwrap();
    assert!(b64.replayed > 0, "b64 was replayed to: {shared:?}");
    assert_eq!(
        shared.samples,
        shared.trainers.iter().map(|t| t.samples).sum::<u64>()
    );
}

/// The pid of the broker serving a run (`serve` with the run folder's
/// socket on its command line).
fn run_broker_pid(run: &str) -> Option<u32> {
    processes_mentioning(run)
        .iter()
        .find(|p| p.contains(" serve ") && p.contains(run))
        .and_then(|p| p.split(':').next()?.parse().ok())
}

/// A broker the launcher started is started again when it dies, and its
/// trainers ride through: every one ends with what it took equal to the
/// summary's, the view says what happened; a trainer that ended before the
/// crash is not waited for by the new broker. With `broker_restarts = 0`
/// it is not started again and the trainers fail, said so.
#[test]
fn a_broker_the_launcher_started_is_started_again_when_it_dies() {
    for restarts in [None, Some(0)] {
        let dir = tempfile::tempdir().unwrap();
        let launch_table = restarts.map_or(String::new(), |n| {
            format!("[launch]\nbroker_restarts = {n}\n")
        });
        let sweep = format!(
            r#"{launch_table}{}
[[trainer]]
name = "t"
copies = 2
command = ["{{batchcast}}", "consume", "--json", "--verify", "--reconnect-timeout", "5", "--sleep-ms", "10"]

[[trainer]]
name = "short"
command = ["{{batchcast}}", "consume", "--json", "--max-batches", "4"]
"#,
            stream(12, "")
        );
        let mut launcher = launch_to_file(dir.path(), &sweep, &[]);
        let run = dir.path().join("run");
        // Killed once the short trainer is done and the others read on.
        let run_s = run.display().to_string();
        let t0 = Instant::now();
        let pid = loop {
            let short_done = std::fs::read_to_string(run.join("shared/short.log"))
                .is_ok_and(|l| l.lines().any(|l| l.starts_with('{')));
            if let Some(pid) = run_broker_pid(&run_s).filter(|_| short_done) {
                break pid;
            }
            assert!(t0.elapsed() < LIMIT, "the run never got going");
            std::thread::sleep(Duration::from_millis(20));
        };
        std::thread::sleep(Duration::from_millis(300));
        harness::signal(pid, nix::sys::signal::Signal::SIGKILL);
        let (status, stdout, summary) = finish_launch(dir.path(), &mut launcher);
        let shared = &summary.shared;
        assert!(
            stdout.contains(&format!("the broker (pid {pid}) exited")),
            "{stdout}"
        );
        if restarts == Some(0) {
            assert_eq!(status.code(), Some(exit::FAILED), "{stdout}");
            assert!(stdout.contains("not started again"), "{stdout}");
            assert_eq!(shared.brokers[0].restarts, 0);
            assert_eq!(shared.failed, 2, "{stdout}");
            continue;
        }
        assert!(status.success(), "{status}\n{stdout}");
        assert!(stdout.contains("starting it again"), "{stdout}");
        assert_eq!(shared.brokers[0].restarts, 1, "{stdout}");
        for t in &shared.trainers {
            let own = own_report(&t.log);
            let short = t.name == "short"; // 4 batches, not checked
            assert!(
                own.ok && (short || own.verified_samples == own.samples),
                "{own:?}"
            );
            assert_eq!(own.reconnects, u64::from(!short), "{own:?}");
            assert_eq!(
                (t.batches, t.samples),
                (own.batches, own.samples),
                "{}\n{stdout}",
                t.name
            );
            if !short {
                assert_eq!(t.samples, 12 * 512, "{}: every epoch", t.name);
            }
        }
    }
}

/// What the live lines and the report show while a trainer holds the
/// stream (issue 70, item 9): the others are shown waiting and their
/// stall counts the hold while it lasts (not only once their clients
/// report it), the cut is an event line with its time (a mark on the
/// report's axis), and the summary's figures agree with the trainers' own
/// reports.
#[test]
fn a_held_stream_shows_as_waiting_and_stall_and_the_cut_as_an_event() {
    let dir = tempfile::tempdir().unwrap();
    let sweep = format!(
        r#"{}
[[trainer]]
name = "steady"
copies = 2
command = ["{{batchcast}}", "consume", "--json", "--verify", "--sleep-ms", "1"]

[[trainer]]
name = "pauses"
command = ["{{batchcast}}", "consume", "--json", "--verify", "--sleep-ms", "1", "--stall-after", "10", "--stall-ms", "8000"]
"#,
        // Lockstep: the hold lasts its 3 s bound, long enough for the
        // live lines to show it (the default pace prices a synthetic
        // stream's replay at its 0.25 s floor and cuts the pause then).
        stream(3, "hold_limit_s = 3.0\npace = \"lockstep\"")
    );
    let (out, summary) = launch(dir.path(), &sweep, &["--status-every", "1", "--report"]);
    assert!(out.status.success(), "{}", text(&out));
    let run = summary.expect("summary.json").shared;
    let stdout = String::from_utf8_lossy(&out.stdout);
    // The cut, said when it happened, and kept with its time.
    let cut = run
        .events
        .iter()
        .find(|e| e.text.contains("pauses was cut to replay"))
        .unwrap_or_else(|| panic!("no cut among {:?}\n{stdout}", run.events));
    assert!(cut.t_s > 2.0 && cut.t_s < run.wall_s, "{cut:?}");
    assert!(stdout.contains("pauses was cut to replay"), "{stdout}");
    assert!(
        run.events
            .iter()
            .any(|e| e.text.contains("steady-0 joined")),
        "{:?}",
        run.events
    );
    // While held, the steady ones were shown waiting for data.
    assert!(
        stdout
            .lines()
            .any(|l| l.contains(" steady-") && l.contains("s for data")),
        "{stdout}"
    );
    // Their stall over time shows the hold: a window in which they waited
    // most of the time, before the cut.
    for (i, t) in run.trainers.iter().enumerate() {
        let own = own_report(&t.log);
        assert!(own.ok && own.verified_samples == own.samples, "{own:?}");
        assert_eq!(t.samples, own.samples, "{}", t.name);
        if !t.name.starts_with("steady") {
            continue;
        }
        let worst = run
            .timeline
            .windows(3)
            .filter(|w| w[2].t_s <= cut.t_s + 0.5)
            .filter_map(|w| {
                let (a, b) = (w[0].trainers.get(i)?, w[2].trainers.get(i)?);
                let (wait, busy) = (b[1] - a[1], b[2] - a[2]);
                (wait + busy > 0.0).then(|| wait / (wait + busy))
            })
            .fold(0.0, f64::max);
        assert!(worst > 0.5, "{}: at most {worst:.2} waiting", t.name);
        // Once over, the stall is the trainer's own account of it.
        assert!(
            (t.wait_s - own.wait_s).abs() < 0.5,
            "{}: {} against its own {}",
            t.name,
            t.wait_s,
            own.wait_s
        );
    }
    let html = std::fs::read_to_string(dir.path().join("run/report.html")).unwrap();
    assert!(html.contains("class=\"event\"") && html.contains("What happened"));
    assert!(html.contains("pauses was cut to replay"));
}
