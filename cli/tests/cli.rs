//! The `levee` binary on real files: exit codes, output, determinism, and simulation results
//! checked against the analytic amplification.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

fn levee(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_levee")).args(args).env("NO_COLOR", "1").output().expect("run levee")
}

fn path(rel: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(rel).display().to_string()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("levee-cli-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn json_lines(o: &Output) -> Vec<Value> {
    stdout(o).lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l}: {e}"))).collect()
}

#[test]
fn check_valid_files_exit_0_with_worst_cases() {
    let o = levee(&["check", &path("examples/checkout.yaml"), &path("examples/retries-only.yaml")]);
    assert_eq!(o.status.code(), Some(0), "{}", stdout(&o));
    let out = stdout(&o);
    assert!(out.contains("checkout.yaml: valid (1 policy)"), "{out}");
    // 3 attempts at 2 s, and a server may ask (Retry-After) for up to 300 s before each
    // retry: the 10 s deadline is the bound.
    assert!(out.contains("worst-case latency   10s"), "{out}");
    assert!(out.contains("27x on 3 layers without a budget (3^3)"), "{out}");
    assert!(out.contains("1x with this policy's retry budget"), "{out}");
    assert!(out.contains("no retry budget"), "{out}");
}

#[test]
fn check_shows_a_hedged_policy_and_simulate_refuses_it() {
    let o = levee(&["check", &path("examples/hedged.yaml")]);
    assert_eq!(o.status.code(), Some(0), "{}", stdout(&o));
    let out = stdout(&o);
    assert!(out.contains("hedged               3 attempts at most (preset grpc, delay 50ms)"), "{out}");
    // The third hedge starts 100 ms after the first and runs to its 500 ms timeout.
    assert!(out.contains("worst-case latency   600ms"), "{out}");
    assert!(out.contains("27x on 3 layers without a budget (3^3)"), "{out}");
    let o = levee(&["simulate", &path("examples/hedged.yaml"), "--scenario", "healthy"]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("does not model hedged attempts"), "{err}");
}

#[test]
fn check_invalid_prints_every_error_with_its_path_and_exits_1() {
    let o = levee(&["check", &path("examples/invalid.yaml")]);
    assert_eq!(o.status.code(), Some(1));
    let out = stdout(&o);
    for p in ["policies.checkout.attempts:", "policies.checkout.backoff.base:", "policies.checkout.breaker.failure-rate:"] {
        assert!(out.contains(p), "missing {p} in {out}");
    }
    assert!(out.contains("(3 errors)"), "{out}");
    let o = levee(&["check", &path("tests/data/unknown-field.yaml")]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stdout(&o).contains("policies.a.retires"), "{}", stdout(&o));
    let o = levee(&["check", &path("tests/data/empty.yaml")]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stdout(&o).contains("policies"), "{}", stdout(&o));
}

#[test]
fn check_exit_codes_fit_scripts() {
    // A missing file is invalid input (1); a bad command line is clap's 2.
    assert_eq!(levee(&["check", "/nonexistent/levee.yaml"]).status.code(), Some(1));
    assert_eq!(levee(&["check"]).status.code(), Some(2));
    assert_eq!(levee(&["check", "--layers", "0", &path("examples/checkout.yaml")]).status.code(), Some(2));
    // Thresholds: 3 when a valid policy is over them.
    let plain = path("examples/retries-only.yaml");
    assert_eq!(levee(&["check", "--max-amplification", "2", &plain]).status.code(), Some(3));
    assert_eq!(levee(&["check", "--max-amplification", "27", &plain]).status.code(), Some(0));
    assert_eq!(levee(&["check", "--max-amplification", "2", &path("examples/checkout.yaml")]).status.code(), Some(0));
    assert_eq!(levee(&["check", "--max-latency", "10s", &path("examples/unbounded.yaml")]).status.code(), Some(3));
    assert_eq!(levee(&["check", "--max-latency", "10s", &path("examples/checkout.yaml")]).status.code(), Some(0));
    // Invalid wins over a threshold.
    let o = levee(&["check", "--max-amplification", "2", &plain, &path("examples/invalid.yaml")]);
    assert_eq!(o.status.code(), Some(1));
}

