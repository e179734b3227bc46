//! Adaptive concurrency limits: a concurrency limit per policy and key that follows the
//! latency the host reports (`report`'s `elapsed`), like Netflix's concurrency-limits and
//! Envoy's adaptive concurrency filter.
//!
//! ```yaml
//! concurrency: { kind: adaptive, algorithm: gradient2, initial-limit: 20, min-limit: 1, max-limit: 200 }
//! ```
//!
//! The limit is enforced exactly as a bulkhead's `max-concurrent` (reason `bulkhead-full`):
//! an attempt starts only while fewer than `limit` attempts of the key are in flight, and its
//! slot is held only while it runs.
//!
//! # Samples
//! When an attempt that held a slot is reported, its outcome decides what the limit learns:
//!
//! | outcome | meaning for the limit |
//! |---|---|
//! | success, HTTP status, gRPC status (the dependency answered) | a latency sample of `elapsed` ns, with the key's in-flight count (this attempt included) |
//! | timeout | a *drop*: no latency sample; AIMD and Vegas decrease the limit, the gradients ignore it |
//! | connection error, error class | ignored (the latency of a failure to connect says nothing of queueing) |
//! | cancellation (`cancel`, an evicted call) | ignored |
//!
//! # Arithmetic
//! Every algorithm is written in integers (milli-units where a fraction is needed, `u128`
//! intermediates, division rounding down, integer square root), so the limit is the same in
//! every host and on every platform. Statistics are exact: a ring of the window's samples and
//! the nearest-rank percentile (`rank = ceil(p * n / 100)`, the `rank`-th smallest).
//!
//! * `gradient2` (Netflix `Gradient2Limit`): `estimate` in milli-units, `long` an average of
//!   the samples (plain mean of the first [`GRADIENT2_WARMUP`], then
//!   `long = (long * (W - 1) + 2 * rtt) / (W + 1)` for `long-window` W). A sample with
//!   in-flight < estimate / 2 is skipped (application-limited). If `long > 2 * rtt` then
//!   `long = long * 95 / 100` (recovery after a latency spike). `g = clamp(tolerance * long /
//!   rtt, 0.5, 1)`; `new = estimate * g + (g == 1 ? queue-size : 0)`; `estimate = estimate *
//!   (1 - smoothing) + new * smoothing`, clamped to `[min-limit, max-limit]`; the limit is its
//!   whole part. **Deviation:** Netflix adds `queue-size` whatever the gradient; here it is
//!   added only while the gradient is 1 (no queueing measured), so that the queue term cannot
//!   hold or grow the limit while latency is rising (concurrency-limits PR #134).
//! * `vegas` (Netflix `VegasLimit`): the first sample, or one below it, sets `noload`; every
//!   `probe-multiplier * limit` samples `noload` is reset to the current sample (Netflix
//!   jitters this probe at random; here it is exact). A drop: `L - lg`. Otherwise, skipped
//!   when in-flight * 2 < L; `lg = max(1, floor(log10 L))`, `alpha = 3 lg`, `beta = 6 lg`,
//!   `queue = ceil(L * (rtt - noload) / rtt)`; `queue <= lg`: `L + beta`; `queue < alpha`:
//!   `L + lg`; `queue > beta`: `L - lg`; else unchanged; clamped.
//! * `envoy-gradient` (Envoy's gradient controller): the limit starts pinned at
//!   `min-rtt-concurrency` while `min-rtt-samples` samples measure `minRTT` (their
//!   `percentile`); then the limit is `initial-limit` (later: the limit before the
//!   measurement) and samples collect in windows of `sample-interval`. A sample reported at
//!   or after its window's end first closes the window: `sample = percentile(window)`,
//!   `g = clamp(minRTT * (100 + buffer) / 100 / sample, 0.5, 2)` (in milli-units, rounded
//!   down), `L = floor(L * g + sqrt(L * g))`, clamped; the new sample opens the next window.
//!   A sample reported `min-rtt-interval` or more after the last measurement starts the next
//!   one. (Envoy runs these on timers; the core, which has no timer, runs them when a sample
//!   is reported, so a key that sees no traffic keeps its limit.)
//! * `aimd`: a drop, or a sample above `latency-threshold`: `L = max(min, floor(L *
//!   backoff-ratio))`; otherwise, when in-flight * 2 >= L, `L + 1`; clamped.
//!
//! The state (limit and algorithm state) is exported and imported with the rest of the
//! engine's state, and kept across a reload when the algorithm stays the same.

use crate::doc::{Fields, Value};
use crate::error::LoadError;
use crate::read::{choose, fraction, opt_duration, pairs, u32_at, u64_at, uint};
use crate::time::{format_duration, MILLISECOND, SECOND};

