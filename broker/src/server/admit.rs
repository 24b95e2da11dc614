//! Who gets a connection, decided at `accept` from the kernel's record of
//! the peer (`SO_PEERCRED`) before a byte is read from it: the allow list,
//! then the connection limits. A refusal is written at once and the socket
//! closed; nothing waits, so a flood of connections can neither fill the
//! broker's memory nor stop the accept loop from watching for shutdown.
//!
//! The limits: `max_connections` in all; the broker's own uid is bounded
//! only by that. Every other uid may hold `max_connections_per_uid`,
//! and all other uids together three quarters of `max_connections`, so the
//! broker's owner always has a quarter of the connections to itself whatever
//! guests do. The numbers come from `[broker]` (`plan::plan_broker`).

use batchcast::proto::ErrorCode;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::listen::Allow;
use crate::plan::BrokerPlan;

/// What all guests together may hold of `max`: the rest is the owner's.
fn guest_share(max: usize) -> usize {
    max - max / 4
}

/// Counts connections by uid.
#[derive(Debug)]
pub struct Admission {
    allow: Allow,
    limits: BrokerPlan,
    held: Mutex<Held>,
}

#[derive(Debug, Default)]
struct Held {
    total: usize,
    guests: usize,
    by_uid: HashMap<u32, usize>,
    refused: u64,
}

/// One admitted connection; dropping it gives the place back.
#[derive(Debug)]
pub struct Ticket {
    admission: Arc<Admission>,
    uid: u32,
}

/// Why a peer gets no connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Refusal {
    pub code: ErrorCode,
    pub message: String,
}

impl Admission {
    pub fn new(allow: Allow, limits: BrokerPlan) -> Arc<Admission> {
        Arc::new(Admission {
            allow,
            limits,
            held: Mutex::new(Held::default()),
        })
    }

    pub fn limits(&self) -> &BrokerPlan {
        &self.limits
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn is_guest(&self, uid: u32) -> bool {
        uid != self.allow.own_uid
    }

    /// Admits a peer of `uid`/`gid`/`pid`, or says why not.
    pub(crate) fn admit(
        self: &Arc<Self>,
        uid: u32,
        gid: u32,
        pid: Option<i32>,
    ) -> Result<Ticket, Refusal> {
        let mut held = self.lock();
        let refusal = self.refusal(&held, uid, gid, pid);
        if let Some(r) = refusal {
            held.refused += 1;
            return Err(r);
        }
        held.total += 1;
        if self.is_guest(uid) {
            held.guests += 1;
        }
        *held.by_uid.entry(uid).or_default() += 1;
        Ok(Ticket {
            admission: self.clone(),
            uid,
        })
    }

    fn refusal(&self, held: &Held, uid: u32, gid: u32, pid: Option<i32>) -> Option<Refusal> {
        if !self.allow.admits(uid, gid, pid) {
            return Some(Refusal {
                code: ErrorCode::NotAllowed,
                message: format!(
                    "uid {uid} is not allowed to use this broker; add it to allow_uids in the broker config"
                ),
            });
        }
        let mine = held.by_uid.get(&uid).copied().unwrap_or(0);
        let limits = &self.limits;
        let busy = |what: String| {
            Some(Refusal {
                code: ErrorCode::Busy,
                message: format!(
                    "the broker is at its connection limit: {what}; {}",
                    held.top()
                ),
            })
        };
        if held.total >= limits.max_connections {
            return busy(format!(
                "{} connections (max_connections); close idle ones or raise max_connections",
                held.total
            ));
        }
        if self.is_guest(uid) {
            if mine >= limits.max_connections_per_uid {
                return busy(format!(
                    "uid {uid} holds {mine} connections (max_connections_per_uid = {}); close idle ones, or ask the broker's owner to raise it",
                    limits.max_connections_per_uid
                ));
            }
            if held.guests >= guest_share(limits.max_connections) {
                return busy(format!(
                    "other users hold {} connections, all they may (three quarters of max_connections = {}; the rest are kept for uid {})",
                    held.guests, limits.max_connections, self.allow.own_uid
                ));
            }
        }
        None
    }

    /// Whether `uid` may register a stream called `name`: the broker's own
    /// user may use any free name; another user only names under its
    /// prefix, so no guest can take a name the owner's trainers expect.
    pub(crate) fn may_name(&self, uid: u32, name: &str) -> Result<(), Refusal> {
        if !self.is_guest(uid) {
            return Ok(());
        }
        let prefix = self.prefix_of(uid);
        if name.starts_with(&prefix) && name.len() > prefix.len() {
            return Ok(());
        }
        Err(Refusal {
            code: ErrorCode::NotAllowed,
            message: format!(
                "uid {uid} may only register streams named `{prefix}...` on this broker (guest_stream_prefix = \"{}\"); name it `{prefix}{name}`",
                self.limits.guest_stream_prefix
            ),
        })
    }

    /// `guest_prefix` for `uid`: its user name (or `u{uid}` without one).
    pub(crate) fn prefix_of(&self, uid: u32) -> String {
        let user = nix::unistd::User::from_uid(uid.into())
            .ok()
            .flatten()
            .map_or_else(|| format!("u{uid}"), |u| u.name);
        self.limits
            .guest_stream_prefix
            .replace("{user}", &user)
            .replace("{uid}", &uid.to_string())
    }

    /// Whether `uid` may change `owner`'s stream (its `min_consumers`): the
    /// stream's owner and the broker's user may.
    pub(crate) fn may_control(&self, uid: u32, owner: u32, stream: &str) -> Result<(), Refusal> {
        if uid == owner || !self.is_guest(uid) {
            return Ok(());
        }
        Err(Refusal {
            code: ErrorCode::NotAllowed,
            message: format!(
                "uid {uid} may not control stream `{stream}`: only its owner (uid {owner}) or the broker's user (uid {}) may",
                self.allow.own_uid
            ),
        })
    }

    /// (connections held, refused so far, the uids holding most).
    pub fn counts(&self) -> (usize, u64, Vec<(u32, usize)>) {
        let held = self.lock();
        (held.total, held.refused, held.largest(8))
    }
}

impl Held {
    fn largest(&self, n: usize) -> Vec<(u32, usize)> {
        let mut v: Vec<_> = self.by_uid.iter().map(|(&u, &c)| (u, c)).collect();
        v.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        v.truncate(n);
        v
    }

