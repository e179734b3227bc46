//! `levee`: check, explain and simulate Levee resilience policies.
//!
//! Every command drives the policy engine through the Rust host (see `engine.rs`).

#[macro_use]
mod out;
mod check;
mod durable;
mod engine;
mod explain;
mod grpc;
mod sim;
mod term;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use term::{ColorChoice, Style};

const AFTER_HELP: &str = "\
Policies are YAML or JSON documents (see docs/policy.md):

  policies:
    checkout:
      attempts: 3                 # counts the first call; 1 means no retry
      attempt-timeout: 2s
      deadline: 10s
      backoff: { kind: exponential, base: 100ms, cap: 2s, jitter: full }
      budget: { kind: token }     # gRPC A6 retry throttling
      breaker: { window: { kind: count, size: 20 }, minimum-calls: 10 }

Start here:
  levee check policy.yaml                       validate, worst cases, amplification
  levee explain policy.yaml --trace trace.jsonl every decision, with its reason
  levee simulate policy.yaml --scenario three-layer-outage
                                                27x load without budgets, and how far
                                                budgets and breakers cut it

Examples live in cli/examples/; docs/cli.md describes every command and the trace format.";

/// Check, explain and simulate Levee resilience policies.
///
/// Levee decides retries, backoff, budgets, circuit breakers, rate limits, deadlines and
/// fallbacks in one engine shared by every language. This tool runs that same engine on
/// your policy documents: before you deploy them (check), on what happened (explain) and on
/// what could happen (simulate).
#[derive(Parser, Debug)]
#[command(name = "levee", version, after_help = AFTER_HELP, max_term_width = 100)]
struct Cli {
    /// When to colour the output (auto: only on a terminal, and never with NO_COLOR set).
    #[arg(long, value_enum, default_value_t = ColorChoice::Auto, global = true)]
    color: ColorChoice,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum DurableCommand {
    /// The calls of the store in id order, with their next attempt and last error: 100 at a
    /// time unless --limit says otherwise, filtered by status, handler, policy and key.
    List {
        /// The store: an SQLite file written by a durable executor, or a PostgreSQL database
        /// (`postgres://...` or a conninfo such as "host=db dbname=app").
        #[arg(value_name = "STORE")]
        store: String,
        /// Only calls given up (dead) and records quarantined (--status dead,quarantined).
        #[arg(long, conflicts_with = "status")]
        dead: bool,
        /// Only these statuses (comma-separated): scheduled, running, done, dead, cancelled, quarantined.
        #[arg(long, value_name = "STATUS", value_delimiter = ',')]
        status: Vec<String>,
        /// Only calls of this handler.
        #[arg(long, value_name = "NAME")]
        handler: Option<String>,
        /// Only calls of this policy.
        #[arg(long, value_name = "NAME")]
        policy: Option<String>,
        /// Only calls of this key (the policy's per-key state).
        #[arg(long, value_name = "KEY")]
        key: Option<String>,
        /// Only calls with an id above this one: the next page.
        #[arg(long, value_name = "ID", default_value_t = 0)]
        after: i64,
        /// At most this many calls; 0 lists them all.
        #[arg(long, value_name = "N", default_value_t = 100)]
        limit: u64,
        /// One JSON object per call.
        #[arg(long)]
        json: bool,
    },
    /// How many calls the store holds in each status.
    Counts {
        #[arg(value_name = "STORE")]
        store: String,
        /// One JSON object.
        #[arg(long)]
        json: bool,
    },
    /// One call: its row and its record, decoded by the core.
    Show {
        #[arg(value_name = "STORE")]
        store: String,
        id: i64,
    },
    /// Give a dead or cancelled call a fresh set of attempts, due now, under the policy document.
    Retry {
        #[arg(value_name = "STORE")]
        store: String,
        id: i64,
        /// The policy document the workers run (the call's policy must be in it).
        #[arg(long, value_name = "POLICY")]
        policy: PathBuf,
    },
    /// Cancel a call that has not finished (an attempt running now has its outcome refused).
    Cancel {
        #[arg(value_name = "STORE")]
        store: String,
        id: i64,
    },
    /// Delete finished calls last written longer ago than a retention: done, dead and cancelled
    /// ones (or the statuses named), with their payloads and results. A call still scheduled or
    /// running, and a quarantined record, are never deleted.
    Prune {
        #[arg(value_name = "STORE")]
        store: String,
        /// The retention: calls last written at least this long ago go (such as 168h).
        #[arg(long, value_name = "DURATION")]
        older_than: String,
        /// Only these statuses (comma-separated): done, dead, cancelled.
        #[arg(long, value_name = "STATUS", value_delimiter = ',', default_values_t = ["done".to_string(), "dead".to_string(), "cancelled".to_string()])]
        status: Vec<String>,
    },
}

#[derive(Subcommand, Debug)]
enum ImportCommand {
    /// Read a gRPC service config (JSON) into a Levee policy document (YAML).
    ///
    /// One policy per method name of `methodConfig[].name`: `pkg.Svc-Method`, `pkg.Svc` (every
    /// method of the service) or `default` (every method). `retryPolicy` becomes attempts,
    /// backoff and retry-on; `hedgingPolicy` becomes hedge (A6's semantics); `timeout` the
    /// deadline; `retryThrottling` a token budget on every policy that retries or hedges.
    /// gRPC's limits apply as gRPC applies them (maxAttempts above 5 is 5, tokenRatio to 3
    /// decimals). What a policy cannot express is an error naming its JSON path, and the exit
    /// code is 1; what stays the channel's (waitForReady, message sizes, load balancing) is a
    /// note, written as a comment in the document.
    #[command(
        name = "grpc-service-config",
        after_help = "Examples:\n  levee import grpc-service-config service-config.json -o policies.yaml\n  levee import grpc-service-config - < service-config.json | levee check -"
    )]
    GrpcServiceConfig {
        /// The service config (JSON); `-` reads stdin.
        #[arg(value_name = "FILE")]
        file: PathBuf,
        /// Write the document here (default: stdout); the notes then go to stderr.
        #[arg(long, short, value_name = "OUT")]
        out: Option<PathBuf>,
    },
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Read and change a store of durable calls (docs/durable.md).
    #[command(
        subcommand,
        after_help = "Examples:\n  levee durable list calls.db\n  levee durable list --dead calls.db\n  levee durable list 'host=db dbname=app' --status scheduled --policy email --limit 20\n  levee durable counts calls.db\n  levee durable show calls.db 17\n  levee durable retry calls.db 17 --policy policies.yaml\n  levee durable cancel calls.db 18\n  levee durable prune calls.db --older-than 168h"
    )]
    Durable(DurableCommand),
    /// Validate policy documents and print each policy's worst cases.
    ///
    /// Prints every error with its field path (such as `policies.checkout.backoff.base`).
    /// For each policy: the worst-case number of attempts (each may fail at once, so only the
    /// shortest delays can make them fewer), the worst-case total latency (every attempt at
    /// its timeout, every delay at its longest, under the deadline) and the load
    /// amplification when LAYERS layers of services each run it: A^L without a budget, and
    /// the bound the policy's retry budget gives.
    ///
    /// Exit codes: 0 every document is valid (and within the thresholds); 1 a document is
    /// invalid or unreadable, or a policy could not be analysed; 2 wrong command line; 3
    /// valid, but a policy exceeds --max-amplification or --max-latency.
    #[command(
        after_help = "Examples:\n  levee check cli/examples/checkout.yaml\n  levee check --layers 4 --max-amplification 2 policies/*.yaml   # fail CI above 2x\n  levee check --json policy.yaml | jq .policies[0].worst_latency"
    )]
    Check {
        /// Policy documents (YAML or JSON); `-` reads stdin.
        #[arg(required = true, value_name = "POLICY")]
        files: Vec<PathBuf>,
        /// Layers of services running the policy, for the amplification figure.
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=64))]
        layers: u32,
        /// One JSON object per document on stdout instead of text.
        #[arg(long)]
        json: bool,
        /// Also print each policy with every default filled in.
        #[arg(long)]
        show_defaults: bool,
        /// Exit 3 when a policy's amplification (with its budget) exceeds this factor.
        #[arg(long, value_name = "FACTOR")]
        max_amplification: Option<f64>,
        /// Exit 3 when a policy's worst-case latency exceeds this duration (such as 5s), or is unbounded.
        #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
        max_latency: Option<u64>,
    },
    /// Replay a trace of (time, outcome) through the engine and print each decision.
    ///
    /// Prints every engine step (start, acquire, report, report-fallback) with the decision,
    /// its reason and the events it raised; --json prints one JSON object per step.
    ///
    /// The trace is JSON lines, one attempt per line, for example
    ///   {"at": "0ms", "outcome": "http:503"}
    ///   {"outcome": "http:429", "retry_after": "1"}
    ///   {"outcome": "success", "elapsed": "40ms"}
    /// `at` is when the attempt starts (default: as soon as the engine allows), `elapsed` how
    /// long it took, `call` which call it belongs to (default 1; a finished call's id starts a
    /// new call). Outcomes: success, timeout, connection-error, http:STATUS, grpc:CODE,
    /// error:CLASS. A line {"fallback": "ok"|"failed"} answers a fallback verdict.
    /// See docs/cli.md for every field.
    #[command(
        verbatim_doc_comment,
        after_help = "Examples:\n  levee explain cli/examples/checkout.yaml --trace cli/examples/flaky.jsonl\n  levee explain policy.yaml --trace - --json < trace.jsonl"
    )]
    Explain {
        /// The policy document (YAML or JSON).
        #[arg(value_name = "POLICY")]
        file: PathBuf,
        /// The trace (JSON lines); `-` reads stdin.
        #[arg(long, value_name = "TRACE")]
        trace: PathBuf,
        /// Which policy of the document (default: the first).
        #[arg(long, short)]
        policy: Option<String>,
        /// The engine's jitter seed: the same seed gives the same delays.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// JSON lines (one object per engine step, with its events) instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Run the engine against a simulated dependency in virtual time.
    ///
    /// Requests arrive at RATE per second (Poisson, seeded: the same seed gives the same run),
    /// pass through one layer of services (three for three-layer-outage), each running the
    /// policy with its own engine, and reach a simulated dependency. Nothing sleeps: a minute
    /// of traffic takes well under a second. Prints calls made, amplification, success rate,
    /// latency percentiles and breaker state over time, and writes an SVG chart of load and
    /// breaker state.
    ///
    /// Scenarios:
    ///   healthy             10-30 ms latency, 1% transient 503s (60 s)
    ///   outage              connections refused from 10 s to 40 s, then recovery (70 s)
    ///   slow                from 10 s to 40 s answers take 3x the attempt timeout (60 s)
    ///   rate-limit          the dependency serves 60/s, above that 429 + Retry-After: 1 (60 s)
    ///   three-layer-outage  3 layers over a dependency failing from 10 s to 40 s, run four
    ///                       times: retries only, + budget, + breaker, + both (70 s)
    ///   proxy-outage        an app over a proxy (Envoy with the Levee filter) over a service
    ///                       failing from 10 s to 40 s, both retrying, then coordinated: the
    ///                       app marks its attempts and the proxy adds none (70 s)
    ///   overload            a dependency of fixed capacity (8 servers, 10-30 ms each: 400/s)
    ///                       under load stepping from RATE/4 to RATE (200 to 800/s), run with a
    ///                       fixed bulkhead and with each adaptive concurrency limit (60 s)
    #[command(
        verbatim_doc_comment,
        after_help = "Examples:\n  levee simulate cli/examples/checkout.yaml --scenario three-layer-outage --svg out.svg\n  levee simulate policy.yaml --scenario outage --seed 7 --json > run.json\n  for s in healthy outage slow rate-limit; do levee simulate p.yaml --scenario $s; done"
    )]
    Simulate {
        /// The policy document (YAML or JSON).
        #[arg(value_name = "POLICY")]
        file: PathBuf,
        /// The scenario.
        #[arg(long, short, value_enum)]
        scenario: sim::Scenario,
        /// Which policy of the document (default: the first).
        #[arg(long, short)]
        policy: Option<String>,
        /// Seed of the arrivals, the dependency and the engine's jitter.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Requests per second arriving at the first layer (default 100; overload: 800, the
        /// peak of its steps).
        #[arg(long)]
        rate: Option<f64>,
        /// How long requests arrive (virtual time, such as 90s); default per scenario.
        #[arg(long, value_parser = parse_duration)]
        duration: Option<u64>,
        /// Where to write the SVG chart (default: levee-SCENARIO.svg).
        #[arg(long, value_name = "FILE")]
        svg: Option<PathBuf>,
        /// Write no chart.
        #[arg(long, conflicts_with = "svg")]
        no_svg: bool,
        /// A JSON report on stdout instead of text.
        #[arg(long)]
        json: bool,
        /// No progress indicator.
        #[arg(long, short)]
        quiet: bool,
    },
    /// Print the Envoy route `retry_policy` that matches a policy.
    ///
    /// Envoy's router makes the retries when the levee proxy-wasm filter runs a policy (see
    /// docs/envoy.md); no request header can carry a backoff, so the route must say it. This
    /// prints the route's `timeout` (the deadline) and `retry_policy`: retry_on and
    /// retriable_status_codes from the policy's classification, num_retries, per_try_timeout,
    /// retry_back_off and rate_limited_retry_back_off (Retry-After, up to retry-after.cap),
    /// with a `# note:` for anything Envoy cannot express exactly.
    #[command(after_help = "Examples:\n  levee envoy-config policy.yaml --policy checkout | sed 's/^/        /' >> envoy-route.yaml")]
    EnvoyConfig {
        /// The policy document (YAML or JSON).
        #[arg(value_name = "POLICY")]
        file: PathBuf,
        /// Which policy of the document (default: the first).
        #[arg(long, short)]
        policy: Option<String>,
    },
    /// Bring a policy in from another system's configuration (docs/grpc.md).
    #[command(subcommand)]
    Import(ImportCommand),
    /// Print the gRPC service config that makes a plain gRPC client follow a policy.
    ///
    /// For a channel without Levee's interceptor: gRPC's own retries (retryPolicy), hedging
    /// (hedgingPolicy), timeout and retryThrottling, as close to the policy as gRPC can say.
    /// The JSON goes to stdout; a `note:` on stderr for each thing gRPC cannot express
    /// (breakers, rate and concurrency limits, fallbacks, per-key state, per-attempt
    /// timeouts, other backoff kinds and jitters, the pushback cap). One policy (the first, or
    /// --policy) applies to every method; --all writes every policy for the methods its
    /// name stands for (`pkg.Svc-Method`, `pkg.Svc`, `default`, as `levee import
    /// grpc-service-config` names them). Exit 1 on an invalid document.
    #[command(
        after_help = "Examples:\n  levee grpc-config policy.yaml --policy checkout > service-config.json\n  levee grpc-config imported.yaml --all"
    )]
    GrpcConfig {
        /// The policy document (YAML or JSON); `-` reads stdin.
        #[arg(value_name = "POLICY")]
        file: PathBuf,
        /// Which policy of the document, for every method (default: the first).
        #[arg(long, short)]
        policy: Option<String>,
        /// Every policy of the document, each for the gRPC methods its name stands for.
        #[arg(long, conflicts_with = "policy")]
        all: bool,
    },
}

