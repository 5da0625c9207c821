//! The few system calls mflow makes about processes, each wrapped once with why it is sound.

use std::io;

/// Sends `sig` to `pid` (a process group for a negative `pid`); signal 0 only checks.
pub fn kill(pid: i32, sig: i32) -> io::Result<()> {
    // SAFETY: kill(2) takes two integers and touches no memory of this process.
    if unsafe { libc::kill(pid, sig) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Whether `pid` (or, negative, a process group) exists, zombies included.
pub fn exists(pid: i32) -> bool {
    match kill(pid, 0) {
        Ok(()) => true,
        Err(e) => e.raw_os_error() == Some(libc::EPERM),
    }
}

/// This process's group: where the children other code of mflow spawns stay.
pub fn own_group() -> i32 {
    // SAFETY: getpgrp(2) takes nothing, cannot fail and touches no memory.
    unsafe { libc::getpgrp() }
}

/// Makes this process the reaper of every process orphaned below it, so that a stage's double
/// fork or daemon re-parents to mflow rather than to init, and stays in mflow's tree.
pub fn become_subreaper() -> bool {
    // SAFETY: prctl(2) with PR_SET_CHILD_SUBREAPER reads only its integer arguments.
    unsafe {
        libc::prctl(
            libc::PR_SET_CHILD_SUBREAPER,
            1 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        ) == 0
    }
}

pub enum Waitable {
    /// No child at all, living or dead.
    NoChildren,
    /// Children, none of them ended.
    None,
    /// An ended child, still waitable (not reaped).
    Child(i32),
}

/// An ended child, if any, without reaping it: tokio reaps the stages' main processes itself.
pub fn peek() -> Waitable {
    // SAFETY: siginfo_t is plain data, for which all zeroes is a valid value.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: waitid(2) writes only into `info`, which lives on this stack; WNOWAIT leaves the
    // child waitable for whoever owns it.
    let r = unsafe { libc::waitid(libc::P_ALL, 0, &mut info, libc::WEXITED | libc::WNOHANG | libc::WNOWAIT) };
    if r != 0 {
        return if io::Error::last_os_error().raw_os_error() == Some(libc::ECHILD) {
            Waitable::NoChildren
        } else {
            Waitable::None
        };
    }
    // SAFETY: reads the pid waitid filled in; it left zero there when no child had ended.
    match unsafe { info.si_pid() } {
        0 => Waitable::None,
        pid => Waitable::Child(pid),
    }
}

/// Reaps `pid` if it has ended; true if it was reaped.
pub fn reap(pid: i32) -> bool {
    // SAFETY: waitpid(2) with a null status pointer writes no memory.
    unsafe { libc::waitpid(pid, std::ptr::null_mut(), libc::WNOHANG) == pid }
}
