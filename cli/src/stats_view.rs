//! Renders a broker's statistics as a table.

use std::fmt::Write;

use batchcast::proto::StatsReply;

pub fn render(s: &StatsReply) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "broker pid {} v{}, up {:.1} s",
        s.broker_pid, s.broker_version, s.uptime_s
    );
    broker_lines(&mut out, s);
    for st in &s.streams {
        let _ = writeln!(
            out,
            "\nstream `{}`: {} batches produced (epoch {}{}), {} deliveries; slots {} × {:.1} MiB: {} free, {} filling, {} in use; \
             pipeline blocked {:.2} s; {} consumers left, {} detached",
            st.name,
            st.batches_produced,
            st.epoch,
            if st.finished { ", finished" } else { "" },
            st.deliveries,
            st.slots,
            st.slot_bytes as f64 / (1 << 20) as f64,
            st.free_slots,
            st.filling,
            st.in_use,
            st.producer_blocked_s,
            st.departed,
            st.detached,
        );
        let threads = match st.workers_auto {
            true => format!(
                "{} of {} threads working (as many as the trainers need)",
                st.workers_active, st.workers
            ),
            false => format!("{} threads", st.workers),
        };
        let _ = writeln!(out, "  pipeline CPU {:.2} s, {threads}", st.pipeline_cpu_s);
        if let Some(src) = &st.source {
            source_line(&mut out, src);
        }
        if let Some((rank, world, samples)) = st.share.filter(|s| s.1 > 1) {
            let _ = writeln!(
                out,
                "  share: rank {rank} of {world} hosts, {samples} samples an epoch"
            );
        }
        match &st.producer {
            Some(p) => {
                let _ = writeln!(out, "  produced by {p}, uid {}", st.owner_uid);
            }
            None => {
                let _ = writeln!(out, "  configured, owned by uid {}", st.owner_uid);
            }
        }
        if let Some(why) = &st.failed {
            let _ = writeln!(out, "  STOPPED: {why}");
        }
        for g in &st.gpus {
            gpu_line(&mut out, g);
        }
        if st.consumers.is_empty() {
            let _ = writeln!(out, "  (no consumers)");
        } else {
            consumer_table(&mut out, &st.consumers);
        }
        past_consumers(&mut out, &st.past_consumers);
    }
    out
}

/// Memory, connections, and registrations not yet open.
fn broker_lines(out: &mut String, s: &StatsReply) {
    let m = &s.memory;
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let _ = writeln!(
        out,
        "memory {:.0} of {:.0} MiB: arenas {:.0}, GPU arenas {:.0}, mailboxes {:.1}, frame buffers {:.0}, replay {:.0}; {} refused",
        mib(m.used_bytes),
        mib(m.budget_bytes),
        mib(m.arenas_bytes),
        mib(m.gpu_arenas_bytes),
        mib(m.mailboxes_bytes),
        mib(m.frame_buffers_bytes),
        mib(m.replay_bytes),
        m.refused,
    );
    let c = &s.connections;
    let by: Vec<String> = c
        .by_uid
        .iter()
        .map(|(uid, n)| format!("uid {uid}: {n}"))
        .collect();
    let _ = writeln!(
        out,
        "connections {} of {} ({}); {} refused at accept, {} refused after (handshake {})",
        c.held,
        c.max,
        by.join(", "),
        c.refused,
        c.requests_refused,
        c.handshakes_refused,
    );
    for p in &s.pending {
        let _ = writeln!(
            out,
            "registering `{}`: {} (pid {}, uid {}), arena {:.1} MiB, waiting {:.1} s for its first Acquire",
            p.name,
            p.producer,
            p.pid,
            p.uid,
            mib(p.arena_bytes),
            p.waiting_s
        );
    }
}

