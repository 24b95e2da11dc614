//! What the end-to-end tests share: a real broker process in a temporary
//! folder (config, socket, log), real consumer processes against it, and
//! bounded waits on its stats. Each test binary uses part of it.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use batchcast::proto::{
    self, ClientMsg, ErrorCode, Hello, Intent, Preamble, ServerMsg, StatsReply, Welcome,
};
use batchcast::shm;
use batchcast_cli::harness::{self, BrokerProcess};
use batchcast_cli::report::ConsumerReport;

pub const EXE: &str = env!("CARGO_BIN_EXE_batchcast");
/// The bound on every wait: a deadlock fails a test instead of hanging it.
pub const LIMIT: Duration = Duration::from_secs(120);

/// A broker started for one test, and the folder holding its files.
/// Dropped in this order: the consumers it started that are still
/// running (killed and reaped), the broker, then the folder.
pub struct Env {
    pub broker: BrokerProcess,
    pub dir: tempfile::TempDir,
    children: Children,
    /// The host-memory stand-in for a GPU (`batchcast::stand_in`): the
    /// value of its setting for the broker and every consumer started
    /// here, if on.
    stand_in: Option<String>,
    /// Consumers started here, counted: each one's stderr goes to
    /// `consumer-N.stderr` in the folder, shown when a wait times out.
    consumers: std::sync::atomic::AtomicUsize,
}

impl Drop for Env {
    fn drop(&mut self) {
        self.children.reap();
    }
}

/// Processes a test started, by pid: whichever is still running (an
/// unreaped child: its pid cannot have been reused) is killed and reaped
/// when the test ends, passed or failed.
#[derive(Default)]
pub struct Children(std::sync::Mutex<Vec<u32>>);

impl Children {
    pub fn add(&self, pid: u32) {
        self.0.lock().unwrap().push(pid);
    }

    pub fn reap(&self) {
        use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
        let pid = |p: u32| nix::unistd::Pid::from_raw(p as i32);
        for p in self.0.lock().unwrap().drain(..) {
            if let Ok(WaitStatus::StillAlive) = waitpid(pid(p), Some(WaitPidFlag::WNOHANG)) {
                let _ = nix::sys::signal::kill(pid(p), nix::sys::signal::Signal::SIGKILL);
                let _ = waitpid(pid(p), None);
            }
        }
    }
}

/// `batchcast serve` for a test (see [`BrokerProcess::spawn`]), with the
/// test's environment ([`command`]), stopped if the test process dies
/// (SIGKILL included), not only when the test drops it. (Tied to the
/// calling thread: start it from the test's own.)
pub fn broker(
    config: Option<&Path>,
    socket: &Path,
    log: Option<&Path>,
) -> std::io::Result<BrokerProcess> {
    broker_stand_in(config, socket, log, None)
}

/// [`broker`], with the GPU stand-in's setting (`batchcast::stand_in`).
pub fn broker_stand_in(
    config: Option<&Path>,
    socket: &Path,
    log: Option<&Path>,
    stand_in: Option<&str>,
) -> std::io::Result<BrokerProcess> {
    let mut cmd = command(EXE);
    if let Some(v) = stand_in {
        cmd.env(batchcast::stand_in::ENV, v);
    }
    batchcast_cli::child::die_with_parent(&mut cmd);
    BrokerProcess::spawn_with(cmd, config, socket, log)
}

/// `batchcast consume --json --socket SOCKET ARGS` with stdout piped (its
/// report), with the test's environment ([`command`]).
pub fn spawn_consumer(socket: &Path, args: &[&str]) -> Child {
    spawn_consumer_stand_in(socket, args, None)
}

/// [`spawn_consumer`], with the GPU stand-in's setting.
pub fn spawn_consumer_stand_in(socket: &Path, args: &[&str], stand_in: Option<&str>) -> Child {
    consumer_command(socket, args, stand_in).spawn().unwrap()
}