    fn top(&self) -> String {
        let top: Vec<_> = self
            .largest(3)
            .into_iter()
            .map(|(u, c)| format!("uid {u}: {c}"))
            .collect();
        format!("held by {}", top.join(", "))
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let guest = self.admission.is_guest(self.uid);
        let mut held = self.admission.lock();
        held.total -= 1;
        if guest {
            held.guests -= 1;
        }
        if let Some(c) = held.by_uid.get_mut(&self.uid) {
            *c -= 1;
            if *c == 0 {
                held.by_uid.remove(&self.uid);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn admission(max: usize, per_uid: usize) -> Arc<Admission> {
        let allow = Allow {
            own_uid: 1000,
            uids: vec![1001, 1002],
            gids: vec![],
        };
        Admission::new(
            allow,
            BrokerPlan {
                allow_gids: vec![],
                max_connections: max,
                max_connections_per_uid: per_uid,
                idle_timeout: Duration::from_secs(60),
                memory_bytes: 1 << 30,
                threads: 1,
                registration_timeout: Duration::from_secs(30),
                guest_stream_prefix: "{user}.".into(),
            },
        )
    }

    #[test]
    fn guests_are_held_to_their_share_and_the_owner_keeps_a_quarter() {
        let a = admission(8, 4);
        let g1: Vec<_> = (0..4).map(|_| a.admit(1001, 0, None).unwrap()).collect();
        let r = a.admit(1001, 0, None).unwrap_err();
        assert_eq!(r.code, ErrorCode::Busy);
        assert!(r.message.contains("uid 1001 holds 4"), "{}", r.message);
        let g2: Vec<_> = (0..2).map(|_| a.admit(1002, 0, None).unwrap()).collect();
        // Guests hold 6 of 8: all they may.
        let r = a.admit(1002, 0, None).unwrap_err();
        assert!(r.message.contains("kept for uid 1000"), "{}", r.message);
        let owner: Vec<_> = (0..2).map(|_| a.admit(1000, 0, None).unwrap()).collect();
        let r = a.admit(1000, 0, None).unwrap_err();
        assert!(
            r.message.contains("8 connections (max_connections)"),
            "{}",
            r.message
        );
        assert!(r.message.contains("uid 1001: 4"), "{}", r.message);
        drop(g1);
        assert!(a.admit(1002, 0, None).is_ok());
        assert_eq!(a.counts().0, 4, "dropped tickets give their places back");
        assert_eq!(a.counts().1, 3);
        drop((g2, owner));
        assert_eq!(a.counts().0, 0);
        assert!(a.counts().2.is_empty());
    }

    #[test]
    fn a_uid_outside_the_allow_list_is_refused_before_any_limit() {
        let a = admission(8, 4);
        let r = a.admit(4242, 4242, None).unwrap_err();
        assert_eq!(r.code, ErrorCode::NotAllowed);
        assert!(r.message.contains("uid 4242"));
        assert_eq!(a.counts().0, 0);
    }

    #[test]
    fn guests_name_streams_under_their_prefix_and_control_only_their_own() {
        let a = admission(8, 4);
        assert!(a.may_name(1000, "train").is_ok());
        let r = a.may_name(1001, "train").unwrap_err();
        assert_eq!(r.code, ErrorCode::NotAllowed);
        let p = a.prefix_of(1001);
        assert!(
            r.message.contains(&format!("name it `{p}train`")),
            "{}",
            r.message
        );
        assert!(a.may_name(1001, &format!("{p}train")).is_ok());
        assert!(a.may_name(1001, &p).is_err(), "the prefix alone is no name");
        assert!(a.may_control(1001, 1001, "x").is_ok());
        assert!(a.may_control(1000, 1001, "x").is_ok());
        let r = a.may_control(1002, 1000, "train").unwrap_err();
        assert!(
            r.message.contains("only its owner (uid 1000)"),
            "{}",
            r.message
        );
    }

    #[test]
    fn the_owner_is_bounded_only_by_the_total() {
        let a = admission(4, 1);
        let t: Vec<_> = (0..4).map(|_| a.admit(1000, 0, None).unwrap()).collect();
        assert_eq!(t.len(), 4);
        assert_eq!(a.admit(1000, 0, None).unwrap_err().code, ErrorCode::Busy);
    }
}
