//! The bulkhead queue's host half (docs/policy.md, "The queue"; docs/hosts.md): a call the core
//! queues (a `wait` verdict with reason `bulkhead-full`) is *parked* until the verdict's payload
//! has elapsed **or** this host reports or cancels an attempt of the same policy and key,
//! whichever comes first; then it acquires again, and the core decides who gets the slot.
//!
//! - A park is registered under the engine's lock, in the crossing that queued the call, and
//!   a wake is registered under that lock in the crossing that reports or cancels, so no
//!   wake-up is lost between the two and none reaches a call queued after the crossing.
//! - The cost is constant per park, per wake and per woken call, whatever the length of the
//!   queue: each queue (policy and key) has a wake epoch and a [`Notify`]. A wake bumps the
//!   epoch (O(1), under the engine's lock) and, after the lock is released, notifies the
//!   queue's registered futures (each is one waker call, no search); a parked call was woken
//!   when the epoch moved past the one it parked at. Nothing scans the waiters to find one, and
//!   a park ends (woken, timed out or dropped) by decrementing a count.
//! - A success the hot path would hold back for the next `start` frees its slot only when it is
//!   settled, so while any call is parked no success is held back (see
//!   [`crate::runtime`]'s `HeldSlot`): it is reported at once, and its report wakes the queue.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use crate::runtime::HeldSlot;

/// The calls parked in one bulkhead queue: one policy (its index) and one key.
pub(crate) struct Queue {
    policy: u32,
    key: Box<str>,
    /// Bumped by every wake, under the engine's lock.
    epoch: AtomicU64,
    /// Wakes the futures of [`Parker::woken`] after a bump.
    notify: Notify,
    /// The parks of this queue not yet over (changed under the registry's lock).
    parked: AtomicUsize,
}

impl Queue {
    /// Tell the parked calls of this queue to look at its epoch (after the engine's lock is
    /// released: each is one waker call).
    pub(crate) fn notify(&self) {
        self.notify.notify_waiters();
    }
}

/// The queues with calls parked in them, by key, then policy (a key seldom has more than one
/// policy). Empty when nothing is parked.
#[derive(Default)]
pub(crate) struct Parked {
    queues: Mutex<HashMap<Box<str>, Vec<Arc<Queue>>>>,
}

impl Parked {
    fn queues(&self) -> std::sync::MutexGuard<'_, HashMap<Box<str>, Vec<Arc<Queue>>>> {
        self.queues.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Park a call in the queue of (`policy`, `key`): under the engine's lock, in the crossing
    /// that queued it. The park lasts until the [`Parker`] is dropped.
    pub(crate) fn join(&self, policy: u32, key: &str) -> (Arc<Queue>, u64) {
        let mut queues = self.queues();
        let list = match queues.get_mut(key) {
            Some(list) => list,
            None => queues.entry(Box::from(key)).or_default(),
        };
        let queue = match list.iter().find(|q| q.policy == policy) {
            Some(q) => q.clone(),
            None => {
                let q = Arc::new(Queue {
                    policy,
                    key: Box::from(key),
                    epoch: AtomicU64::new(0),
                    notify: Notify::new(),
                    parked: AtomicUsize::new(0),
                });
                list.push(q.clone());
                q
            }
        };
        queue.parked.fetch_add(1, Ordering::Relaxed);
        // Read under the engine's lock, like every bump: a wake registered before this park
        // is not this call's.
        let epoch = queue.epoch.load(Ordering::Relaxed);
        (queue, epoch)
    }

    /// Wake every call parked in the queue of (`policy`, `key`): under the engine's lock, in the
    /// crossing that reported or cancelled. The queue returned is to be
    /// [notified](Queue::notify) once the lock is released (`None`: nobody is parked there).
    pub(crate) fn wake(&self, policy: u32, key: &str) -> Option<Arc<Queue>> {
        let queues = self.queues();
        let queue = queues.get(key)?.iter().find(|q| q.policy == policy)?.clone();
        drop(queues);
        queue.epoch.fetch_add(1, Ordering::Release);
        Some(queue)
    }