/// The command [`spawn_consumer_stand_in`] runs.
fn consumer_command(socket: &Path, args: &[&str], stand_in: Option<&str>) -> Command {
    let mut cmd = command(EXE);
    if let Some(v) = stand_in {
        cmd.env(batchcast::stand_in::ENV, v);
    }
    cmd.args(["consume", "--json", "--socket"])
        .arg(socket)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped());
    cmd
}

/// A command for a program the tests start, without the `BATCHCAST_*`
/// variables of the shell that runs the tests (a developer's
/// `BATCHCAST_JOIN` must not change what a test does); a test sets the
/// ones it means.
pub fn command(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = Command::new(program);
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("BATCHCAST_") && k != SKIPS {
            cmd.env_remove(k);
        }
    }
    cmd
}

/// Whether `program` is an executable file in a folder of `$PATH`.
pub fn on_path(program: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path).any(|d| {
            std::fs::metadata(d.join(program))
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
    })
}

/// Runs `cmd` (no input, output captured) to its end, within [`LIMIT`]:
/// a program that should exit and hangs fails the test with what was
/// running and what it said, instead of hanging the suite.
pub fn run(cmd: &mut Command) -> Output {
    run_within(cmd, LIMIT)
}

/// [`run`] within `limit`.
pub fn run_within(cmd: &mut Command, limit: Duration) -> Output {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = r.read_to_end(&mut v);
            v
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            let (o, e) = (out.join().unwrap(), err.join().unwrap());
            panic!(
                "{cmd:?} did not exit within {limit:?}; its output:\n{}\n{}",
                String::from_utf8_lossy(&o),
                String::from_utf8_lossy(&e)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Output {
        status,
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    }
}

/// Where `scripts/test` collects the tests' skips (one line each), to
/// count and name them at its end.
pub const SKIPS: &str = "BATCHCAST_TEST_SKIPS";

/// Records that part of a test did not run, and why: on stderr, and in
/// the file `scripts/test` counts skips in.
pub fn skip(what: &str, why: &str) {
    eprintln!("SKIPPED ({why}): {what}");
    if let Some(path) = std::env::var_os(SKIPS) {
        let line = format!("{}: {what} ({why})\n", test_name());
        let _ = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .and_then(|mut f| f.write_all(line.as_bytes()));
    }
}

/// The running test's name (its thread's, as the harness names it).
fn test_name() -> String {
    std::thread::current()
        .name()
        .unwrap_or("a test")
        .to_string()
}

impl Env {
    /// A broker serving the streams of `config`.
    pub fn start(config: &str) -> Env {
        Env::spawn(Some(config))
    }

    /// A broker with no configured stream (producers register theirs).
    pub fn bare() -> Env {
        Env::spawn(None)
    }

    /// [`Env::start`] with the host-memory stand-in for GPUs on, as
    /// `setting` says (`1`, `fail-at=N`), for the broker and every
    /// consumer [`Env::consumer`] starts: `--device cuda:N` consumers
    /// read "device memory" made of host memory.
    pub fn start_stand_in(config: &str, setting: &str) -> Env {
        Env::spawn_with(Some(config), Some(setting))
    }

    fn spawn(config: Option<&str>) -> Env {
        Env::spawn_with(config, None)
    }

    fn spawn_with(config: Option<&str>, stand_in: Option<&str>) -> Env {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config.map(|c| {
            let p = dir.path().join("broker.toml");
            std::fs::write(&p, c).unwrap();
            p
        });
        let broker = broker_stand_in(
            cfg.as_deref(),
            &dir.path().join("b.sock"),
            Some(&dir.path().join("broker.log")),
            stand_in,
        )
        .unwrap_or_else(|e| panic!("broker failed to start: {e}"));
        HERE.with(|h| *h.borrow_mut() = Some(dir.path().to_path_buf()));
        Env {
            broker,
            dir,
            children: Children::default(),
            stand_in: stand_in.map(Into::into),
            consumers: Default::default(),
        }
    }

    /// Stops the broker (SIGKILL, or SIGTERM and a wait), waits a moment
    /// with none running, and starts a new one on the same socket with the
    /// same config (none for a bare broker).
    pub fn restart_broker(&mut self, kill: bool) {
        if kill {
            self.broker.kill().unwrap();
        } else {
            self.broker.terminate(LIMIT).unwrap();
        }
        std::thread::sleep(Duration::from_millis(200));
        let cfg = self.path("broker.toml");
        let log = self.path("broker-again.log");
        self.broker = broker_stand_in(
            cfg.exists().then_some(cfg.as_path()),
            &self.socket(),
            Some(&log),
            self.stand_in.as_deref(),
        )
        .unwrap_or_else(|e| panic!("broker failed to start again: {e}"));
    }

    /// A path in the test's folder.
    pub fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    pub fn socket(&self) -> PathBuf {
        self.broker.socket.clone()
    }

    /// Starts `batchcast consume` with `args` against this broker (killed
    /// when the test ends, if it is still running then).
    pub fn consumer(&self, args: &[&str]) -> std::process::Child {
        self.consumer_on(&self.socket(), args)
    }

    /// [`Env::consumer`], connecting to `socket` (a way to this broker).
    pub fn consumer_on(&self, socket: &Path, args: &[&str]) -> std::process::Child {
        let n = self
            .consumers
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let err = std::fs::File::create(self.path(&format!("consumer-{n}.stderr"))).unwrap();
        let mut cmd = consumer_command(socket, args, self.stand_in.as_deref());
        self.own(cmd.stderr(err).spawn().unwrap())
    }

    /// The end of what the consumers started here and the brokers said
    /// (their stderr and logs), for a failure's message.
    pub fn what_they_said(&self) -> String {
        said_in(self.dir.path())
    }

    /// Makes a child the test started its own: killed and reaped when
    /// the test ends, if it is still running then.
    pub fn own(&self, child: Child) -> Child {
        self.children.add(child.id());
        child
    }

    /// Spawns `cmd` (a binary this test just copied) and owns it. Another
    /// test's thread forking while the copy's file was open for writing
    /// holds that fd until its child execs, and exec then fails with
    /// ETXTBSY: tried again for up to 2 s.
    pub fn spawn_own(&self, cmd: &mut std::process::Command) -> Child {
        let t0 = Instant::now();
        loop {
            match cmd.spawn() {
                Ok(child) => return self.own(child),
                Err(e)
                    if e.raw_os_error() == Some(libc::ETXTBSY)
                        && t0.elapsed() < Duration::from_secs(2) =>
                {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("spawning {cmd:?}: {e}"),
            }
        }
    }

    pub fn stats(&self) -> StatsReply {
        self.broker.stats().unwrap()
    }

    /// Stats once the broker has recorded each of `names` as gone (in a
    /// stream's past consumers): a consumer's process can exit, and its
    /// report be read, before the broker has seen its connection close.
    pub fn gone(&self, names: &[&str]) -> StatsReply {
        self.wait_for(&format!("{names:?} to be recorded as gone"), |s| {
            names.iter().all(|n| {
                s.streams
                    .iter()
                    .any(|st| st.past_consumers.iter().any(|c| c.name == *n))
            })
        })
    }

    /// Polls stats until `pred` holds (bounded).
    pub fn wait_for(&self, what: &str, pred: impl Fn(&StatsReply) -> bool) -> StatsReply {
        let t0 = Instant::now();
        loop {
            let s = self.stats();
            if pred(&s) {
                return s;
            }
            assert!(
                t0.elapsed() < LIMIT,
                "timed out waiting for {what}; last stats: {s:#?}\n{}",
                self.what_they_said()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A consumer process's report, once it has exited (bounded); when it
    /// gives none (hung past the limit and killed, or crashed), the panic
    /// carries the broker's stats and the end of its log.
    pub fn report(&self, child: std::process::Child) -> ConsumerReport {
        harness::wait_report(child, LIMIT).unwrap_or_else(|e| {
            panic!(
                "{e}\nstats: {:#?}\n{}",
                self.broker.stats().ok(),
                self.what_they_said()
            )
        })
    }

    /// What the broker logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.path("broker.log")).unwrap_or_default()
    }
}

/// The repository's root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The Python with Pillow and numpy that `scripts/test` puts in `.venv`
/// (or `BATCHCAST_PYTHON`).
pub fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("BATCHCAST_PYTHON") {
        return p.into();
    }
    let venv = repo().join(".venv/bin/python");
    assert!(
        venv.exists(),
        "{} is missing: run `bash scripts/test` once (it creates .venv with Pillow and numpy), or set BATCHCAST_PYTHON",
        venv.display()
    );
    venv
}

/// Runs `tests/images/imgtool.py ARGS` (test images, Pillow references)
/// and returns its stdout.
pub fn imgtool(args: &[&str]) -> String {
    let out = run(command(python())
        .arg(repo().join("tests/images/imgtool.py"))
        .args(args));
    assert!(
        out.status.success(),
        "imgtool {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Makes in `root` what the imgtool commands `steps` make, whose paths
/// are written `@/NAME` for `root/NAME`; returns each command's stdout.
/// Pillow's encoders cost seconds of CPU a folder and most tests make the
/// same ones: the first run of a recipe is kept under cargo's
/// `target/tmp`, keyed by the recipe and imgtool's source (made aside and
/// renamed into place, so another test process never sees it half made),
/// and each test gets a copy of its own (a test may change its files).
pub fn imgtool_made(root: &Path, steps: &[&[&str]]) -> Vec<String> {
    use std::hash::{Hash, Hasher};
    static MAKING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let tool = repo().join("tests/images/imgtool.py");
    let mut h = std::hash::DefaultHasher::new();
    std::fs::read(&tool).unwrap().hash(&mut h);
    steps.hash(&mut h);
    let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("imgtool-{:016x}", h.finish()));
    {
        let _one_at_a_time = MAKING.lock().unwrap_or_else(|e| e.into_inner());
        if !cache.join("done").exists() {
            let aside = cache.with_extension(format!("making-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&aside);
            std::fs::create_dir_all(aside.join("tree")).unwrap();
            let tree = format!("{}/", aside.join("tree").display());
            for (i, step) in steps.iter().enumerate() {
                let args: Vec<String> = step.iter().map(|a| a.replacen("@/", &tree, 1)).collect();
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                std::fs::write(aside.join(format!("out-{i}")), imgtool(&args)).unwrap();
            }
            std::fs::write(aside.join("done"), "").unwrap();
            // Another process may have won the race: its copy is as good.
            if std::fs::rename(&aside, &cache).is_err() {
                let _ = std::fs::remove_dir_all(&aside);
            }
        }
    }
    copy_tree(&cache.join("tree"), root);
    (0..steps.len())
        .map(|i| std::fs::read_to_string(cache.join(format!("out-{i}"))).unwrap())
        .collect()
}

/// Copies the files and folders under `from` into `to` (made if missing).
pub fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &dest);
        } else {
            std::fs::copy(e.path(), &dest).unwrap();
        }
    }
}

/// An i64 field of the batches `consume --dump DIR` wrote, per epoch, in
/// batch order.
pub fn dumped_i64_by_epoch(dir: &Path, field: &str) -> std::collections::BTreeMap<u64, Vec<i64>> {
    let suffix = format!("-{field}.bin");
    let mut files: Vec<((u64, u64), PathBuf)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter_map(|p| {
            let name = p.file_name()?.to_str()?.strip_suffix(&suffix)?.to_string();
            let (e, b) = name.strip_prefix('e')?.split_once("-b")?;
            Some(((e.parse().ok()?, b.parse().ok()?), p))
        })
        .collect();
    files.sort();
    let mut out = std::collections::BTreeMap::new();
    for ((epoch, _), f) in files {
        let v: &mut Vec<i64> = out.entry(epoch).or_default();
        v.extend(
            std::fs::read(f)
                .unwrap()
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap())),
        );
    }
    out
}

