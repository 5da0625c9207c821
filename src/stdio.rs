//! Lines on standard output and standard error for code that has no `cli::Printer` at hand.
//! `println!` and `eprintln!` panic when the stream is gone (`mflow run SPEC 2>&1 | head -1`,
//! the terminal of a closed ssh session): the run would end there, without its JUnit file, its
//! report, its webhook or its exit code. Here a write that fails points the stream at /dev/null
//! instead, so that every later message (mflow's own, miette's, the live display's) is dropped
//! quietly and the process goes on. `errln!` and `outln!` take `format!`'s arguments;
//! tests/architecture.rs keeps the panicking macros out of the code.

use std::io::Write;

/// Writes `args` and a line end to standard error.
pub fn err_line(args: std::fmt::Arguments<'_>) {
    let mut err = std::io::stderr().lock();
    if writeln!(err, "{args}").is_err() {
        to_null(libc::STDERR_FILENO);
    }
}

/// Writes `args` and a line end to standard output.
pub fn out_line(args: std::fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    if writeln!(out, "{args}").and_then(|()| out.flush()).is_err() {
        to_null(libc::STDOUT_FILENO);
    }
}

/// Points `fd` at /dev/null: writes to it then succeed and go nowhere.
pub fn to_null(fd: libc::c_int) {
    use std::os::fd::AsRawFd;
    if let Ok(null) = std::fs::OpenOptions::new().write(true).open("/dev/null") {
        // SAFETY: dup2(2) on two descriptors that are open; it replaces `fd` atomically.
        unsafe { libc::dup2(null.as_raw_fd(), fd) };
    }
}

/// `eprintln!` that cannot panic: see [`err_line`].
#[macro_export]
macro_rules! errln {
    ($($arg:tt)*) => {
        $crate::stdio::err_line(format_args!($($arg)*))
    };
}

/// `println!` that cannot panic: see [`out_line`].
#[macro_export]
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::stdio::out_line(format_args!($($arg)*))
    };
}
