use std::collections::{BTreeMap, VecDeque};

use proptest::prelude::*;

use super::*;
use batchcast::JoinPolicy;

fn hub(slots: u32, bpe: u64, epochs: Option<u64>, lag_limit: Option<u32>) -> Hub {
    Hub::new(HubConfig {
        slots,
        batches_per_epoch: bpe,
        epochs,
        lag_limit,
        min_consumers: 1,
    })
}

/// Produces one batch if possible; returns it.
fn produce(h: &mut Hub) -> Option<Work> {
    let w = h.start_batch()?;
    h.finish_batch(w.seq, 4);
    Some(w)
}

fn batches(out: &[(ConsumerId, Outbound)], who: ConsumerId) -> Vec<(u64, u64)> {
    out.iter()
        .filter(|(id, _)| *id == who)
        .filter_map(|(_, o)| match o {
            Outbound::Batch { epoch, index, .. } => Some((*epoch, *index)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_stream_whose_only_consumer_said_goodbye_pauses() {
    let mut h = hub(4, 10, None, None);
    let (a, _) = h.join(1, JoinPolicy::Immediate).unwrap();
    let w = produce(&mut h).unwrap();
    h.take_outbound();
    h.goodbye(a).unwrap();
    // It still holds batch 0, and is still subscribed until it leaves,
    // but takes nothing more: nothing is made for nobody.
    assert!(
        !h.view().can_start(),
        "a closing consumer is nobody to produce for"
    );
    h.release(a, w.seq).unwrap();
    assert!(!h.view().can_start());
    let (_b, _) = h.join(1, JoinPolicy::Immediate).unwrap();
    assert!(h.view().can_start(), "a new reader starts it again");
}

#[test]
fn a_stream_nobody_read_yet_starts_where_it_is_sought_and_only_then() {
    let mut h = hub(4, 10, Some(3), None);
    assert!(!h.seek(3, 0), "past the stream");
    assert!(!h.seek(1, 10), "past an epoch");
    // An endless stream still refuses an epoch it would count past u64's
    // end (a forged registration at 2^64-1 wrapped to epoch 0).
    let mut endless = hub(4, 10, None, None);
    assert!(!endless.seek(u64::MAX, 9) && !endless.seek(MAX_EPOCH, 0));
    assert!(endless.seek(MAX_EPOCH - 1, 9));
    assert!(h.seek(2, 7));
    let (a, start) = h.join(2, JoinPolicy::Now).unwrap();
    assert_eq!(
        (start, h.view().reader(a).map(|c| c.first_batch())),
        (2, Some((2, 7)))
    );
    assert!(!h.seek(0, 0), "someone is subscribed");
    let w = produce(&mut h).unwrap();
    assert_eq!(
        (w.seq, w.epoch, w.index),
        (0, 2, 7),
        "the first batch made is there"
    );
    produce(&mut h).unwrap();
    produce(&mut h).unwrap();
    assert_eq!(batches(&h.take_outbound(), a), vec![(2, 7), (2, 8)]);
    h.view().check_invariants();
    // Once a batch was started, a seek changes nothing.
    let mut h = hub(4, 10, None, None);
    let (b, _) = h.join(1, JoinPolicy::Immediate).unwrap();
    produce(&mut h).unwrap();
    h.leave(b);
    assert!(!h.seek(5, 0));
}

#[test]
fn pipeline_waits_for_the_first_consumer_then_for_free_slots() {
    let mut h = hub(2, 10, None, None);
    assert!(h.start_batch().is_none(), "nobody subscribed yet");
    let (a, start) = h.join(1, JoinPolicy::NextEpoch).unwrap();
    assert_eq!(start, 0);
    let w0 = produce(&mut h).unwrap();
    produce(&mut h).unwrap();
    assert!(
        h.start_batch().is_none(),
        "both slots in use: back-pressure"
    );
    let out = h.take_outbound();
    assert_eq!(
        batches(&out, a),
        vec![(0, 0)],
        "window of one: second batch waits"
    );
    h.release(a, w0.seq).unwrap();
    assert_eq!(batches(&h.take_outbound(), a), vec![(0, 1)]);
    assert!(h.start_batch().is_some(), "released slot is reused");
    h.view().check_invariants();
}

#[test]
fn min_consumers_can_be_lowered_before_the_start_and_not_after() {
    let mut h = Hub::new(HubConfig {
        slots: 4,
        batches_per_epoch: 10,
        epochs: None,
        lag_limit: None,
        min_consumers: 3,
    });
    let (a, _) = h.join(2, JoinPolicy::NextEpoch).unwrap();
    assert!(h.start_batch().is_none(), "waiting for three");
    // One of the three will never come: wait for two.
    h.set_min_consumers(2);
    assert!(h.start_batch().is_none(), "still waiting for the second");
    let (b, start) = h.join(2, JoinPolicy::NextEpoch).unwrap();
    assert_eq!(start, 0);
    assert!(produce(&mut h).is_some(), "both are here: it starts");
    h.set_min_consumers(5);
    assert!(h.start_batch().is_some(), "no effect once started");
    let out = h.take_outbound();
    assert_eq!(batches(&out, a), batches(&out, b));
    h.view().check_invariants();
}

#[test]
fn slowest_consumer_sets_the_pace_and_slot_is_reused_only_at_zero() {
    let mut h = hub(3, 100, None, None);
    let (fast, _) = h.join(3, JoinPolicy::NextEpoch).unwrap();
    let (slow, _) = h.join(3, JoinPolicy::NextEpoch).unwrap();
    let ws: Vec<Work> = (0..3).map(|_| produce(&mut h).unwrap()).collect();
    for w in &ws {
        h.release(fast, w.seq).unwrap();
    }
    assert!(
        h.start_batch().is_none(),
        "slow consumer still holds every slot"
    );
    h.release(slow, ws[1].seq).unwrap();
    assert!(
        h.start_batch().is_none(),
        "slots are a ring: the next batch takes the oldest's slot, still held"
    );
    h.release(slow, ws[0].seq).unwrap();
    let w = h.start_batch().unwrap();
    assert_eq!(
        w.slot, ws[0].slot,
        "the ring's next slot is reused once released by both"
    );
    h.view().check_invariants();
}

#[test]
fn an_ahead_consumer_is_sent_every_batch_at_once_and_owes_them_all() {
    let mut h = hub(4, 100, None, None);
    let (ahead, _) = h
        .join_group(1, JoinPolicy::NextEpoch, None, Delivery::Ahead)
        .unwrap();
    let (windowed, _) = h.join(1, JoinPolicy::NextEpoch).unwrap();
    let ws: Vec<Work> = (0..3).map(|_| produce(&mut h).unwrap()).collect();
    let out = h.take_outbound();
    assert_eq!(batches(&out, ahead).len(), 3, "past its window of 1");
    assert_eq!(batches(&out, windowed).len(), 1, "its window of 1");
    let c = h.view().reader(ahead).map(|c| c.counts()).unwrap();
    assert_eq!((c.window, c.held, c.queued), (1, 3, 0));
    // What it was sent pins slots exactly as what is queued would.
    h.release(windowed, ws[0].seq).unwrap();
    h.release(windowed, ws[1].seq).unwrap();
    h.release(windowed, ws[2].seq).unwrap();
    let w = produce(&mut h).unwrap();
    assert!(
        h.start_batch().is_none(),
        "the ahead consumer still owes three of four slots"
    );
    h.release(ahead, ws[1].seq).unwrap();
    assert!(h.start_batch().is_none(), "the ring's next slot is ws[0]'s");
    h.release(ahead, ws[0].seq).unwrap();
    assert_eq!(h.start_batch().unwrap().slot, ws[0].slot);
    assert_eq!(
        h.view().reader(ahead).map(|c| c.counts()).unwrap().held,
        2,
        "2 and {}",
        w.seq
    );
    h.view().check_invariants();
}

#[test]
fn a_dead_consumer_gives_back_everything_at_once() {
    let mut h = hub(4, 100, None, None);
    let (a, _) = h.join(2, JoinPolicy::NextEpoch).unwrap();
    let (b, _) = h.join(2, JoinPolicy::NextEpoch).unwrap();
    let ws: Vec<Work> = (0..4).map(|_| produce(&mut h).unwrap()).collect();
    for w in &ws[..2] {
        h.release(a, w.seq).unwrap();
    }
    assert!(h.start_batch().is_none());
    assert!(h.leave(b));
    assert!(!h.leave(b), "leaving twice is a no-op");
    assert_eq!(
        h.view().counts().free,
        2,
        "b's two held and two queued batches: two slots a released"
    );
    assert_eq!(h.view().reader(a).map(|c| c.counts()).unwrap().held, 2);
    h.view().check_invariants();
}

#[test]
fn late_joiners_start_at_the_next_epoch_unless_they_ask_for_now() {
    let mut h = hub(8, 3, None, None);
    let (a, _) = h.join(8, JoinPolicy::NextEpoch).unwrap();
    produce(&mut h).unwrap(); // epoch 0, index 0
    let (next, start) = h.join(8, JoinPolicy::NextEpoch).unwrap();
    let (now, start_now) = h.join(8, JoinPolicy::Immediate).unwrap();
    assert_eq!((start, start_now), (1, 0));
    for _ in 0..5 {
        produce(&mut h).unwrap();
    }
    let out = h.take_outbound();
    assert_eq!(
        batches(&out, a),
        vec![(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    );
    assert_eq!(batches(&out, next), vec![(1, 0), (1, 1), (1, 2)]);
    assert_eq!(
        batches(&out, now),
        vec![(0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    );
    let partial: Vec<_> = out
        .iter()
        .filter(|(id, o)| *id == now && matches!(o, Outbound::EndOfEpoch { .. }))
        .map(|(_, o)| o.clone())
        .collect();
    assert_eq!(
        partial,
        vec![
            Outbound::EndOfEpoch {
                epoch: 0,
                batches: 2,
                complete: false
            },
            Outbound::EndOfEpoch {
                epoch: 1,
                batches: 3,
                complete: true
            }
        ]
    );
    h.view().check_invariants();
}

#[test]
fn a_joiner_with_batches_in_flight_still_gets_their_whole_epoch() {
    let mut h = hub(8, 3, None, None);
    let (a, _) = h.join(8, JoinPolicy::NextEpoch).unwrap();
    for _ in 0..3 {
        produce(&mut h).unwrap();
    }
    let w = h.start_batch().unwrap(); // epoch 1 index 0, not yet published
    let (b, start) = h.join(8, JoinPolicy::NextEpoch).unwrap();
    assert_eq!(start, 1);
    h.finish_batch(w.seq, 4);
    let out = h.take_outbound();
    assert_eq!(batches(&out, b), vec![(1, 0)]);
    assert_eq!(batches(&out, a).len(), 4);
}

#[test]
fn paused_stream_skips_the_epoch_nobody_watched() {
    let mut h = hub(4, 10, None, None);
    let (a, _) = h.join(4, JoinPolicy::NextEpoch).unwrap();
    produce(&mut h).unwrap();
    h.leave(a);
    assert!(h.start_batch().is_none(), "no consumers: pipeline pauses");
    let (b, start) = h.join(4, JoinPolicy::NextEpoch).unwrap();
    assert_eq!(start, 1);
    let w = produce(&mut h).unwrap();
    assert_eq!(
        (w.epoch, w.index),
        (1, 0),
        "rest of epoch 0 is not produced for nobody"
    );
    assert_eq!(batches(&h.take_outbound(), b), vec![(1, 0)]);
}

/// The lag limit counts a consumer's own window: one whose window of 2 of
/// its batches spans 4 units is allowed the 2 more units, and a window is
/// refused above the limit in its own batches, not in units.
#[test]
fn the_lag_limit_allows_what_a_consumers_own_window_spans() {
    let mut h = hub(8, 100, None, Some(2));
    let wide = |batches| Window { units: 4, batches };
    assert_eq!(
        h.view().check_window(wide(3), None),
        Err(HubError::WindowAboveLagLimit {
            window: 3,
            lag_limit: 2
        })
    );
    let (held, _) = h
        .join_group(wide(2), JoinPolicy::NextEpoch, None, Delivery::Window)
        .unwrap();
    let (fast, _) = h.join(1, JoinPolicy::NextEpoch).unwrap();
    // `held` keeps everything it is sent; `fast` releases each batch.
    let mut detached_at = None;
    for made in 1..=8u64 {
        let w = produce(&mut h).unwrap();
        h.release(fast, w.seq).unwrap();
        if h.take_outbound()
            .iter()
            .any(|(id, o)| *id == held && matches!(o, Outbound::Detached { .. }))
        {
            detached_at = Some(made);
            break;
        }
        h.view().check_invariants();
    }
    // Behind by 5 (its oldest batch 0, the head 5) is 3 past its 2 units
    // of allowance: past the limit of 2. A plain window went at 3.
    assert_eq!(detached_at, Some(5));
}

#[test]
fn straggler_beyond_the_lag_limit_is_detached_and_frees_its_slots() {
    let mut h = hub(6, 100, None, Some(3));
    let (fast, _) = h.join(2, JoinPolicy::NextEpoch).unwrap();
    let (slow, _) = h.join(2, JoinPolicy::NextEpoch).unwrap();
    let mut detached = false;
    for _ in 0..10 {
        let Some(w) = produce(&mut h) else { break };
        h.release(fast, w.seq).unwrap();
        for (id, o) in h.take_outbound() {
            if let Outbound::Detached { reason, .. } = o {
                assert_eq!(id, slow);
                assert!(reason.contains("lag_limit of 3"), "{reason}");
                detached = true;
            }
        }
        h.view().check_invariants();
    }
    assert!(detached);
    assert!(h.view().reader(slow).map(|c| c.counts()).is_none());
    assert_eq!(h.view().counts().detached, 1);
    assert_eq!(
        h.view().counts().free,
        6,
        "fast consumer released everything it got"
    );
}

#[test]
fn the_lag_limit_leaves_a_consumer_that_may_be_cut_alone() {
    // Decoupled pace: a consumer that may be cut falls behind and is cut
    // and replayed to (not here), never detached for its lag; one that
    // may not is.
    let mut h = hub(6, 100, None, Some(3));
    let (fast, _) = h.join(2, JoinPolicy::NextEpoch).unwrap();
    let (cuttable, _) = h.join(2, JoinPolicy::NextEpoch).unwrap();
    let (lockstep, _) = h.join(2, JoinPolicy::NextEpoch).unwrap();
    h.may_be_cut(cuttable, true);
    let mut detached = Vec::new();
    for _ in 0..10 {
        let Some(w) = produce(&mut h) else { break };
        h.release(fast, w.seq).unwrap();
        for (id, o) in h.take_outbound() {
            if let Outbound::Detached { .. } = o {
                detached.push(id);
            }
        }
        h.view().check_invariants();
    }
    assert_eq!(detached, vec![lockstep]);
    assert!(h.view().reader(cuttable).map(|c| c.counts()).is_some());
}

#[test]
fn the_lag_limit_detaches_a_stalled_ahead_consumer_not_the_one_keeping_up() {
    // Mailbox consumers (sent ahead): one reads everything at once, one
    // joins later, takes a few and stalls owning the rest of the ring.
    let mut h = hub(12, 1000, None, Some(6));
    let (steady, _) = h
        .join_group(2, JoinPolicy::NextEpoch, None, Delivery::Ahead)
        .unwrap();
    for _ in 0..5 {
        let w = produce(&mut h).unwrap();
        h.take_outbound();
        h.release(steady, w.seq).unwrap();
    }
    let (staller, _) = h
        .join_group(2, JoinPolicy::Immediate, None, Delivery::Ahead)
        .unwrap();
    let mut detached = Vec::new();
    let mut taken = 0;
    for _ in 0..40 {
        let Some(w) = produce(&mut h) else { break };
        for (id, o) in h.take_outbound() {
            match o {
                Outbound::Detached { .. } => detached.push(id),
                Outbound::Batch { seq, .. } if id == steady => h.release(steady, seq).unwrap(),
                Outbound::Batch { seq, .. } if id == staller && taken < 3 => {
                    taken += 1;
                    h.release(staller, seq).unwrap();
                }
                _ => {}
            }
        }
        let _ = w;
        h.view().check_invariants();
    }
    assert_eq!(detached, vec![staller], "{:?}", h.view().counts());
}

#[test]
fn a_consumer_joining_beside_one_sent_the_ring_ahead_does_not_get_it_detached() {
    // A mailbox consumer in step with the pipeline owes the whole ring
    // while it reads; one that joins now owes only what comes next. It
    // never owed the older batches: the first is not behind it.
    let mut h = hub(12, 1000, None, Some(6));
    let (reader, _) = h
        .join_group(2, JoinPolicy::NextEpoch, None, Delivery::Ahead)
        .unwrap();
    let mut owed: VecDeque<u64> = VecDeque::new();
    for _ in 0..12 {
        owed.push_back(produce(&mut h).unwrap().seq);
    }
    h.take_outbound();
    let (newcomer, _) = h
        .join_group(2, JoinPolicy::Immediate, None, Delivery::Ahead)
        .unwrap();
    // Both read in step from here: the reader its oldest, the newcomer
    // what it is sent.
    for _ in 0..30 {
        h.release(reader, owed.pop_front().unwrap()).unwrap();
        let w = produce(&mut h).unwrap();
        owed.push_back(w.seq);
        for (id, o) in h.take_outbound() {
            match o {
                Outbound::Detached { reason, .. } => {
                    panic!(
                        "consumer {id} detached (reader {reader}, newcomer {newcomer}): {reason}"
                    )
                }
                Outbound::Batch { seq, .. } if id == newcomer => h.release(newcomer, seq).unwrap(),
                _ => {}
            }
        }
        h.view().check_invariants();
    }
    assert!(
        h.view().reader(reader).map(|c| c.counts()).is_some()
            && h.view().reader(newcomer).map(|c| c.counts()).is_some()
    );
}

#[test]
fn a_now_joiner_starts_within_the_lag_limit() {
    // A reader that said goodbye still holds batches 0-2, a slow one holds
    // 3-5 (three behind, the limit), a fast one released everything: the
    // ring holds 0-5, but a `Now` joiner starting at 0 would be six behind
    // the fast one, past the lag limit of 3, and detached at once.
    let mut h = hub(8, 100, None, Some(3));
    let (leaving, _) = h.join(3, JoinPolicy::NextEpoch).unwrap();
    let (fast, _) = h.join(3, JoinPolicy::NextEpoch).unwrap();
    let (slow, _) = h.join(3, JoinPolicy::NextEpoch).unwrap();
    for seq in 0..6 {
        let w = produce(&mut h).unwrap();
        assert_eq!(w.seq, seq);
        h.release(fast, seq).unwrap();
        if seq < 3 {
            h.release(slow, seq).unwrap();
        }
        if seq == 2 {
            h.goodbye(leaving).unwrap();
        }
    }
    let out = h.take_outbound();
    assert!(
        !out.iter()
            .any(|(_, o)| matches!(o, Outbound::Detached { .. }))
    );
    assert_eq!(
        h.view().ring().oldest_live().map(|o| (o.1, o.2)),
        Some((0, 0))
    );
    let (late, _) = h.join(2, JoinPolicy::Now).unwrap();
    assert_eq!(
        h.view().reader(late).map(|c| c.first_batch()),
        Some((0, 3)),
        "three behind the fast one"
    );
    let out = h.take_outbound();
    assert!(
        !out.iter()
            .any(|(_, o)| matches!(o, Outbound::Detached { .. })),
        "{out:?}"
    );
    assert_eq!(batches(&out, late), vec![(0, 3), (0, 4)]);
    h.view().check_invariants();
}

#[test]
fn finite_stream_ends_for_everyone_and_frees_all_slots() {
    let mut h = hub(2, 2, Some(2), None);
    let (a, _) = h.join(2, JoinPolicy::NextEpoch).unwrap();
    let mut ends = 0;
    while let Some(w) = produce(&mut h) {
        h.release(a, w.seq).unwrap();
    }
    for (_, o) in h.take_outbound() {
        ends += usize::from(o == Outbound::EndOfStream);
    }
    assert_eq!(ends, 1);
    assert!(h.view().finished());
    let (_, start) = h.join(1, JoinPolicy::NextEpoch).unwrap();
    assert_eq!(start, 2);
    assert_eq!(
        h.take_outbound().last().unwrap().1,
        Outbound::EndOfStream,
        "late joiner of a finished stream"
    );
}

#[test]
fn out_of_order_fills_are_published_in_order() {
    let mut h = hub(4, 10, None, None);
    let (a, _) = h.join(4, JoinPolicy::NextEpoch).unwrap();
    let w0 = h.start_batch().unwrap();
    let w1 = h.start_batch().unwrap();
    h.finish_batch(w1.seq, 4);
    assert!(
        batches(&h.take_outbound(), a).is_empty(),
        "batch 1 waits for batch 0"
    );
    h.finish_batch(w0.seq, 4);
    assert_eq!(batches(&h.take_outbound(), a), vec![(0, 0), (0, 1)]);
}

#[test]
fn bad_windows_and_releases_are_errors() {
    let mut h = hub(4, 10, None, Some(2));
    assert_eq!(h.join(0, JoinPolicy::NextEpoch), Err(HubError::WindowZero));
    assert!(matches!(
        h.join(5, JoinPolicy::NextEpoch),
        Err(HubError::WindowTooLarge { .. })
    ));
    assert!(matches!(
        h.join(3, JoinPolicy::NextEpoch),
        Err(HubError::WindowAboveLagLimit { .. })
    ));
    let (a, _) = h.join(2, JoinPolicy::NextEpoch).unwrap();
    assert_eq!(h.release(a, 42), Err(HubError::NotHeld { seq: 42 }));
    let w = produce(&mut h).unwrap();
    h.release(a, w.seq).unwrap();
    assert_eq!(
        h.release(a, w.seq),
        Err(HubError::NotHeld { seq: w.seq }),
        "double release"
    );
    assert_eq!(h.release(99, 0), Err(HubError::UnknownConsumer(99)));
    h.view().check_invariants();
}

#[test]
fn goodbye_stops_sending_but_keeps_held_batches_valid() {
    let mut h = hub(4, 10, None, None);
    let (a, _) = h.join(2, JoinPolicy::NextEpoch).unwrap();
    let (b, _) = h.join(4, JoinPolicy::NextEpoch).unwrap();
    let ws: Vec<Work> = (0..4).map(|_| produce(&mut h).unwrap()).collect();
    h.goodbye(a).unwrap();
    h.view().check_invariants();
    for w in &ws {
        h.release(b, w.seq).unwrap();
    }
    assert_eq!(
        h.view().counts().free,
        2,
        "a's two held batches stay pinned"
    );
    h.release(a, ws[0].seq).unwrap();
    h.release(a, ws[1].seq).unwrap();
    assert_eq!(h.view().counts().free, 4);
    produce(&mut h).unwrap();
    assert!(
        batches(&h.take_outbound(), a).len() == 2,
        "nothing after goodbye"
    );
}

#[test]
fn a_cut_consumer_frees_what_it_never_took_and_rejoins_where_batches_are_live() {
    let mut h = hub(4, 100, None, None);
    let (fast, _) = h
        .join_group(1, JoinPolicy::NextEpoch, None, Delivery::Ahead)
        .unwrap();
    let (slow, _) = h
        .join_group(1, JoinPolicy::NextEpoch, None, Delivery::Ahead)
        .unwrap();
    let ws: Vec<Work> = (0..4).map(|_| produce(&mut h).unwrap()).collect();
    h.take_outbound();
    for w in &ws {
        h.release(fast, w.seq).unwrap();
    }
    assert!(h.start_batch().is_none(), "the slow one owes the ring");
    h.release(slow, ws[0].seq).unwrap();
    let w4 = produce(&mut h).unwrap();
    h.take_outbound();
    // It took batch 1 and never took 2, 3 and 4.
    assert_eq!(h.cut(slow, &[9]), Err(HubError::NotHeld { seq: 9 }));
    assert_eq!(h.cut(slow, &[ws[2].seq, ws[3].seq, w4.seq]), Ok((0, 2)));
    assert!(h.view().reader(slow).is_some_and(|c| c.is_cut()));
    assert_eq!(h.view().reader(slow).map(|c| c.counts()).unwrap().held, 1);
    assert_eq!(
        h.release(slow, ws[2].seq),
        Err(HubError::NotHeld { seq: 2 })
    );
    assert!(h.start_batch().is_none(), "batch 1 is still held");
    assert_eq!(
        batches(&h.take_outbound(), slow),
        vec![],
        "nothing while cut"
    );
    // Rejoining where a batch is gone, or where it holds one, is refused.
    assert_eq!(
        h.rejoin_through(slow, ws[2].seq, None),
        Err(HubError::NotLive { seq: 2 })
    );
    assert_eq!(
        h.rejoin_through(slow, ws[1].seq, None),
        Err(HubError::NotLive { seq: 1 })
    );
    assert_eq!(
        h.rejoin_through(fast, w4.seq, None),
        Err(HubError::NotCut(fast))
    );
    h.release(slow, ws[1].seq).unwrap();
    // The fast one reads on; batch 4 is still owed by it: the slow one may
    // rejoin there, and gets 4, 5, ... in order.
    let w5 = produce(&mut h).unwrap();
    h.rejoin_through(slow, w4.seq, None).unwrap();
    assert!(!h.view().reader(slow).is_some_and(|c| c.is_cut()));
    let w6 = produce(&mut h).unwrap();
    assert_eq!(
        batches(&h.take_outbound(), slow),
        vec![(0, 4), (0, 5), (0, 6)]
    );
    for w in [w4, w5, w6] {
        h.release(fast, w.seq).unwrap();
        h.release(slow, w.seq).unwrap();
    }
    assert_eq!(h.view().counts().free, 4);
    h.view().check_invariants();
}

/// A rotated consumer (`rejoin_through`) is sent its epoch's rest and
/// nothing of the next, not even the stream's end; `read_through` says
/// when it has all of it; `rotation_point` finds where it may rotate.
#[test]
fn a_consumer_rejoined_through_an_epoch_gets_nothing_after_it() {
    // Epochs of 4 batches, 2 of them, a ring of 6.
    let mut h = hub(6, 4, Some(2), None);
    let (fast, _) = h
        .join_group(6, JoinPolicy::NextEpoch, None, Delivery::Ahead)
        .unwrap();
    let (late, _) = h
        .join_group(6, JoinPolicy::NextEpoch, None, Delivery::Ahead)
        .unwrap();
    assert_eq!(h.cut(late, &[]), Ok((0, 0)));
    let ws: Vec<Work> = (0..3).map(|_| produce(&mut h).unwrap()).collect();
    // Batches 1 and 2 of epoch 0 are live; every other index (2) only 2.
    assert_eq!(
        h.view().ring().rotation_point(0, 0, 1),
        Some((ws[1].seq, 1))
    );
    assert_eq!(
        h.view().ring().rotation_point(0, 0, 2),
        Some((ws[2].seq, 2))
    );
    assert_eq!(h.view().ring().rotation_point(0, ws[2].seq, 3), None);
    assert_eq!(
        h.view().ring().rotation_point(1, 0, 1),
        None,
        "no batch of epoch 1 yet"
    );
    h.rejoin_through(late, ws[2].seq, Some(0)).unwrap();
    assert!(
        !h.view().read_through(late, 0),
        "batch 3 of epoch 0 is to come"
    );
    for w in &ws {
        h.release(fast, w.seq).unwrap();
    }
    h.release(late, ws[2].seq).unwrap();
    let rest: Vec<Work> = (0..5).map(|_| produce(&mut h).unwrap()).collect();
    let out = h.take_outbound();
    assert_eq!(batches(&out, late), vec![(0, 2), (0, 3)]);
    assert!(
        out.iter()
            .any(|(id, o)| *id == late && matches!(o, Outbound::EndOfEpoch { epoch: 0, .. })),
        "its epoch's end from the shared stream"
    );
    assert!(
        !out.iter()
            .any(|(id, o)| *id == late && *o == Outbound::EndOfStream)
    );
    assert!(h.view().read_through(late, 0));
    assert!(
        !h.view().read_through(fast, 0),
        "not rejoined through an epoch"
    );
    // It owes nothing of epoch 1: the ring is the fast one's alone.
    for w in &rest {
        h.release(fast, w.seq).unwrap();
    }
    h.release(late, rest[0].seq).unwrap();
    assert_eq!(h.view().counts().free, 6);
    // Cut to be replayed its epoch's start: nothing to give back.
    h.cut(late, &[]).unwrap();
    assert!(!h.view().read_through(late, 0));
    h.view().check_invariants();
}

/// `(seq, slot)` of every batch sent to `who`.
fn sent(out: &[(ConsumerId, Outbound)], who: ConsumerId) -> Vec<(u64, SlotId)> {
    out.iter()
        .filter(|(id, _)| *id == who)
        .filter_map(|(_, o)| match o {
            Outbound::Batch { seq, slot, .. } => Some((*seq, *slot)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_group_copies_each_batch_once_and_sends_it_only_once_copied() {
    let mut h = hub(2, 10, None, None);
    let g = h.add_group(2);
    let (m1, _) = h
        .join_group(2, JoinPolicy::NextEpoch, Some(g), Delivery::Window)
        .unwrap();
    let (m2, _) = h
        .join_group(2, JoinPolicy::NextEpoch, Some(g), Delivery::Window)
        .unwrap();
    let (host, _) = h.join(2, JoinPolicy::NextEpoch).unwrap();
    let w = produce(&mut h).unwrap();
    let copies = h.take_copies();
    assert_eq!(
        copies,
        vec![CopyOrder {
            group: g,
            seq: w.seq,
            host: w.slot,
            slot: copies[0].slot
        }],
        "one copy for two members"
    );
    let out = h.take_outbound();
    assert_eq!(
        sent(&out, host),
        vec![(w.seq, w.slot)],
        "host consumers do not wait"
    );
    assert!(
        sent(&out, m1).is_empty() && sent(&out, m2).is_empty(),
        "not before the copy"
    );
    h.view().check_invariants();
    h.release(host, w.seq).unwrap();
    assert_eq!(
        h.view().counts().free,
        1,
        "the copy still reads the host slot"
    );
    h.copied(g, w.seq).unwrap();
    assert_eq!(
        h.view().counts().free,
        2,
        "copied and released by the host consumer: free"
    );
    let out = h.take_outbound();
    assert_eq!(sent(&out, m1), vec![(w.seq, copies[0].slot)]);
    assert_eq!(sent(&out, m2), vec![(w.seq, copies[0].slot)]);
    assert_eq!(
        h.view().group_counts(g).unwrap().in_use,
        1,
        "the members hold the copy"
    );
    assert_eq!(
        h.copied(g, w.seq),
        Err(HubError::NotCopying {
            group: g,
            seq: w.seq
        })
    );
    h.release(m1, w.seq).unwrap();
    h.release(m2, w.seq).unwrap();
    assert_eq!(h.view().group_counts(g).unwrap().in_use, 0);
    h.view().check_invariants();
}

#[test]
fn host_slots_are_refilled_while_members_still_hold_their_copies() {
    let mut h = hub(2, 100, None, None);
    let g = h.add_group(4);
    let (m, _) = h
        .join_group(2, JoinPolicy::NextEpoch, Some(g), Delivery::Window)
        .unwrap();
    let mut placed = Vec::new();
    for _ in 0..4 {
        let w = produce(&mut h).expect("a host slot is free: its copy completed");
        for c in h.take_copies() {
            h.copied(g, c.seq).unwrap();
            placed.push(c.slot);
        }
        assert_eq!(w.seq as usize + 1, placed.len());
    }
    placed.sort();
    assert_eq!(
        placed,
        vec![0, 1, 2, 3],
        "four batches in four distinct group slots"
    );
    assert_eq!(
        h.view().reader(m).map(|c| c.counts()).unwrap().held,
        2,
        "window of two sent"
    );
    assert_eq!(
        h.view().counts().free,
        2,
        "no host slot is pinned by the GPU"
    );
    // The group is full: the next batch pins its host slot until a member
    // releases a copy.
    let w = produce(&mut h).unwrap();
    assert!(h.take_copies().is_empty(), "no group slot free");
    produce(&mut h).unwrap();
    assert!(
        h.start_batch().is_none(),
        "both host slots wait for group slots"
    );
    let first = sent(&h.take_outbound(), m)[0];
    h.release(m, first.0).unwrap();
    let c = h.take_copies();
    assert_eq!(c.len(), 1);
    assert_eq!(
        (c[0].seq, c[0].slot),
        (w.seq, first.1),
        "the freed group slot takes the next batch"
    );
    h.view().check_invariants();
}

#[test]
fn a_member_leaving_during_its_copy_frees_both_slots_when_the_copy_ends() {
    let mut h = hub(2, 10, None, None);
    let g = h.add_group(2);
    let (m, _) = h
        .join_group(1, JoinPolicy::NextEpoch, Some(g), Delivery::Window)
        .unwrap();
    let (host, _) = h.join(2, JoinPolicy::NextEpoch).unwrap();
    let w0 = produce(&mut h).unwrap();
    let w1 = produce(&mut h).unwrap();
    let copies = h.take_copies();
    assert_eq!(copies.len(), 2);
    h.copied(g, w0.seq).unwrap();
    assert!(h.leave(m));
    h.release(host, w0.seq).unwrap();
    h.release(host, w1.seq).unwrap();
    h.view().check_invariants();
    assert_eq!(
        h.view().counts().free,
        1,
        "batch 1's copy still reads its host slot"
    );
    assert_eq!(
        h.view().group_counts(g).unwrap().in_use,
        1,
        "and its group slot is being written"
    );
    h.copied(g, w1.seq).unwrap();
    assert_eq!(h.view().counts().free, 2);
    assert_eq!(h.view().group_counts(g).unwrap().in_use, 0);
    h.view().check_invariants();
}

#[test]
fn a_failed_group_lets_go_of_host_slots_and_host_consumers_go_on() {
    let mut h = hub(2, 10, None, None);
    let g = h.add_group(2);
    let (m, _) = h
        .join_group(2, JoinPolicy::NextEpoch, Some(g), Delivery::Window)
        .unwrap();
    let (host, _) = h.join(2, JoinPolicy::NextEpoch).unwrap();
    let w0 = produce(&mut h).unwrap();
    let c0 = h.take_copies();
    h.copied(g, w0.seq).unwrap();
    h.release(host, w0.seq).unwrap();
    assert_eq!(sent(&h.take_outbound(), m), vec![(w0.seq, c0[0].slot)]);
    // Batch 1 is being copied, batch 2 waits for a device slot.
    let ws: Vec<Work> = (0..2).map(|_| produce(&mut h).unwrap()).collect();
    assert_eq!(h.take_copies().len(), 1, "one device slot left");
    for w in &ws {
        h.release(host, w.seq).unwrap();
    }
    assert!(
        h.start_batch().is_none(),
        "both host slots pinned by copies"
    );
    h.take_outbound();
    assert_eq!(h.fail_group(g), vec![m]);
    h.view().check_invariants();
    assert!(produce(&mut h).is_some(), "host consumers go on");
    assert_eq!(
        h.join_group(1, JoinPolicy::Immediate, Some(g), Delivery::Window),
        Err(HubError::GroupFailed)
    );
    let out = h.take_outbound();
    assert!(sent(&out, m).is_empty(), "members are sent nothing more");
    assert_eq!(sent(&out, host).len(), 1);
    h.release(m, w0.seq)
        .expect("what a member held it may still release");
    h.view().check_invariants();
    assert!(h.leave(m));
    h.view().check_invariants();
}

#[test]
fn a_window_larger_than_the_group_is_refused() {
    let mut h = hub(8, 10, None, None);
    let g = h.add_group(2);
    assert_eq!(
        h.join_group(3, JoinPolicy::NextEpoch, Some(g), Delivery::Window),
        Err(HubError::WindowAboveGroupSlots {
            window: 3,
            slots: 2
        })
    );
    assert_eq!(
        h.view().check_window(3, Some(2)),
        Err(HubError::WindowAboveGroupSlots {
            window: 3,
            slots: 2
        })
    );
    assert_eq!(h.view().check_window(3, None), Ok(()));
    assert_eq!(
        h.join_group(1, JoinPolicy::NextEpoch, Some(7), Delivery::Window),
        Err(HubError::UnknownGroup(7))
    );
}

// ---------------------------------------------------------------------------
// Property test: random schedules against a model of what each consumer saw.

#[derive(Debug, Clone)]
enum Op {
    Join {
        window: u32,
        /// 0: next epoch, 1: immediate, 2: now (host consumers start at
        /// the oldest batch still published).
        policy: u8,
        /// Sent every batch at once (a mailbox consumer).
        ahead: bool,
        /// `Some`: a member of that group (a GPU consumer).
        group: Option<GroupId>,
    },
    Start,
    /// Completes one of the copies under way (in any order).
    Copy(prop::sample::Index),
    Finish(prop::sample::Index),
    Release {
        who: prop::sample::Index,
        which: prop::sample::Index,
    },
    Die(prop::sample::Index),
    /// Detached for pinning the ring past the hold limit (decoupled pace).
    Detach(prop::sample::Index),
    Goodbye(prop::sample::Index),
    /// Cuts a host consumer, revoking the batches it holds from `from`
    /// (in sequence order) on, as if it never took them.
    Cut {
        who: prop::sample::Index,
        from: prop::sample::Index,
    },
    /// A cut consumer rejoins at a seq between the oldest published batch
    /// and the head (refused where that is not live).
    Rejoin {
        who: prop::sample::Index,
        at: prop::sample::Index,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => (1u32..4, 0u8..3, any::<bool>(), prop::option::of(0u32..2)).prop_map(|(window, policy, ahead, group)| Op::Join { window, policy, ahead, group }),
        4 => Just(Op::Start),
        3 => any::<prop::sample::Index>().prop_map(Op::Copy),
        4 => any::<prop::sample::Index>().prop_map(Op::Finish),
        6 => (any::<prop::sample::Index>(), any::<prop::sample::Index>()).prop_map(|(who, which)| Op::Release { who, which }),
        1 => any::<prop::sample::Index>().prop_map(Op::Die),
        1 => any::<prop::sample::Index>().prop_map(Op::Detach),
        1 => any::<prop::sample::Index>().prop_map(Op::Goodbye),
        1 => (any::<prop::sample::Index>(), any::<prop::sample::Index>()).prop_map(|(who, from)| Op::Cut { who, from }),
        2 => (any::<prop::sample::Index>(), any::<prop::sample::Index>()).prop_map(|(who, at)| Op::Rejoin { who, at }),
    ]
}

#[derive(Debug, Default)]
struct Seen {
    /// (seq, epoch, index) in arrival order.
    got: Vec<(u64, u64, u64)>,
    /// (seq, slot) sent and not released; the slot is a group slot for a
    /// member.
    held: Vec<(u64, SlotId)>,
    group: Option<GroupId>,
    start_epoch: u64,
    immediate: bool,
    /// Where its first batch must be (a `Now` joiner).
    first: Option<(u64, u64)>,
    ended: bool,
    gone: bool,
    closing: bool,
    /// Cut from the stream; was ever cut; the seq its next batch must be
    /// after a rejoin.
    cut: bool,
    was_cut: bool,
    rejoined_at: Option<u64>,
}

struct Model {
    hub: Hub,
    bpe: u64,
    lag_limit: Option<u32>,
    /// What the pipeline last wrote into each slot: the batch's seq.
    content: Vec<Option<u64>>,
    /// Per group, what the last completed copy wrote into each group slot.
    device: Vec<Vec<Option<u64>>>,
    /// Copies ordered and not yet completed.
    copying: Vec<CopyOrder>,
    inflight: Vec<Work>,
    seen: BTreeMap<ConsumerId, Seen>,
}

impl Model {
    fn drain(&mut self) {
        // A consumer detached in this step is gone already: the copies the
        // hub ordered may reuse what it held.
        let out = self.hub.take_outbound();
        let detached: Vec<ConsumerId> = out
            .iter()
            .filter(|(_, o)| matches!(o, Outbound::Detached { .. }))
            .map(|(id, _)| *id)
            .collect();
        for c in self.hub.take_copies() {
            assert_eq!(
                self.content[c.host as usize],
                Some(c.seq),
                "copy of batch {} from a host slot holding something else",
                c.seq
            );
            assert!(
                !self
                    .copying
                    .iter()
                    .any(|o| (o.group, o.slot) == (c.group, c.slot)),
                "two copies into group {} slot {} at once",
                c.group,
                c.slot
            );
            self.assert_not_held_in_group(c.group, c.slot, &detached);
            self.copying.push(c);
        }
        for (id, o) in out {
            let s = self
                .seen
                .get_mut(&id)
                .expect("outbound for a consumer that never joined");
            assert!(!s.gone, "message to a departed consumer");
            match o {
                Outbound::Batch {
                    seq,
                    epoch,
                    index,
                    slot,
                    ..
                } => {
                    assert!(!s.ended && !s.closing, "batch after end or goodbye");
                    assert!(!s.cut, "batch {seq} sent to a cut consumer");
                    let content = match s.group {
                        None => &self.content,
                        Some(g) => &self.device[g as usize],
                    };
                    assert_eq!(
                        content[slot as usize],
                        Some(seq),
                        "slot {slot} (group {:?}) does not hold batch {seq}",
                        s.group
                    );
                    if let Some(at) = s.rejoined_at.take() {
                        assert_eq!(seq, at, "a rejoined consumer starts where it rejoined");
                        // (It may get again a batch it took before the cut:
                        // it skips to where its replay ended.)
                    } else if let Some(&(pseq, pe, pi)) = s.got.last() {
                        assert!(seq > pseq, "out of order");
                        let expect = if pi + 1 == self.bpe {
                            (pe + 1, 0)
                        } else {
                            (pe, pi + 1)
                        };
                        assert_eq!((epoch, index), expect, "gap or repeat in the stream");
                    } else if let Some(first) = s.first.filter(|_| !s.was_cut) {
                        assert_eq!(
                            (epoch, index),
                            first,
                            "a `Now` joiner starts at the oldest batch"
                        );
                    } else if !s.immediate {
                        assert_eq!(
                            (epoch, index),
                            (s.start_epoch, 0),
                            "next-epoch joiner starts mid-epoch"
                        );
                    }
                    s.got.push((seq, epoch, index));
                    s.held.push((seq, slot));
                }
                Outbound::EndOfEpoch { epoch, .. } => {
                    let &(_, e, i) = s.got.last().expect("end of epoch before any batch");
                    assert_eq!((e, i + 1), (epoch, self.bpe));
                }
                Outbound::EndOfStream => {
                    assert!(!s.ended);
                    s.ended = true;
                }
                Outbound::Detached { .. } => s.gone = true,
            }
        }
    }

    fn assert_not_held_in_group(&self, g: GroupId, slot: SlotId, detached: &[ConsumerId]) {
        for (_, s) in self
            .seen
            .iter()
            .filter(|(id, s)| !s.gone && s.group == Some(g) && !detached.contains(id))
        {
            assert!(
                s.held.iter().all(|&(_, held)| held != slot),
                "group {g} slot {slot} written while a member holds it"
            );
        }
    }

    /// Completes copy `k` of those under way.
    fn complete_copy(&mut self, k: usize) {
        let c = self.copying.remove(k);
        assert_eq!(
            self.content[c.host as usize],
            Some(c.seq),
            "host slot {} rewritten while batch {} was being copied from it",
            c.host,
            c.seq
        );
        self.assert_not_held_in_group(c.group, c.slot, &[]);
        self.device[c.group as usize][c.slot as usize] = Some(c.seq);
        self.hub.copied(c.group, c.seq).unwrap();
    }

    fn live(&self) -> Vec<ConsumerId> {
        self.seen
            .iter()
            .filter(|(_, s)| !s.gone)
            .map(|(&id, _)| id)
            .collect()
    }

    fn release(&mut self, id: ConsumerId, k: usize) {
        let s = self.seen.get_mut(&id).unwrap();
        let (seq, slot) = s.held.remove(k);
        // Invariant 2: the slot still holds what was sent while held.
        let content = match s.group {
            None => &self.content,
            Some(g) => &self.device[g as usize],
        };
        assert_eq!(
            content[slot as usize],
            Some(seq),
            "slot rewritten while held"
        );
        self.hub.release(id, seq).unwrap();
    }

    fn step(&mut self, op: Op) {
        match op {
            Op::Join {
                window,
                policy,
                ahead,
                group,
            } => {
                let immediate = policy > 0;
                let policy = match policy {
                    0 => JoinPolicy::NextEpoch,
                    1 => JoinPolicy::Immediate,
                    _ => JoinPolicy::Now,
                };
                let delivery = if ahead {
                    Delivery::Ahead
                } else {
                    Delivery::Window
                };
                let oldest = self.hub.view().ring().oldest_live();
                let (id, start_epoch) = self
                    .hub
                    .join_group(window, policy, group, delivery)
                    .unwrap();
                // `Now` (host): its first batch is the oldest still
                // published, whatever the pipeline made since; under a lag
                // limit, a later one if the oldest would detach it at once.
                let first = match (policy, group, oldest) {
                    (JoinPolicy::Now, None, Some((_, e, i))) => {
                        let first = self.hub.view().reader(id).map(|c| c.first_batch());
                        assert!(first.is_some(), "a `Now` joiner detached at once");
                        if self.lag_limit.is_none() {
                            assert_eq!(first, Some((e, i)));
                        } else {
                            assert!(first >= Some((e, i)), "{first:?} before the oldest");
                        }
                        first
                    }
                    _ => None,
                };
                self.seen.insert(
                    id,
                    Seen {
                        start_epoch,
                        immediate,
                        first,
                        group,
                        ..Default::default()
                    },
                );
            }
            Op::Start => {
                if let Some(w) = self.hub.start_batch() {
                    // Invariant 2: nobody may hold a slot handed out for writing.
                    for s in self.seen.values().filter(|s| !s.gone && s.group.is_none()) {
                        assert!(
                            s.held.iter().all(|&(_, slot)| slot != w.slot),
                            "slot {} reused while held",
                            w.slot
                        );
                    }
                    assert!(
                        self.copying.iter().all(|c| c.host != w.slot),
                        "slot {} reused while a copy reads it",
                        w.slot
                    );
                    self.content[w.slot as usize] = Some(w.seq);
                    self.inflight.push(w);
                }
            }
            Op::Finish(i) if !self.inflight.is_empty() => {
                let w = self.inflight.remove(i.index(self.inflight.len()));
                let samples = if w.index + 1 == self.bpe { 1 } else { 4 };
                self.hub.finish_batch(w.seq, samples);
            }
            Op::Release { who, which } => {
                let live = self.live();
                if !live.is_empty() {
                    let id = live[who.index(live.len())];
                    let n = self.seen[&id].held.len();
                    if n > 0 {
                        self.release(id, which.index(n));
                    }
                }
            }
            Op::Die(i) => {
                let live = self.live();
                if !live.is_empty() {
                    let id = live[i.index(live.len())];
                    assert!(self.hub.leave(id));
                    self.seen.get_mut(&id).unwrap().gone = true;
                }
            }
            Op::Detach(i) => {
                let live = self.live();
                if !live.is_empty() {
                    let id = live[i.index(live.len())];
                    assert!(self.hub.detach(id, "held too long".into()));
                    // Its `Detached` message marks it gone when drained.
                }
            }
            Op::Goodbye(i) => {
                let live = self.live();
                if !live.is_empty() {
                    let id = live[i.index(live.len())];
                    self.hub.goodbye(id).unwrap();
                    self.seen.get_mut(&id).unwrap().closing = true;
                }
            }
            Op::Cut { who, from } => self.cut(who, from),
            Op::Rejoin { who, at } => self.rejoin(who, at),
            Op::Copy(i) if !self.copying.is_empty() => {
                let k = i.index(self.copying.len());
                self.complete_copy(k);
            }
            Op::Finish(_) | Op::Copy(_) => {}
        }
        self.drain();
        self.hub.view().check_invariants();
    }

    fn cut(&mut self, who: prop::sample::Index, from: prop::sample::Index) {
        let cuttable: Vec<ConsumerId> = self
            .seen
            .iter()
            .filter(|(_, s)| !s.gone && !s.closing && !s.ended && !s.cut)
            .map(|(&id, _)| id)
            .collect();
        if cuttable.is_empty() {
            return;
        }
        let id = cuttable[who.index(cuttable.len())];
        let s = self.seen.get_mut(&id).unwrap();
        let mut held: Vec<u64> = s.held.iter().map(|&(seq, _)| seq).collect();
        held.sort_unstable();
        let revoke = held.split_off(from.index(held.len() + 1));
        s.held.retain(|(seq, _)| !revoke.contains(seq));
        s.cut = true;
        s.was_cut = true;
        s.rejoined_at = None;
        self.hub.cut(id, &revoke).unwrap();
    }

    fn rejoin(&mut self, who: prop::sample::Index, at: prop::sample::Index) {
        let cut: Vec<ConsumerId> = self
            .seen
            .iter()
            .filter(|(_, s)| !s.gone && !s.closing && s.cut)
            .map(|(&id, _)| id)
            .collect();
        if cut.is_empty() {
            return;
        }
        let id = cut[who.index(cut.len())];
        let head = self.hub.view().ring().head();
        let oldest = super::ring::tests::oldest_published(&self.hub.ring).unwrap_or(head);
        let seq = oldest + at.index((head - oldest + 2) as usize) as u64;
        let s = self.seen.get_mut(&id).unwrap();
        let live = seq <= head
            && (seq..head).all(|q| self.hub.ring.published(q).is_some())
            && self
                .hub
                .view().ring()
                .position(seq)
                .is_some_and(|(e, _)| e >= self.hub.ring.cursor().live_epoch)
            && s.held.iter().all(|&(h, _)| h < seq)
            // A GPU member: its GPU's copies from there are still there, or
            // come after every copy placed (made now, in order).
            && s.group.is_none_or(|g| {
                let grp = &self.hub.groups[g as usize];
                let placed = super::group::tests::last_placed(grp);
                !grp.failed()
                    && (seq..head).all(|q| {
                        super::group::tests::replica(grp, q).is_some()
                            || placed.is_none_or(|p| q > p)
                    })
            });
        match self.hub.rejoin_through(id, seq, None) {
            Ok(()) => {
                assert!(live, "rejoined at {seq}, which is not live");
                s.cut = false;
                s.rejoined_at = Some(seq);
            }
            Err(HubError::NotLive { .. }) => assert!(!live, "refused to rejoin at live {seq}"),
            Err(e) => panic!("rejoin: {e}"),
        }
    }

    /// Each cut consumer that holds nothing rejoins at the head (where its
    /// replay would meet the shared stream).
    fn rejoin_at_head(&mut self) {
        let cut: Vec<ConsumerId> = self
            .seen
            .iter()
            .filter(|(_, s)| !s.gone && !s.closing && s.cut && s.held.is_empty())
            .map(|(&id, _)| id)
            .collect();
        for id in cut {
            let head = self.hub.view().ring().head();
            match self.hub.rejoin_through(id, head, None) {
                Ok(()) => {}
                // Batches of an epoch nobody read are still in flight.
                Err(HubError::NotLive { .. }) => continue,
                Err(e) => panic!("rejoin at the head: {e}"),
            }
            let s = self.seen.get_mut(&id).unwrap();
            s.cut = false;
            s.rejoined_at = Some(head);
            self.drain();
        }
    }

    /// Every live consumer releases promptly until the stream ends; a cut
    /// one rejoins at the head once it holds nothing.
    fn run_to_end(&mut self) {
        for _ in 0..10_000 {
            self.rejoin_at_head();
            if self.live().iter().all(|id| self.seen[id].closing) {
                self.step(Op::Join {
                    window: 1,
                    policy: 0,
                    ahead: false,
                    group: None,
                });
            }
            for id in self.live() {
                while !self.seen[&id].gone && !self.seen[&id].held.is_empty() {
                    self.release(id, 0);
                    self.drain();
                }
            }
            if let Some(w) = self.hub.start_batch() {
                self.content[w.slot as usize] = Some(w.seq);
                self.inflight.push(w);
            }
            if let Some(w) = self.inflight.pop() {
                self.hub.finish_batch(w.seq, 4);
            }
            self.drain();
            while !self.copying.is_empty() {
                self.complete_copy(0);
            }
            self.drain();
            self.hub.view().check_invariants();
            if self.hub.view().finished() && self.inflight.is_empty() {
                self.rejoin_at_head();
                break;
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn random_schedules_keep_every_invariant(
        slots in 1u32..6,
        group_slots in 1u32..6,
        bpe in 1u64..5,
        lag in prop::option::of(3u32..6),
        ops in prop::collection::vec(op(), 1..150),
    ) {
        let lag_limit = lag.map(|l| l.min(slots.max(3)));
        let mut h = hub(slots, bpe, Some(3), lag_limit);
        for _ in 0..2 {
            h.add_group(group_slots);
        }
        let mut m = Model {
            hub: h,
            bpe,
            lag_limit,
            content: vec![None; slots as usize],
            device: vec![vec![None; group_slots as usize]; 2],
            copying: Vec::new(),
            inflight: Vec::new(),
            seen: BTreeMap::new(),
        };
        for op in ops {
            if let Op::Join { window, group, .. } = op
                && (window > slots
                    || lag_limit.is_some_and(|l| window > l)
                    || (group.is_some() && window > group_slots))
            {
                continue; // rejected joins are covered by a unit test
            }
            m.step(op);
        }
        m.run_to_end();
        prop_assert!(m.hub.view().finished(), "stream did not finish: {:?}", m.hub.view().counts());
        for (id, s) in &m.seen {
            if s.gone || s.closing {
                continue;
            }
            // Invariant 1: a consumer present to the end got every batch of
            // every epoch from its start, once, in order.
            prop_assert!(s.ended, "consumer {id} never saw the end of the stream");
            if let Some(&(_, e, i)) = s.got.last().filter(|_| !s.was_cut) {
                prop_assert_eq!((e, i), (2, bpe - 1), "consumer {} stopped early", id);
            }
        }
        let c = m.hub.view().counts();
        prop_assert_eq!(c.free, slots);
        for g in 0..2 {
            prop_assert_eq!(m.hub.view().group_counts(g).unwrap().in_use, 0);
        }
    }
}

#[test]
fn a_consumer_cut_as_it_joins_owes_and_holds_nothing_and_is_sent_nothing() {
    let mut h = hub(4, 100, None, None);
    let (reader, _) = h
        .join_group(1, JoinPolicy::NextEpoch, None, Delivery::Ahead)
        .unwrap();
    let ws: Vec<Work> = (0..4).map(|_| produce(&mut h).unwrap()).collect();
    h.take_outbound();
    // Joining `now` sends it the published batches (at once: ahead)...
    let (late, _) = h
        .join_group(1, JoinPolicy::Now, None, Delivery::Ahead)
        .unwrap();
    assert_eq!(h.view().reader(late).map(|c| c.counts()).unwrap().held, 4);
    // ...all taken back before they left the hub.
    assert_eq!(h.cut_at_join(late), Ok((0, 0)));
    assert!(h.view().reader(late).is_some_and(|c| c.is_cut()));
    assert_eq!(h.view().reader(late).map(|c| c.counts()).unwrap().held, 0);
    assert_eq!(batches(&h.take_outbound(), late), vec![]);
    // The ring waits only for the reader.
    let (seq, owe) = h.view().pinning().unwrap();
    assert_eq!((seq, owe), (ws[0].seq, vec![reader]));
    for w in &ws {
        h.release(reader, w.seq).unwrap();
    }
    assert!(h.start_batch().is_some(), "nobody else owes the ring");
    h.view().check_invariants();
}

/// A GPU member is cut as a host consumer is (its window full, units
/// waiting for it): what it was never sent is given back to its GPU's
/// ring, and its replay begins at the first of those, whose host slot was
/// given back once copied (the position comes from its GPU's copy). It
/// rejoins only where its GPU's copies are still there or yet to be
/// placed in order.
#[test]
fn a_gpu_member_is_cut_at_its_first_unsent_batch_and_rejoins_in_order() {
    let mut h = hub(4, 10, None, None);
    let g = h.add_group(2);
    let (m, _) = h
        .join_group(1, JoinPolicy::NextEpoch, Some(g), Delivery::Window)
        .unwrap();
    let (host, _) = h.join(1, JoinPolicy::NextEpoch).unwrap();
    let mut seqs = Vec::new();
    for _ in 0..2 {
        let w = produce(&mut h).unwrap();
        seqs.push(w.seq);
        h.release(host, w.seq).ok();
        for c in h.take_copies() {
            h.copied(g, c.seq).unwrap();
        }
        h.take_outbound();
    }
    // The member holds batch 0 (its window of 1); batch 1 is copied and
    // queued for it, its host slot given back.
    assert!(
        h.view()
            .reader(m)
            .is_some_and(|c| c.holds(seqs[0]) && !c.holds(seqs[1]))
    );
    assert_eq!(
        h.view().ring().position(seqs[1]),
        None,
        "gone from the host ring"
    );
    h.view().check_invariants();
    assert_eq!(h.cut(m, &[]), Ok((0, 1)), "its replay begins at batch 1");
    h.view().check_invariants();
    assert_eq!(
        h.view().group_counts(g).unwrap().in_use,
        1,
        "batch 1's copy freed"
    );
    h.release(m, seqs[0]).unwrap();
    // Batch 1 left both rings: it cannot rejoin there.
    assert_eq!(
        h.rejoin_through(m, seqs[1], None),
        Err(HubError::NotLive { seq: seqs[1] })
    );
    let w = produce(&mut h).unwrap();
    h.rejoin_through(m, w.seq, None).unwrap();
    h.view().check_invariants();
    assert_eq!(
        h.take_copies().len(),
        1,
        "its GPU's copy made again, in order"
    );
}