/// Default starting limit (Netflix's `initialLimit`).
pub const DEFAULT_INITIAL_LIMIT: u32 = 20;
/// Default lowest limit. Not the initial limit: Netflix's `minLimit` of 20 with an initial
/// limit of 20 means the limit can never drop below where it started.
pub const DEFAULT_MIN_LIMIT: u32 = 1;
/// Default highest limit of `gradient2` and `aimd` (Netflix's `maxConcurrency`).
pub const DEFAULT_MAX_LIMIT: u32 = 200;
/// Default highest limit of `vegas` (Netflix) and `envoy-gradient` (Envoy's `max_concurrency_limit`).
pub const DEFAULT_MAX_LIMIT_WIDE: u32 = 1000;
/// Largest limit accepted.
pub const MAX_LIMIT: u32 = 1_000_000;
/// Gradient2's default smoothing, in milli-units (0.2).
pub const GRADIENT2_SMOOTHING_MILLI: u64 = 200;
/// Gradient2's default queue size.
pub const GRADIENT2_QUEUE_SIZE: u32 = 4;
/// Gradient2's default long window, in samples.
pub const GRADIENT2_LONG_WINDOW: u32 = 600;
/// Gradient2's default tolerance, in milli-units (1.5).
pub const GRADIENT2_TOLERANCE_MILLI: u64 = 1500;
/// Samples the long average is a plain mean of before it becomes exponential (Netflix's warm-up).
pub const GRADIENT2_WARMUP: u32 = 10;
/// Vegas's default probe multiplier (`noload` is re-measured every multiplier x limit samples).
pub const VEGAS_PROBE_MULTIPLIER: u32 = 30;
/// Envoy's default window of samples (`concurrency_update_interval`).
pub const ENVOY_SAMPLE_INTERVAL: u64 = 100 * MILLISECOND;
/// Envoy's default percentile of a window (`sample_aggregate_percentile`).
pub const ENVOY_PERCENTILE: u32 = 50;
/// Envoy's default time between minRTT measurements (`min_rtt_calc_interval`).
pub const ENVOY_MIN_RTT_INTERVAL: u64 = 60 * SECOND;
/// Envoy's default samples of a minRTT measurement (`request_count`).
pub const ENVOY_MIN_RTT_SAMPLES: u32 = 50;
/// Envoy's default limit while minRTT is measured (`min_concurrency`); also its lowest limit.
pub const ENVOY_MIN_CONCURRENCY: u32 = 3;
/// Envoy's default buffer on minRTT, percent (`min_rtt_buffer`, 25%).
pub const ENVOY_BUFFER_PERCENT: u32 = 25;
/// Most samples a window keeps (a ring: the newest replace the oldest).
pub const MAX_WINDOW_SAMPLES: usize = 1024;
/// AIMD's default decrease factor, in milli-units (0.9).
pub const AIMD_BACKOFF_MILLI: u64 = 900;
/// AIMD's default latency above which a sample counts as a drop.
pub const AIMD_LATENCY_THRESHOLD: u64 = 5 * SECOND;

/// The algorithms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algorithm {
    /// Netflix Gradient2.
    Gradient2,
    /// Netflix Vegas.
    Vegas,
    /// Envoy's gradient controller.
    EnvoyGradient,
    /// Additive increase, multiplicative decrease.
    Aimd,
}

impl Algorithm {
    /// Every algorithm with its document name.
    pub const ALL: [(&'static str, Algorithm); 4] = [
        ("gradient2", Algorithm::Gradient2),
        ("vegas", Algorithm::Vegas),
        ("envoy-gradient", Algorithm::EnvoyGradient),
        ("aimd", Algorithm::Aimd),
    ];

    /// Name in documents.
    pub fn name(self) -> &'static str {
        Self::ALL.iter().find(|(_, a)| *a == self).map(|(n, _)| *n).unwrap_or("gradient2")
    }
}

/// Parameters of one algorithm.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Params {
    /// Gradient2.
    Gradient2 {
        /// Smoothing, milli-units.
        smoothing_milli: u64,
        /// Queue size.
        queue_size: u32,
        /// Long window, samples.
        long_window: u32,
        /// Tolerance, milli-units.
        tolerance_milli: u64,
    },
    /// Vegas.
    Vegas {
        /// Probe multiplier.
        probe_multiplier: u32,
    },
    /// Envoy's gradient controller.
    EnvoyGradient {
        /// Window length.
        sample_interval: u64,
        /// Percentile of a window and of a minRTT measurement.
        percentile: u32,
        /// Time between minRTT measurements.
        min_rtt_interval: u64,
        /// Samples of a minRTT measurement.
        min_rtt_samples: u32,
        /// Limit during a minRTT measurement.
        min_rtt_concurrency: u32,
        /// Buffer on minRTT, percent.
        buffer_percent: u32,
    },
    /// AIMD.
    Aimd {
        /// Decrease factor, milli-units.
        backoff_milli: u64,
        /// Latency above which a sample is a drop.
        latency_threshold: u64,
    },
}

