//! The one error type of documents and imported state: a field path and a reason.

/// An error in a document (or in imported state): where, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadError {
    /// Field path, such as `policies.checkout.backoff.base`.
    pub path: String,
    /// What is wrong and what is expected.
    pub message: String,
}

impl LoadError {
    /// Make an error. Control, bidirectional and other invisible characters that came from
    /// the document are escaped (`\u{202e}`), so that an error never reorders or hides the text
    /// around it in a terminal or a log.
    pub fn new(path: &str, message: impl Into<String>) -> Self {
        LoadError { path: escape(path), message: escape(&message.into()) }
    }
}

/// Whether a character must not reach a message as it is: C0 and C1 controls, DEL, the
/// bidirectional marks, embeddings, overrides and isolates, zero-width characters, line and
/// paragraph separators, and the byte order mark.
pub(crate) fn needs_escape(c: char) -> bool {
    matches!(c as u32,
        0..=0x1f | 0x7f..=0x9f | 0x61c | 0x200b..=0x200f | 0x2028..=0x202e | 0x2060..=0x2069 | 0xfeff)
}

/// `s` with every [`needs_escape`] character written as `\u{...}` (unchanged, and not
/// copied, in the usual case).
pub fn escape(s: &str) -> String {
    if !s.chars().any(needs_escape) {
        return s.to_string();
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if needs_escape(c) {
            out.push_str(&format!("\\u{{{:x}}}", c as u32));
        } else {
            out.push(c);
        }
    }
    out
}

impl core::fmt::Display for LoadError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        if self.path.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_only_what_must_be() {
        assert_eq!(escape("plain"), "plain");
        assert_eq!(escape("a\u{1b}[31mb"), "a\\u{1b}[31mb");
        assert_eq!(escape("x\u{202e}y"), "x\\u{202e}y");
        assert_eq!(LoadError::new("", "m").to_string(), "m");
        assert_eq!(LoadError::new("a.b", "m").to_string(), "a.b: m");
    }
}
