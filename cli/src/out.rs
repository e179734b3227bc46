//! Every line the CLI prints goes through here, so that a closed pipe
//! (`levee check policy.yaml | head -1`) never panics.
//!
//! `println!` panics when stdout is a closed pipe ("failed printing to stdout: Broken pipe",
//! exit 101), because Rust ignores SIGPIPE. Here a broken pipe quietly stops that stream: the
//! command runs to its end and returns its own exit code (so `set -o pipefail` still sees
//! an invalid document or a threshold). Any other write error is reported on stderr once and
//! makes the exit code 1.

use std::fmt::Arguments;
use std::io::{ErrorKind, Write};
use std::sync::atomic::{AtomicBool, Ordering};

static STDOUT_CLOSED: AtomicBool = AtomicBool::new(false);
static STDERR_CLOSED: AtomicBool = AtomicBool::new(false);
static WRITE_FAILED: AtomicBool = AtomicBool::new(false);

/// Write to stdout (use [`outln!`] and [`out!`]).
pub fn stdout(args: Arguments<'_>) {
    if STDOUT_CLOSED.load(Ordering::Relaxed) {
        return;
    }
    if let Err(e) = std::io::stdout().lock().write_fmt(args) {
        STDOUT_CLOSED.store(true, Ordering::Relaxed);
        if e.kind() != ErrorKind::BrokenPipe {
            WRITE_FAILED.store(true, Ordering::Relaxed);
            stderr(format_args!("levee: cannot write to stdout: {e}\n"));
        }
    }
}

/// Write to stderr (use [`errln!`]).
pub fn stderr(args: Arguments<'_>) {
    if STDERR_CLOSED.load(Ordering::Relaxed) {
        return;
    }
    if let Err(e) = std::io::stderr().lock().write_fmt(args) {
        STDERR_CLOSED.store(true, Ordering::Relaxed);
        if e.kind() != ErrorKind::BrokenPipe {
            WRITE_FAILED.store(true, Ordering::Relaxed);
        }
    }
}

/// Flush stdout (its buffer would otherwise be flushed, or fail, at exit).
pub fn flush() {
    if STDOUT_CLOSED.load(Ordering::Relaxed) {
        return;
    }
    if let Err(e) = std::io::stdout().lock().flush() {
        STDOUT_CLOSED.store(true, Ordering::Relaxed);
        if e.kind() != ErrorKind::BrokenPipe {
            WRITE_FAILED.store(true, Ordering::Relaxed);
            stderr(format_args!("levee: cannot write to stdout: {e}\n"));
        }
    }
}

/// The exit code to return: `code`, or 1 when output was lost to an error other than a
/// closed pipe.
pub fn exit_code(code: u8) -> u8 {
    flush();
    if WRITE_FAILED.load(Ordering::Relaxed) && code == 0 {
        1
    } else {
        code
    }
}

/// `println!` that never panics (see the module documentation).
#[macro_export]
macro_rules! outln {
    () => { $crate::out::stdout(format_args!("\n")) };
    ($($arg:tt)*) => { $crate::out::stdout(format_args!("{}\n", format_args!($($arg)*))) };
}

/// `print!` that never panics.
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => { $crate::out::stdout(format_args!($($arg)*)) };
}

/// `eprintln!` that never panics.
#[macro_export]
macro_rules! errln {
    ($($arg:tt)*) => { $crate::out::stderr(format_args!("{}\n", format_args!($($arg)*))) };
}