#[test]
fn check_json_matches_the_analysis() {
    let o = levee(&[
        "check",
        "--json",
        "--layers",
        "2",
        &path("tests/data/edge-json.json"),
        &path("tests/data/deadline-and-fast-failures.yaml"),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stdout(&o));
    let docs = json_lines(&o);
    assert_eq!(docs.len(), 2);
    let p = &docs[0]["policies"];
    assert_eq!(p[0]["name"], "one-shot");
    assert_eq!(p[0]["worst_attempts"], 1);
    assert_eq!(p[0]["amplification"], 1.0);
    assert_eq!(p[0]["worst_latency"], 500_000_000u64);
    assert_eq!(p[1]["amplification"], 16.0);
    // 4 attempts of 1 s and 3 delays of 100 ms.
    assert_eq!(p[1]["worst_latency"], 4_300_000_000u64);
    // Attempts of up to 1 s under a 2.5 s deadline: still 10 attempts in the worst case, for
    // each may fail at once (issue 14, item 5), and the latency is the deadline.
    let t = &docs[1]["policies"][0];
    assert_eq!(t["worst_attempts"], 10);
    assert_eq!(t["worst_latency"], 2_500_000_000u64);
    assert_eq!(t["amplification"], 100.0);
    assert_eq!(t["error"], Value::Null);
    assert_eq!(docs[1]["errors"], serde_json::json!([]));
    let o = levee(&["check", "--json", &path("examples/invalid.yaml")]);
    let d = &json_lines(&o)[0];
    assert_eq!(d["valid"], false);
    assert_eq!(d["errors"].as_array().map(Vec::len), Some(3));
    assert_eq!(d["errors"][0]["path"], "policies.checkout.attempts");
}

#[test]
fn check_show_defaults_prints_the_filled_policy() {
    let o = levee(&["check", "--show-defaults", &path("examples/retries-only.yaml")]);
    let out = stdout(&o);
    assert!(out.contains("with every default filled in"), "{out}");
    assert!(out.contains("\"retry-on\""), "{out}");
}

#[test]
fn explain_prints_each_decision_and_is_deterministic() {
    let args = ["explain", &path("examples/checkout.yaml"), "--trace", &path("examples/flaky.jsonl"), "--json", "--seed", "7"];
    let o = levee(&args);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    let steps = json_lines(&o);
    let kinds: Vec<&str> = steps.iter().map(|s| s["verdict"]["kind"].as_str().unwrap_or("")).collect();
    assert_eq!(
        kinds,
        [
            "attempt", "retry", "attempt", "retry", "attempt", "done", "attempt", "retry", "attempt", "retry", "attempt", "done",
            "attempt", "fail"
        ]
    );
    // Retry-After: 1 gives exactly a 1 s delay.
    assert_eq!(steps[7]["verdict"]["payload"], 1_000_000_000u64);
    assert_eq!(steps[7]["input"], "http 429 (Retry-After: 1)");
    // The 404 is never retried.
    assert_eq!(steps[13]["reason"], "non-retryable");
    // The timeout is reported after the attempt's timeout (2 s).
    assert_eq!(steps[9]["at"].as_u64().unwrap() - steps[8]["at"].as_u64().unwrap(), 2_000_000_000);
    // Events ride along.
    assert_eq!(steps[1]["events"][0]["kind"], "retry-scheduled");
    assert_eq!(stdout(&levee(&args)), stdout(&o), "same seed, same output");
    let text = stdout(&levee(&["explain", &path("examples/checkout.yaml"), "--trace", &path("examples/flaky.jsonl")]));
    assert!(text.contains("fail: non-retryable"), "{text}");
    assert!(text.contains("retry after 1s"), "{text}");
}

#[test]
fn explain_outage_opens_the_breaker_and_falls_back() {
    let o = levee(&["explain", &path("examples/checkout.yaml"), "--trace", &path("examples/outage.jsonl"), "--json"]);
    assert_eq!(o.status.code(), Some(0));
    let steps = json_lines(&o);
    let events: Vec<&Value> = steps.iter().filter_map(|s| s["events"].as_array()).flatten().collect();
    assert!(events.iter().any(|e| e["kind"] == "breaker-transition" && e["state_to"] == "open"));
    assert!(events.iter().any(|e| e["kind"] == "budget-refused"));
    assert!(steps.iter().any(|s| s["verdict"]["kind"] == "fallback" && s["reason"] == "breaker-open"));
    assert!(steps.iter().any(|s| s["op"] == "skip"));
    let last = steps.last().unwrap();
    assert_eq!(last["verdict"]["kind"], "done");
}

#[test]
fn explain_replays_overlapping_calls_in_time_order() {
    let o = levee(&["explain", &path("tests/data/overlap.yaml"), "--trace", &path("tests/data/overlap.jsonl"), "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    let steps = json_lines(&o);
    let times: Vec<u64> = steps.iter().filter_map(|s| s["at"].as_u64()).collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "time never goes back: {times:?}");
    const MS: u64 = 1_000_000;
    let of = |call: u64, op: &str| steps.iter().find(|s| s["call"] == call && s["op"] == op).unwrap_or_else(|| panic!("call {call} {op}"));
    // Call 2 starts at 100 ms, before the breaker opened: it is admitted and succeeds.
    assert_eq!((of(2, "start")["at"].as_u64(), of(2, "start")["verdict"]["kind"].as_str()), (Some(100 * MS), Some("attempt")));
    assert_eq!(of(2, "report")["verdict"]["kind"], "done");
    // The breaker opens at 570 ms, on call 3's failure; call 4 then finds it open.
    let opened = steps
        .iter()
        .find(|s| s["events"].as_array().is_some_and(|e| e.iter().any(|e| e["kind"] == "breaker-transition" && e["state_to"] == "open")))
        .expect("the breaker opens");
    assert_eq!((opened["call"].as_u64(), opened["at"].as_u64()), (Some(3), Some(570 * MS)));
    assert_eq!(of(4, "start")["reason"], "breaker-open");
    let text = stdout(&levee(&["explain", &path("tests/data/overlap.yaml"), "--trace", &path("tests/data/overlap.jsonl")]));
    let order: Vec<&str> = text.lines().filter_map(|l| l.trim_start().strip_prefix("t=")).collect();
    assert!(order.first().is_some_and(|l| l.starts_with("0 ")) && order.get(3).is_some_and(|l| l.contains("call 2")), "{text}");
}

#[test]
fn explain_rejects_bad_traces_with_the_line_number() {
    let o = levee(&["explain", &path("examples/checkout.yaml"), "--trace", &path("tests/data/bad-trace.jsonl")]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("trace line 2") && err.contains("teapot"), "{err}");
    let o = levee(&["explain", &path("examples/checkout.yaml"), "--trace", &path("examples/flaky.jsonl"), "--policy", "checkuot"]);
    assert_eq!(o.status.code(), Some(1));
    // Issue 14, item 19: an unknown name lists the document's policies.
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("no policy named `checkuot` in the document; did you mean `checkout`? (its policies: checkout)"), "{err}");
    let o = levee(&["simulate", &path("examples/checkout.yaml"), "--scenario", "healthy", "--policy", "nope", "--no-svg"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("(its policies: checkout)"));
    let o = levee(&["explain", &path("examples/invalid.yaml"), "--trace", &path("examples/flaky.jsonl")]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("policies.checkout.attempts"));
}

fn simulate(policy: &str, scenario: &str, extra: &[&str]) -> Value {
    let svg = tmp(&format!("{scenario}-{}.svg", policy.replace(['/', '.'], "_")));
    let mut args = vec!["simulate", policy, "--scenario", scenario, "--json", "--svg"];
    let svg_s = svg.display().to_string();
    args.push(&svg_s);
    args.extend_from_slice(extra);
    let o = levee(&args);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    let chart = std::fs::read_to_string(&svg).unwrap();
    assert!(chart.starts_with("<svg") && chart.trim_end().ends_with("</svg>"));
    assert!(chart.contains("<polyline"));
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    for r in v["runs"].as_array().unwrap() {
        assert_eq!(r["invalid"], 0, "no protocol errors");
    }
    v
}

#[test]
fn three_layer_outage_multiplies_to_a_pow_l_without_budgets() {
    let v = simulate(&path("examples/retries-only.yaml"), "three-layer-outage", &["--duration", "45s"]);
    assert_eq!(v["analytic"]["amplification"], 27.0);
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 4);
    assert_eq!(runs[0]["label"], "retries only");
    // Every request inside the outage makes exactly 3 x 3 x 3 dependency calls.
    assert_eq!(runs[0]["window_amplification"], 27.0);
    // A token budget holds each layer near 1 attempt per call; a breaker cuts below 1.
    let budget = runs[1]["window_amplification"].as_f64().unwrap();
    assert!(budget < 1.5, "budget {budget}");
    for r in &runs[2..] {
        let a = r["window_amplification"].as_f64().unwrap();
        assert!(a < 1.0, "{}: {a}", r["label"]);
        assert!(r["layers"][0]["transitions"].as_array().is_some_and(|t| !t.is_empty()));
    }
    // 4 attempts on 3 layers: 64.
    let v = simulate(&path("tests/data/four-plain.yaml"), "three-layer-outage", &["--duration", "30s", "--rate", "20"]);
    assert_eq!(v["analytic"]["amplification"], 64.0);
    assert_eq!(v["runs"][0]["window_amplification"], 64.0);
}

#[test]
fn single_layer_outage_matches_the_attempts() {
    let v = simulate(&path("examples/retries-only.yaml"), "outage", &["--duration", "45s", "--seed", "3"]);
    assert_eq!(v["analytic"]["amplification"], 3.0);
    assert_eq!(v["runs"][0]["window_amplification"], 3.0);
}

#[test]
fn simulations_repeat_with_the_same_seed() {
    let a = simulate(&path("examples/checkout.yaml"), "outage", &["--seed", "11"]);
    let b = simulate(&path("examples/checkout.yaml"), "outage", &["--seed", "11"]);
    let c = simulate(&path("examples/checkout.yaml"), "outage", &["--seed", "12"]);
    assert_eq!(a, b);
    assert_ne!(a["runs"][0]["load"], c["runs"][0]["load"]);
    // The breaker opens during the outage and closes after it.
    let strip = a["runs"][0]["layers"][0]["breaker"].as_str().unwrap().to_string();
    assert!(strip[..10].chars().all(|c| c == '.'), "{strip}");
    assert!(strip[12..38].contains('O'), "{strip}");
    assert!(strip[50..].chars().all(|c| c == '.'), "{strip}");
    // Every second in which the breaker went half-open shows it, however short the trial.
    let transitions = a["runs"][0]["layers"][0]["transitions"].as_array().unwrap();
    let half: Vec<u64> = transitions.iter().filter(|t| t[2] == "half-open").map(|t| t[0].as_u64().unwrap() / 1_000_000_000).collect();
    assert!(!half.is_empty(), "{transitions:?}");
    for s in half {
        assert_eq!(strip.as_bytes()[s as usize], b'h', "second {s} in {strip}");
    }
}

#[test]
fn healthy_slow_and_rate_limited_scenarios() {
    let v = simulate(&path("examples/retries-only.yaml"), "healthy", &["--duration", "20s"]);
    let r = &v["runs"][0];
    // 1% transient errors, 3 attempts: practically every request succeeds, with ~1% retries.
    assert!(r["success_rate"].as_f64().unwrap() > 0.999, "{r}");
    let amp = r["amplification"].as_f64().unwrap();
    assert!((1.0..1.05).contains(&amp), "{amp}");
    // Slow: answers take 3x the 5 s timeout, so every attempt inside the window times out.
    let v = simulate(&path("examples/retries-only.yaml"), "slow", &["--rate", "10"]);
    let r = &v["runs"][0];
    assert_eq!(r["window_amplification"], 3.0);
    assert!(r["latency"]["max"].as_u64().unwrap() >= 15_000_000_000);
    // Rate limited: Retry-After: 1 spaces the retries by a second at least.
    let v = simulate(&path("examples/retries-only.yaml"), "rate-limit", &["--duration", "20s"]);
    let r = &v["runs"][0];
    assert!(r["layers"][0]["retries"].as_u64().unwrap() > 0);
    assert!(r["latency"]["max"].as_u64().unwrap() >= 1_000_000_000);
}

#[test]
fn simulate_errors_and_help() {
    let o = levee(&["simulate", &path("examples/checkout.yaml"), "--scenario", "nope"]);
    assert_eq!(o.status.code(), Some(2));
    let o = levee(&["simulate", &path("examples/checkout.yaml"), "--scenario", "healthy", "--rate", "0", "--no-svg"]);
    assert_eq!(o.status.code(), Some(1));
    let o = levee(&["--help"]);
    assert_eq!(o.status.code(), Some(0));
    let help = stdout(&o);
    assert!(help.contains("levee check policy.yaml") && help.contains("three-layer-outage"), "{help}");
    let o = levee(&["simulate", "--help"]);
    assert!(stdout(&o).contains("rate-limit"));
}

fn tmp_policy(name: &str, text: &str) -> String {
    let p = tmp(name);
    std::fs::write(&p, text).unwrap();
    p.display().to_string()
}

#[test]
fn check_fails_fast_attempts_and_huge_attempts_are_reported_and_checked() {
    // Issue 14, item 5: 5 attempts, a 10 s deadline, no attempt timeout: 5 attempts, 125x.
    let p = tmp_policy("fail-fast.yaml", "policies:\n  p: { attempts: 5, deadline: 10s }\n");
    let o = levee(&["check", "--max-amplification", "2", &p]);
    assert_eq!(o.status.code(), Some(3), "{}", stdout(&o));
    assert!(stdout(&o).contains("worst-case attempts  5\n"), "{}", stdout(&o));
    assert!(stdout(&o).contains("125x on 3 layers"), "{}", stdout(&o));
    // Issue 14, item 4: attempts up to 2^32-1 were dropped from the report (the analysis ran
    // out of time in the engine) and the thresholds skipped, with exit 0.
    let p = tmp_policy("huge.yaml", "policies:\n  huge: { attempts: 4294967295, attempt-timeout: 1s, deadline: 1h }\n");
    let started = std::time::Instant::now();
    let o = levee(&["check", "--json", "--layers", "1", &p]);
    assert_eq!(o.status.code(), Some(0), "{}", stdout(&o));
    let d = &json_lines(&o)[0];
    assert_eq!(d["policies"][0]["name"], "huge");
    assert_eq!(d["policies"][0]["worst_attempts"], 4_294_967_295u64);
    assert_eq!(d["policies"][0]["worst_latency"], 3_600_000_000_000u64);
    assert_eq!(levee(&["check", "--max-amplification", "2", &p]).status.code(), Some(3));
    assert_eq!(levee(&["check", "--max-latency", "10s", &p]).status.code(), Some(3));
    assert!(started.elapsed() < std::time::Duration::from_secs(20), "{:?}", started.elapsed());
}

/// Run levee with stdout (or stderr) a pipe whose reading end is already closed.
fn closed_pipe(args: &[&str], close_stderr: bool) -> Output {
    use std::process::Stdio;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_levee"));
    cmd.args(args).env("NO_COLOR", "1").stdin(Stdio::null());
    if close_stderr {
        cmd.stdout(Stdio::null()).stderr(Stdio::piped());
    } else {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    }
    let mut child = cmd.spawn().expect("run levee");
    // Close the reading end before levee writes anything: every write gets EPIPE.
    if close_stderr {
        drop(child.stderr.take());
    } else {
        drop(child.stdout.take());
    }
    let status = child.wait().expect("levee ends");
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        std::io::Read::read_to_string(&mut e, &mut err).unwrap();
    }
    Output { status, stdout: Vec::new(), stderr: err.into_bytes() }
}