/// Adaptive concurrency configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdaptiveCfg {
    /// Starting limit.
    pub initial_limit: u32,
    /// Lowest limit.
    pub min_limit: u32,
    /// Highest limit.
    pub max_limit: u32,
    /// The algorithm and its parameters.
    pub params: Params,
}

/// What the host observed of an attempt, as far as the limit is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signal {
    /// The dependency answered after `rtt` ns, with `in_flight` attempts running.
    Sample {
        /// Latency.
        rtt: u64,
        /// In-flight attempts of the key, this one included.
        in_flight: u32,
    },
    /// The attempt timed out.
    Drop,
}

/// Live limit state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limit {
    /// The limit (outside a minRTT measurement).
    pub limit: u32,
    /// The algorithm's state.
    pub algo: AlgoState,
}

/// An algorithm's state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AlgoState {
    /// Gradient2.
    Gradient2 {
        /// Estimated limit, milli-units.
        estimate_milli: u64,
        /// Long average latency, ns.
        long: u64,
        /// Samples averaged (saturating).
        samples: u32,
    },
    /// Vegas.
    Vegas {
        /// No-load latency, ns (0 before the first sample).
        noload: u64,
        /// Samples since `noload` was last reset.
        since_probe: u64,
    },
    /// Envoy's gradient controller.
    EnvoyGradient {
        /// Measured minRTT, ns (0 before the first measurement).
        min_rtt: u64,
        /// A minRTT measurement is under way (the limit is pinned).
        measuring: bool,
        /// When the next minRTT measurement is due.
        next_measure: u64,
        /// When the current window started.
        window_start: u64,
        /// Samples of the current window or measurement (a ring of at most [`MAX_WINDOW_SAMPLES`]).
        samples: Vec<u64>,
        /// Next slot of the ring once it is full.
        pos: u32,
    },
    /// AIMD (no state beyond the limit).
    Aimd,
}

const FIELDS_COMMON: &[&str] = &["kind", "algorithm", "initial-limit", "min-limit", "max-limit"];

fn milli(x: f64) -> u64 {
    (x * 1000.0).round() as u64
}

