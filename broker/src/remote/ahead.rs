//! The read-ahead window: units fetched ahead of the pipeline, at most
//! `max_units` of them and `max_bytes` together (in flight or ready).
//!
//! The pipeline says where it reads (`Ahead::admit`: a lead position
//! and the units of the samples after it, in order); the window starts
//! fetches for the first of those it does not hold, while it has room;
//! tar members in bursts (once a quarter of the nearest units is missing,
//! or the next one is), so that neighbours go out together.
//! Room is made by dropping ready units the latest wanted list no longer
//! names (oldest first); a unit in flight is never dropped. A unit is one
//! sample (an object, or a tar member: the window holds what a shuffle
//! buffer holds, not whole shard parts kept for one sample) and is held
//! for the positions it was admitted for: one read each (a shared source
//! decodes each sample once). A sample the window names twice (near an
//! epoch's end, the next epoch's first samples follow, and with them
//! some of the last ones again) is fetched once and kept until its second
//! read, not fetched again once the first took it, too late. A hint
//! behind the lead (another pipeline thread's older batch) fetches
//! nothing new. Reading a unit the window does not hold is the caller's
//! business (a direct request).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;

use super::fetch::{FailKind, FetchError};

/// What an object of unknown size (given as 0) is assumed to weigh
/// before any has arrived; after, the mean of those that did.
pub(crate) const UNKNOWN_SIZE: u64 = 256 << 10;

/// A unit of the window: the bytes `start..end` of object `object` (a
/// tar member, or a shard part while a shard is indexed), or the whole
/// object ([`Unit::whole`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Unit {
    pub object: u32,
    pub start: u64,
    pub end: u64,
}

impl Unit {
    /// All of object `o`.
    pub const fn whole(object: u32) -> Unit {
        Unit {
            object,
            start: 0,
            end: u64::MAX,
        }
    }

    pub const fn range(object: u32, r: std::ops::Range<u64>) -> Unit {
        Unit {
            object,
            start: r.start,
            end: r.end,
        }
    }

    /// Its byte range, `None` for a whole object.
    pub fn bytes(self) -> Option<std::ops::Range<u64>> {
        (self.end != u64::MAX).then_some(self.start..self.end)
    }
}

#[derive(Debug)]
enum Slot {
    Pending,
    Ready(Bytes),
    Failed(FetchError),
}

#[derive(Debug)]
struct Entry {
    slot: Slot,
    /// Bytes counted against the window (the estimate until it arrives).
    bytes: u64,
    /// The positions it was admitted for, in order: a read takes the
    /// first; the bytes leave the window with the last.
    reads: VecDeque<u64>,
}

#[derive(Debug, Default)]
struct Window {
    entries: HashMap<Unit, Entry>,
    /// Units in the order they were admitted (oldest first).
    order: VecDeque<Unit>,
    bytes: u64,
    lead: Option<u64>,
    /// Every position before this one is admitted (or behind the lead).
    next: u64,
    closed: bool,
    /// Units arrived and their bytes (the estimate of unknown sizes).
    arrived: (u64, u64),
}

/// A read's answer from the window.
#[derive(Debug)]
pub enum Taken {
    Ready(Bytes),
    Failed(FetchError),
    /// Not in the window: read it directly.
    Absent,
}

#[derive(Debug)]
pub struct Ahead {
    max_units: usize,
    max_bytes: u64,
    state: Mutex<Window>,
    arrived: Condvar,
}

impl Ahead {
    pub fn new(max_units: u32, max_bytes: u64) -> Ahead {
        Ahead {
            max_units: max_units as usize,
            max_bytes,
            state: Mutex::new(Window::default()),
            arrived: Condvar::new(),
        }
    }

    pub(crate) fn max_units(&self) -> usize {
        self.max_units
    }

