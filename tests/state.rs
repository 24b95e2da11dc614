//! A trainer's data state in its checkpoint: real broker, real consumer
//! processes. A trainer writes its state after every batch
//! (`consume --state-file`, as one checkpointing every step), is
//! SIGKILLed at a chosen batch and started again from that state
//! (`--resume-state`); every epoch's digest (sample by sample, so batch
//! sizes do not matter; the resumed epoch's carried on from the state)
//! must equal an uninterrupted trainer's, while two others read
//! undisturbed. And a stream that changed refuses the state, naming what.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use batchcast_broker::config::StreamToml;
use batchcast_cli::report::{ConsumerReport, SavedState};

use crate::common;

use common::{Env, report, sigkill};

/// 400 samples an epoch in batches of 10 (40 an epoch), 3 epochs,
/// shuffled: each sample's bytes differ (`fill = "full"`). It starts
/// with three consumers.
fn config(seed: u64) -> String {
    config_for(seed, 3)
}

fn config_for(seed: u64, min_consumers: u32) -> String {
    let fields: [(&str, &str, &[u64]); 2] = [("image", "u8", &[3, 8, 8]), ("label", "i64", &[])];
    StreamToml::synthetic("train", 10, 400, &fields)
        .epochs(3)
        .key("seed", seed)
        .key("slots", SLOTS)
        .key("workers", 2)
        .key("min_consumers", min_consumers)
        .key("max_batch_size", 16)
        .fill("full")
        .to_toml()
}

const PER_EPOCH: u64 = 400;
const SLOTS: u32 = 12;

/// Epoch → digest, for the epochs a report covers whole.
fn digests(r: &ConsumerReport) -> Vec<(u64, String)> {
    r.epochs
        .iter()
        .map(|e| (e.epoch, e.digest.clone().expect("--digest")))
        .collect()
}