#[test]
fn a_closed_pipe_ends_output_quietly_with_the_commands_exit_code() {
    // Issue 14, item 6: `levee check FILE | head -1` panicked ("failed printing to stdout:
    // Broken pipe", exit 101).
    let checkout = path("examples/checkout.yaml");
    let cases: [(&[&str], i32); 6] = [
        (&["check", &checkout, &checkout, &checkout], 0),
        (&["check", "--json", "--show-defaults", &checkout], 0),
        (&["check", "--max-amplification", "2", &path("examples/retries-only.yaml")], 3),
        (&["check", &path("examples/invalid.yaml")], 1),
        (&["explain", &checkout, "--trace", &path("examples/outage.jsonl")], 0),
        (&["simulate", &checkout, "--scenario", "healthy", "--duration", "2s", "--no-svg", "--quiet"], 0),
    ];
    for (args, code) in cases {
        let o = closed_pipe(args, false);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(code), "{args:?}: {err}");
        assert!(!err.contains("panicked") && !err.contains("Broken pipe"), "{args:?}: {err}");
    }
    // stderr closed too: an unreadable file is still exit 1, without a panic.
    let o = closed_pipe(&["check", "/nonexistent/levee.yaml"], true);
    assert_eq!(o.status.code(), Some(1));
    let o = closed_pipe(&["explain", &checkout, "--trace", "/nonexistent/trace.jsonl"], true);
    assert_eq!(o.status.code(), Some(1));
}

