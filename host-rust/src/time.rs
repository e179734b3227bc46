//! Time for the async handle: where the engine's `now` comes from, and what runs its timers
//! (attempt timeouts and the sleeps between attempts). Both always come from the same clock.
//!
//! - The default ([`Builder::clock`](crate::Builder::clock) not called): the CPU's invariant
//!   time-stamp counter (through `quanta`) for `now` and tokio's timers, the fastest pair for
//!   production. It does **not** follow `tokio::time::pause`.
//! - [`TokioClock`]: `now` is `tokio::time::Instant::now()` and the timers are tokio's, so a test
//!   under paused time (`#[tokio::test(start_paused = true)]`, or `tokio::time::pause()`, with
//!   tokio's `test-util` feature) drives the engine with `tokio::time::advance`; with nothing to
//!   do, a paused runtime jumps to the next timer, so sleeps and timeouts take no real time
//!   ([`TokioClock::paused`] ends them on the exact nanosecond, not tokio's millisecond).
//! - Any [`Clock`] of your own: `now` and `sleep_until` are both yours.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! // In a #[tokio::test(start_paused = true)] test:
//! let levee = levee::Levee::builder().seed(7).clock(levee::time::TokioClock::new()).load(
//!     "policies:\n  api:\n    attempts: 3\n    backoff: {kind: constant, base: 10s}\n",
//! )?;
//! // Two retries 10 s apart run at once in real time; the engine saw 20 s pass.
//! # Ok(()) }
//! ```

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A timer of a [`Clock`].
pub type Sleep = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// A monotonic clock and its timers, injected per handle with
/// [`Builder::clock`](crate::Builder::clock).
///
/// Every `now` the host passes the core, every attempt timeout and every sleep between
/// attempts comes from one `Clock`, so a clock that a test moves by hand moves all of them.
pub trait Clock: Send + Sync + 'static {
    /// Nanoseconds since an origin of the clock's choosing; never decreases.
    fn now(&self) -> u64;

    /// A future that completes once [`Clock::now`] has reached `at`.
    fn sleep_until(&self, at: u64) -> Sleep;

    /// Wall-clock seconds since the Unix epoch, for `Retry-After` HTTP-dates (default: the
    /// system's clock).
    fn unix_seconds(&self) -> u64 {
        system_unix_seconds()
    }
}

pub(crate) fn system_unix_seconds() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// tokio's clock: `tokio::time::Instant` for `now` and tokio's timers, so that paused time
/// (`tokio::time::pause`, `#[tokio::test(start_paused = true)]`) and `tokio::time::advance`
/// drive the engine. `now` counts from when the clock was made.
///
/// tokio's timers have a resolution of one millisecond: a sleep ends on the first whole
/// millisecond at or after its deadline, paused or not. [`TokioClock::paused`] ends sleeps on
/// their exact nanosecond under paused time (what the host scenarios need).
#[derive(Clone, Copy, Debug)]
pub struct TokioClock {
    origin: tokio::time::Instant,
    exact: bool,
}

impl TokioClock {
    /// A clock whose origin is now (tokio's `now`, paused or not).
    pub fn new() -> Self {
        TokioClock { origin: tokio::time::Instant::now(), exact: false }
    }

    /// For tests under paused time only: sleeps end on their exact nanosecond (the clock sleeps
    /// to within a millisecond of the deadline, then `tokio::time::advance`s the rest). Its
    /// sleeps panic when time is not paused.
    pub fn paused() -> Self {
        TokioClock { origin: tokio::time::Instant::now(), exact: true }
    }

    /// The tokio instant of a reading of [`Clock::now`].
    pub fn instant(&self, at: u64) -> tokio::time::Instant {
        self.origin + Duration::from_nanos(at)
    }
}

impl Default for TokioClock {
    fn default() -> Self {
        TokioClock::new()
    }
}

