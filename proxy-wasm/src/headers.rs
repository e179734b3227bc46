//! A header map as the proxy-wasm ABI serializes it (`proxy_get_header_map_pairs`), read in
//! place: one host call gives every header of a request or response, and the filter looks
//! up the few it needs without copying each name and value into its own allocation.
//!
//! The format: the number of pairs N (u32, little endian), N pairs of sizes (name, value),
//! then each name and each value followed by a NUL byte. Bytes that do not follow it read as
//! no (more) headers: nothing here trusts the host.

/// A serialized header map.
#[derive(Clone, Debug, Default)]
pub struct Headers {
    bytes: Vec<u8>,
}

fn u32_at(bytes: &[u8], at: usize) -> Option<usize> {
    let b: [u8; 4] = bytes.get(at..at.checked_add(4)?)?.try_into().ok()?;
    Some(u32::from_le_bytes(b) as usize)
}

impl Headers {
    /// The map from its serialized bytes.
    pub fn new(bytes: Vec<u8>) -> Headers {
        Headers { bytes }
    }

    /// Every (name, value), in order.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        let b = self.bytes.as_slice();
        let n = u32_at(b, 0).unwrap_or(0);
        let mut data = n.checked_mul(8).and_then(|s| s.checked_add(4)).unwrap_or(usize::MAX);
        (0..n).map_while(move |i| {
            let sizes = 4 + i * 8;
            let (ks, vs) = (u32_at(b, sizes)?, u32_at(b, sizes + 4)?);
            let name = b.get(data..data.checked_add(ks)?)?;
            data = data.checked_add(ks)?.checked_add(1)?;
            let value = b.get(data..data.checked_add(vs)?)?;
            data = data.checked_add(vs)?.checked_add(1)?;
            Some((name, value))
        })
    }

    /// The first value of a header (names are lower case in Envoy's maps).
    pub fn get(&self, name: &str) -> Option<&str> {
        self.iter().find(|(k, _)| *k == name.as_bytes()).map(|(_, v)| std::str::from_utf8(v).unwrap_or_default())
    }
}

/// Serialize pairs as the ABI does (what the host sends; for tests and the cost example).
pub fn serialize(pairs: &[(&str, &str)]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (k, v) in pairs {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in pairs {
        for s in [k, v] {
            out.extend_from_slice(s.as_bytes());
            out.push(0);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_the_host_serializes_and_nothing_past_garbage() {
        let pairs = [(":method", "GET"), (":path", "/x"), ("x-levee-attempt", "2"), ("empty", ""), ("x-levee-attempt", "3")];
        let bytes = serialize(&pairs);
        let h = Headers::new(bytes.clone());
        assert_eq!(h.iter().count(), 5);
        assert_eq!((h.get(":method"), h.get("x-levee-attempt"), h.get("empty"), h.get("nope")), (Some("GET"), Some("2"), Some(""), None));
        // Every truncation into the last value, and a huge count, read as fewer headers, never
        // a panic (the last NUL is not needed).
        for cut in 0..bytes.len() - 1 {
            let t = Headers::new(bytes.get(..cut).unwrap_or_default().to_vec());
            assert!(t.iter().count() < 5, "cut at {cut}");
        }
        let mut huge = bytes;
        huge.get_mut(..4).unwrap_or_default().copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(Headers::new(huge).iter().count(), 0);
        assert_eq!(Headers::default().get(":status"), None);
    }
}