/// Parse `concurrency`.
pub(crate) fn parse(path: &str, v: &Value, errors: &mut Vec<LoadError>) -> Option<AdaptiveCfg> {
    let before = errors.len();
    let mut f = Fields::new(path, v, errors)?;
    match f.take("kind") {
        None => errors.push(LoadError::new(&f.path_of("kind"), "is required: `adaptive` (a fixed limit is `bulkhead`)")),
        Some(k) => {
            let _ = choose(&f.path_of("kind"), k, &[("adaptive", ())], errors);
        }
    }
    let algorithm = match f.take("algorithm") {
        None => Algorithm::Gradient2,
        Some(a) => choose(&f.path_of("algorithm"), a, &Algorithm::ALL, errors).unwrap_or(Algorithm::Gradient2),
    };
    let (default_max, default_min) = match algorithm {
        Algorithm::Gradient2 | Algorithm::Aimd => (DEFAULT_MAX_LIMIT, DEFAULT_MIN_LIMIT),
        Algorithm::Vegas => (DEFAULT_MAX_LIMIT_WIDE, DEFAULT_MIN_LIMIT),
        Algorithm::EnvoyGradient => (DEFAULT_MAX_LIMIT_WIDE, ENVOY_MIN_CONCURRENCY),
    };
    let initial_limit = uint(&mut f, "initial-limit", DEFAULT_INITIAL_LIMIT, 1, MAX_LIMIT, errors);
    let min_limit = uint(&mut f, "min-limit", default_min.min(initial_limit), 1, MAX_LIMIT, errors);
    let max_limit = uint(&mut f, "max-limit", default_max.max(initial_limit), 1, MAX_LIMIT, errors);
    if min_limit > initial_limit {
        errors.push(LoadError::new(&f.path_of("min-limit"), "must not be above initial-limit"));
    }
    if max_limit < initial_limit {
        errors.push(LoadError::new(&f.path_of("max-limit"), "must not be below initial-limit"));
    }
    let (params, own): (Params, &[&str]) = match algorithm {
        Algorithm::Gradient2 => (
            Params::Gradient2 {
                smoothing_milli: milli(fraction(&mut f, "smoothing", 0.2, 0.001, 1.0, errors)),
                queue_size: uint(&mut f, "queue-size", GRADIENT2_QUEUE_SIZE, 0, MAX_LIMIT, errors),
                long_window: uint(&mut f, "long-window", GRADIENT2_LONG_WINDOW, 1, 1_000_000, errors),
                tolerance_milli: milli(fraction(&mut f, "tolerance", 1.5, 1.0, 100.0, errors)),
            },
            &["smoothing", "queue-size", "long-window", "tolerance"],
        ),
        Algorithm::Vegas => (
            Params::Vegas { probe_multiplier: uint(&mut f, "probe-multiplier", VEGAS_PROBE_MULTIPLIER, 1, 1_000_000, errors) },
            &["probe-multiplier"],
        ),
        Algorithm::EnvoyGradient => {
            let sample_interval = opt_duration(&mut f, "sample-interval", errors, true).unwrap_or(ENVOY_SAMPLE_INTERVAL);
            let percentile = uint(&mut f, "percentile", ENVOY_PERCENTILE, 1, 100, errors);
            let min_rtt_interval = opt_duration(&mut f, "min-rtt-interval", errors, true).unwrap_or(ENVOY_MIN_RTT_INTERVAL);
            let min_rtt_samples = uint(&mut f, "min-rtt-samples", ENVOY_MIN_RTT_SAMPLES, 1, MAX_WINDOW_SAMPLES as u32, errors);
            let min_rtt_concurrency = uint(&mut f, "min-rtt-concurrency", ENVOY_MIN_CONCURRENCY, 1, MAX_LIMIT, errors);
            let buffer_percent = uint(&mut f, "buffer", ENVOY_BUFFER_PERCENT, 0, 1000, errors);
            (
                Params::EnvoyGradient {
                    sample_interval,
                    percentile,
                    min_rtt_interval,
                    min_rtt_samples,
                    min_rtt_concurrency,
                    buffer_percent,
                },
                &["sample-interval", "percentile", "min-rtt-interval", "min-rtt-samples", "min-rtt-concurrency", "buffer"],
            )
        }
        Algorithm::Aimd => (
            Params::Aimd {
                backoff_milli: milli(fraction(&mut f, "backoff-ratio", 0.9, 0.001, 0.999, errors)),
                latency_threshold: opt_duration(&mut f, "latency-threshold", errors, true).unwrap_or(AIMD_LATENCY_THRESHOLD),
            },
            &["backoff-ratio", "latency-threshold"],
        ),
    };
    let known: Vec<&str> = FIELDS_COMMON.iter().chain(own.iter()).copied().collect();
    f.finish(&known, errors);
    (errors.len() == before).then_some(AdaptiveCfg { initial_limit, min_limit, max_limit, params })
}

impl AdaptiveCfg {
    /// The algorithm.
    pub fn algorithm(&self) -> Algorithm {
        match self.params {
            Params::Gradient2 { .. } => Algorithm::Gradient2,
            Params::Vegas { .. } => Algorithm::Vegas,
            Params::EnvoyGradient { .. } => Algorithm::EnvoyGradient,
            Params::Aimd { .. } => Algorithm::Aimd,
        }
    }

    /// A fresh state.
    pub fn fresh(&self) -> Limit {
        let algo = match self.params {
            Params::Gradient2 { .. } => AlgoState::Gradient2 { estimate_milli: u64::from(self.initial_limit) * 1000, long: 0, samples: 0 },
            Params::Vegas { .. } => AlgoState::Vegas { noload: 0, since_probe: 0 },
            Params::EnvoyGradient { .. } => {
                AlgoState::EnvoyGradient { min_rtt: 0, measuring: true, next_measure: 0, window_start: 0, samples: Vec::new(), pos: 0 }
            }
            Params::Aimd { .. } => AlgoState::Aimd,
        };
        Limit { limit: self.initial_limit, algo }
    }

    /// The limit a fresh state admits under (what [`Limit::current`] answers for
    /// [`fresh`](Self::fresh)), without making one.
    pub fn fresh_current(&self) -> u32 {
        match self.params {
            Params::EnvoyGradient { min_rtt_concurrency, .. } => min_rtt_concurrency,
            _ => self.initial_limit,
        }
    }

    fn clamp(&self, l: u64) -> u32 {
        l.clamp(u64::from(self.min_limit), u64::from(self.max_limit)) as u32
    }