fn envoy_config(doc: &str, policy: Option<&str>) -> Result<String, String> {
    let engine = levee_core::Engine::load(doc, 0).map_err(|errors| {
        errors
            .iter()
            .map(|e| format!("{}: {}", if e.path.is_empty() { "(document)" } else { &e.path }, e.message))
            .collect::<Vec<_>>()
            .join("\n")
    })?;
    let index = match policy {
        Some(name) => engine.policy_index(name).ok_or_else(|| format!("the document has no policy `{name}`"))?,
        None => 0,
    };
    let p = engine.policy(index).ok_or_else(|| "the document names no policy".to_string())?;
    Ok(levee_proxy_wasm::envoy::route_yaml(p))
}

fn parse_duration(s: &str) -> Result<u64, String> {
    engine::parse_duration(s)
}

fn read(path: &PathBuf) -> Result<String, String> {
    if path.as_os_str() == "-" {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut s).map_err(|e| format!("cannot read stdin: {e}"))?;
        return Ok(s);
    }
    std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

fn fail(style: Style, msg: &str) -> u8 {
    errln!("{} {msg}", style.red("error:"));
    1
}

fn main() -> ExitCode {
    let code = run();
    ExitCode::from(out::exit_code(code))
}

fn run() -> u8 {
    let cli = Cli::parse();
    let style = Style::new(cli.color);
    match cli.command {
        Command::Durable(cmd) => {
            let result = match cmd {
                DurableCommand::List { store, dead, status, handler, policy, key, after, limit, json } => {
                    let statuses = if dead { vec!["dead".to_string(), "quarantined".to_string()] } else { status };
                    let filter = durable::Filter { statuses, handler, policy, key, after, limit };
                    durable::list(&store, &filter, json)
                }
                DurableCommand::Counts { store, json } => durable::counts(&store, json),
                DurableCommand::Show { store, id } => durable::show(&store, id),
                DurableCommand::Cancel { store, id } => durable::cancel(&store, id),
                DurableCommand::Prune { store, older_than, status } => durable::prune(&store, &older_than, &status),
                DurableCommand::Retry { store, id, policy } => read(&policy).and_then(|doc| durable::retry(&store, id, &doc)),
            };
            match result {
                Ok(lines) => {
                    for l in lines {
                        outln!("{l}");
                    }
                    0
                }
                Err(e) => fail(style, &e),
            }
        }
        Command::Check { files, layers, json, show_defaults, max_amplification, max_latency } => {
            let args = check::CheckArgs { files, layers, json, show_defaults, max_amplification, max_latency };
            check::run(&args, style)
        }
        Command::Explain { file, trace, policy, seed, json } => {
            let result = (|| {
                let doc = read(&file)?;
                let lines = explain::parse_trace(&read(&trace)?)?;
                explain::replay(&doc, policy.as_deref(), seed, &lines, json, style)
            })();
            match result {
                Ok(lines) => {
                    for l in lines {
                        outln!("{l}");
                    }
                    0
                }
                Err(e) => fail(style, &e),
            }
        }
        Command::Import(ImportCommand::GrpcServiceConfig { file, out }) => {
            let source = if file.as_os_str() == "-" {
                "(stdin)".to_string()
            } else {
                file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| file.display().to_string())
            };
            let text = match read(&file) {
                Ok(t) => t,
                Err(e) => return fail(style, &e),
            };
            match grpc::import(&text, &source) {
                Err(errors) => {
                    for e in &errors {
                        errln!("{} {e}", style.red("error:"));
                    }
                    1
                }
                Ok((document, names, notes)) => match out {
                    None => {
                        out!("{document}");
                        0
                    }
                    Some(path) => {
                        if let Err(e) = std::fs::write(&path, &document) {
                            return fail(style, &format!("cannot write {}: {e}", path.display()));
                        }
                        errln!("wrote {}: {} ({})", path.display(), plural(names.len(), "policy", "policies"), names.join(", "));
                        for n in &notes {
                            errln!("note: {n}");
                        }
                        0
                    }
                },
            }
        }
        Command::GrpcConfig { file, policy, all } => {
            match read(&file).map_err(|e| vec![e]).and_then(|doc| grpc::export(&doc, policy.as_deref(), all)) {
                Ok((json, notes)) => {
                    out!("{json}");
                    for n in &notes {
                        errln!("note: {n}");
                    }
                    0
                }
                Err(errors) => {
                    for e in &errors {
                        errln!("{} {e}", style.red("error:"));
                    }
                    1
                }
            }
        }
        Command::EnvoyConfig { file, policy } => match read(&file).and_then(|doc| envoy_config(&doc, policy.as_deref())) {
            Ok(yaml) => {
                out!("{yaml}");
                0
            }
            Err(e) => fail(style, &e),
        },
        Command::Simulate { file, scenario, policy, seed, rate, duration, svg, no_svg, json, quiet } => {
            let rate = rate.unwrap_or(if scenario == sim::Scenario::Overload { sim::OVERLOAD_RATE } else { 100.0 });
            if !(rate.is_finite() && rate > 0.0 && rate <= 100_000.0) {
                return fail(style, "--rate must be above 0 and at most 100000 requests per second");
            }
            let opts = sim::RunOptions {
                scenario,
                seed,
                rate,
                duration: duration.unwrap_or_else(|| scenario_default(scenario)),
                quiet: quiet || json,
            };
            if opts.duration == 0 || opts.duration > 3600 * 1_000_000_000 {
                return fail(style, "--duration must be above 0 and at most 1h");
            }
            let doc = match read(&file) {
                Ok(d) => d,
                Err(e) => return fail(style, &e),
            };
            let outcome = match sim::simulate(&doc, policy.as_deref(), &opts) {
                Ok(o) => o,
                Err(e) => return fail(style, &e),
            };
            if json {
                outln!("{}", sim::report_json(&outcome, &opts));
            } else {
                out!("{}", sim::report_text(&outcome, &opts, style));
            }
            if !no_svg {
                let path = svg.unwrap_or_else(|| PathBuf::from(format!("levee-{}.svg", scenario.name())));
                if let Err(e) = std::fs::write(&path, sim::chart(&outcome, &opts)) {
                    return fail(style, &format!("cannot write {}: {e}", path.display()));
                }
                if !json {
                    outln!("\nchart written to {}", path.display());
                }
            }
            0
        }
    }
}

fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

fn scenario_default(s: sim::Scenario) -> u64 {
    sim::default_duration(s)
}
