//! `levee check`: validate documents and print each policy's worst cases.

use std::path::PathBuf;

use crate::engine::core::{Analysis, PolicyInfo};
use crate::engine::{self, human, Engine};
use crate::term::Style;

/// Exit code: every document is valid and within the thresholds.
pub const EXIT_OK: u8 = 0;
/// Exit code: a document is invalid (or unreadable).
pub const EXIT_INVALID: u8 = 1;
// Exit code 2 (the command line is wrong) is clap's own.
/// Exit code: every document is valid but a policy exceeds `--max-amplification` or `--max-latency`.
pub const EXIT_THRESHOLD: u8 = 3;

/// Arguments of `check`.
pub struct CheckArgs {
    pub files: Vec<PathBuf>,
    pub layers: u32,
    pub json: bool,
    pub show_defaults: bool,
    pub max_amplification: Option<f64>,
    pub max_latency: Option<u64>,
}

/// Run `check`; returns the exit code.
pub fn run(args: &CheckArgs, style: Style) -> u8 {
    let mut code = EXIT_OK;
    for file in &args.files {
        let c = check_file(file, args, style);
        // Invalid beats a threshold: a script sees the worst problem.
        code = match (code, c) {
            (EXIT_INVALID, _) | (_, EXIT_INVALID) => EXIT_INVALID,
            (a, b) => a.max(b),
        };
    }
    code
}

fn read(file: &PathBuf) -> Result<String, String> {
    if file.as_os_str() == "-" {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut s).map_err(|e| format!("cannot read stdin: {e}"))?;
        return Ok(s);
    }
    std::fs::read_to_string(file).map_err(|e| format!("cannot read {}: {e}", file.display()))
}

fn check_file(file: &PathBuf, args: &CheckArgs, style: Style) -> u8 {
    let name = file.display().to_string();
    let text = match read(file) {
        Ok(t) => t,
        Err(e) => {
            if args.json {
                outln!("{}", serde_json::json!({"file": name, "valid": false, "errors": [{"path": "", "message": e}]}));
            } else {
                errln!("{} {e}", style.red("error:"));
            }
            return EXIT_INVALID;
        }
    };
    let mut eng = match engine::load(&text, 0) {
        Ok(e) => e,
        Err(errors) => {
            if args.json {
                let errs: Vec<_> = errors.iter().map(|e| serde_json::json!({"path": e.path, "message": e.message})).collect();
                outln!("{}", serde_json::json!({"file": name, "valid": false, "errors": errs}));
            } else {
                outln!("{}: {} ({} error{})", name, style.red("invalid"), errors.len(), if errors.len() == 1 { "" } else { "s" });
                for e in &errors {
                    let path = if e.path.is_empty() { "(document)" } else { e.path.as_str() };
                    outln!("  {} {}: {}", style.red("error"), style.bold(path), e.message);
                }
            }
            return EXIT_INVALID;
        }
    };
    report_policies(&mut eng, &name, args, style)
}

/// What `check` reports of one policy, or why it cannot.
struct Report {
    name: String,
    result: Result<(PolicyInfo, Analysis), String>,
}

/// Every policy of the engine with its analysis. A policy whose analysis fails (the engine
/// trapped, or gave no answer) is kept, with the reason: it is never dropped from the report.
fn analyse(eng: &mut Engine, layers: u32) -> Result<Vec<Report>, String> {
    let count = eng.try_policy_count().map_err(|t| format!("cannot count the policies: {t}"))?;
    let mut out = Vec::new();
    for i in 0..count {
        let info = eng.try_policy_info(i).map_err(|t| t.to_string()).and_then(|o| o.ok_or_else(|| format!("the engine has no policy {i}")));
        let name = info.as_ref().map(|p| p.name.clone()).unwrap_or_else(|_| format!("#{i}"));
        let result = info.and_then(|info| match eng.try_analyze(i, layers) {
            Ok(Some(a)) => Ok((info, a)),
            Ok(None) => Err("the engine gave no analysis".to_string()),
            Err(t) => Err(t.to_string()),
        });
        out.push(Report { name, result: result.map_err(|e| format!("cannot analyse the policy: {e}")) });
    }
    Ok(out)
}

