//! Durations: parsing the policy document's human form (`"250ms"`, `"1.5s"`) and printing it back.
//!
//! Every time in Levee is a `u64` of nanoseconds. `now` is the host's monotonic clock.

/// Nanoseconds in a microsecond.
pub const MICROSECOND: u64 = 1_000;
/// Nanoseconds in a millisecond.
pub const MILLISECOND: u64 = 1_000_000;
/// Nanoseconds in a second.
pub const SECOND: u64 = 1_000_000_000;
/// Nanoseconds in a minute.
pub const MINUTE: u64 = 60 * SECOND;
/// Nanoseconds in an hour.
pub const HOUR: u64 = 60 * MINUTE;

const UNITS: [(&str, u64); 7] =
    [("ns", 1), ("us", MICROSECOND), ("µs", MICROSECOND), ("ms", MILLISECOND), ("s", SECOND), ("m", MINUTE), ("h", HOUR)];

/// Parse a duration such as `"250ms"`, `"1.5s"`, `"2m"`, `"100us"`, `"0"`.
///
/// A number needs a unit (`ns`, `us`, `ms`, `s`, `m`, `h`); only `0` may stand alone.
/// Fractions are allowed (`"1.5s"`); the result is rounded down to a nanosecond and must fit
/// in 2^63 ns (about 292 years).
pub fn parse_duration(text: &str) -> Result<u64, String> {
    let t = text.trim();
    if t == "0" {
        return Ok(0);
    }
    let split = t.char_indices().find(|(_, c)| !(c.is_ascii_digit() || *c == '.')).map(|(i, _)| i).unwrap_or(t.len());
    let (number, unit) = t.split_at_checked(split).unwrap_or((t, ""));
    let unit = unit.trim();
    if number.is_empty() {
        return Err(format!("`{text}` is not a duration: expected a number and a unit, such as \"250ms\" or \"2s\""));
    }
    let Some(scale) = UNITS.iter().find(|(u, _)| *u == unit).map(|(_, s)| *s) else {
        return Err(if unit.is_empty() {
            format!("`{text}` needs a unit: ns, us, ms, s, m or h (such as \"{text}ms\")")
        } else {
            format!("`{text}` has an unknown unit `{unit}`: use ns, us, ms, s, m or h")
        });
    };
    let (int_part, frac_part) = match number.split_once('.') {
        Some((i, f)) => (i, f),
        None => (number, ""),
    };
    if frac_part.as_bytes().contains(&b'.') || (int_part.is_empty() && frac_part.is_empty()) {
        return Err(format!("`{text}` is not a number followed by a unit"));
    }
    let too_long = || format!("`{text}` is too long: durations must stay below 292 years");
    let mut total: u64 = 0;
    for c in int_part.chars() {
        let digit = u64::from(c.to_digit(10).unwrap_or(0));
        total = total.checked_mul(10).and_then(|v| v.checked_add(digit)).ok_or_else(too_long)?;
    }
    total = total.checked_mul(scale).ok_or_else(too_long)?;
    // Fraction: digits beyond the unit's nanosecond resolution are dropped.
    let mut place = scale;
    for c in frac_part.chars() {
        place /= 10;
        if place == 0 {
            break;
        }
        let digit = u64::from(c.to_digit(10).unwrap_or(0));
        total = total.checked_add(digit.saturating_mul(place)).ok_or_else(too_long)?;
    }
    if total > i64::MAX as u64 {
        return Err(too_long());
    }
    Ok(total)
}

/// Print a duration in the shortest exact form `parse_duration` reads back (`"1500ms"`, `"2s"`).
pub fn format_duration(ns: u64) -> String {
    if ns == 0 {
        return "0".to_string();
    }
    for (unit, scale) in [("h", HOUR), ("m", MINUTE), ("s", SECOND), ("ms", MILLISECOND), ("us", MICROSECOND)] {
        if ns % scale == 0 {
            return format!("{}{unit}", ns / scale);
        }
    }
    format!("{ns}ns")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units_and_fractions() {
        assert_eq!(parse_duration("250ms"), Ok(250 * MILLISECOND));
        assert_eq!(parse_duration("1.5s"), Ok(1_500 * MILLISECOND));
        assert_eq!(parse_duration(" 2m "), Ok(2 * MINUTE));
        assert_eq!(parse_duration("100us"), Ok(100_000));
        assert_eq!(parse_duration("7ns"), Ok(7));
        assert_eq!(parse_duration("0"), Ok(0));
        assert_eq!(parse_duration("0.0000000001s"), Ok(0));
        assert_eq!(parse_duration(".5s"), Ok(500 * MILLISECOND));
    }

    #[test]
    fn rejects_bad_input_with_reasons() {
        assert!(parse_duration("250").unwrap_err().contains("needs a unit"));
        assert!(parse_duration("2 weeks").unwrap_err().contains("unknown unit"));
        assert!(parse_duration("ms").is_err());
        assert!(parse_duration("1.2.3s").is_err());
        assert!(parse_duration("-1s").is_err());
        assert!(parse_duration("99999999999999999999h").unwrap_err().contains("too long"));
        assert!(parse_duration("300h").is_ok());
        assert!(parse_duration("3000000h").is_err());
    }

    #[test]
    fn formats_round_trip() {
        for ns in [1, 999, 1_000, 1_500_000, 2 * SECOND, 90 * SECOND, 3 * HOUR, 123_456_789] {
            assert_eq!(parse_duration(&format_duration(ns)), Ok(ns), "{ns}");
        }
    }
}
