//! A sorted-vector map: the few operations the engine needs, with a fraction of a B-tree's
//! code size (the component's size budget) and no allocation on lookup.
//!
//! Keys per policy are bounded by `keys.max` and live calls arrive with mostly increasing
//! ids, so inserts are near the end and lookups are binary searches.

use std::borrow::Borrow;

/// A map kept as a vector sorted by key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct VecMap<K, V> {
    items: Vec<(K, V)>,
}

impl<K, V> Default for VecMap<K, V> {
    fn default() -> Self {
        VecMap { items: Vec::new() }
    }
}

impl<K: Ord, V> VecMap<K, V> {
    /// Where `key` is (`Ok`), or where it would be inserted (`Err`).
    pub(crate) fn find<Q: Ord + ?Sized>(&self, key: &Q) -> Result<usize, usize>
    where
        K: Borrow<Q>,
    {
        self.items.binary_search_by(|(k, _)| k.borrow().cmp(key))
    }

    pub(crate) fn get<Q: Ord + ?Sized>(&self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
    {
        self.find(key).ok().and_then(|i| self.items.get(i)).map(|(_, v)| v)
    }

    pub(crate) fn get_mut<Q: Ord + ?Sized>(&mut self, key: &Q) -> Option<&mut V>
    where
        K: Borrow<Q>,
    {
        let i = self.find(key).ok()?;
        self.items.get_mut(i).map(|(_, v)| v)
    }

    /// The value for `key`, inserting `make()` under `owned()` when absent.
    #[allow(clippy::indexing_slicing)] // `i` was found, or an element was just inserted at it.
    pub(crate) fn get_or_insert_with<Q: Ord + ?Sized>(&mut self, key: &Q, owned: impl FnOnce() -> K, make: impl FnOnce() -> V) -> &mut V
    where
        K: Borrow<Q>,
    {
        let i = self.position_or_insert_with(key, owned, make);
        &mut self.items[i].1
    }

    pub(crate) fn insert(&mut self, key: K, value: V) {
        match self.find(&key) {
            Ok(i) => {
                if let Some(slot) = self.items.get_mut(i) {
                    slot.1 = value;
                }
            }
            Err(i) => self.items.insert(i, (key, value)),
        }
    }

    pub(crate) fn remove<Q: Ord + ?Sized>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
    {
        let i = self.find(key).ok()?;
        Some(self.items.remove(i).1)
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.items.iter().map(|(k, v)| (k, v))
    }

    /// The entry at a position, if any.
    pub(crate) fn at(&self, i: usize) -> Option<(&K, &V)> {
        self.items.get(i).map(|(k, v)| (k, v))
    }

    /// Insert at a position `find` answered `Err` with (nothing else changed the map since).
    pub(crate) fn insert_at(&mut self, i: usize, key: K, value: V) {
        debug_assert!(self.items.get(i).is_none_or(|(k, _)| *k > key) && (i == 0 || self.items.get(i - 1).is_some_and(|(k, _)| *k < key)));
        self.items.insert(i.min(self.items.len()), (key, value));
    }

    /// Drop the entry at a position, in place (no copy of it is made on the way out).
    pub(crate) fn delete_at(&mut self, i: usize) {
        if i < self.items.len() {
            self.items.drain(i..=i);
        }
    }

    /// The entry at a position, if any (for callers that remember where a key was).
    pub(crate) fn at_mut(&mut self, i: usize) -> Option<(&K, &mut V)> {
        self.items.get_mut(i).map(|(k, v)| (&*k, v))
    }

    /// Position of `key`, inserting `make()` under `owned()` when absent.
    pub(crate) fn position_or_insert_with<Q: Ord + ?Sized>(&mut self, key: &Q, owned: impl FnOnce() -> K, make: impl FnOnce() -> V) -> usize
    where
        K: Borrow<Q>,
    {
        match self.find(key) {
            Ok(i) => i,
            Err(i) => {
                self.items.insert(i, (owned(), make()));
                i
            }
        }
    }

    /// The value at a position known to be valid, or (should it not be) the value for `key`.
    #[allow(clippy::indexing_slicing)] // bounds checked on the line before.
    #[inline]
    pub(crate) fn value_at_or_insert_with<Q: Ord + ?Sized>(
        &mut self,
        i: usize,
        key: &Q,
        owned: impl FnOnce() -> K,
        make: impl FnOnce() -> V,
    ) -> &mut V
    where
        K: Borrow<Q>,
    {
        if i < self.items.len() {
            return &mut self.items[i].1;
        }
        self.get_or_insert_with(key, owned, make)
    }

    pub(crate) fn len(&self) -> usize {
        self.items.len()
    }
}