    fn lock(&self) -> MutexGuard<'_, Window> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Which of `upcoming` (the units of the samples at positions `lead`,
    /// `lead + 1`, ..., with their sizes) to fetch now; they are in the
    /// window as pending when this returns.
    pub(crate) fn admit(&self, lead: u64, upcoming: &[(Unit, u64)]) -> Vec<Unit> {
        if self.max_units == 0 || self.max_bytes == 0 {
            return Vec::new();
        }
        let mut w = self.lock();
        if w.closed || w.lead.is_some_and(|l| lead < l) {
            return Vec::new();
        }
        w.lead = Some(lead);
        // What the window keeps: the nearest units, as many as it can
        // hold. Units further on are not worth keeping over nearer ones
        // (protecting every upcoming unit would let stale ones fill it).
        let mut room = self.max_bytes;
        let mut seen = HashSet::new();
        let near = upcoming
            .iter()
            .take_while(|(u, size)| {
                let fits = room > 0 && (seen.len() < self.max_units || seen.contains(u));
                if fits && seen.insert(*u) {
                    room = room.saturating_sub(self.estimate(&w, *size));
                }
                fits
            })
            .count();
        let wanted = seen;
        // Tar members are fetched in bursts: while the next unit is held
        // (or on its way) and fewer than a quarter of the nearest are
        // missing, start nothing yet, so members of one shard go out
        // together as runs. Whole objects go one request each anyway.
        let members = upcoming.first().is_some_and(|(u, _)| u.bytes().is_some());
        let missing = wanted.iter().filter(|u| !w.entries.contains_key(u)).count();
        let next_held = upcoming
            .first()
            .is_none_or(|(u, _)| w.entries.contains_key(u));
        if members && next_held && missing < (wanted.len() / 4).max(1) {
            return Vec::new();
        }
        let mut start = Vec::new();
        let from = usize::try_from(w.next.saturating_sub(lead)).unwrap_or(usize::MAX);
        for (k, &(u, size)) in upcoming.iter().enumerate().take(near).skip(from) {
            let at = lead + k as u64;
            if let Some(e) = w.entries.get_mut(&u) {
                if !e.reads.contains(&at) {
                    let i = e.reads.partition_point(|&p| p < at);
                    e.reads.insert(i, at);
                }
                w.next = at + 1;
                continue;
            }
            let size = self.estimate(&w, size);
            while w.entries.len() >= self.max_units || w.bytes + size > self.max_bytes {
                if !self.drop_one(&mut w, &wanted, lead) {
                    return start;
                }
            }
            w.entries.insert(
                u,
                Entry {
                    slot: Slot::Pending,
                    bytes: size,
                    reads: VecDeque::from([at]),
                },
            );
            w.order.push_back(u);
            w.bytes += size;
            w.next = at + 1;
            start.push(u);
        }
        start
    }

    /// A unit's size for the window's count: as listed, or (unknown: 0)
    /// the mean of the units that arrived so far.
    fn estimate(&self, w: &Window, size: u64) -> u64 {
        match (size, w.arrived) {
            (0, (0, _)) => UNKNOWN_SIZE,
            (0, (n, bytes)) => (bytes / n).max(1),
            (s, _) => s,
        }
    }

    /// Drops the oldest ready (or failed) unit `wanted` does not name;
    /// whether one was. A position of its still ahead of `lead` is
    /// admitted again later.
    fn drop_one(&self, w: &mut Window, wanted: &HashSet<Unit>, lead: u64) -> bool {
        let victim = w.order.iter().position(|u| {
            !wanted.contains(u)
                && w.entries
                    .get(u)
                    .is_some_and(|e| !matches!(e.slot, Slot::Pending))
        });
        let Some(i) = victim else {
            return false;
        };
        if let Some(u) = w.order.remove(i)
            && let Some(e) = w.entries.remove(&u)
        {
            w.bytes -= e.bytes;
            if let Some(&at) = e.reads.iter().find(|&&p| p >= lead) {
                w.next = w.next.min(at);
            }
        }
        true
    }

    /// A fetch ended: its bytes or its error, for the readers waiting.
    pub(crate) fn settle(&self, u: Unit, r: Result<Bytes, FetchError>) {
        let mut w = self.lock();
        let mut delta: i64 = 0;
        let mut w_arrived = None;
        if let Some(e) = w.entries.get_mut(&u) {
            match r {
                Ok(b) => {
                    w_arrived = Some(b.len() as u64);
                    delta = b.len() as i64 - e.bytes as i64;
                    e.bytes = b.len() as u64;
                    e.slot = Slot::Ready(b);
                }
                Err(err) => e.slot = Slot::Failed(err),
            }
        }
        w.bytes = (w.bytes as i64 + delta).max(0) as u64;
        if let Some(n) = w_arrived {
            w.arrived.0 += 1;
            w.arrived.1 += n;
        }
        drop(w);
        self.arrived.notify_all();
    }