    /// A park in `queue` is over (woken, timed out, or its call dropped).
    fn leave(&self, queue: &Arc<Queue>) {
        let mut queues = self.queues();
        if queue.parked.fetch_sub(1, Ordering::Relaxed) != 1 {
            return;
        }
        // The last one: forget the queue (a later park makes a new one).
        if let Some(list) = queues.get_mut(&*queue.key) {
            list.retain(|q| !Arc::ptr_eq(q, queue));
            if list.is_empty() {
                queues.remove(&*queue.key);
            }
        }
    }

    /// Calls parked, all queues (for tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.queues().values().flatten().map(|q| q.parked.load(Ordering::Relaxed)).sum()
    }
}

/// One parked call. Dropping it ends the park (the call was woken, its wait elapsed, or the
/// call itself was dropped): the registry forgets it, then `held` counts it out.
pub(crate) struct Parker<'a> {
    parked: &'a Parked,
    held: &'a HeldSlot,
    queue: Arc<Queue>,
    epoch: u64,
}

impl<'a> Parker<'a> {
    /// The park `joined` ([`Parked::join`]) in `parked`, counted in `held` by the caller.
    pub(crate) fn new(parked: &'a Parked, held: &'a HeldSlot, (queue, epoch): (Arc<Queue>, u64)) -> Self {
        Parker { parked, held, queue, epoch }
    }

    /// Whether a wake was registered since the park.
    #[inline]
    fn was_woken(&self) -> bool {
        self.queue.epoch.load(Ordering::Acquire) != self.epoch
    }

    /// [`Parker::was_woken`], for the runtime's tests.
    #[cfg(test)]
    pub(crate) fn was_woken_for_tests(&self) -> bool {
        self.was_woken()
    }

    /// Completes once a report or cancel of the queue's policy and key has woken this call.
    pub(crate) async fn woken(&self) {
        loop {
            // Registered before the epoch is read: a bump after the read is notified to it
            // (`Notify::notify_waiters` reaches every future made before the call).
            let notified = self.queue.notify.notified();
            if self.was_woken() {
                return;
            }
            notified.await;
        }
    }
}

impl Drop for Parker<'_> {
    fn drop(&mut self) {
        self.parked.leave(&self.queue);
        self.held.unpark();
    }
}

impl std::fmt::Debug for Parker<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Parker").field("policy", &self.queue.policy).field("key", &self.queue.key).field("epoch", &self.epoch).finish()
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
    fn a_wake_reaches_the_calls_parked_before_it_in_its_queue_only() {
        let (parked, held) = (Parked::default(), HeldSlot::new());
        let park = |policy, key| {
            assert!(held.park().is_none());
            Parker::new(&parked, &held, parked.join(policy, key))
        };
        let a = park(0, "k");
        let other_key = park(0, "j");
        let other_policy = park(1, "k");
        assert_eq!(parked.len(), 3);
        let b = {
            let mut fa = std::pin::pin!(a.woken());
            assert!(!ready(&mut fa), "nothing woke it yet");
            let q = parked.wake(0, "k");
            // A call parked after the wake's crossing is not woken by it.
            let b = park(0, "k");
            q.iter().for_each(|q| q.notify());
            assert!(ready(&mut fa));
            b
        };
        assert!(!ready(&mut std::pin::pin!(b.woken())));
        assert!(!ready(&mut std::pin::pin!(other_key.woken())));
        assert!(!ready(&mut std::pin::pin!(other_policy.woken())));
        assert!(parked.wake(2, "k").is_none() && parked.wake(0, "none").is_none());
        assert_eq!(held.parked(), 4);
        drop((a, b, other_key, other_policy));
        assert_eq!((parked.len(), held.parked()), (0, 0));
        assert!(parked.queues().is_empty(), "a queue nobody waits in is forgotten");
    }

    #[test]
    fn a_wake_before_the_first_poll_is_not_lost() {
        let (parked, held) = (Parked::default(), HeldSlot::new());
        let _ = held.park();
        let a = Parker::new(&parked, &held, parked.join(3, ""));
        // Bumped and notified before the park's future exists: the epoch tells.
        if let Some(q) = parked.wake(3, "") {
            q.notify();
        }
        assert!(ready(&mut std::pin::pin!(a.woken())));
    }
}
