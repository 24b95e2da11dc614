//! Children that do not outlive whoever started them (a `pre_exec` hook,
//! this module's one `unsafe` block).

use std::os::unix::process::CommandExt;
use std::process::Command;

use nix::sys::signal::Signal;

/// Makes the child started by `cmd` receive SIGTERM when this process dies,
/// however it dies (a launcher killed with SIGKILL must not leave its
/// broker and trainers running). Linux ties this to the thread that spawns
/// the child, so spawn from a thread that lives as long as the child
/// should (the launcher's main thread).
pub fn die_with_parent(cmd: &mut Command) {
    let parent = nix::unistd::getpid();
    // SAFETY: the hook runs in the forked child before exec, where only
    // async-signal-safe work is allowed. It makes two system calls
    // (prctl(PR_SET_PDEATHSIG) and getppid), allocates nothing (errors are
    // raw OS errors), takes no lock, and touches no state shared with the
    // parent's other threads.
    unsafe {
        cmd.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(Signal::SIGTERM)?;
            // The parent may have died between fork and prctl: then no
            // signal will ever come, so do not start at all.
            // (A raw OS error: nothing may allocate here.)
            if nix::unistd::getppid() != parent {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}