#[test]
fn envoy_config_prints_the_route_retry_policy_of_the_document() {
    let doc = tmp("envoy.yaml");
    std::fs::write(
        &doc,
        "policies:\n  a: {}\n  edge:\n    attempts: 4\n    attempt-timeout: 300ms\n    deadline: 2s\n    backoff: { base: 25ms, cap: 250ms }\n    retry-on: [timeout, \"http:503\"]\n",
    )
    .expect("write");
    let out = levee(&["envoy-config", doc.to_str().expect("path"), "--policy", "edge"]);
    assert!(out.status.success(), "{out:?}");
    let y = stdout(&out);
    for want in [
        "timeout: 2s\n",
        "retry_policy:\n",
        "  retry_on: \"reset,retriable-status-codes\"\n",
        "  num_retries: 3\n",
        "  per_try_timeout: 0.3s\n",
        "  retriable_status_codes: [503]\n",
        "    base_interval: 0.025s\n",
        "    max_interval: 0.25s\n",
        "  rate_limited_retry_back_off:\n",
        "    - name: retry-after\n      format: SECONDS\n",
        "    max_interval: 300s\n",
    ] {
        assert!(y.contains(want), "{want:?} in\n{y}");
    }
    std::fs::write(&doc, "policies: { p: { atempts: 2 } }").expect("write");
    let out = levee(&["envoy-config", doc.to_str().expect("path")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("policies.p.atempts"), "{out:?}");
    let out = levee(&["envoy-config", doc.to_str().expect("path"), "--policy", "nope"]);
    assert_eq!(out.status.code(), Some(1));
}

#[test]
fn proxy_outage_shows_9x_without_coordination_and_3x_with_it() {
    let v = simulate(&path("examples/retries-only.yaml"), "proxy-outage", &["--duration", "45s", "--rate", "50"]);
    assert_eq!(v["analytic"]["amplification"], 9.0);
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    // 3 attempts at the application x 3 at the proxy, then 3 x 1 when the app marks its attempts.
    assert_eq!(runs[0]["window_amplification"], 9.0);
    assert_eq!(runs[1]["window_amplification"], 3.0);
    assert_eq!(runs[1]["layers"][1]["retries"], 0, "the proxy adds no retry to a marked request");
}

#[test]
fn overload_adaptive_limits_track_the_capacity_and_keep_latency_down() {
    let policy = path("examples/overload.yaml");
    let v = simulate(&policy, "overload", &["--duration", "40s"]);
    let servers = v["dependency"]["servers"].as_f64().unwrap();
    let runs = v["runs"].as_array().unwrap();
    let labels: Vec<&str> = runs.iter().map(|r| r["label"].as_str().unwrap()).collect();
    assert_eq!(labels.len(), 5, "{labels:?}");
    assert!(labels[0].contains("fixed bulkhead, max-concurrent 25"), "{labels:?}");
    let fixed = &runs[0]["peak"];
    assert_eq!(fixed["final_limit"], 25);
    let fixed_p99 = fixed["p99"].as_u64().unwrap();
    let peak = |label: &str| runs.iter().find(|r| r["label"] == label).map(|r| r["peak"].clone()).unwrap();
    for alg in ["gradient2", "vegas", "envoy-gradient"] {
        let p = peak(&format!("adaptive {alg}"));
        let limit = p["final_limit"].as_f64().unwrap();
        // The limit ends near the servers the dependency has, not at its initial 20 or its max.
        assert!(limit >= servers / 2.0 && limit <= servers * 3.0, "{alg}: limit {limit}");
        // The dependency stays busy: goodput near its capacity.
        let goodput = p["goodput"].as_f64().unwrap();
        assert!(goodput > 0.8 * v["dependency"]["capacity"].as_f64().unwrap(), "{alg}: goodput {goodput}");
    }
    // Fewer requests queue at the dependency: the fixed bulkhead's p99 is higher.
    for alg in ["vegas", "envoy-gradient"] {
        let p99 = peak(&format!("adaptive {alg}"))["p99"].as_u64().unwrap();
        assert!(fixed_p99 > p99, "{alg}: p99 {p99} vs fixed {fixed_p99}");
    }
    // AIMD decreases only on a drop or a sample above latency-threshold (5 s): with no
    // timeouts it climbs to its max-limit and the queue builds.
    assert_eq!(peak("adaptive aimd")["final_limit"], 200);
    assert!(peak("adaptive aimd")["p99"].as_u64().unwrap() > fixed_p99);
    // Deterministic: the same seed gives the same report.
    assert_eq!(v, simulate(&policy, "overload", &["--duration", "40s"]));
    // A policy that names its algorithm is compared with the fixed bulkhead only.
    let own = tmp("overload-own.yaml");
    std::fs::write(&own, "policies:\n  p:\n    attempts: 1\n    concurrency: { kind: adaptive, algorithm: vegas }\n").unwrap();
    let v = simulate(&own.display().to_string(), "overload", &["--duration", "20s", "--rate", "600"]);
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[1]["label"], "policy's adaptive limit, vegas");
    assert_eq!(runs[0]["peak"]["final_limit"], 25);
}

