//! What `/proc` says about a process: CPU time and resident memory, for
//! benchmarks and the test consumer's reports.

/// CPU seconds of a process's live threads, to the nanosecond (the first
/// field of each `/proc/PID/task/*/schedstat`), or [`cpu_seconds`] without
/// schedstat. For benchmarks: a short run is a few clock ticks; a thread
/// that exits between two reads is not counted.
pub fn thread_cpu_seconds(pid: u32) -> Option<f64> {
    task_cpu_seconds(pid).or_else(|| cpu_seconds(pid))
}

fn task_cpu_seconds(pid: u32) -> Option<f64> {
    let mut ns = 0u64;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let Ok(task) = task else { continue };
        // A thread that exits meanwhile is skipped.
        let Ok(s) = std::fs::read_to_string(task.path().join("schedstat")) else {
            continue;
        };
        ns += s.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(ns as f64 / 1e9)
}

/// User + system CPU seconds a process has used (`/proc/PID/stat`, in
/// clock ticks of 10 ms; threads that exited included).
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .unwrap_or(100) as f64;
    Some(ticks / hz)
}

/// Resident memory of a process in KiB (`VmRSS`).
pub fn rss_kb(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Anonymous resident memory of this process (excludes the shared arena).
pub fn rss_anon_kb(pid: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("RssAnon:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

/// CPU seconds of the threads of process `pid` named `comm*` (a
/// thread's name is its first 15 bytes), and seconds they waited on a run
/// queue for a core: the first two fields of `/proc/PID/task/*/schedstat`.
/// `None` without schedstat or such a thread.
pub fn named_threads(pid: u32, comm: &str) -> Option<ThreadTimes> {
    let want = &comm.as_bytes()[..comm.len().min(15)];
    let mut ns = [0u64; 2];
    let mut seen = false;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let Ok(task) = task else { continue };
        let Ok(name) = std::fs::read(task.path().join("comm")) else {
            continue;
        };
        if !name.starts_with(want) {
            continue;
        }
        // A thread that exits meanwhile is skipped.
        let Ok(s) = std::fs::read_to_string(task.path().join("schedstat")) else {
            continue;
        };
        let mut f = s.split_whitespace().map(str::parse::<u64>);
        ns[0] += f.next()?.ok()?;
        ns[1] += f.next()?.ok()?;
        seen = true;
    }
    seen.then_some(ThreadTimes {
        cpu_s: ns[0] as f64 / 1e9,
        run_queue_s: ns[1] as f64 / 1e9,
    })
}

/// What [`named_threads`] reads.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ThreadTimes {
    pub cpu_s: f64,
    pub run_queue_s: f64,
}

pub use batchcast::stats_client::{REMOTE_THREADS, pipeline_threads};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_named_threads_run_queue_wait_is_found_and_others_are_not() {
        let t = std::thread::Builder::new()
            .name("probe-worker-0".into())
            .spawn(|| std::thread::sleep(std::time::Duration::from_millis(300)))
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(50));
        let me = std::process::id();
        let q = named_threads(me, &pipeline_threads("probe"));
        assert!(q.is_some_and(|q| q.run_queue_s >= 0.0), "{q:?}");
        assert_eq!(named_threads(me, "no-such-thread"), None);
        t.join().unwrap();
    }
}