fn report_policies(eng: &mut Engine, name: &str, args: &CheckArgs, style: Style) -> u8 {
    let reports = match analyse(eng, args.layers) {
        Ok(r) => r,
        Err(e) => {
            if args.json {
                outln!("{}", serde_json::json!({"file": name, "valid": true, "errors": [{"path": "", "message": e}], "policies": []}));
            } else {
                outln!("{}: {} {e}", name, style.red("error:"));
            }
            return EXIT_INVALID;
        }
    };
    let mut code = EXIT_OK;
    let mut policies = Vec::new();
    let mut errors = Vec::new();
    if !args.json {
        let n = reports.len();
        outln!("{}: {} ({} polic{})", name, style.green("valid"), n, if n == 1 { "y" } else { "ies" });
    }
    for (i, report) in reports.iter().enumerate() {
        let (info, a) = match &report.result {
            Ok(r) => r,
            Err(e) => {
                code = EXIT_INVALID;
                let path = format!("policies.{}", report.name);
                if args.json {
                    policies.push(serde_json::json!({"name": report.name, "layers": args.layers, "error": e}));
                    errors.push(serde_json::json!({"path": path, "message": e}));
                } else {
                    outln!("  {} {}", style.bold("policy"), style.bold(&report.name));
                    outln!("    {} {e}", style.red("error:"));
                }
                continue;
            }
        };
        let mut over = Vec::new();
        if let Some(max) = args.max_amplification {
            if a.amplification_with_budget > max {
                over.push(format!(
                    "amplification {} on {} layers is above --max-amplification {}",
                    fmt_x(a.amplification_with_budget),
                    args.layers,
                    fmt_x(max)
                ));
            }
        }
        if let Some(max) = args.max_latency {
            match a.worst_latency {
                None => over.push("worst-case latency is unbounded, above --max-latency".to_string()),
                Some(l) if l > max => over.push(format!("worst-case latency {} is above --max-latency {}", human(l), human(max))),
                _ => {}
            }
        }
        if !over.is_empty() && code == EXIT_OK {
            code = EXIT_THRESHOLD;
        }
        let defaults: Option<serde_json::Value> =
            if args.show_defaults { eng.policy_json(i as u32).and_then(|j| serde_json::from_str(&j).ok()) } else { None };
        if args.json {
            policies.push(serde_json::json!({
                "name": info.name,
                "max_attempts": info.max_attempts,
                "attempt_timeout": info.attempt_timeout,
                "deadline": info.deadline,
                "fallbacks": info.fallbacks,
                "layers": args.layers,
                "worst_attempts": a.worst_attempts,
                "worst_latency": a.worst_latency,
                "amplification": a.amplification,
                "amplification_with_budget": a.amplification_with_budget,
                "over_threshold": over,
                "policy": defaults,
                "error": null,
            }));
            continue;
        }
        outln!("  {} {}", style.bold("policy"), style.bold(&info.name));
        let timeout = if info.attempt_timeout == 0 { "none".to_string() } else { human(info.attempt_timeout) };
        let deadline = if info.deadline == 0 { "none".to_string() } else { human(info.deadline) };
        // A hedged policy makes one call-level attempt and races `hedge.attempts` of them.
        let hedge = eng
            .policy_json(i as u32)
            .and_then(|j| serde_json::from_str::<serde_json::Value>(&j).ok())
            .and_then(|j| j.get("hedge").cloned());
        match &hedge {
            Some(h) => outln!(
                "    hedged               {} attempts at most (preset {}, delay {}), per-attempt timeout {timeout}, deadline {deadline}; never retried",
                h.get("attempts").and_then(serde_json::Value::as_u64).unwrap_or(0),
                h.get("preset").and_then(serde_json::Value::as_str).unwrap_or("?"),
                h.get("delay").and_then(serde_json::Value::as_str).unwrap_or("?"),
            ),
            None => outln!("    attempts             {} (at most), per-attempt timeout {timeout}, deadline {deadline}", info.max_attempts),
        }
        let cut =
            if hedge.is_none() && a.worst_attempts < info.max_attempts { " (even the shortest delays reach the deadline)" } else { "" };
        outln!("    worst-case attempts  {}{cut}", a.worst_attempts);
        match a.worst_latency {
            Some(l) => outln!(
                "    worst-case latency   {} (every attempt at its timeout, every delay at its longest, under the deadline)",
                human(l)
            ),
            None => outln!(
                "    worst-case latency   {} (no attempt-timeout and no deadline: a hung dependency hangs the caller)",
                style.yellow("unbounded")
            ),
        }
        outln!(
            "    amplification        {} on {} layer{} without a budget ({}^{})",
            fmt_x(a.amplification),
            args.layers,
            if args.layers == 1 { "" } else { "s" },
            a.worst_attempts,
            args.layers
        );
        if (a.amplification_with_budget - a.amplification).abs() > f64::EPSILON {
            outln!("                         {} with this policy's retry budget (long-run bound)", fmt_x(a.amplification_with_budget));
        } else if a.worst_attempts > 1 {
            outln!("                         {}", style.dim("no retry budget: add `budget: { kind: token }` to bound it"));
        }
        if !info.fallbacks.is_empty() {
            outln!("    fallbacks            {}", info.fallbacks.join(" -> "));
        }
        for o in &over {
            outln!("    {} {o}", style.yellow("over threshold:"));
        }
        if let Some(d) = defaults {
            let pretty = serde_json::to_string_pretty(&d).unwrap_or_default();
            outln!("    with every default filled in:");
            for line in pretty.lines() {
                outln!("      {line}");
            }
        }
    }
    if args.json {
        outln!("{}", serde_json::json!({"file": name, "valid": true, "errors": errors, "policies": policies}));
    }
    code
}

