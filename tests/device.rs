//! Device twins: end-to-end tests of consumers with `--device cuda:N`
//! against the real broker, on the host-memory stand-in for a GPU
//! (`batchcast::stand_in`, a test setting of the broker and the
//! consumers). Everything the broker decides for a device consumer (which
//! batches, copied where, when its slot comes back, a device that fails)
//! runs as on a GPU host; only CUDA's own calls are left for one
//! (`bench/gpu.sh`). Each test has a host twin elsewhere with the same
//! assertions: the bytes a device consumer reads are the bytes a host
//! consumer reads.

use batchcast_cli::report::ConsumerReport;

use crate::common;

use common::{Env, digests, report};

// `batch_sizes`' stream: 1000 samples an epoch in units of 40, three
// fields whose rings are not multiples of the unit (units straddle their
// wraps, so copies are made of two pieces), shuffled, 28 slots.
use crate::batch_sizes::config;

fn assert_whole(r: &ConsumerReport, epochs: u64) {
    assert!(r.ok && r.ended, "{r:#?}");
    assert_eq!(r.verified_samples, epochs * 1000, "{r:#?}");
    common::assert_every_epoch_whole(r, epochs, 1000);
}

/// Two consumers on one GPU and one on another read every sample of every
/// epoch with a host consumer's bytes; each GPU gets one copy of each
/// batch, whoever reads it.
#[test]
fn device_consumers_read_a_host_consumers_bytes_one_copy_per_batch_per_gpu() {
    let env = Env::start_stand_in(&config("epochs = 3\nmin_consumers = 4"), "1");
    let host = env.consumer(&["--verify", "--digest", "--name", "host"]);
    let gpus: Vec<_> = [("a", "cuda:0"), ("b", "cuda:0"), ("c", "cuda:1")]
        .into_iter()
        .map(|(name, dev)| env.consumer(&["--verify", "--digest", "--device", dev, "--name", name]))
        .collect();
    let host = report(host);
    assert_whole(&host, 3);
    for r in gpus.into_iter().map(report) {
        assert_whole(&r, 3);
        assert_eq!(
            digests(&r),
            digests(&host),
            "{}: a host consumer's bytes",
            r.name
        );
    }
    let s = env.stats();
    let st = &s.streams[0];
    assert_eq!(st.batches_produced, 75);
    let copies: Vec<(String, u64)> = st.gpus.iter().map(|g| (g.gpu.clone(), g.copies)).collect();
    assert_eq!(
        copies,
        [
            ("cuda:0 host-memory stand-in".to_string(), 75),
            ("cuda:1 host-memory stand-in".to_string(), 75)
        ],
        "one copy per batch per GPU"
    );
    assert!(
        st.gpus.iter().all(|g| g.slots_in_use == 0),
        "{:#?}",
        st.gpus
    );
}

/// A GPU that fails mid-run ends its consumers with the device's error;
/// a host consumer of the same stream reads every batch.
#[test]
fn a_device_failing_mid_run_ends_its_consumers_and_no_one_else() {
    let env = Env::start_stand_in(&config("epochs = 2\nmin_consumers = 2"), "fail-at=7");
    let host = env.consumer(&["--verify", "--digest", "--name", "host"]);
    let gpu = env.consumer(&["--verify", "--device", "cuda:0", "--name", "gpu"]);
    let gpu = report(gpu);
    assert!(!gpu.ok, "{gpu:#?}");
    assert_eq!(
        gpu.error_code.as_deref(),
        Some("DeviceUnavailable"),
        "{gpu:#?}"
    );
    let e = gpu.error.as_deref().unwrap_or_default();
    assert!(e.contains("CUDA_ERROR_ILLEGAL_ADDRESS"), "{e}");
    // Copies 0..7 ended before the failure; the consumer reads those it
    // was sent before the device's error reached it (a window's worth,
    // often fewer), never one more.
    assert!(gpu.batches <= 7, "{gpu:#?}");
    assert_whole(&report(host), 2);
}

/// The stand-in is the broker's test setting, never a consumer's choice:
/// a broker started without it refuses a consumer that asks for one, and
/// says how it is turned on.
#[test]
fn a_broker_without_the_setting_refuses_a_stand_in_gpu() {
    let env = Env::start(&config("epochs = 1"));
    let c = env.own(common::spawn_consumer_stand_in(
        &env.socket(),
        &["--device", "cuda:0"],
        Some("1"),
    ));
    let r = report(c);
    assert!(!r.ok, "{r:#?}");
    assert_eq!(r.error_code.as_deref(), Some("DeviceUnavailable"), "{r:#?}");
    let e = r.error.as_deref().unwrap_or_default();
    assert!(e.contains("BATCHCAST_TEST_GPU=1"), "{e}");
    assert_eq!(env.stats().streams[0].gpus.len(), 0);
}