    /// The unit's bytes for its first position, waiting while they are
    /// on their way; they leave the window with the last (a failure at
    /// once: a later position fetches again).
    pub fn take(&self, u: Unit) -> Taken {
        let mut w = self.lock();
        loop {
            if w.closed {
                return Taken::Failed(FetchError {
                    url: String::new(),
                    kind: FailKind::Closed,
                    detail: "the stream stopped".into(),
                });
            }
            let Some(e) = w.entries.get(&u) else {
                return Taken::Absent;
            };
            match &e.slot {
                Slot::Pending => {
                    w = self
                        .arrived
                        .wait_timeout(w, Duration::from_millis(100))
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
                Slot::Ready(b) => {
                    let b = b.clone();
                    if let Some(e) = w.entries.get_mut(&u) {
                        e.reads.pop_front();
                        if !e.reads.is_empty() {
                            return Taken::Ready(b);
                        }
                    }
                    self.remove(&mut w, u);
                    return Taken::Ready(b);
                }
                Slot::Failed(err) => {
                    let err = err.clone();
                    let later = e.reads.get(1).copied();
                    self.remove(&mut w, u);
                    if let Some(at) = later {
                        w.next = w.next.min(at);
                    }
                    return Taken::Failed(err);
                }
            }
        }
    }

    fn remove(&self, w: &mut Window, u: Unit) {
        if let Some(e) = w.entries.remove(&u) {
            w.bytes -= e.bytes;
            if let Some(i) = w.order.iter().position(|x| *x == u) {
                w.order.remove(i);
            }
        }
    }

    /// Units and bytes the window holds (in flight or ready).
    pub fn held(&self) -> (u64, u64) {
        let w = self.lock();
        (w.entries.len() as u64, w.bytes)
    }

    pub fn close(&self) {
        self.lock().closed = true;
        self.arrived.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn u(object: u32) -> Unit {
        Unit::whole(object)
    }

    #[test]
    fn admits_within_its_bounds_and_readers_wait_for_arrivals() {
        let a = Ahead::new(3, 1000);
        let list: Vec<_> = (0..5).map(|o| (u(o), 100)).collect();
        assert_eq!(a.admit(0, &list), vec![u(0), u(1), u(2)]);
        // Full of pending units: nothing more, whatever is asked.
        assert!(a.admit(1, &list[1..]).is_empty());
        a.settle(u(0), Ok(Bytes::from_static(b"abc")));
        assert!(matches!(a.take(u(0)), Taken::Ready(b) if &b[..] == b"abc"));
        assert!(matches!(a.take(u(0)), Taken::Absent));
        // Room again: the next is admitted; an older hint admits nothing.
        assert_eq!(a.admit(1, &list[1..]), vec![u(3)]);
        assert!(a.admit(1, &list).is_empty());
        // A reader waiting on a pending unit is woken by its arrival.
        std::thread::scope(|s| {
            let r = s.spawn(|| a.take(u(1)));
            std::thread::sleep(Duration::from_millis(20));
            a.settle(u(1), Ok(Bytes::from_static(b"x")));
            assert!(matches!(r.join().unwrap(), Taken::Ready(_)));
        });
    }

    #[test]
    fn bytes_bound_the_window_and_unwanted_ready_units_make_room() {
        // Room for two units of four: the reader moving past unit 0 makes
        // room for unit 2; a unit further on never keeps a stale one.
        let a = Ahead::new(100, 250);
        let list: Vec<_> = (0..4).map(|o| (u(o), 100)).collect();
        assert_eq!(a.admit(0, &list), vec![u(0), u(1)]);
        a.settle(u(0), Ok(Bytes::from(vec![0u8; 100])));
        a.settle(u(1), Ok(Bytes::from(vec![0u8; 100])));
        // Unit 0 is no longer wanted: it goes to make room for unit 2.
        assert_eq!(a.admit(1, &list[1..]), vec![u(2)]);
        assert!(matches!(a.take(u(0)), Taken::Absent));
        assert_eq!(a.held(), (2, 200));
        // Read units leave the window.
        assert!(matches!(a.take(u(1)), Taken::Ready(_)));
        assert_eq!(a.held(), (1, 100));
    }

    #[test]
    fn members_are_fetched_in_bursts_unless_the_next_is_missing() {
        let a = Ahead::new(8, 1 << 20);
        let u = |o: u32| Unit::range(0, u64::from(o) * 100..u64::from(o) * 100 + 100);
        let list: Vec<_> = (0..20).map(|o| (u(o), 100)).collect();
        assert_eq!(a.admit(0, &list).len(), 8);
        for o in 0..8 {
            a.settle(u(o), Ok(Bytes::from(vec![0u8; 100])));
        }
        // One read: one of the nearest eight missing, fewer than a
        // quarter: nothing starts yet.
        assert!(matches!(a.take(u(0)), Taken::Ready(_)));
        assert!(a.admit(1, &list[1..]).is_empty());
        // Two missing: both start together.
        assert!(matches!(a.take(u(1)), Taken::Ready(_)));
        assert_eq!(a.admit(2, &list[2..]), vec![u(8), u(9)]);
        // A reader moved past what the window holds: the next unit
        // missing starts at once.
        assert_eq!(a.admit(12, &list[12..13]), vec![u(12)]);
    }

    #[test]
    fn a_unit_named_twice_is_fetched_once_and_kept_for_its_second_read() {
        // Near an epoch's end the next epoch's first samples follow: unit
        // 3 is read at positions 1 and 4 (and unit 1 at 0 and 5).
        let a = Ahead::new(8, 1 << 20);
        let at = |objects: &[u32]| objects.iter().map(|&o| (u(o), 10)).collect::<Vec<_>>();
        let list = at(&[1, 3, 5, 2, 3, 1]);
        assert_eq!(a.admit(0, &list), vec![u(1), u(3), u(5), u(2)]);
        for o in [1, 3, 5, 2] {
            a.settle(u(o), Ok(Bytes::from(vec![o as u8; 10])));
        }
        assert!(matches!(a.take(u(1)), Taken::Ready(_)));
        assert!(matches!(a.take(u(3)), Taken::Ready(_)));
        // The reader moved on: nothing is fetched again, both still held
        // for their second reads.
        assert!(a.admit(2, &list[2..]).is_empty());
        assert_eq!(a.held(), (4, 40));
        assert!(matches!(a.take(u(5)), Taken::Ready(_)));
        assert!(matches!(a.take(u(2)), Taken::Ready(_)));
        assert!(matches!(a.take(u(3)), Taken::Ready(b) if b[0] == 3));
        assert!(matches!(a.take(u(1)), Taken::Ready(b) if b[0] == 1));
        // Read twice, gone.
        assert_eq!(a.held(), (0, 0));
        assert!(matches!(a.take(u(1)), Taken::Absent));
    }

    #[test]
    fn a_failed_unit_named_again_is_fetched_again_for_its_later_read() {
        let a = Ahead::new(8, 1 << 20);
        let list = vec![(u(7), 10), (u(8), 10), (u(7), 10)];
        assert_eq!(a.admit(0, &list), vec![u(7), u(8)]);
        a.settle(
            u(7),
            Err(FetchError {
                url: "x".into(),
                kind: FailKind::Refused,
                detail: "503".into(),
            }),
        );
        a.settle(u(8), Ok(Bytes::from_static(b"8")));
        assert!(matches!(a.take(u(7)), Taken::Failed(_)));
        // Its second read is not answered by the first one's failure.
        assert_eq!(a.admit(1, &list[1..]), vec![u(7)]);
    }

    #[test]
    fn unknown_sizes_count_as_the_mean_of_arrivals() {
        // Unknown sizes (0) count as the mean of arrivals.
        // Before any arrival one such unit fills most of this window;
        // after one of 100 bytes arrived, 19 more fit.
        let b = Ahead::new(100, 300 << 10);
        let unknown: Vec<_> = (0..20).map(|o| (u(o), 0)).collect();
        assert_eq!(b.admit(0, &unknown), vec![u(0)]);
        b.settle(u(0), Ok(Bytes::from(vec![0u8; 100])));
        assert_eq!(b.admit(1, &unknown).len(), 19);
        assert_eq!(b.held(), (20, 2000));
    }

    #[test]
    fn closing_ends_every_wait() {
        let a = Ahead::new(4, 1000);
        a.admit(0, &[(u(0), 10)]);
        std::thread::scope(|s| {
            let r = s.spawn(|| a.take(u(0)));
            std::thread::sleep(Duration::from_millis(20));
            a.close();
            assert!(matches!(r.join().unwrap(), Taken::Failed(e) if e.kind == FailKind::Closed));
        });
    }
}