/// `27x`, `1.331x`.
pub fn fmt_x(v: f64) -> String {
    if v.is_finite() && v == v.trunc() && v.abs() < 1e15 {
        format!("{}x", v as i64)
    } else if v.is_finite() && v.abs() < 1e15 {
        let s = format!("{v:.3}");
        let s = s.trim_end_matches('0').trim_end_matches('.');
        format!("{s}x")
    } else {
        format!("{v:e}x")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(json: bool) -> CheckArgs {
        CheckArgs { files: Vec::new(), layers: 3, json, show_defaults: false, max_amplification: None, max_latency: None }
    }

    #[test]
    fn every_policy_is_analysed() {
        let doc = "policies:\n  a: { attempts: 4294967295 }\n  b: { attempts: 5, deadline: 10s }\n";
        let mut eng = engine::load(doc, 0).unwrap_or_else(|e| panic!("{e:?}"));
        let reports = analyse(&mut eng, 3).unwrap_or_else(|e| panic!("{e}"));
        let names: Vec<&str> = reports.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        let attempts: Vec<u32> = reports.iter().filter_map(|r| r.result.as_ref().ok()).map(|(_, a)| a.worst_attempts).collect();
        assert_eq!(attempts, [u32::MAX, 5]);
    }

    #[test]
    fn a_failed_analysis_is_an_error_not_an_empty_report() {
        // An engine whose every query traps: before, `check` printed "valid (0 policies)"
        // and exited 0.
        let limits = levee::Limits { call_ticks: 0, ..levee::Limits::default() };
        let mut eng =
            Engine::load_with(levee::Backend::Wasm, "policies:\n  a: { attempts: 3 }\n", 0, limits).unwrap_or_else(|e| panic!("{e:?}"));
        assert!(analyse(&mut eng, 3).is_err());
        for json in [false, true] {
            assert_eq!(report_policies(&mut eng, "t.yaml", &args(json), Style::new(crate::term::ColorChoice::Never)), EXIT_INVALID);
        }
    }
}