/// Device twin of `batch_sizes::consumers_of_mixed_batch_sizes_...`:
/// device consumers of their own batch sizes on one GPU read every sample
/// of every epoch once, in the stream's order, with a host consumer's
/// bytes, from one copy of each unit (their runs straddle units and the
/// device rings' wraps: spans of the rings, as on the host).
#[test]
fn device_consumers_of_mixed_batch_sizes_read_one_copy_of_each_unit() {
    let sizes: [u64; 6] = [1, 7, 32, 40, 64, 96];
    let env = Env::start_stand_in(
        &config("epochs = 3\nmin_consumers = 7\ngpu_slots = 16"),
        "1",
    );
    let host = env.consumer(&["--verify", "--digest", "--name", "host"]);
    let kids: Vec<_> = sizes
        .iter()
        .map(|b| {
            let (name, b) = (format!("b{b}"), b.to_string());
            env.consumer(&[
                "--verify",
                "--digest",
                "--device",
                "cuda:0",
                "--batch-size",
                &b,
                "--name",
                &name,
            ])
        })
        .collect();
    let host = report(host);
    assert_whole(&host, 3);
    for (r, &b) in kids.into_iter().map(report).zip(&sizes) {
        assert_whole(&r, 3);
        assert_eq!(r.batches, 3 * 1000u64.div_ceil(b), "batch size {b}");
        assert_eq!(
            digests(&r),
            digests(&host),
            "batch size {b}: a host consumer's bytes"
        );
    }
    let s = env.stats();
    let st = &s.streams[0];
    assert_eq!(st.batches_produced, 75);
    assert_eq!(st.gpus.len(), 1);
    assert_eq!(
        st.gpus[0].copies, 75,
        "one copy per unit, whatever the batch sizes"
    );
}

/// Device twin of `groups::a_groups_ranks_split_each_epoch_...`: the
/// members of one group on one GPU, those of another on a second, and a
/// plain consumer on a third each read exactly their share (runs of the
/// device rings, as of the host's).
#[test]
fn a_groups_device_ranks_split_each_epoch_while_others_receive_everything() {
    let env = Env::start_stand_in(&crate::groups::config(6), "1");
    crate::groups::ranks_split_each_epoch_while_others_receive_everything(
        &env,
        [
            &["--device", "cuda:0"],
            &["--device", "cuda:1"],
            &["--device", "cuda:2"],
        ],
    );
    let s = env.stats();
    let copies: Vec<u64> = s.streams[0].gpus.iter().map(|g| g.copies).collect();
    let units = s.streams[0].batches_produced;
    assert_eq!(copies, [units; 3], "one copy of each unit per GPU");
}

/// Device twin of `replay::joining_now_at_every_position_...`: a device
/// consumer that joins now at any unit of an epoch is replayed the
/// epoch's start (each replayed batch copied to its own arena on its GPU
/// before it is sent) and reads a complete first epoch of the stream's
/// bytes.
#[test]
fn a_device_consumer_joining_now_anywhere_in_an_epoch_reads_it_complete() {
    let env = Env::start_stand_in(&crate::replay::config(""), "1");
    crate::replay::joining_now_at_every_position_of_an_epoch(&env, &["--device", "cuda:0"]);
    let s = env.stats();
    let g = &s.streams[0].gpus;
    assert_eq!(g.len(), 1);
    assert!(g[0].replayed > 0, "replayed batches were copied: {g:#?}");
}

/// Device twin of `replay::a_trainer_resumes_at_a_checkpoint_...`.
#[test]
fn a_device_trainer_resumes_at_a_checkpoint_position_behind_or_ahead_of_the_stream() {
    let env = Env::start_stand_in(&crate::replay::config(""), "1");
    crate::replay::resumes_at_a_checkpoint_position_behind_or_ahead(&env, &["--device", "cuda:0"]);
}