/// A consumer process's report, once it has exited (bounded); when it
/// gives none (hung past the limit and killed, or crashed), the panic
/// carries what the consumers and the broker of this thread's test
/// environment said (CI once showed only "no report").
pub fn report(child: std::process::Child) -> ConsumerReport {
    harness::wait_report(child, LIMIT).unwrap_or_else(|e| {
        let said = HERE.with(|h| h.borrow().as_deref().map(said_in).unwrap_or_default());
        panic!("{e}\n{said}")
    })
}

thread_local! {
    /// The folder of the environment this test thread started last (a
    /// test runs on a thread of its own): where [`report`] finds what
    /// was said.
    static HERE: std::cell::RefCell<Option<PathBuf>> = const { std::cell::RefCell::new(None) };
}

/// The end of what each consumer started in `dir` said on stderr, and of
/// the broker's logs there.
fn said_in(dir: &Path) -> String {
    let tail = |path: &Path, lines: usize| {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    };
    let mut out = String::new();
    for k in 0.. {
        let path = dir.join(format!("consumer-{k}.stderr"));
        if !path.exists() {
            break;
        }
        out += &format!("--- consumer {k} said:\n{}\n", tail(&path, 12));
    }
    for log in ["broker.log", "broker-again.log"] {
        let path = dir.join(log);
        if path.exists() {
            out += &format!("--- {log}, its end:\n{}\n", tail(&path, 25));
        }
    }
    out
}

