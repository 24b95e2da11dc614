//! How the units the window starts become requests: a whole object one
//! each; members of one shard close together one range request.

use super::ahead::Unit;

/// Members of one shard read close together are fetched by one range
/// request when the bytes between them are few.
pub(crate) const RUN_GAP: u64 = 64 << 10;

/// `units` (in reading order) grouped into fetches: a whole object
/// alone; members of one shard, by offset, merged while the gap between
/// them is at most `RUN_GAP` and the run at most `max_run` bytes (a
/// shard part). The fetches go out in reading order (a run where its
/// first-read member is), since a limit on requests in flight makes the
/// later ones wait: the next batch's samples must not queue behind
/// samples read a window later.
pub fn runs(units: Vec<Unit>, max_run: u64) -> Vec<Vec<Unit>> {
    let mut by_offset: Vec<(usize, Unit)> = units.into_iter().enumerate().collect();
    by_offset.sort_by_key(|&(_, u)| (u.object, u.start));
    // Each run with the reading rank of its first-read member.
    let mut out: Vec<(usize, Vec<Unit>)> = Vec::new();
    for (rank, u) in by_offset {
        if let Some((first_read, run)) = out.last_mut()
            && let (Some(first), Some(last)) = (run.first(), run.last())
            && u.bytes().is_some()
            && last.bytes().is_some()
            && last.object == u.object
            && u.start >= last.end
            && u.start - last.end <= RUN_GAP
            && u.end - first.start <= max_run
        {
            *first_read = (*first_read).min(rank);
            run.push(u);
            continue;
        }
        out.push((rank, vec![u]));
    }
    out.sort_by_key(|&(rank, _)| rank);
    out.into_iter().map(|(_, run)| run).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ops::Range;

    fn m(object: u32, r: Range<u64>) -> Unit {
        Unit::range(object, r)
    }

    #[test]
    fn members_close_together_are_one_request_and_whole_objects_their_own() {
        let units = vec![
            m(1, 5000..6000),
            m(0, 0..100),
            m(0, 612..900),
            // 100 KiB further on: past the gap, a run of its own.
            m(0, 900 + (100 << 10)..1000 + (100 << 10)),
            Unit::whole(7),
            Unit::whole(8),
            m(1, 6512..7000),
        ];
        // In reading order: a run where its first-read member is.
        assert_eq!(
            runs(units, 1 << 20),
            vec![
                vec![m(1, 5000..6000), m(1, 6512..7000)],
                vec![m(0, 0..100), m(0, 612..900)],
                vec![m(0, 900 + (100 << 10)..1000 + (100 << 10))],
                vec![Unit::whole(7)],
                vec![Unit::whole(8)],
            ]
        );
        // Whole objects keep the order they are read in.
        let read = vec![Unit::whole(9), Unit::whole(2), Unit::whole(5)];
        assert_eq!(
            runs(read.clone(), 1 << 20),
            read.into_iter().map(|u| vec![u]).collect::<Vec<_>>()
        );
        // A run stops at a part's size.
        let close: Vec<_> = (0..10).map(|i| m(0, i * 100..i * 100 + 90)).collect();
        assert_eq!(
            runs(close, 500).iter().map(Vec::len).collect::<Vec<_>>(),
            vec![5, 5]
        );
    }
}