/// Device twin of `restart::consumers_ride_through_broker_restarts_...`:
/// device consumers (one of the stream's batch size, one of 16, on two
/// GPUs) ride through a SIGKILL, a SIGTERM and a SIGKILL of the broker
/// with the bytes of an uninterrupted run: each new broker serves each
/// from its place, replayed to its GPU.
#[test]
fn device_consumers_ride_through_broker_restarts_with_the_bytes_of_an_uninterrupted_run() {
    let mut env = Env::start_stand_in(&crate::restart::config(), "1");
    crate::restart::ride_through_broker_restarts(
        &mut env,
        [&["--device", "cuda:0"], &["--device", "cuda:1"]],
    );
}

/// Device twin of `pause::a_stopped_trainer_on_a_default_stream_is_cut_...`:
/// a device consumer stopped for 6 s on a lockstep stream holds the others
/// only for the hold limit: it is cut to replay (to its own arena on its
/// GPU) and, continued, reads every sample once, then merges back.
#[test]
fn a_stopped_device_trainer_on_a_default_stream_is_cut_and_reads_every_sample_once() {
    let env = Env::start_stand_in(&crate::pause::lockstep(), "1");
    crate::pause::stopped_trainer_is_cut_and_reads_every_sample_once(&env, &["--device", "cuda:0"]);
    assert!(env.stats().streams[0].gpus[0].replayed > 0);
}

/// Issue 72 at the defaults, on the stand-in: a GPU trainer stopped
/// mid-step holding its batch (`--hold 1`) holds a steady host trainer at
/// most the 2 s hold limit. Its GPU's ring, full of what it holds, keeps
/// the next copy waiting; the members owing that copy are cut (owed by
/// nobody, it is never made and its host slot goes), the ring stays where
/// it is (a GPU copier reads it), and continued, the GPU trainer reads
/// every sample once. Before, the others waited the held-batch limit
/// (30 s) and it was detached.
#[test]
fn at_the_defaults_a_gpu_trainer_stopped_holding_its_batch_holds_the_others_at_most_2_s() {
    let env = Env::start_stand_in(&crate::pause::defaults(), "1");
    let st = crate::pause::stopped_holding_its_batch_reads_on(&env, &["--device", "cuda:0"]);
    assert_eq!(st.ring_moves, 0, "{st:#?}");
    assert!(st.gpus[0].replayed > 0, "{st:#?}");
}

/// At the defaults, a GPU trainer stopped holding its batch once every
/// unit of the stream was made (the host ring holds them all: the
/// pipeline waits for no slot) holds another trainer on its GPU only for
/// the bound: the copies that trainer needs wait for the slot of its
/// GPU's ring the stopped one keeps, and the hold rule judges that as
/// when the pipeline waits. Before, nothing judged it once every unit was
/// made, and the other waited for good (the hold simulation found it on
/// finite streams).
#[test]
fn at_the_defaults_a_gpu_trainer_stopped_holding_its_batch_at_the_streams_end_holds_no_one_for_good()
 {
    let cfg = "[[stream]]\nname = \"train\"\nbatch_size = 2\nslots = 8\ngpu_slots = 2\n\
               epochs = 1\nmin_consumers = 2\n\n[stream.synthetic]\nlen = 16\nfill = \"stamp\"\n\
               fields = [{ name = \"x\", dtype = \"u8\", shape = [64] }]\n";
    let env = Env::start_stand_in(cfg, "1");
    let gpu = ["--verify", "--device", "cuda:0"];
    let keep = ["--hold", "1", "--stop-after", "1", "--name", "stopped"];
    let stopped = env.consumer(&[&gpu[..], &keep].concat());
    let steady = env.consumer(&[&gpu[..], &["--name", "steady"]].concat());
    common::wait_stopped(stopped.id());
    let r = env.report(steady);
    assert!(
        r.ok && r.ended && r.verify_failures == 0 && r.samples == 16,
        "{r:#?}"
    );
    batchcast_cli::harness::signal(stopped.id(), nix::sys::signal::Signal::SIGCONT);
    let r = env.report(stopped);
    assert_eq!(r.verify_failures, 0, "{r:#?}");
}

