//! The bulkhead queue's host half (docs/policy.md, "The queue"; docs/hosts.md): a call the core
//! queues (a `wait` verdict with reason `bulkhead-full`) is *parked* until the verdict's payload
//! has elapsed **or** the core names it in `take-wakes` (it was granted a slot), whichever comes
//! first; then it acquires again. The core decides who gets a freed slot and names exactly
//! that call: nobody else is woken.
//!
//! - A park is registered under the engine's lock, in the crossing that queued the call, and
//!   the calls a crossing's verdict says were granted (its wakes bit, or any `cancel` or
//!   `report-attempt` while calls are parked) are taken and woken under that lock when the
//!   crossing's locked section ends, after its own park: so no wake is lost between the two,
//!   even the one that names the call its own verdict queued.
//! - The cost is constant per park and per wake, whatever the number of parked calls: the
//!   parks are a map from call id to the call's [`Park`]; a wake removes the entry and
//!   notifies that one future (one waker call). Nothing scans the waiters, and a park ends
//!   (woken, timed out or dropped) by removing its own entry.
//! - A success the hot path would hold back for the next `start` frees its slot only when it is
//!   settled, so while any call is parked no success is held back (see
//!   [`crate::runtime`]'s `HeldSlot`): it is reported at once, and its report grants the slot.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use crate::runtime::HeldSlot;

/// One parked call: woken once, by [`Parked::wake`].
pub(crate) struct Park {
    woken: AtomicBool,
    notify: Notify,
}

impl Park {
    /// Tell the parked call it was woken (after the engine's lock is released: one waker call;
    /// a permit is stored if its future has not been polled yet).
    pub(crate) fn notify(&self) {
        self.notify.notify_one();
    }
}

/// The parked calls, by call id. Empty when nothing is parked.
#[derive(Default)]
pub(crate) struct Parked {
    calls: Mutex<HashMap<u64, Arc<Park>>>,
}

impl Parked {
    fn calls(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Park>>> {
        self.calls.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Park `call`: under the engine's lock, in the crossing that queued it. The park lasts
    /// until the [`Parker`] is dropped.
    pub(crate) fn join(&self, call: u64) -> Arc<Park> {
        let park = Arc::new(Park { woken: AtomicBool::new(false), notify: Notify::new() });
        self.calls().insert(call, park.clone());
        park
    }

    /// Wake the parked calls among `calls` (the core's `take-wakes`, under the engine's lock);
    /// each woken park is pushed to `woken`, to be [notified](Park::notify) once the lock is
    /// released. A call not parked here (it already acquired, or ended) is ignored: the list is
    /// the guest's, and only a call this host parked can be woken.
    pub(crate) fn wake(&self, calls: &[u64], woken: &mut Vec<Arc<Park>>) {
        let mut map = self.calls();
        for call in calls {
            if let Some(park) = map.remove(call) {
                park.woken.store(true, Ordering::Release);
                woken.push(park);
            }
        }
    }

    /// The park of `call` is over (woken, timed out, or its call dropped).
    fn leave(&self, call: u64, park: &Arc<Park>) {
        let mut map = self.calls();
        if map.get(&call).is_some_and(|p| Arc::ptr_eq(p, park)) {
            map.remove(&call);
        }
    }

    /// Calls parked (for tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.calls().len()
    }
}

/// One parked call. Dropping it ends the park (the call was woken, its wait elapsed, or the
/// call itself was dropped): the registry forgets it, then `held` counts it out.
pub(crate) struct Parker<'a> {
    parked: &'a Parked,
    held: &'a HeldSlot,
    call: u64,
    park: Arc<Park>,
}

impl<'a> Parker<'a> {
    /// The park of `call`, `joined` ([`Parked::join`]) in `parked`, counted in `held` by the
    /// caller.
    pub(crate) fn new(parked: &'a Parked, held: &'a HeldSlot, call: u64, joined: Arc<Park>) -> Self {
        Parker { parked, held, call, park: joined }
    }

    /// Whether the core named this call since the park.
    #[inline]
    fn was_woken(&self) -> bool {
        self.park.woken.load(Ordering::Acquire)
    }

    /// [`Parker::was_woken`], for the runtime's tests.
    #[cfg(test)]
    pub(crate) fn was_woken_for_tests(&self) -> bool {
        self.was_woken()
    }

    /// Completes once the core has named this call (granted it a slot).
    pub(crate) async fn woken(&self) {
        loop {
            // Registered before the flag is read; `notify_one` also leaves a permit.
            let notified = self.park.notify.notified();
            if self.was_woken() {
                return;
            }
            notified.await;
        }
    }
}

impl Drop for Parker<'_> {
    fn drop(&mut self) {
        self.parked.leave(self.call, &self.park);
        self.held.unpark();
    }
}

impl std::fmt::Debug for Parker<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Parker").field("call", &self.call).field("woken", &self.was_woken()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::task::{Context, Poll, Waker};

    fn ready(f: &mut std::pin::Pin<&mut impl Future<Output = ()>>) -> bool {
        let mut cx = Context::from_waker(Waker::noop());
        f.as_mut().poll(&mut cx) == Poll::Ready(())
    }

    #[test]
    fn a_wake_reaches_the_named_calls_only() {
        let (parked, held) = (Parked::default(), HeldSlot::new());
        let park = |call| {
            assert!(held.park().is_none());
            Parker::new(&parked, &held, call, parked.join(call))
        };
        let (a, b, c) = (park(1), park(2), park(3));
        assert_eq!(parked.len(), 3);
        {
            let mut fa = std::pin::pin!(a.woken());
            assert!(!ready(&mut fa), "nothing woke it yet");
            let mut woken = Vec::new();
            // 9 is not parked here (it acquired already, or is another host's): ignored.
            parked.wake(&[3, 9, 1], &mut woken);
            assert_eq!(woken.len(), 2);
            woken.iter().for_each(|p| p.notify());
            assert!(ready(&mut fa));
        }
        assert!(ready(&mut std::pin::pin!(c.woken())));
        assert!(!ready(&mut std::pin::pin!(b.woken())), "2 was not named");
        assert_eq!(parked.len(), 1, "a woken park leaves the map at once");
        drop((a, b, c));
        assert_eq!((parked.len(), held.parked()), (0, 0));
    }

    #[test]
    fn a_wake_before_the_first_poll_is_not_lost() {
        let (parked, held) = (Parked::default(), HeldSlot::new());
        let _ = held.park();
        let a = Parker::new(&parked, &held, 5, parked.join(5));
        let mut woken = Vec::new();
        parked.wake(&[5], &mut woken);
        woken.iter().for_each(|p| p.notify());
        assert!(ready(&mut std::pin::pin!(a.woken())));
    }

    #[test]
    fn a_park_dropped_before_its_wake_is_forgotten_and_a_later_park_of_the_call_is_its_own() {
        let (parked, held) = (Parked::default(), HeldSlot::new());
        let _ = held.park();
        let first = Parker::new(&parked, &held, 7, parked.join(7));
        drop(first);
        assert_eq!(parked.len(), 0);
        let _ = held.park();
        let second = Parker::new(&parked, &held, 7, parked.join(7));
        let mut woken = Vec::new();
        parked.wake(&[7], &mut woken);
        assert_eq!(woken.len(), 1);
        assert!(second.was_woken());
    }
}