/// SIGKILLs a consumer process (a trainer dying mid-step) and reaps it.
pub fn sigkill(child: &mut std::process::Child) {
    harness::signal(child.id(), nix::sys::signal::Signal::SIGKILL);
    child.wait().unwrap();
}

/// Tests that need a second user run as root (as CI does); elsewhere they
/// skip that part, and say so ([`skip`]).
pub fn is_root(what: &str) -> bool {
    let root = nix::unistd::geteuid().is_root();
    if !root {
        skip(what, "needs root to act as a second user");
    }
    root
}

/// A consumer speaking the protocol by hand: the welcome, and the fds
/// that came with it (the arena's, then the mailbox's, then the replay
/// arena's).
pub fn raw_subscribe(
    socket: &Path,
    name: &str,
    mailbox: bool,
    join: batchcast::JoinPolicy,
    resume: Option<proto::Position>,
) -> (UnixStream, Welcome, Vec<OwnedFd>) {
    let mut request = consume_request(2);
    request.resume = resume;
    request.join = join;
    request.mailbox = mailbox;
    raw_subscribe_with(socket, name, request)
}

/// A request for stream `train`'s batches with `window`, the rest default.
pub fn consume_request(window: u32) -> proto::ConsumeRequest {
    proto::ConsumeRequest {
        batch_size: None,
        expect: None,
        group: None,
        drop_last: None,
        resume: None,
        rotation: None,
        stream: "train".into(),
        window,
        join: batchcast::JoinPolicy::Immediate,
        device: None,
        mailbox: true,
        serial: 0,
        taken: Default::default(),
    }
}