    /// As the policy's JSON shows it.
    pub(crate) fn to_json(&self) -> Value {
        let common = [
            ("kind", Value::from("adaptive")),
            ("algorithm", self.algorithm().name().into()),
            ("initial-limit", self.initial_limit.into()),
            ("min-limit", self.min_limit.into()),
            ("max-limit", self.max_limit.into()),
        ];
        let own: Vec<(&str, Value)> = match self.params {
            Params::Gradient2 { smoothing_milli, queue_size, long_window, tolerance_milli } => vec![
                ("smoothing", (smoothing_milli as f64 / 1000.0).into()),
                ("queue-size", queue_size.into()),
                ("long-window", long_window.into()),
                ("tolerance", (tolerance_milli as f64 / 1000.0).into()),
            ],
            Params::Vegas { probe_multiplier } => vec![("probe-multiplier", probe_multiplier.into())],
            Params::EnvoyGradient {
                sample_interval,
                percentile,
                min_rtt_interval,
                min_rtt_samples,
                min_rtt_concurrency,
                buffer_percent,
            } => vec![
                ("sample-interval", format_duration(sample_interval).into()),
                ("percentile", percentile.into()),
                ("min-rtt-interval", format_duration(min_rtt_interval).into()),
                ("min-rtt-samples", min_rtt_samples.into()),
                ("min-rtt-concurrency", min_rtt_concurrency.into()),
                ("buffer", buffer_percent.into()),
            ],
            Params::Aimd { backoff_milli, latency_threshold } => vec![
                ("backoff-ratio", (backoff_milli as f64 / 1000.0).into()),
                ("latency-threshold", format_duration(latency_threshold).into()),
            ],
        };
        Value::Map(common.into_iter().chain(own).map(|(k, v)| (k.to_string(), v)).collect())
    }

    /// Import exported state: kept (the limit clamped to this configuration's bounds) when
    /// the algorithm is the same, else a fresh state.
    pub(crate) fn import(&self, v: &Value, path: &str) -> Result<Limit, LoadError> {
        let algorithm =
            v.get("algorithm").and_then(Value::as_str).ok_or_else(|| LoadError::new(&format!("{path}.algorithm"), "is missing"))?;
        let limit = u32_at(v, "limit", path)?;
        let algo = match algorithm {
            "gradient2" => AlgoState::Gradient2 {
                estimate_milli: u64_at(v, "estimate_milli", path)?,
                long: u64_at(v, "long", path)?,
                samples: u32_at(v, "samples", path)?,
            },
            "vegas" => AlgoState::Vegas { noload: u64_at(v, "noload", path)?, since_probe: u64_at(v, "since_probe", path)? },
            "envoy-gradient" => {
                let samples: Vec<u64> = pairs(v.get("samples"), &format!("{path}.samples"), 1)?
                    .iter()
                    .map(|r| r.first().copied().unwrap_or(0).max(0) as u64)
                    .take(MAX_WINDOW_SAMPLES)
                    .collect();
                let pos = u32_at(v, "pos", path)?;
                AlgoState::EnvoyGradient {
                    min_rtt: u64_at(v, "min_rtt", path)?,
                    measuring: v.get("measuring").is_some_and(|m| matches!(m, Value::Bool(true))),
                    next_measure: u64_at(v, "next_measure", path)?,
                    window_start: u64_at(v, "window_start", path)?,
                    pos: if samples.is_empty() { 0 } else { pos % samples.len() as u32 },
                    samples,
                }
            }
            "aimd" => AlgoState::Aimd,
            _ => return Err(LoadError::new(&format!("{path}.algorithm"), "is not an adaptive algorithm")),
        };
        if algorithm != self.algorithm().name() {
            return Ok(self.fresh());
        }
        let mut out = Limit { limit: self.clamp(u64::from(limit)), algo };
        if let AlgoState::Gradient2 { estimate_milli, .. } = &mut out.algo {
            *estimate_milli = (*estimate_milli).clamp(u64::from(self.min_limit) * 1000, u64::from(self.max_limit) * 1000);
        }
        Ok(out)
    }
}

/// The `percentile`-th nearest-rank value of `samples` (0 when empty).
pub fn nearest_rank(samples: &[u64], percentile: u32) -> u64 {
    if samples.is_empty() {
        return 0;
    }
    let mut sorted = samples.to_vec();
    crate::order::sort(&mut sorted);
    let n = sorted.len() as u64;
    let rank = (u64::from(percentile.clamp(1, 100)) * n).div_ceil(100).clamp(1, n);
    sorted.get(rank as usize - 1).copied().unwrap_or(0)
}

/// `max(1, floor(log10 l))`, by counting digits.
fn log10_floor_at_least_1(l: u32) -> u64 {
    let mut digits = 0u64;
    let mut x = l;
    while x >= 10 {
        x /= 10;
        digits += 1;
    }
    digits.max(1)
}

