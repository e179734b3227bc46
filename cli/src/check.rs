//! `levee check`: validate documents and print each policy's worst cases.

use std::path::PathBuf;

use crate::engine::{self, human, Engine};
use crate::term::Style;

/// Exit code: every document is valid and within the thresholds.
pub const EXIT_OK: i32 = 0;
/// Exit code: a document is invalid (or unreadable).
pub const EXIT_INVALID: i32 = 1;
// Exit code 2 (the command line is wrong) is clap's own.
/// Exit code: every document is valid but a policy exceeds `--max-amplification` or `--max-latency`.
pub const EXIT_THRESHOLD: i32 = 3;

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
pub fn run(args: &CheckArgs, style: Style) -> i32 {
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

fn check_file(file: &PathBuf, args: &CheckArgs, style: Style) -> i32 {
    let name = file.display().to_string();
    let text = match read(file) {
        Ok(t) => t,
        Err(e) => {
            if args.json {
                println!("{}", serde_json::json!({"file": name, "valid": false, "errors": [{"path": "", "message": e}]}));
            } else {
                eprintln!("{} {e}", style.red("error:"));
            }
            return EXIT_INVALID;
        }
    };
    let mut eng = match engine::load(&text, 0) {
        Ok(e) => e,
        Err(errors) => {
            if args.json {
                let errs: Vec<_> = errors.iter().map(|e| serde_json::json!({"path": e.path, "message": e.message})).collect();
                println!("{}", serde_json::json!({"file": name, "valid": false, "errors": errs}));
            } else {
                println!("{}: {} ({} error{})", name, style.red("invalid"), errors.len(), if errors.len() == 1 { "" } else { "s" });
                for e in &errors {
                    let path = if e.path.is_empty() { "(document)" } else { e.path.as_str() };
                    println!("  {} {}: {}", style.red("error"), style.bold(path), e.message);
                }
            }
            return EXIT_INVALID;
        }
    };
    report_policies(&mut eng, &name, args, style)
}

fn report_policies(eng: &mut Engine, name: &str, args: &CheckArgs, style: Style) -> i32 {
    let mut code = EXIT_OK;
    let mut policies = Vec::new();
    if !args.json {
        let n = eng.policy_count();
        println!("{}: {} ({} polic{})", name, style.green("valid"), n, if n == 1 { "y" } else { "ies" });
    }
    for i in 0..eng.policy_count() {
        let (Some(info), Some(a)) = (eng.policy_info(i), eng.analyze(i, args.layers)) else { continue };
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
        if !over.is_empty() {
            code = EXIT_THRESHOLD;
        }
        let defaults: Option<serde_json::Value> =
            if args.show_defaults { eng.policy_json(i).and_then(|j| serde_json::from_str(&j).ok()) } else { None };
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
            }));
            continue;
        }
        println!("  {} {}", style.bold("policy"), style.bold(&info.name));
        let timeout = if info.attempt_timeout == 0 { "none".to_string() } else { human(info.attempt_timeout) };
        let deadline = if info.deadline == 0 { "none".to_string() } else { human(info.deadline) };
        println!("    attempts             {} (at most), per-attempt timeout {timeout}, deadline {deadline}", info.max_attempts);
        let cut = if a.worst_attempts < info.max_attempts { " (the deadline cuts it short)" } else { "" };
        println!("    worst-case attempts  {}{cut}", a.worst_attempts);
        match a.worst_latency {
            Some(l) => {
                println!("    worst-case latency   {} (every attempt at its timeout, plus capped backoff, under the deadline)", human(l))
            }
            None => println!(
                "    worst-case latency   {} (no attempt-timeout and no deadline: a hung dependency hangs the caller)",
                style.yellow("unbounded")
            ),
        }
        println!(
            "    amplification        {} on {} layer{} without a budget ({}^{})",
            fmt_x(a.amplification),
            args.layers,
            if args.layers == 1 { "" } else { "s" },
            a.worst_attempts,
            args.layers
        );
        if (a.amplification_with_budget - a.amplification).abs() > f64::EPSILON {
            println!("                         {} with this policy's retry budget (long-run bound)", fmt_x(a.amplification_with_budget));
        } else if a.worst_attempts > 1 {
            println!("                         {}", style.dim("no retry budget: add `budget: { kind: token }` to bound it"));
        }
        if !info.fallbacks.is_empty() {
            println!("    fallbacks            {}", info.fallbacks.join(" -> "));
        }
        for o in &over {
            println!("    {} {o}", style.yellow("over threshold:"));
        }
        if let Some(d) = defaults {
            let pretty = serde_json::to_string_pretty(&d).unwrap_or_default();
            println!("    with every default filled in:");
            for line in pretty.lines() {
                println!("      {line}");
            }
        }
    }
    if args.json {
        println!("{}", serde_json::json!({"file": name, "valid": true, "policies": policies}));
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