/// A device consumer whose replay arena on its GPU cannot be had (here
/// the memory budget has room for the stream, two host replay arenas and
/// the GPU's arena, not for one more on the GPU) falls back as a host
/// consumer does: it is served, and stopped past the hold limit it is
/// detached, told why (its replay arena was refused at subscribe), while
/// the steady reader is held only for the bound. Before, its subscription
/// was refused.
#[test]
fn a_device_trainer_without_room_for_a_replay_arena_is_served_and_detached_at_the_bound() {
    // 1 MiB samples in units of 4: the stream's ring of 8 units 32 MiB;
    // a consumer's replay arena (window 1: 3 batches) 12 MiB; the GPU's
    // arena of 4 units 16 MiB. Of 80 MiB: the frame buffers of 16
    // connections (about 1 MiB), 32 + 12 (steady) + 12 (the device
    // trainer's on the host) + 16 (the GPU's arena) leave 7, no room for
    // a replay arena on the GPU.
    let cfg = "[broker]\nmemory_mib = 80\nmax_connections = 16\n\n[[stream]]\nname = \"train\"\nbatch_size = 4\nslots = 8\n\
               gpu_slots = 4\nepochs = 40\nmin_consumers = 2\nhold_limit_s = 1.0\n\n\
               [stream.synthetic]\nlen = 16\nfill = \"stamp\"\n\
               fields = [{ name = \"x\", dtype = \"u8\", shape = [1048576] }]\n";
    let env = Env::start_stand_in(cfg, "1");
    let mut steady = env.consumer(&crate::pause::STEADY_OF_ONE);
    // The budget is sized for this order: the steady one's replay arena
    // first (subscribed the other way round, the device trainer's would
    // fit and the steady one's not).
    env.wait_for("the steady reader to subscribe", |s| {
        s.streams[0].consumers.iter().any(|c| c.name == "steady")
    });
    let stopped = env.consumer(&[
        "--verify",
        "--window",
        "1",
        "--device",
        "cuda:0",
        "--stop-after",
        "5",
        "--name",
        "stopped",
    ]);
    common::wait_stopped(stopped.id());
    let t0 = std::time::Instant::now();
    while t0.elapsed() < std::time::Duration::from_secs(6) && steady.try_wait().unwrap().is_none() {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let finished = t0.elapsed();
    batchcast_cli::harness::signal(stopped.id(), nix::sys::signal::Signal::SIGCONT);
    let (steady, stopped) = (report(steady), report(stopped));
    assert!(steady.ok && steady.ended, "{steady:#?}\n{}", env.log());
    assert_eq!(steady.verified_samples, 40 * 16);
    assert!(
        finished < std::time::Duration::from_secs(4),
        "steady finished {finished:?} after the stop"
    );
    assert_eq!(
        stopped.error_code.as_deref(),
        Some("HoldLimit"),
        "{stopped:#?}\n{}",
        env.log()
    );
    let why = stopped.error.clone().unwrap_or_default();
    assert!(
        why.contains("no replay arena (refused at subscribe: on cuda:0") && why.contains("memory"),
        "{why}"
    );
    assert_eq!(stopped.verified_samples, 5 * 4, "{stopped:#?}");
    assert!(
        env.log().contains("no replay arena on its GPU"),
        "{}",
        env.log()
    );
}

/// Device twin of `decoupled::a_trainer_that_stalls_is_replayed_to_...`:
/// on a decoupled stream, device consumers (one of batches of 7) read
/// every sample once while a stalling one is cut, replayed to its GPU and
/// merged back, the others never held.
#[test]
fn on_a_decoupled_stream_a_stalling_device_trainer_is_replayed_to_and_holds_no_one() {
    let env = Env::start_stand_in(&crate::decoupled::config(4), "1");
    crate::decoupled::stalling_trainer_is_replayed_to_while_the_others_go_on(
        &env,
        [&["--device", "cuda:0"], &["--device", "cuda:0"]],
    );
}

/// Device twin of `decoupled::a_joiner_as_fast_as_the_others_reads_each_
/// epoch_rotated_...`: a device consumer joining now on a stream whose
/// epochs are far longer than the ring reads each epoch from where the
/// shared stream is and its start after its end (rotated), replayed only
/// that part.
#[test]
fn a_device_joiner_reads_each_epoch_rotated_and_replays_only_its_start() {
    let env = Env::start_stand_in(&crate::decoupled::long_epochs(3), "1");
    crate::decoupled::joiner_reads_each_epoch_rotated(&env, &["--device", "cuda:0"]);
}

/// Device twin of `replay::a_forged_release_of_a_replayed_batch_ends_
/// only_that_consumer` (threat model: a device consumer is held to a host
/// one's bounds): a raw client on a stand-in GPU, granted replay (and its
/// own replay arena on the GPU, whose fd comes last), releases a replayed
/// batch it never got; it alone is ended, a steady device reader reads
/// on, and both of its replay arenas go back to the budget.
#[test]
fn a_forged_release_of_a_batch_replayed_to_a_gpu_ends_only_that_consumer() {
    use batchcast::proto;

    let env = Env::start_stand_in(&crate::replay::config(""), "1");
    let r = report(env.consumer(&["--max-batches", "5"]));
    assert!(r.ok, "{r:#?}");
    let steady = env.consumer(&[
        "--join",
        "immediate",
        "--verify",
        "--max-batches",
        "40",
        "--sleep-ms",
        "2",
        "--device",
        "cuda:0",
        "--name",
        "steady",
    ]);
    let request = proto::ConsumeRequest {
        join: batchcast::JoinPolicy::Now,
        resume: Some(proto::Position::default()),
        device: Some(proto::DeviceRequest {
            uuid: batchcast::stand_in::uuid(0),
            ordinal: 0,
            name: batchcast::stand_in::NAME.into(),
        }),
        mailbox: false,
        ..common::consume_request(2)
    };
    let (mut sock, welcome, fds) = common::raw_subscribe_with(&env.socket(), "forger", request);
    let grant = welcome.replay.expect("behind the stream: replay granted");
    let device = grant
        .device
        .as_ref()
        .expect("and a replay arena on its GPU");
    assert_eq!(device.memory, proto::DeviceMemory::StandIn);
    // The host arena, the replay arena, the GPU's arena, its replay arena.
    assert_eq!(fds.len(), 4, "{grant:?}");
    // The GPU's arena (the steady reader's and its own), and its own
    // replay arena there (the steady one, if still there, has one too:
    // for a cut), in the budget.
    let shared = welcome
        .device
        .as_ref()
        .expect("a device arena")
        .rings
        .arena_bytes;
    let gpu = env.stats().memory.gpu_arenas_bytes;
    assert!(
        gpu >= shared + device.rings.arena_bytes,
        "charged to the budget: {gpu}"
    );
    let s = crate::replay::forged_release_ends_only_the_forger(&env, &mut sock, steady);
    assert_eq!(s.memory.replay_bytes, 0, "its replay arena went back");
    assert_eq!(
        s.memory.gpu_arenas_bytes, shared,
        "and those on its GPU (the GPU's own arena stays)"
    );
}

/// 46 guest device consumers (the guest's connection share) that resume
/// at 0:0 once the stream has moved on (an early trainer read 20 batches),
/// so each joins cut, to be replayed to, and never read (half stopped
/// before their first notice, half after one batch): they hold neither a
/// decoupled stream nor the owner's trainer that joins it at the next
/// epoch; it is served as fast as beside never-reading host consumers.
#[test]
fn a_guests_device_consumers_cut_at_join_that_never_read_hold_no_one() {
    let Some(env) = guest_stream(1) else { return };
    let early = env.consumer(&["--max-batches", "20", "--name", "early"]);
    assert!(common::report(early).ok);
    let idle = guest_device_consumers(&env, 0..46);
    owner_is_served_at_once(&env, &idle);
}

/// Issue 70 item 5: two guest device consumers that read the shared
/// stream from its start (the stream waits for both) and stop, one before
/// its first batch, fill their GPU ring with what they hold (a device
/// consumer takes its batches on the socket: a cut cannot take them
/// back). The next copy there waits, and the members owing it are cut, so
/// nobody owes it, it is never made and its host slot goes: the owner's
/// trainer is served at once, and neither guest is detached. Before,
/// the owner waited the hold limit and the guests were detached.
#[test]
fn a_guests_device_consumers_stopped_on_the_shared_stream_hold_no_one() {
    let Some(env) = guest_stream(2) else { return };
    let idle = guest_device_consumers(&env, 0..2);
    owner_is_served_at_once(&env, &idle);
    assert_eq!(env.stats().streams[0].detached, 0, "{}", env.log());
}

/// Threat model: memory shared over CUDA IPC is mapped writable, so a
/// guest's device consumers read an arena of their own uid on the GPU
/// (copied once per batch for all of that uid's consumers), never the
/// owner's: the owner's and the guest's device consumers on one GPU read
/// every sample of the epoch with the host's bytes, and the stream shows
/// two arenas on it, one per uid, each with one copy per batch. Before,
/// both read the one arena (one entry, 25 copies).
#[test]
fn a_guests_device_consumers_read_an_arena_of_their_own_uid() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    if !common::is_root("running consumers as another uid") {
        return;
    }
    let env = Env::start_stand_in(
        &format!(
            "[broker]\nallow_uids = [{GUEST}]\n{}",
            config("epochs = 1\nmin_consumers = 2")
        ),
        "1",
    );
    let dir = env.socket().parent().unwrap().to_path_buf();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let bin = tempfile::tempdir().unwrap();
    std::fs::set_permissions(bin.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let exe = bin.path().join("batchcast");
    std::fs::copy(common::EXE, &exe).unwrap();
    let guest = env.spawn_own(
        common::command(&exe)
            .args(["consume", "--json", "--socket"])
            .arg(env.socket())
            .args([
                "--verify", "--digest", "--device", "cuda:0", "--name", "guest",
            ])
            .env(batchcast::stand_in::ENV, "1")
            .env("BATCHCAST_BROKER_UID", "0")
            .uid(GUEST)
            .gid(GUEST)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped()),
    );
    let owner = env.consumer(&[
        "--verify", "--digest", "--device", "cuda:0", "--name", "owner",
    ]);
    let (owner, guest) = (report(owner), report(guest));
    assert_whole(&owner, 1);
    assert_whole(&guest, 1);
    assert_eq!(digests(&owner), digests(&guest), "the same bytes");
    let s = env.stats();
    let mut copies: Vec<(String, u64)> = s.streams[0]
        .gpus
        .iter()
        .map(|g| (g.gpu.clone(), g.copies))
        .collect();
    copies.sort();
    assert_eq!(
        copies,
        [
            ("cuda:0 host-memory stand-in".to_string(), 25),
            (format!("cuda:0 host-memory stand-in, uid {GUEST}"), 25)
        ],
        "an arena per uid on the GPU, one copy per batch each"
    );
}

