//! Colours (only on a terminal, never with `NO_COLOR`) and a progress indicator on stderr.

use std::io::{IsTerminal, Write};

/// Colour choice of the `--color` flag.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ColorChoice {
    // No doc comments here: clap would list each value on its own lines.
    Auto,
    Always,
    Never,
}

/// Output styling.
#[derive(Clone, Copy, Debug)]
pub struct Style {
    on: bool,
}

impl Style {
    /// Decide once, from the flag, the environment and whether stdout is a terminal.
    pub fn new(choice: ColorChoice) -> Self {
        let on = match choice {
            ColorChoice::Always => true,
            ColorChoice::Never => false,
            ColorChoice::Auto => std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()),
        };
        Style { on }
    }

    fn paint(self, code: &str, text: &str) -> String {
        if self.on {
            format!("\x1b[{code}m{text}\x1b[0m")
        } else {
            text.to_string()
        }
    }

    /// Errors, failures, open breakers.
    pub fn red(self, t: &str) -> String {
        self.paint("31", t)
    }
    /// Success.
    pub fn green(self, t: &str) -> String {
        self.paint("32", t)
    }
    /// Warnings, retries.
    pub fn yellow(self, t: &str) -> String {
        self.paint("33", t)
    }
    /// Headings.
    pub fn bold(self, t: &str) -> String {
        self.paint("1", t)
    }
    /// Secondary text.
    pub fn dim(self, t: &str) -> String {
        self.paint("2", t)
    }
}

/// A progress line on stderr, shown only when stderr is a terminal.
pub struct Progress {
    on: bool,
    label: String,
    last: u32,
}

impl Progress {
    /// A progress indicator for `label`; `quiet` hides it.
    pub fn new(label: &str, quiet: bool) -> Self {
        Progress { on: !quiet && std::io::stderr().is_terminal(), label: label.to_string(), last: u32::MAX }
    }

    /// Report `done` out of `total`; redraws only when the percentage changes.
    pub fn set(&mut self, done: u64, total: u64) {
        if !self.on || total == 0 {
            return;
        }
        let pct = (done.min(total) * 100 / total) as u32;
        if pct == self.last {
            return;
        }
        self.last = pct;
        let filled = (pct / 5) as usize;
        let bar: String = "#".repeat(filled) + &".".repeat(20 - filled.min(20));
        let mut err = std::io::stderr();
        let _ = write!(err, "\r{} [{bar}] {pct:3}%", self.label);
        let _ = err.flush();
    }

    /// Erase the line.
    pub fn finish(&mut self) {
        if self.on && self.last != u32::MAX {
            let mut err = std::io::stderr();
            let _ = write!(err, "\r{}\r", " ".repeat(self.label.len() + 30));
            let _ = err.flush();
        }
    }
}
