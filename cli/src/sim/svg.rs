//! A small hand-written SVG chart: load over time (lines) and breaker state over time (bands).

use std::fmt::Write;

use crate::engine::core::BreakerState;

/// One line of the chart: a value per time bucket.
pub struct Series {
    pub name: String,
    pub color: &'static str,
    pub values: Vec<f64>,
}

/// One band: a breaker state per time bucket.
pub struct Band {
    pub name: String,
    pub states: Vec<Option<BreakerState>>,
}

/// Colour of a breaker state.
pub fn state_color(s: Option<BreakerState>) -> &'static str {
    match s {
        None => "#e5e7eb",
        Some(BreakerState::Closed) => "#22c55e",
        Some(BreakerState::Open) => "#ef4444",
        Some(BreakerState::HalfOpen) => "#f59e0b",
        Some(BreakerState::ForcedOpen) => "#7f1d1d",
        Some(BreakerState::ForcedClosed) | Some(BreakerState::Disabled) => "#9ca3af",
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// Render. `bucket_secs` is the width of one bucket in seconds; `marks` are shaded intervals
/// (in seconds) such as an outage.
pub fn render(title: &str, y_label: &str, bucket_secs: f64, series: &[Series], bands: &[Band], marks: &[(f64, f64, &str)]) -> String {
    let (w, left, right, top) = (1120.0f64, 70.0f64, 330.0f64, 40.0f64);
    let plot_h = 300.0f64;
    let band_h = 18.0f64;
    let band_gap = 6.0f64;
    let bands_top = top + plot_h + 40.0;
    let h = bands_top + bands.len() as f64 * (band_h + band_gap) + if bands.is_empty() { 10.0 } else { 40.0 };
    let n = series.iter().map(|s| s.values.len()).chain(bands.iter().map(|b| b.states.len())).max().unwrap_or(0).max(1);
    let plot_w = w - left - right;
    let x = |i: f64| left + plot_w * i / n as f64;
    let max = series.iter().flat_map(|s| s.values.iter().copied()).fold(0.0f64, f64::max);
    let min_positive = series.iter().flat_map(|s| s.values.iter().copied()).filter(|v| *v > 0.0).fold(f64::INFINITY, f64::min);
    // Values that span more than LOG_SPAN (a run without a budget next to one with it) share
    // the bottom pixel on a linear scale: then the scale is log10(1 + v), and says so.
    let log = min_positive.is_finite() && max / min_positive >= LOG_SPAN;
    let ymax = if log { 10f64.powf(max.log10().ceil()) } else { nice_ceiling(max) };
    let y = |v: f64| {
        let f = if log { (1.0 + v.max(0.0)).log10() / (1.0 + ymax).log10() } else { v / ymax };
        top + plot_h - plot_h * f
    };
    let y_label = if log { format!("{y_label} (log scale)") } else { y_label.to_string() };
    let ticks: Vec<f64> = if log {
        std::iter::once(0.0).chain((0..=ymax.log10().round() as i32).map(|k| 10f64.powi(k))).collect()
    } else {
        (0..=4).map(|k| ymax * f64::from(k) / 4.0).collect()
    };
    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(o, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(o, r#"<text x="{left}" y="22" font-size="15" font-weight="bold">{}</text>"#, esc(title));
    for (a, b, label) in marks {
        let (xa, xb) = (x(a / bucket_secs), x(b / bucket_secs));
        let _ = writeln!(o, r##"<rect x="{xa:.1}" y="{top}" width="{:.1}" height="{plot_h}" fill="#fee2e2"/>"##, (xb - xa).max(0.0));
        let _ = writeln!(o, r##"<text x="{:.1}" y="{:.1}" fill="#b91c1c">{}</text>"##, xa + 4.0, top + 14.0, esc(label));
    }
    // Axes and grid.
    for v in ticks {
        let yy = y(v);
        let _ = writeln!(o, r##"<line x1="{left}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#e5e7eb"/>"##, left + plot_w);
        let _ = writeln!(o, r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#, left - 6.0, yy + 4.0, fmt_num(v));
    }
    let total_secs = n as f64 * bucket_secs;
    let step = nice_ceiling(total_secs / 10.0).max(bucket_secs);
    let mut t = 0.0;
    while t <= total_secs + 1e-9 {
        let xx = x(t / bucket_secs);
        let _ =
            writeln!(o, r##"<line x1="{xx:.1}" y1="{:.1}" x2="{xx:.1}" y2="{:.1}" stroke="#6b7280"/>"##, top + plot_h, top + plot_h + 4.0);
        let _ = writeln!(o, r#"<text x="{xx:.1}" y="{:.1}" text-anchor="middle">{}s</text>"#, top + plot_h + 16.0, fmt_num(t));
        t += step;
    }
    let _ = writeln!(
        o,
        r##"<line x1="{left}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="#374151"/>"##,
        top + plot_h,
        left + plot_w,
        top + plot_h
    );
    let _ = writeln!(o, r##"<line x1="{left}" y1="{top}" x2="{left}" y2="{:.1}" stroke="#374151"/>"##, top + plot_h);
    let _ = writeln!(
        o,
        r#"<text transform="translate(16 {:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
        top + plot_h / 2.0,
        esc(&y_label)
    );
    // Lines.
    for (k, s) in series.iter().enumerate() {
        let pts: Vec<String> = s.values.iter().enumerate().map(|(i, v)| format!("{:.1},{:.1}", x(i as f64 + 0.5), y(*v))).collect();
        let _ = writeln!(o, r#"<polyline fill="none" stroke="{}" stroke-width="2" points="{}"/>"#, s.color, pts.join(" "));
        let ly = top + 10.0 + k as f64 * 18.0;
        let lx = left + plot_w + 12.0;
        let _ = writeln!(o, r#"<rect x="{lx:.1}" y="{:.1}" width="14" height="4" fill="{}"/>"#, ly - 4.0, s.color);
        let _ = writeln!(o, r#"<text x="{:.1}" y="{:.1}">{}</text>"#, lx + 20.0, ly + 2.0, esc(&s.name));
    }
    // Breaker bands.
    if !bands.is_empty() {
        let _ = writeln!(o, r#"<text x="{left}" y="{:.1}" font-weight="bold">breaker state</text>"#, bands_top - 8.0);
    }
    for (k, b) in bands.iter().enumerate() {
        let by = bands_top + k as f64 * (band_h + band_gap);
        let mut i = 0usize;
        while i < b.states.len() {
            let s = b.states.get(i).copied().flatten();
            let mut j = i + 1;
            while j < b.states.len() && b.states.get(j).copied().flatten() == s {
                j += 1;
            }
            let _ = writeln!(
                o,
                r#"<rect x="{:.1}" y="{by:.1}" width="{:.1}" height="{band_h}" fill="{}"><title>{}</title></rect>"#,
                x(i as f64),
                x(j as f64) - x(i as f64),
                state_color(s),
                s.map(|s| s.name()).unwrap_or("no breaker")
            );
            i = j;
        }
        let _ = writeln!(o, r#"<text x="{:.1}" y="{:.1}">{}</text>"#, left + plot_w + 8.0, by + 13.0, esc(&b.name));
    }
    if !bands.is_empty() {
        let ly = bands_top + bands.len() as f64 * (band_h + band_gap) + 14.0;
        let mut lx = left;
        for s in [BreakerState::Closed, BreakerState::Open, BreakerState::HalfOpen] {
            let _ = writeln!(o, r#"<rect x="{lx:.1}" y="{:.1}" width="12" height="12" fill="{}"/>"#, ly - 10.0, state_color(Some(s)));
            let _ = writeln!(o, r#"<text x="{:.1}" y="{ly:.1}">{}</text>"#, lx + 16.0, s.name());
            lx += 100.0;
        }
    }
    o.push_str("</svg>\n");
    o
}

/// Charts made by [`render`] one above the other in one SVG.
pub fn stack(parts: &[String]) -> String {
    let height = |p: &str| -> f64 {
        p.split_once("height=\"").and_then(|(_, rest)| rest.split_once('"')).and_then(|(h, _)| h.parse().ok()).unwrap_or(0.0)
    };
    let width = parts
        .iter()
        .map(|p| p.split_once("width=\"").and_then(|(_, r)| r.split_once('"')).and_then(|(w, _)| w.parse::<f64>().ok()).unwrap_or(0.0))
        .fold(0.0, f64::max);
    let total: f64 = parts.iter().map(|p| height(p.as_str())).sum();
    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{total}" viewBox="0 0 {width} {total}" font-family="sans-serif" font-size="12">"#
    );
    let mut y = 0.0;
    for p in parts {
        // A nested <svg> placed at `y`: the part as rendered, its own coordinates kept.
        let inner = p.trim_end().strip_prefix("<svg ").map(|rest| format!("<svg x=\"0\" y=\"{y}\" {rest}")).unwrap_or_default();
        o.push_str(&inner);
        o.push('\n');
        y += height(p.as_str());
    }
    o.push_str("</svg>\n");
    o
}

/// Largest over smallest positive value above which the chart's scale is logarithmic.
const LOG_SPAN: f64 = 50.0;

fn fmt_num(v: f64) -> String {
    if v == v.trunc() {
        format!("{}", v as i64)
    } else {
        format!("{v:.1}")
    }
}

/// 1, 2, 5 x 10^k at or above `v` (at least 1).
fn nice_ceiling(v: f64) -> f64 {
    if !(v.is_finite()) || v <= 1.0 {
        return 1.0;
    }
    let p = 10f64.powf(v.log10().floor());
    for m in [1.0, 2.0, 2.5, 5.0, 10.0] {
        if m * p >= v {
            return m * p;
        }
    }
    10.0 * p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_well_formed_svg() {
        let s = vec![Series { name: "a<b".into(), color: "#000", values: vec![1.0, 5.0, 2.0] }];
        let b = vec![Band { name: "layer 1".into(), states: vec![Some(BreakerState::Closed), Some(BreakerState::Open), None] }];
        let svg = render("t", "calls/s", 1.0, &s, &b, &[(1.0, 2.0, "outage")]);
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert!(svg.contains("a&lt;b"));
        assert_eq!(svg.matches("<polyline").count(), 1);
        assert!(svg.contains("<title>open</title>"));
        assert_eq!(nice_ceiling(27.0), 50.0);
        assert_eq!(nice_ceiling(2700.0), 5000.0);
    }

    /// The y of each point of the first polyline.
    fn ys(svg: &str) -> Vec<f64> {
        let pts = svg.split_once("points=\"").and_then(|(_, r)| r.split_once('"')).map(|(p, _)| p).unwrap_or_default();
        pts.split(' ').filter_map(|p| p.split_once(',')).filter_map(|(_, y)| y.parse().ok()).collect()
    }

    #[test]
    fn small_values_stay_apart_under_large_ones() {
        // 3000 calls/s without a budget, 3 and 1 with one: on a linear scale 3 and 1 are both on
        // the axis. The scale is logarithmic when the values span that much, and says so.
        let s = vec![
            Series { name: "x".into(), color: "#000", values: vec![1.0, 3.0, 3000.0] },
            Series { name: "y".into(), color: "#111", values: vec![0.0, 1.0, 1.0] },
        ];
        let svg = render("t", "calls/s", 1.0, &s, &[], &[]);
        let y = ys(&svg);
        assert!(y[0] - y[1] > 20.0, "1 and 3 are {} px apart: {y:?}", y[0] - y[1]);
        assert!(svg.contains("(log scale)"), "{svg}");
        // Values of one magnitude keep the linear scale.
        let lin = render("t", "calls/s", 1.0, &[Series { name: "x".into(), color: "#000", values: vec![10.0, 20.0] }], &[], &[]);
        assert!(!lin.contains("log scale"));
    }

    #[test]
    fn stacks_charts_one_above_the_other() {
        let s = vec![Series { name: "a".into(), color: "#000", values: vec![1.0, 2.0] }];
        let one = render("one", "x", 1.0, &s, &[], &[]);
        let h: f64 = one.split_once("height=\"").and_then(|(_, r)| r.split_once('"')).and_then(|(h, _)| h.parse().ok()).unwrap();
        let both = stack(&[one.clone(), one]);
        assert!(both.contains(&format!("height=\"{}\"", 2.0 * h)), "{both}");
        assert!(both.contains(&format!("<svg x=\"0\" y=\"{h}\" ")));
        assert_eq!(both.matches("<svg").count(), 3);
        assert_eq!(both.matches("</svg>").count(), 3);
    }
}