const GUEST: u32 = 65534;

/// A decoupled stream that does not end, on the stand-in GPU, starting
/// once `min` consumers subscribed, which the guest may read with as many
/// connections as it wants (`None` when not root).
fn guest_stream(min: usize) -> Option<Env> {
    use std::os::unix::fs::PermissionsExt;
    if !common::is_root("running consumers as another uid") {
        return None;
    }
    let body = common::small_images(40, 410)
        .epochs(100_000)
        .key("min_consumers", min)
        .raw("pace = \"decoupled\"")
        .to_toml();
    let env = Env::start_stand_in(
        &format!("[broker]\nallow_uids = [{GUEST}]\nmax_connections_per_uid = 64\n{body}"),
        "1",
    );
    let dir = env.socket().parent().unwrap().to_path_buf();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    Some(env)
}

/// The guest's device consumers `ks` on `env`'s stream, resuming at 0:0
/// and stopped (even ones before their first notice, odd ones after one
/// batch), with the folder of the binary they run.
fn guest_device_consumers(env: &Env, ks: std::ops::Range<usize>) -> (tempfile::TempDir, Vec<u32>) {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    let bin = tempfile::tempdir().unwrap();
    std::fs::set_permissions(bin.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let exe = bin.path().join("batchcast");
    std::fs::copy(common::EXE, &exe).unwrap();
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    let pids: Vec<u32> = ks
        .map(|k| {
            let stop = if k % 2 == 0 { "0" } else { "1" };
            env.spawn_own(
                common::command(&exe)
                    .args(["consume", "--json", "--socket"])
                    .arg(env.socket())
                    .args(["--device", "cuda:0", "--resume", "0:0"])
                    .args(["--stop-after", stop, "--name", &format!("idle-{k}")])
                    .env(batchcast::stand_in::ENV, "1")
                    .env("BATCHCAST_BROKER_UID", "0")
                    .uid(GUEST)
                    .gid(GUEST)
                    .stdin(std::process::Stdio::null())
                    .stdout(std::process::Stdio::null()),
            )
            .id()
        })
        .collect();
    for &pid in &pids {
        common::wait_stopped(pid);
    }
    (bin, pids)
}

/// The owner's trainer, joining at the next epoch while the guest's
/// consumers stay stopped, gets its 50 batches in well under the hold
/// limit (alone: about 0.2 s).
fn owner_is_served_at_once(env: &Env, _guests: &(tempfile::TempDir, Vec<u32>)) {
    let t0 = std::time::Instant::now();
    let r = common::report(env.consumer(&[
        "--verify",
        "--join",
        "next-epoch",
        "--max-batches",
        "50",
        "--name",
        "owner",
    ]));
    let took = t0.elapsed();
    assert!(r.ok, "{r:#?}");
    assert!(
        took < std::time::Duration::from_secs(10),
        "the owner took {took:?}: {}",
        env.log()
    );
}