fn push_ring(samples: &mut Vec<u64>, pos: &mut u32, rtt: u64) {
    if samples.len() < MAX_WINDOW_SAMPLES {
        samples.push(rtt);
    } else if let Some(slot) = samples.get_mut(*pos as usize) {
        *slot = rtt;
        *pos = ((*pos as usize + 1) % MAX_WINDOW_SAMPLES) as u32;
    }
}

impl Limit {
    /// The limit attempts are admitted under now.
    #[inline]
    pub fn current(&self, cfg: &AdaptiveCfg) -> u32 {
        match (&self.algo, &cfg.params) {
            (AlgoState::EnvoyGradient { measuring: true, .. }, Params::EnvoyGradient { min_rtt_concurrency, .. }) => *min_rtt_concurrency,
            _ => self.limit,
        }
    }

    /// Learn from one attempt's outcome at `now`.
    pub fn observe(&mut self, cfg: &AdaptiveCfg, signal: Signal, now: u64) {
        let l = u64::from(self.limit);
        match (&mut self.algo, &cfg.params) {
            (
                AlgoState::Gradient2 { estimate_milli, long, samples },
                Params::Gradient2 { smoothing_milli, queue_size, long_window, tolerance_milli },
            ) => {
                let Signal::Sample { rtt, in_flight } = signal else { return };
                let rtt = rtt.max(1);
                // Application-limited: the limit is not what holds the load back.
                if u64::from(in_flight) * 2000 < *estimate_milli {
                    return;
                }
                let w = u128::from(*long_window);
                *long = if *samples < GRADIENT2_WARMUP {
                    ((u128::from(*long) * u128::from(*samples) + u128::from(rtt)) / (u128::from(*samples) + 1)) as u64
                } else {
                    ((u128::from(*long) * (w - 1) + 2 * u128::from(rtt)) / (w + 1)) as u64
                };
                *samples = samples.saturating_add(1);
                if *long / 2 > rtt {
                    *long = (u128::from(*long) * 95 / 100) as u64;
                }
                let g = (u128::from(*tolerance_milli) * u128::from(*long) / u128::from(rtt)).clamp(500, 1000);
                let queue = if g == 1000 { u128::from(*queue_size) * 1000 } else { 0 };
                let new = u128::from(*estimate_milli) * g / 1000 + queue;
                let s = u128::from(*smoothing_milli);
                let smoothed = (u128::from(*estimate_milli) * (1000 - s) + new * s) / 1000;
                let lo = u128::from(cfg.min_limit) * 1000;
                let hi = u128::from(cfg.max_limit) * 1000;
                *estimate_milli = smoothed.clamp(lo, hi) as u64;
                self.limit = cfg.clamp(*estimate_milli / 1000);
            }
            (AlgoState::Vegas { noload, since_probe }, Params::Vegas { probe_multiplier }) => {
                let lg = log10_floor_at_least_1(self.limit);
                let (rtt, in_flight) = match signal {
                    Signal::Drop => {
                        self.limit = cfg.clamp(l.saturating_sub(lg));
                        return;
                    }
                    Signal::Sample { rtt, in_flight } => (rtt.max(1), in_flight),
                };
                *since_probe = since_probe.saturating_add(1);
                if *noload == 0 || rtt < *noload || *since_probe >= u64::from(*probe_multiplier) * l {
                    *noload = rtt;
                    *since_probe = 0;
                    return;
                }
                if u64::from(in_flight) * 2 < l {
                    return;
                }
                let queue = (u128::from(l) * u128::from(rtt - *noload)).div_ceil(u128::from(rtt)) as u64;
                let (alpha, beta) = (3 * lg, 6 * lg);
                let next = if queue <= lg {
                    l + beta
                } else if queue < alpha {
                    l + lg
                } else if queue > beta {
                    l.saturating_sub(lg)
                } else {
                    l
                };
                self.limit = cfg.clamp(next);
            }
            (
                AlgoState::EnvoyGradient { min_rtt, measuring, next_measure, window_start, samples, pos },
                Params::EnvoyGradient { sample_interval, percentile, min_rtt_interval, min_rtt_samples, buffer_percent, .. },
            ) => {
                let Signal::Sample { rtt, .. } = signal else { return };
                if *measuring {
                    push_ring(samples, pos, rtt);
                    if samples.len() >= *min_rtt_samples as usize {
                        *min_rtt = nearest_rank(samples, *percentile).max(1);
                        *measuring = false;
                        *next_measure = now.saturating_add(*min_rtt_interval);
                        *window_start = now;
                        samples.clear();
                        *pos = 0;
                    }
                    return;
                }
                if now >= window_start.saturating_add(*sample_interval) {
                    if !samples.is_empty() {
                        let sample = nearest_rank(samples, *percentile).max(1);
                        let g = (u128::from(*min_rtt) * u128::from(100 + *buffer_percent) * 10 / u128::from(sample)).clamp(500, 2000);
                        let lg = u128::from(l) * g; // milli-units
                        let headroom = (lg * 1000).isqrt();
                        self.limit = cfg.clamp(((lg + headroom) / 1000) as u64);
                        samples.clear();
                        *pos = 0;
                    }
                    *window_start = now;
                }
                push_ring(samples, pos, rtt);
                if now >= *next_measure {
                    *measuring = true;
                    samples.clear();
                    *pos = 0;
                }
            }
            (AlgoState::Aimd, Params::Aimd { backoff_milli, latency_threshold }) => {
                let next = match signal {
                    Signal::Sample { rtt, .. } if rtt > *latency_threshold => l * *backoff_milli / 1000,
                    Signal::Drop => l * *backoff_milli / 1000,
                    Signal::Sample { in_flight, .. } if u64::from(in_flight) * 2 >= l => l + 1,
                    Signal::Sample { .. } => l,
                };
                self.limit = cfg.clamp(next);
            }
            // A state of another algorithm (cannot happen: state is made and imported per configuration).
            _ => *self = cfg.fresh(),
        }
    }

