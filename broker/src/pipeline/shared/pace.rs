//! How the streams of a source advance together: which are live, where
//! each is, who holds whom and for how long (the rules in [`super`]'s
//! docs), and entries swept once every stream has passed them.

use super::*;

impl SourceShare {
    /// Whether a stream takes batches (it has consumers and epochs left);
    /// one that does not neither holds the others nor is left entries.
    pub(crate) fn set_live(&self, member: usize, live: bool) {
        let mut st = self.lock();
        let lead = Self::lead(&st);
        let p = &mut st.members[member];
        if p.live == live {
            return;
        }
        let now = Instant::now();
        p.live = live;
        p.moved_at = now;
        if live {
            st.first_live.get_or_insert(now);
            st.ever_live |= 1 << member;
        }
        let p = &mut st.members[member];
        p.holding = live
            && p.marker()
                .saturating_add(self.plan.window.saturating_mul(REACH_WINDOWS))
                >= lead;
        p.kept_waiting = Duration::ZERO;
        if !live {
            let bit = 1u64 << member;
            let keys: Vec<u64> = st.entries.keys().copied().collect();
            for k in keys {
                if let Some(e) = st.entries.get_mut(&k) {
                    e.want &= !bit;
                }
                Self::drop_if_done(&mut st, k);
            }
        }
        self.sweep(&mut st);
        drop(st);
        self.changed.notify_all();
    }

    /// A stream starts filling the batch whose first sample is `at`.
    pub fn begin(&self, member: usize, at: u64) {
        let mut st = self.lock();
        st.members[member].in_flight.push(at);
    }

    /// It has filled the batch `at..end`.
    pub fn end(&self, member: usize, at: u64, end: u64) {
        let mut st = self.lock();
        let lead = Self::lead(&st);
        let window = self.plan.window;
        let p = &mut st.members[member];
        let before = p.marker();
        if let Some(i) = p.in_flight.iter().position(|&s| s == at) {
            p.in_flight.swap_remove(i);
        }
        p.done_to = p.done_to.max(end);
        if p.marker() != before {
            p.moved_at = Instant::now();
        }
        if p.live && !p.holding && p.marker().saturating_add(window / 2) >= lead {
            p.holding = true;
            p.kept_waiting = Duration::ZERO;
        }
        self.sweep(&mut st);
        drop(st);
        self.changed.notify_all();
    }

    /// The furthest place of a live stream.
    pub(super) fn lead(st: &State) -> u64 {
        st.members
            .iter()
            .filter(|p| p.live)
            .map(Progress::marker)
            .max()
            .unwrap_or(0)
    }

    /// Drops the entries every live stream has passed.
    pub(super) fn sweep(&self, st: &mut State) {
        let Some(low) = st
            .members
            .iter()
            .filter(|p| p.live)
            .map(Progress::marker)
            .min()
        else {
            // Nobody takes batches: nothing left is wanted.
            let keys: Vec<u64> = st.entries.keys().copied().collect();
            for k in keys {
                if let Some(e) = st.entries.get_mut(&k) {
                    e.want = 0;
                }
                Self::drop_if_done(st, k);
            }
            return;
        };
        let passed: Vec<u64> = st.entries.range(..low).map(|(&k, _)| k).collect();
        for k in passed {
            let keep = self.expected(st, k);
            if let Some(e) = st.entries.get_mut(&k) {
                e.want &= keep;
            }
            Self::drop_if_done(st, k);
        }
    }

    pub(super) fn drop_if_done(st: &mut State, at: u64) {
        if st
            .entries
            .get(&at)
            .is_some_and(|e| e.want == 0 && !e.pending())
            && let Some(e) = st.entries.remove(&at)
        {
            st.bytes -= e.bytes;
        }
    }

    /// Waits while a slower stream that holds the source is `window`
    /// samples or more behind `at`; lets go of one that does not move, or
    /// that has kept the others waiting its patience in all.
    pub(super) fn wait_turn<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        member: usize,
        at: u64,
    ) -> MutexGuard<'a, State> {
        let mut since: Option<Instant> = None;
        let mut last: Option<Instant> = None;
        loop {
            let now = Instant::now();
            // This wait so far is charged to every stream it waits for.
            let waited = last.map_or(Duration::ZERO, |t| now.duration_since(t));
            last = Some(now);
            // A stream that stopped taking batches (stopping, its consumers
            // gone) finishes its batch without waiting.
            let mut blocked = false;
            let waiting = st.members[member].live;
            for (k, p) in st.members.iter_mut().enumerate() {
                if !waiting || k == member || !p.live || !p.holding {
                    continue;
                }
                if p.marker().saturating_add(self.plan.window) > at {
                    continue;
                }
                let patience = if self.plan.members[k].decoupled {
                    DECOUPLED_HOLD
                } else {
                    HOLD_STALL
                };
                p.kept_waiting += waited;
                if now.duration_since(p.moved_at) >= patience {
                    tracing::debug!(
                        source = %self.plan.name,
                        stream = %self.plan.members[k].stream,
                        "a stream on this source stopped moving: the others go on without it"
                    );
                    p.holding = false;
                    self.let_go[k].fetch_add(1, Ordering::Relaxed);
                } else if p.kept_waiting >= patience {
                    tracing::debug!(
                        source = %self.plan.name,
                        stream = %self.plan.members[k].stream,
                        kept_waiting_ms = p.kept_waiting.as_millis() as u64,
                        "a slow stream on this source kept the others waiting too long: it decodes alone until it catches up"
                    );
                    p.holding = false;
                    self.let_go[k].fetch_add(1, Ordering::Relaxed);
                } else {
                    blocked = true;
                }
            }
            if !blocked {
                if let Some(t) = since {
                    let ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
                    self.held_ns[member].fetch_add(ns, Ordering::Relaxed);
                }
                return st;
            }
            since.get_or_insert(now);
            st = self
                .changed
                .wait_timeout(st, RECHECK)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}