impl Clock for TokioClock {
    fn now(&self) -> u64 {
        tokio::time::Instant::now().saturating_duration_since(self.origin).as_nanos() as u64
    }

    fn sleep_until(&self, at: u64) -> Sleep {
        let target = self.instant(at);
        if !self.exact {
            return Box::pin(tokio::time::sleep_until(target));
        }
        Box::pin(async move {
            // tokio's timers end on a millisecond tick (up to two past the deadline here): sleep to
            // two milliseconds before, then
            // advance the paused clock by what is left.
            let early = target.checked_sub(Duration::from_millis(2)).unwrap_or(target);
            if tokio::time::Instant::now() < early {
                tokio::time::sleep_until(early).await;
            }
            let now = tokio::time::Instant::now();
            if now < target {
                tokio::time::advance(target - now).await;
            }
        })
    }
}

/// The clock a handle runs on (the default one inline, so the hot path makes no dynamic call).
pub(crate) enum EngineClock {
    /// The time-stamp counter for `now`, tokio's timers (by the time still to go, so that the
    /// two clocks need not share an origin).
    Tsc { source: quanta::Clock, origin: quanta::Instant },
    /// A clock injected by the user.
    Injected(Arc<dyn Clock>),
}

impl EngineClock {
    pub(crate) fn tsc() -> Self {
        let source = quanta::Clock::new();
        let origin = source.now();
        EngineClock::Tsc { source, origin }
    }

    /// The monotonic `now` the host passes the core, never 0 (so that `settle-at` and
    /// deadlines are never mistaken for "none").
    #[inline]
    pub(crate) fn now(&self) -> u64 {
        let t = match self {
            EngineClock::Tsc { source, origin } => source.now().saturating_duration_since(*origin).as_nanos() as u64,
            EngineClock::Injected(c) => c.now(),
        };
        t.saturating_add(1)
    }

    /// A timer that fires when [`EngineClock::now`] reaches `at`.
    pub(crate) fn sleep_until(&self, at: u64) -> Sleep {
        match self {
            EngineClock::Tsc { .. } => {
                let left = Duration::from_nanos(at.saturating_sub(self.now()));
                Box::pin(tokio::time::sleep_until(tokio::time::Instant::now() + left))
            }
            EngineClock::Injected(c) => c.sleep_until(at.saturating_sub(1)),
        }
    }

    /// [`EngineClock::sleep_until`], not boxed for the default clock: a per-attempt timeout
    /// held in the call's own future costs no allocation, and its timer entry shares the
    /// memory the task touches anyway.
    #[inline]
    pub(crate) fn timer_until(&self, at: u64) -> Timer {
        match self {
            EngineClock::Tsc { .. } => {
                let left = Duration::from_nanos(at.saturating_sub(self.now()));
                Timer::Tokio { sleep: tokio::time::sleep(left) }
            }
            EngineClock::Injected(c) => Timer::Boxed { sleep: c.sleep_until(at.saturating_sub(1)) },
        }
    }

    /// Wall-clock seconds, for `Retry-After` HTTP-dates.
    pub(crate) fn unix_seconds(&self) -> u64 {
        match self {
            EngineClock::Tsc { .. } => system_unix_seconds(),
            EngineClock::Injected(c) => c.unix_seconds(),
        }
    }
}

pin_project_lite::pin_project! {
    /// A timer of an [`EngineClock`] ([`EngineClock::timer_until`]).
    #[project = TimerProj]
    pub(crate) enum Timer {
        /// The default clock's: tokio's, inline.
        Tokio { #[pin] sleep: tokio::time::Sleep },
        /// An injected clock's.
        Boxed { sleep: Sleep },
    }
}

impl Future for Timer {
    type Output = ();

    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        match self.project() {
            TimerProj::Tokio { sleep } => sleep.poll(cx),
            TimerProj::Boxed { sleep } => sleep.as_mut().poll(cx),
        }
    }
}
