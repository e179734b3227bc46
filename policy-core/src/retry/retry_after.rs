//! Server-directed delays: HTTP `Retry-After` and gRPC `grpc-retry-pushback-ms`.

use crate::time::{MILLISECOND, SECOND};

/// What a server said about when to retry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServerDelay {
    /// Nothing usable was said (absent, or an HTTP-date with no wall clock, or garbage
    /// in Retry-After, which RFC 9110 says to ignore).
    None,
    /// Retry after this many nanoseconds.
    After(u64),
    /// Do not retry (a negative or unparseable gRPC pushback).
    Stop,
}

/// Parse a raw `Retry-After` header. `wall_secs` is the host's Unix time (0 = unknown).
///
/// Digits are tested first (delta-seconds), so `"120"` is never read as a year
/// (denoland/std #7299). The three HTTP-date forms of RFC 9110 are accepted: IMF-fixdate
/// (`Sun, 06 Nov 1994 08:49:37 GMT`), obsolete RFC 850 (`Sunday, 06-Nov-94 08:49:37 GMT`) and
/// asctime (`Sun Nov  6 08:49:37 1994`). A date in the past means retry now (0).
pub fn parse_retry_after(raw: &str, wall_secs: u64) -> ServerDelay {
    let t = raw.trim();
    if t.is_empty() {
        return ServerDelay::None;
    }
    if t.bytes().all(|b| b.is_ascii_digit()) {
        // Saturate absurd values; the policy's cap decides what happens to them.
        let secs = t.parse::<u64>().unwrap_or(u64::MAX);
        return ServerDelay::After(secs.saturating_mul(SECOND));
    }
    if wall_secs == 0 {
        return ServerDelay::None;
    }
    match parse_http_date(t) {
        // Every wall time up to 2^64-1 s is a time (i128 holds both sides exactly).
        Some(at) => {
            let secs = (i128::from(at) - i128::from(wall_secs)).clamp(0, i128::from(u64::MAX)) as u64;
            ServerDelay::After(secs.saturating_mul(SECOND))
        }
        None => ServerDelay::None,
    }
}

/// Parse a gRPC pushback (`grpc-retry-pushback-ms`): an integer of milliseconds; negative or
/// unparseable means do not retry (gRPC A6).
pub fn parse_pushback(raw: &str) -> ServerDelay {
    let t = raw.trim();
    if t.is_empty() {
        return ServerDelay::None;
    }
    match t.parse::<i64>() {
        Ok(ms) if ms >= 0 => ServerDelay::After((ms as u64).saturating_mul(MILLISECOND)),
        _ => ServerDelay::Stop,
    }
}

const MONTHS: [&str; 12] = ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"];

/// Parse an HTTP-date (all three RFC 9110 forms) into Unix seconds.
pub fn parse_http_date(text: &str) -> Option<i64> {
    let parts: Vec<&str> = text.split([' ', ',']).filter(|p| !p.is_empty()).collect();
    // IMF-fixdate: Sun, 06 Nov 1994 08:49:37 GMT -> [Sun, 06, Nov, 1994, 08:49:37, GMT]
    // RFC 850:     Sunday, 06-Nov-94 08:49:37 GMT -> [Sunday, 06-Nov-94, 08:49:37, GMT]
    // asctime:     Sun Nov  6 08:49:37 1994 -> [Sun, Nov, 6, 08:49:37, 1994]
    let (day, month, year, clock) = match parts.as_slice() {
        [_, d, m, y, clock, "GMT"] => (d.parse::<u32>().ok()?, month(m)?, y.parse::<i64>().ok()?, *clock),
        [_, dmy, clock, "GMT"] => {
            let mut it = dmy.split('-');
            let d = it.next()?.parse::<u32>().ok()?;
            let m = month(it.next()?)?;
            let y2 = it.next()?;
            if it.next().is_some() || y2.len() != 2 {
                return None;
            }
            let y2 = y2.parse::<i64>().ok()?;
            // RFC 9110 7.1.1.1: a two-digit year more than 50 years in the future is in the past century.
            let y = if y2 >= 70 { 1900 + y2 } else { 2000 + y2 };
            (d, m, y, *clock)
        }
        [_, m, d, clock, y] => (d.parse::<u32>().ok()?, month(m)?, y.parse::<i64>().ok()?, *clock),
        _ => return None,
    };
    let mut hms = clock.split(':');
    let h = hms.next()?.parse::<i64>().ok()?;
    let mi = hms.next()?.parse::<i64>().ok()?;
    let s = hms.next()?.parse::<i64>().ok()?;
    if hms.next().is_some() || !(0..24).contains(&h) || !(0..60).contains(&mi) || !(0..=60).contains(&s) {
        return None;
    }
    if !(1..=31).contains(&day) || !(1970..=9999).contains(&year) {
        return None;
    }
    let days = days_from_civil(year, month, day);
    Some(days * 86_400 + h * 3_600 + mi * 60 + s)
}

fn month(m: &str) -> Option<u32> {
    let lower = m.to_ascii_lowercase();
    MONTHS.iter().position(|x| *x == lower).map(|p| p as u32 + 1)
}

/// Days since 1970-01-01 (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let m = i64::from(m);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOV_6_1994_08_49_37: i64 = 784_111_777;

    #[test]
    fn all_three_date_forms() {
        assert_eq!(parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT"), Some(NOV_6_1994_08_49_37));
        assert_eq!(parse_http_date("Sunday, 06-Nov-94 08:49:37 GMT"), Some(NOV_6_1994_08_49_37));
        assert_eq!(parse_http_date("Sun Nov  6 08:49:37 1994"), Some(NOV_6_1994_08_49_37));
        assert_eq!(parse_http_date("Sun, 06 Nov 1994 25:49:37 GMT"), None);
        assert_eq!(parse_http_date("120"), None);
    }

    #[test]
    fn delta_seconds_first_and_dates_relative_to_wall() {
        assert_eq!(parse_retry_after("120", 0), ServerDelay::After(120 * SECOND));
        assert_eq!(parse_retry_after(" 0 ", 5), ServerDelay::After(0));
        let wall = NOV_6_1994_08_49_37 as u64 - 30;
        assert_eq!(parse_retry_after("Sun, 06 Nov 1994 08:49:37 GMT", wall), ServerDelay::After(30 * SECOND));
        assert_eq!(parse_retry_after("Sun, 06 Nov 1994 08:49:37 GMT", wall + 100), ServerDelay::After(0));
        assert_eq!(parse_retry_after("Sun, 06 Nov 1994 08:49:37 GMT", 0), ServerDelay::None);
        assert_eq!(parse_retry_after("soon", wall), ServerDelay::None);
        assert_eq!(parse_retry_after("-5", wall), ServerDelay::None);
        // Wall times from 2^63 s up are far in the future, never negative.
        assert_eq!(parse_retry_after("Sun, 06 Nov 1994 08:49:37 GMT", 1 << 63), ServerDelay::After(0));
        assert_eq!(parse_retry_after("Sun, 06 Nov 1994 08:49:37 GMT", u64::MAX), ServerDelay::After(0));
        assert_eq!(parse_retry_after("99999999999999999999999", 0), ServerDelay::After(u64::MAX));
    }

    #[test]
    fn pushback() {
        assert_eq!(parse_pushback("250"), ServerDelay::After(250 * MILLISECOND));
        assert_eq!(parse_pushback("-1"), ServerDelay::Stop);
        assert_eq!(parse_pushback("x"), ServerDelay::Stop);
        assert_eq!(parse_pushback(""), ServerDelay::None);
    }
}