/// [`raw_subscribe`] with the whole request given (a group seat, a
/// batch size, ...).
pub fn raw_subscribe_with(
    socket: &Path,
    name: &str,
    request: proto::ConsumeRequest,
) -> (UnixStream, Welcome, Vec<OwnedFd>) {
    raw_subscribe_claiming(socket, name, std::process::id(), request)
}

/// [`raw_subscribe_with`], its hello claiming to come from process `pid`.
pub fn raw_subscribe_claiming(
    socket: &Path,
    name: &str,
    pid: u32,
    request: proto::ConsumeRequest,
) -> (UnixStream, Welcome, Vec<OwnedFd>) {
    let s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let hello = ClientMsg::Hello(Hello {
        name: name.into(),
        pid,
        intent: Intent::Consume(request),
    });
    let mut out = Preamble::ours().to_bytes().to_vec();
    out.extend(proto::encode(&hello).unwrap());
    (&s).write_all(&out).unwrap();
    let mut pre = [0u8; Preamble::LEN];
    (&s).read_exact(&mut pre).unwrap();
    let mut fds = Vec::new();
    let mut recv = |buf: &mut [u8]| {
        let mut at = 0;
        while at < buf.len() {
            let (n, got) = shm::recv_with_fds(s.as_raw_fd(), &mut buf[at..]).unwrap();
            assert!(n > 0, "the broker closed the connection");
            fds.extend(got);
            at += n;
        }
    };
    let mut len = [0u8; 4];
    recv(&mut len);
    let mut payload = vec![0u8; u32::from_le_bytes(len) as usize];
    recv(&mut payload);
    let w = match proto::decode(&payload).unwrap() {
        ServerMsg::Welcome(w) => w,
        other => panic!("no welcome: {other:?}"),
    };
    (s, *w, fds)
}