    /// As exported state.
    pub(crate) fn to_json(&self, cfg: &AdaptiveCfg) -> Value {
        let mut entries: Vec<(String, Value)> =
            vec![("algorithm".to_string(), cfg.algorithm().name().into()), ("limit".to_string(), self.limit.into())];
        let own: Vec<(&str, Value)> = match &self.algo {
            AlgoState::Gradient2 { estimate_milli, long, samples } => {
                vec![("estimate_milli", (*estimate_milli).into()), ("long", (*long).into()), ("samples", (*samples).into())]
            }
            AlgoState::Vegas { noload, since_probe } => vec![("noload", (*noload).into()), ("since_probe", (*since_probe).into())],
            AlgoState::EnvoyGradient { min_rtt, measuring, next_measure, window_start, samples, pos } => vec![
                ("min_rtt", (*min_rtt).into()),
                ("measuring", (*measuring).into()),
                ("next_measure", (*next_measure).into()),
                ("window_start", (*window_start).into()),
                ("samples", Value::List(samples.iter().map(|s| Value::List(vec![(*s).into()])).collect())),
                ("pos", (*pos).into()),
            ],
            AlgoState::Aimd => Vec::new(),
        };
        entries.extend(own.into_iter().map(|(k, v)| (k.to_string(), v)));
        Value::Map(entries)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doc;

    fn cfg(text: &str) -> AdaptiveCfg {
        let v = doc::parse(text).unwrap_or(Value::Null);
        let mut errors = Vec::new();
        let c = parse("c", &v, &mut errors);
        assert!(errors.is_empty(), "{errors:?}");
        c.unwrap_or(AdaptiveCfg { initial_limit: 1, min_limit: 1, max_limit: 1, params: Params::Vegas { probe_multiplier: 1 } })
    }

    fn sample(rtt: u64, in_flight: u32) -> Signal {
        Signal::Sample { rtt, in_flight }
    }

    #[test]
    fn envoy_anchor_values() {
        const MS: u64 = MILLISECOND;
        for (rtt, want) in [(25 * MS, 57), (5 * MS, 214), (10 * MS, 136)] {
            let c = cfg("{ kind: adaptive, algorithm: envoy-gradient, initial-limit: 100, min-rtt-samples: 1 }");
            let mut l = c.fresh();
            assert_eq!(l.current(&c), 3, "pinned while minRTT is measured");
            l.observe(&c, sample(10 * MS, 1), 0);
            assert_eq!(l.current(&c), 100);
            l.observe(&c, sample(rtt, 1), MS);
            assert_eq!(l.current(&c), 100, "the window is still open");
            l.observe(&c, sample(rtt, 1), 100 * MS);
            assert_eq!(l.current(&c), want, "rtt {rtt}");
        }
    }

    #[test]
    fn vegas_steps() {
        let c = cfg("{ kind: adaptive, algorithm: vegas }");
        let mut l = c.fresh();
        l.observe(&c, sample(100, 10), 0);
        assert_eq!(l.limit, 20, "the first sample sets noload");
        l.observe(&c, sample(100, 10), 0);
        assert_eq!(l.limit, 26, "queue 0 <= lg: + beta (6)");
        l.observe(&c, sample(200, 13), 0);
        assert_eq!(l.limit, 25, "queue ceil(26 * 100 / 200) = 13 > beta: - lg");
        l.observe(&c, sample(105, 13), 0);
        assert_eq!(l.limit, 26, "queue ceil(25 * 5 / 105) = 2 < alpha: + lg");
        l.observe(&c, sample(110, 13), 0);
        assert_eq!(l.limit, 26, "queue ceil(26 * 10 / 110) = 3, from alpha to beta: unchanged");
        l.observe(&c, sample(105, 12), 0);
        assert_eq!(l.limit, 26, "app-limited: 12 * 2 < 26");
        l.observe(&c, Signal::Drop, 0);
        assert_eq!(l.limit, 25);
    }

    #[test]
    fn gradient2_steps_and_no_unbounded_queue_term() {
        let c = cfg("{ kind: adaptive, algorithm: gradient2 }");
        let mut l = c.fresh();
        l.observe(&c, sample(100, 5), 0);
        assert_eq!(l.algo, AlgoState::Gradient2 { estimate_milli: 20_000, long: 0, samples: 0 }, "app-limited");
        // Steady latency: g = 1, the queue term grows the estimate by 0.2 * 4 per sample.
        l.observe(&c, sample(100, 10), 0);
        assert_eq!(l.algo, AlgoState::Gradient2 { estimate_milli: 20_800, long: 100, samples: 1 });
        // Latency doubles: g = clamp(1.5 * long / rtt) where long = (100 + 200) / 2 = 150:
        // g = 1.125 -> 1: still no queueing by the tolerance.
        l.observe(&c, sample(200, 11), 0);
        assert_eq!(l.algo, AlgoState::Gradient2 { estimate_milli: 21_600, long: 150, samples: 2 });
        // Latency 400: long = (300 + 400) / 3 = 233, g = 1.5 * 233 / 400 = 0.873; no queue term:
        // 21600 * 0.8 + 21600 * 0.873 * 0.2 = 17280 + 3771 = 21051.
        l.observe(&c, sample(400, 11), 0);
        assert_eq!(l.algo, AlgoState::Gradient2 { estimate_milli: 21_051, long: 233, samples: 3 });
        assert_eq!(l.limit, 21);
        // Past the warm-up, latency rising tenfold: the long average follows slowly, the
        // gradient stays at 0.5, and the limit falls to the minimum (1), not to the initial 20.
        for _ in 0..20 {
            l.observe(&c, sample(100, 100), 0);
        }
        assert!(l.limit > 20, "{}", l.limit);
        for _ in 0..60 {
            l.observe(&c, sample(1_000, 100), 0);
        }
        assert_eq!(l.limit, 1);
    }

    #[test]
    fn aimd_steps() {
        let c = cfg("{ kind: adaptive, algorithm: aimd, initial-limit: 10 }");
        let mut l = c.fresh();
        l.observe(&c, sample(1, 5), 0);
        assert_eq!(l.limit, 11);
        l.observe(&c, sample(1, 4), 0);
        assert_eq!(l.limit, 11, "app-limited");
        l.observe(&c, Signal::Drop, 0);
        assert_eq!(l.limit, 9);
        l.observe(&c, sample(6 * SECOND, 9), 0);
        assert_eq!(l.limit, 8);
    }

    #[test]
    fn nearest_rank_is_exact() {
        assert_eq!(nearest_rank(&[], 50), 0);
        assert_eq!(nearest_rank(&[5], 50), 5);
        assert_eq!(nearest_rank(&[4, 1, 3, 2], 50), 2);
        assert_eq!(nearest_rank(&[4, 1, 3, 2], 51), 3);
        assert_eq!(nearest_rank(&[4, 1, 3, 2], 100), 4);
        assert_eq!(nearest_rank(&[4, 1, 3, 2], 1), 1);
    }

    #[test]
    fn parse_errors_and_defaults() {
        let mut errors = Vec::new();
        let v = doc::parse("{ algorithm: vegs, min-limit: 30 }").unwrap_or(Value::Null);
        assert_eq!(parse("c", &v, &mut errors), None);
        let paths: Vec<&str> = errors.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, ["c.kind", "c.algorithm", "c.min-limit"]);
        let c = cfg("{ kind: adaptive }");
        assert_eq!((c.initial_limit, c.min_limit, c.max_limit), (20, 1, 200));
        let e = cfg("{ kind: adaptive, algorithm: envoy-gradient }");
        assert_eq!((e.min_limit, e.max_limit), (3, 1000));
    }

    #[test]
    fn state_round_trips() {
        let c = cfg("{ kind: adaptive, algorithm: envoy-gradient, min-rtt-samples: 2 }");
        let mut l = c.fresh();
        l.observe(&c, sample(7, 1), 0);
        let back = c.import(&l.to_json(&c), "s");
        assert_eq!(back, Ok(l.clone()));
        let other = cfg("{ kind: adaptive, algorithm: vegas }");
        assert_eq!(other.import(&l.to_json(&c), "s"), Ok(other.fresh()));
    }
}