/// Starts a trainer that checkpoints every batch to `state`, waits until
/// its state says it stands at `at` (it stalls there: `--stall-after`
/// batches of this process), and SIGKILLs it.
fn kill_at(env: &Env, state: &Path, stall_after: u64, at: (u64, u64), extra: &[&str]) {
    let stall = stall_after.to_string();
    let file = state.to_str().unwrap();
    let mut args = vec![
        "--digest",
        "--state-file",
        file,
        "--stall-after",
        &stall,
        "--stall-ms",
        "60000",
        "--name",
        "trainer",
    ];
    args.extend_from_slice(extra);
    let mut child = env.consumer(&args);
    let t0 = Instant::now();
    loop {
        if let Ok(s) = SavedState::load(state)
            && (s.state.position.epoch, s.state.position.sample) == at
        {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the trainer never stood at {at:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    sigkill(&mut child);
}

/// Two undisturbed readers (batches of 10 and of 7, 20 ms a batch).
fn others(env: &Env) -> [std::process::Child; 2] {
    [
        env.consumer(&["--digest", "--sleep-ms", "20", "--name", "a"]),
        env.consumer(&[
            "--digest",
            "--sleep-ms",
            "20",
            "--batch-size",
            "7",
            "--name",
            "b",
        ]),
    ]
}

/// The resumed trainer reads to the end; returns its report and an
/// undisturbed reader's, after checking the other agrees with it.
fn finish(
    env: &Env,
    state: &Path,
    extra: &[&str],
    others: [std::process::Child; 2],
) -> (ConsumerReport, ConsumerReport) {
    let mut args = vec!["--digest", "--resume-state", state.to_str().unwrap()];
    args.extend_from_slice(extra);
    let resumed = report(env.consumer(&args));
    let [a, b] = others.map(report);
    assert!(a.ok && b.ok, "{a:#?}\n{b:#?}");
    assert_eq!(digests(&a), digests(&b), "the undisturbed readers agree");
    assert_eq!(digests(&a).len(), 3);
    assert!(resumed.ok, "{resumed:#?}");
    (resumed, a)
}

/// The resumed trainer's epochs from `from` on equal the reference's, and
/// it carried on the epoch it was killed in (whole sample counts).
fn same_from(resumed: &ConsumerReport, reference: &ConsumerReport, from: u64) {
    let want: Vec<_> = digests(reference)
        .into_iter()
        .filter(|(e, _)| *e >= from)
        .collect();
    assert_eq!(digests(resumed), want, "{resumed:#?}");
    for e in &resumed.epochs {
        assert_eq!(
            e.samples, PER_EPOCH,
            "epoch {} counted whole: {resumed:#?}",
            e.epoch
        );
    }
    assert!(
        resumed.order_errors.is_empty(),
        "{:?}",
        resumed.order_errors
    );
}

fn state_file(env: &Env) -> PathBuf {
    env.path("trainer.state")
}

#[test]
fn a_trainer_killed_mid_epoch_resumes_from_its_state_exactly() {
    let env = Env::start(&config(5));
    let state = state_file(&env);
    let others = others(&env);
    // Epoch 1, batch 17 handed out: its state is right after it.
    kill_at(&env, &state, 58, (1, 180), &[]);
    // The others go on until the ring no longer holds where it stood.
    env.wait_for("the stream to move a ring past the trainer", |s| {
        s.streams[0].batches_produced >= 58 + 2 * u64::from(SLOTS)
    });
    let (resumed, reference) = finish(&env, &state, &[], others);
    assert!(
        resumed.replayed_batches > 0,
        "what the stream made meanwhile is replayed: {resumed:#?}"
    );
    same_from(&resumed, &reference, 1);
    let saved = SavedState::load(&state).unwrap();
    let json = serde_json::to_string(&saved.state).unwrap();
    assert!(json.len() < 1024, "a state is small: {json}");
}

#[test]
fn a_trainer_killed_at_an_epochs_last_batch_goes_on_with_the_next_epoch() {
    let env = Env::start(&config(6));
    let state = state_file(&env);
    let others = others(&env);
    kill_at(&env, &state, 40, (1, 0), &[]);
    let (resumed, reference) = finish(&env, &state, &[], others);
    // Epoch 0 ended with the killed process; the resumed one begins epoch 1.
    same_from(&resumed, &reference, 1);
    assert_eq!(resumed.epochs.first().map(|e| e.epoch), Some(1));
}

#[test]
fn a_trainer_resumed_twice_within_an_epoch_does_not_drift() {
    let env = Env::start(&config(7));
    let state = state_file(&env);
    let others = others(&env);
    kill_at(&env, &state, 45, (1, 50), &[]);
    // Again from there: 20 more batches, killed at sample 250 of epoch 1.
    let file = state.to_str().unwrap().to_string();
    kill_at(&env, &state, 20, (1, 250), &["--resume-state", &file]);
    let (resumed, reference) = finish(&env, &state, &[], others);
    same_from(&resumed, &reference, 1);
}

#[test]
fn a_trainer_may_resume_with_another_batch_size() {
    let env = Env::start(&config(8));
    let state = state_file(&env);
    let others = others(&env);
    kill_at(&env, &state, 52, (1, 120), &[]);
    // Batches of 16 from sample 120 on: the same samples, grouped anew.
    let file = state.to_str().unwrap().to_string();
    let extra = ["--batch-size", "16", "--state-file", &file];
    let (resumed, reference) = finish(&env, &state, &extra, others);
    same_from(&resumed, &reference, 1);
    let saved = SavedState::load(&state).unwrap();
    assert_eq!(saved.state.batch_size, 16, "its state now says 16");
}

#[test]
fn a_state_saved_under_another_stream_is_refused_naming_what_changed() {
    let env = Env::start(&config(9));
    let state = state_file(&env);
    let others = others(&env);
    kill_at(&env, &state, 5, (0, 50), &[]);
    for o in others {
        drop(report(o));
    }
    // The broker comes back with another seed: another order.
    let changed = Env::start(&config(10));
    let r = report(changed.consumer(&["--resume-state", state.to_str().unwrap()]));
    assert!(!r.ok, "{r:#?}");
    assert_eq!(r.error_code.as_deref(), Some("StreamChanged"), "{r:#?}");
    let err = r.error.unwrap_or_default();
    assert!(
        err.contains("has changed") && err.contains("the order or split"),
        "{err}"
    );
    assert!(
        !err.contains("the dataset"),
        "only the order changed: {err}"
    );
    // The same stream as before serves it: what the digest covers did
    // not change (min_consumers is not about the data).
    let same = Env::start(&config_for(9, 1));
    let r = report(same.consumer(&[
        "--resume-state",
        state.to_str().unwrap(),
        "--max-batches",
        "3",
    ]));
    assert!(r.ok, "{r:#?}");
}

#[test]
fn a_restarted_broker_starts_where_its_first_trainer_resumes() {
    let env = Env::start(&config_for(11, 1));
    let state = state_file(&env);
    // Epoch 2, sample 120: 80 batches of epochs 0 and 1, then 12.
    kill_at(&env, &state, 92, (2, 120), &[]);
    let saved = std::fs::read(&state).unwrap();
    drop(env); // the broker goes, and comes back
    let fresh = Env::start(&config_for(11, 1));
    let state = fresh.path("trainer.state");
    std::fs::write(&state, saved).unwrap();
    let resumed = report(fresh.consumer(&["--digest", "--resume-state", state.to_str().unwrap()]));
    assert!(resumed.ok && resumed.ended, "{resumed:#?}");
    assert_eq!(
        resumed.replayed_batches, 0,
        "nothing to recompute: {resumed:#?}"
    );
    assert_eq!(
        fresh.stats().streams[0].batches_produced,
        40 - 12,
        "the stream made only what the trainer had left, not epochs 0 and 1 for nobody"
    );
    let whole = Env::start(&config_for(11, 1));
    let reference = report(whole.consumer(&["--digest"]));
    assert!(reference.ok, "{reference:#?}");
    same_from(&resumed, &reference, 2);
}