/// A child process a test started, killed and reaped when the guard is
/// dropped (the test ended, passed or failed) if it is still running.
pub struct Guard(pub Child);

impl Drop for Guard {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

impl std::ops::Deref for Guard {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Guard {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

/// Sends `bytes` (a preamble and a hello) and reads the broker's
/// preamble and first message.
pub fn raw_exchange(socket: &Path, bytes: &[u8]) -> (Preamble, ServerMsg) {
    let mut s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(bytes).unwrap();
    let mut pre = [0u8; 8];
    s.read_exact(&mut pre).unwrap();
    let msg = proto::read_frame::<ServerMsg>(&mut s, &mut Vec::new())
        .unwrap()
        .expect("an error frame");
    (Preamble::parse(pre).unwrap(), msg)
}

/// `msg` is an error with `code` whose message holds `needle`.
pub fn expect_error(msg: ServerMsg, code: ErrorCode, needle: &str) {
    match msg {
        ServerMsg::Error(e) => {
            assert_eq!(e.code, code, "{e:?}");
            assert!(
                e.message.contains(needle),
                "message `{}` lacks `{needle}`",
                e.message
            );
        }
        other => panic!("expected an error, got {other:?}"),
    }
}

/// Per-epoch digests (sample by sample) a consumer report holds.
pub fn digests(r: &ConsumerReport) -> Vec<(u64, Option<String>)> {
    r.epochs
        .iter()
        .map(|e| (e.epoch, e.digest.clone()))
        .collect()
}

/// A consumer that rode through `reconnects` broker restarts: no error,
/// every epoch whole (`samples` each) with the digests of `reference`.
pub fn assert_rode_through(
    r: &ConsumerReport,
    reconnects: u64,
    reference: &[(u64, Option<String>)],
    samples: u64,
) {
    assert!(r.ok && r.ended, "{r:#?}");
    assert_eq!(r.reconnects, reconnects, "{r:#?}");
    assert_eq!(digests(r), reference, "{r:#?}");
    for e in &r.epochs {
        assert!(
            e.samples == samples && e.complete,
            "epoch {} whole: {r:#?}",
            e.epoch
        );
    }
}

/// The whole HTTP answer to `GET path` at `addr` (the metrics address).
pub fn http_get(addr: &str, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// The address a broker started with `--metrics 127.0.0.1:0` wrote to its
/// log `log` (fails if `broker` exits first, or after LIMIT).
pub fn metrics_address(log: &Path, broker: &mut Child) -> String {
    let t0 = Instant::now();
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if let Some(rest) = text.split("metrics on http://").nth(1) {
            return rest.split('/').next().unwrap().to_string();
        }
        let exited = broker.try_wait().unwrap().is_some();
        assert!(
            t0.elapsed() < LIMIT && !exited,
            "no metrics address in the log:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until process `pid` is stopped (SIGSTOP: `consume --stop-after`).
pub fn wait_stopped(pid: u32) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // The state follows the command's closing parenthesis.
        let state = stat.rsplit_once(") ").and_then(|(_, s)| s.chars().next());
        if state == Some('T') {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "process {pid} never stopped: {stat}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Every sample of `epochs` epochs of `per_epoch` samples, once, in order,
/// with the synthetic generator's bytes (`--verify`).
pub fn assert_every_epoch_whole(r: &ConsumerReport, epochs: u64, per_epoch: u64) {
    assert!(r.ok && r.ended, "{r:#?}");
    assert_eq!(r.verify_failures, 0, "{r:#?}");
    assert!(r.order_errors.is_empty(), "{:?}", r.order_errors);
    assert_eq!(r.samples, epochs * per_epoch, "{}", r.name);
    assert_eq!(r.verified_samples, r.samples);
    let got: Vec<(u64, u64, bool)> = r
        .epochs
        .iter()
        .map(|e| (e.epoch, e.samples, e.complete))
        .collect();
    let want: Vec<(u64, u64, bool)> = (0..epochs).map(|e| (e, per_epoch, true)).collect();
    assert_eq!(got, want, "{}", r.name);
}

/// A synthetic stream `train` of 8x8 RGB images and labels, `len` samples
/// an epoch in batches of `batch` (seed 5, 12 slots, 2 workers): the
/// stream the pace and pause tests run against, keys added by each.
pub fn small_images(batch: u64, len: u64) -> batchcast_broker::config::StreamToml {
    let fields: [(&str, &str, &[u64]); 2] = [("image", "u8", &[3, 8, 8]), ("label", "i64", &[])];
    batchcast_broker::config::StreamToml::synthetic("train", batch, len, &fields)
        .key("seed", 5)
        .key("slots", 12)
        .key("workers", 2)
}

/// A hostile client speaking the protocol by hand, subscribed to stream
/// `train` as `hoarder` with a mailbox: it takes every batch noticed to it
/// (its mailbox's `tail` says so) and gives none back, keeping its
/// connection open, until the broker says something on its socket or
/// `stays` passes. Returns how many batches it took and the broker's
/// message, if one came.
pub fn hoarder(
    socket: &Path,
    stays: Duration,
) -> std::thread::JoinHandle<(u64, Option<ServerMsg>)> {
    use batchcast::mailbox::{ConsumerMailbox, Notice};
    let (sock, welcome, mut fds) = raw_subscribe(
        socket,
        "hoarder",
        true,
        batchcast::JoinPolicy::Immediate,
        None,
    );
    let mb = ConsumerMailbox::open(fds.remove(1), welcome.mailbox.expect("a mailbox")).unwrap();
    std::thread::spawn(move || {
        let t0 = Instant::now();
        let mut taken = 0u64;
        while t0.elapsed() < stays {
            match mb.pop() {
                Ok(Some(Notice::Batch(_))) => taken += 1,
                Ok(_) => std::thread::sleep(Duration::from_millis(1)),
                Err(_) => break,
            }
            // Stop once the broker has said why it ended this client.
            let mut poll = [nix::poll::PollFd::new(
                std::os::fd::AsFd::as_fd(&sock),
                nix::poll::PollFlags::POLLIN,
            )];
            if nix::poll::poll(&mut poll, nix::poll::PollTimeout::ZERO).is_ok_and(|n| n > 0) {
                break;
            }
        }
        sock.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let msg = proto::read_frame::<ServerMsg>(&mut &sock, &mut Vec::new())
            .ok()
            .flatten();
        (taken, msg)
    })
}
