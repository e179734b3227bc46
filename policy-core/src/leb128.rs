//! The compact integers of the core's binary formats (per-key shared state, `share`; the
//! fleet's shared bytes, `fleet::wire`): unsigned LEB128, and signed values zigzag-encoded
//! first. One reader for both formats, whose errors name the format they read.

use crate::error::LoadError;

/// Append `v` as unsigned LEB128.
pub(crate) fn put(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Append `v` zigzag-encoded, as LEB128.
pub(crate) fn put_i(out: &mut Vec<u8>, v: i64) {
    put(out, ((v << 1) ^ (v >> 63)) as u64);
}

/// Append a length-prefixed string.
pub(crate) fn put_s(out: &mut Vec<u8>, s: &str) {
    put(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

/// Reads what the `put` functions wrote. `format` names the bytes in errors
/// ("not Levee key state: truncated").
pub(crate) struct Reader<'a> {
    /// What is left to read.
    pub(crate) bytes: &'a [u8],
    format: &'static str,
}

impl<'a> Reader<'a> {
    /// A reader of `bytes`, which are `format` (for errors: "Levee key state").
    pub(crate) fn new(bytes: &'a [u8], format: &'static str) -> Self {
        Reader { bytes, format }
    }

    /// An error about these bytes.
    pub(crate) fn bad(&self, what: &str) -> LoadError {
        LoadError::new("", format!("not {}: {what}", self.format))
    }

    pub(crate) fn u64(&mut self) -> Result<u64, LoadError> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let (&b, rest) = self.bytes.split_first().ok_or_else(|| self.bad("truncated"))?;
            self.bytes = rest;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(self.bad("integer too long"))
    }

    pub(crate) fn u32(&mut self) -> Result<u32, LoadError> {
        u32::try_from(self.u64()?).map_err(|_| self.bad("integer out of range"))
    }

    pub(crate) fn i64(&mut self) -> Result<i64, LoadError> {
        let z = self.u64()?;
        Ok(((z >> 1) as i64) ^ -((z & 1) as i64))
    }

    /// A length of at most `max` (a list's or a string's).
    pub(crate) fn len(&mut self, max: u64, what: &str) -> Result<usize, LoadError> {
        let n = self.u64()?;
        if n > max {
            return Err(self.bad(what));
        }
        Ok(n as usize)
    }

    /// The next `n` bytes.
    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], LoadError> {
        let b = self.bytes.get(..n).ok_or_else(|| self.bad("truncated"))?;
        self.bytes = self.bytes.get(n..).unwrap_or_default();
        Ok(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_names_its_format() {
        let mut out = Vec::new();
        for v in [0u64, 1, 127, 128, 300, u64::MAX] {
            put(&mut out, v);
        }
        for v in [0i64, -1, 1, i64::MIN, i64::MAX] {
            put_i(&mut out, v);
        }
        put_s(&mut out, "node");
        let mut r = Reader::new(&out, "Levee test bytes");
        for v in [0u64, 1, 127, 128, 300, u64::MAX] {
            assert_eq!(r.u64().ok(), Some(v));
        }
        for v in [0i64, -1, 1, i64::MIN, i64::MAX] {
            assert_eq!(r.i64().ok(), Some(v));
        }
        let n = r.len(8, "name too long").unwrap_or(0);
        assert_eq!(r.take(n).ok(), Some(&b"node"[..]));
        assert!(r.bytes.is_empty());
        assert_eq!(r.u64().err().map(|e| e.message), Some("not Levee test bytes: truncated".to_string()));
        let mut long = Reader::new(&[0xff; 11], "X");
        assert_eq!(long.u64().err().map(|e| e.message), Some("not X: integer too long".to_string()));
        let mut big = Reader::new(&[0x80, 0x80, 0x80, 0x80, 0x10], "X");
        assert_eq!(big.u32().err().map(|e| e.message), Some("not X: integer out of range".to_string()));
    }
}