#[test]
fn import_grpc_service_config_writes_the_pinned_document_and_grpc_config_reads_it_back() {
    // The same text as the core's pinned conversion of A6's retry example.
    let input = path("../grpc/service-config/a6-retry.json");
    let o = levee(&["import", "grpc-service-config", &input]);
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    let pinned = std::fs::read_to_string(path("../grpc/service-config/a6-retry.levee.yaml")).unwrap();
    assert_eq!(stdout(&o), pinned);
    assert!(o.stderr.is_empty(), "{o:?}");
    // -o: the file, and a summary with the notes on stderr.
    let out = tmp("a6-retry.yaml");
    let o = levee(&["import", "grpc-service-config", &input, "-o", out.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    assert!(stdout(&o).is_empty());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("1 policy (levee.flaky.v1.Flaky-Unary)"), "{err}");
    assert!(err.contains("note: retryThrottling: gRPC keeps one token bucket per server"), "{err}");
    assert_eq!(std::fs::read_to_string(&out).unwrap(), pinned);
    // The document is a valid policy document.
    let o = levee(&["check", out.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stdout(&o));
    // And back: --all gives the pinned export; one policy applies to every method.
    let o = levee(&["grpc-config", out.to_str().unwrap(), "--all"]);
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    assert_eq!(stdout(&o), std::fs::read_to_string(path("../grpc/service-config/a6-retry.export.json")).unwrap());
    let o = levee(&["grpc-config", out.to_str().unwrap()]);
    let sc: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(sc["methodConfig"][0]["name"], serde_json::json!([{}]));
    assert_eq!(sc["methodConfig"][0]["retryPolicy"]["maxAttempts"], 4);
    // stdin works too.
    let mut child = Command::new(env!("CARGO_BIN_EXE_levee"))
        .args(["import", "grpc-service-config", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), std::fs::read(&input).unwrap().as_slice()).unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(stdout(&o).starts_with("# A Levee policy document imported from the gRPC service config (stdin)\n"), "{o:?}");
}

#[test]
fn import_grpc_service_config_errors_name_their_json_paths() {
    let bad = tmp("bad-service-config.json");
    std::fs::write(
        &bad,
        r#"{"methodConfig": [{"name": [{"method": "Get"}], "retryPolicy": {"maxAttempts": 1, "initialBackoff": "100ms", "maxBackoff": "1s", "backoffMultiplier": 2, "retryableStatusCodes": ["unavailable"]}}]}"#,
    )
    .unwrap();
    let o = levee(&["import", "grpc-service-config", bad.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stdout(&o).is_empty());
    let err = String::from_utf8_lossy(&o.stderr);
    for want in [
        "error: methodConfig[0].name[0]: gives a method without its service",
        "error: methodConfig[0].retryPolicy.maxAttempts: must be 2 or more",
        "error: methodConfig[0].retryPolicy.initialBackoff: `100ms` is not a gRPC duration",
        "error: methodConfig[0].retryPolicy.retryableStatusCodes[0]: `unavailable` is not a gRPC status name; gRPC writes it UNAVAILABLE",
    ] {
        assert!(err.contains(want), "{want:?} in\n{err}");
    }
    let o = levee(&["import", "grpc-service-config", "/nonexistent/sc.json"]);
    assert_eq!(o.status.code(), Some(1));
}

#[test]
fn grpc_config_prints_the_service_config_and_what_grpc_cannot_express() {
    let o = levee(&["grpc-config", &path("examples/checkout.yaml")]);
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    let sc: Value = serde_json::from_str(&stdout(&o)).unwrap();
    let mc = &sc["methodConfig"][0];
    assert_eq!(mc["name"], serde_json::json!([{}]));
    assert_eq!(mc["timeout"], "10s");
    assert_eq!(mc["retryPolicy"]["maxAttempts"], 3);
    assert_eq!(mc["retryPolicy"]["initialBackoff"], "0.1s");
    assert_eq!(sc["retryThrottling"], serde_json::json!({"maxTokens": 10, "tokenRatio": 0.1}));
    let err = String::from_utf8_lossy(&o.stderr);
    for want in [
        "note: policies.checkout.breaker: gRPC has no circuit breaker",
        "note: policies.checkout.fallbacks: gRPC has no fallbacks",
        "note: policies.checkout.attempt-timeout: 2s",
    ] {
        assert!(err.contains(want), "{want:?} in\n{err}");
    }
    // --all reads policy names as gRPC names: `checkout-v2`... is not one.
    let doc = tmp("not-grpc-names.yaml");
    std::fs::write(&doc, "policies:\n  payment-api-v2: {}\n").unwrap();
    let o = levee(&["grpc-config", doc.to_str().unwrap(), "--all"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("error: policies.payment-api-v2: is not a gRPC method name pattern"), "{o:?}");
    let o = levee(&["grpc-config", doc.to_str().unwrap(), "--policy", "nope"]);
    assert_eq!(o.status.code(), Some(1));
    let o = levee(&["grpc-config", &path("examples/invalid.yaml")]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("policies.checkout.attempts"), "{o:?}");
    let o = levee(&["grpc-config", doc.to_str().unwrap(), "--all", "--policy", "x"]);
    assert_eq!(o.status.code(), Some(2), "--all and --policy conflict");
}