/// The source's decodes, replacements and cache.
fn source_line(out: &mut String, src: &batchcast::proto::SourceStats) {
    match &src.shared {
        None => {
            let cut = match src.cut {
                0 => String::new(),
                n => format!(", {n} of them cut at restart markers"),
            };
            let _ = write!(
                out,
                "  images: {} decoded ({} at reduced size, {} in part{cut}), {} bad samples replaced",
                src.decoded, src.reduced, src.in_part, src.skipped
            );
        }
        Some(sh) => {
            let _ = write!(
                out,
                "  images: {} written, {} of them decoded by another stream; {} bad samples replaced\n  source `{}`: {} decodes for its {} streams, this one held {:.2} s by slower ones (let go {} times), {} decoded images ({:.1} MiB) left for others",
                src.decoded,
                sh.taken,
                src.skipped,
                sh.source,
                sh.decodes,
                sh.streams,
                sh.held_s,
                sh.let_go,
                sh.entries,
                sh.bytes as f64 / (1 << 20) as f64
            );
        }
    }
    if src.cache_budget > 0 {
        let _ = write!(
            out,
            "; cache {} hits, {} misses, {} items, {:.1} of {:.1} MiB",
            src.cache_hits,
            src.cache_misses,
            src.cache_items,
            src.cache_bytes as f64 / (1 << 20) as f64,
            src.cache_budget as f64 / (1 << 20) as f64
        );
    }
    if let Some(k) = &src.decoded_cache {
        let looked = (k.hits + k.misses).max(1);
        let _ = write!(
            out,
            "; decoded cache {:.0} % hits ({} of {}), {} images, {:.1} of {:.1} MiB",
            100.0 * k.hits as f64 / looked as f64,
            k.hits,
            k.hits + k.misses,
            k.items,
            k.bytes as f64 / (1 << 20) as f64,
            k.budget as f64 / (1 << 20) as f64
        );
    }
    if let Some(why) = &src.caches_chosen {
        let _ = write!(out, "; caches sized by the broker: {why}");
    }
    let st = &src.stages;
    if src.decoded > 0 {
        let per = |s: f64| 1e6 * s / src.decoded as f64;
        let _ = write!(
            out,
            "; per image: read {:.0} µs ({:.0} on a CPU), decode {:.0} µs, transform {:.0} µs",
            per(st.read_s),
            per(st.read_cpu_s),
            per(st.decode_s),
            per(st.transform_s)
        );
    }
    let _ = writeln!(out);
}

/// One GPU's copies and device slots.
fn gpu_line(out: &mut String, g: &batchcast::proto::GpuCopyStats) {
    let _ = writeln!(
        out,
        "  {}: {} H2D copies{}, {:.1} GiB at {:.1} GB/s, device slots {}/{} in use{}{}",
        g.gpu,
        g.copies,
        if g.replayed > 0 {
            format!(" (and {} of replayed batches)", g.replayed)
        } else {
            String::new()
        },
        g.bytes as f64 / (1u64 << 30) as f64,
        if g.copy_s > 0.0 {
            g.bytes as f64 / g.copy_s / 1e9
        } else {
            0.0
        },
        g.slots_in_use,
        g.slots,
        if g.waiting > 0 {
            format!(", {} batches waiting for one", g.waiting)
        } else {
            String::new()
        },
        if g.pinned {
            ""
        } else {
            " (pageable host memory)"
        }
    );
}

/// The latest consumers that left, and why.
fn past_consumers(out: &mut String, past: &[batchcast::proto::ConsumerStats]) {
    if !past.is_empty() {
        let shown = past.len().min(8);
        let _ = writeln!(out, "  left ({}, latest {shown}):", past.len());
        let recent = &past[past.len() - shown..];
        for c in recent {
            let (stall, why) = (100.0 * c.stall_fraction(), c.left.as_deref());
            // Its own batches (a group member's share, its batch size).
            let (who, batches) = (who(c), c.batches);
            let taken = c.taken.batches;
            let group = c
                .group
                .as_deref()
                .map_or(String::new(), |g| format!("group {g}  "));
            let _ = writeln!(
                out,
                "  {who} {batches:>10} batches ({taken} taken) {stall:>5.1}% stall  {group}{}",
                why.unwrap_or("")
            );
        }
    }
}

fn consumer_table(out: &mut String, consumers: &[batchcast::proto::ConsumerStats]) {
    let _ = writeln!(
        out,
        "  {:>4}  {:<20} {:>8} {:>6} {:>10} {:>10} {:>10} {:>5} {:>7} {:>6} {:>7} {:>6} {:>9} {:>7} {:>9} {:>9} {:>5} {:>7}  device",
        "id",
        "name",
        "pid",
        "uid",
        "batches",
        "taken",
        "units",
        "held",
        "queued",
        "batch",
        "window",
        "epoch",
        "wait s",
        "stall",
        "hold s",
        "replayed",
        "cuts",
        "rotated"
    );
    for c in consumers {
        let _ = writeln!(
            out,
            "  {} {:>6} {:>10} {:>10} {:>10} {:>5} {:>7} {:>6} {:>7} {:>6} {:>9.3} {:>6.1}% {:>9.3} {:>9} {:>5} {:>7}  {}{}",
            who(c),
            c.uid,
            c.batches,
            c.taken.batches,
            c.delivered,
            c.held,
            c.queued,
            c.batch_size,
            c.window,
            c.epoch,
            c.wait_s,
            100.0 * c.stall_fraction(),
            c.hold_s,
            c.replayed,
            c.cuts,
            c.rotations,
            c.device.as_deref().unwrap_or("cpu"),
            c.group
                .as_deref()
                .map_or(String::new(), |g| format!("  group {g}"))
        );
    }
}

/// A consumer's first three columns: id, name and pid.
fn who(c: &batchcast::proto::ConsumerStats) -> String {
    format!("{:>4}  {:<20} {:>8}", c.id, truncate(&c.name, 20), c.pid)
}

/// `s` cut to `n` characters, the last one `…` when cut.
pub fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        s.chars().take(n - 1).chain(['…']).collect()
    }
}
