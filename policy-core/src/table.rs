//! The engine's tables: a slab of entries indexed by a hash table, with the entries threaded
//! on intrusive doubly linked lists.
//!
//! Every operation the engine makes per call is constant expected time, whatever the size of
//! the table: find by key, insert, remove, and moving an entry to the back of a list (a
//! touch, for least-recently-used order). The front of a list is its oldest entry, so the
//! least recently used key and the oldest live call are found without a scan.
//!
//! Determinism: the hash table only answers "where is this key". Nothing the engine decides,
//! emits or exports depends on its iteration order: orders come from the lists, which follow
//! the sequence of operations alone, and exports sort. The hasher is seeded from the
//! engine's seed, so a document and a seed always build the same table, while keys chosen
//! by an attacker (client addresses, tenants) cannot aim at a hash known in advance.
//!
//! An entry's index (its slot in the slab) stays valid until the entry is removed; a slot is
//! then reused, so holders of an index (a live call remembering its key) check the slot
//! still holds what they expect before trusting it.
//!
//! A resize of the index reads the index alone: each of its entries keeps the key's 32-bit
//! hash beside the slot, so growing it hashes no key and reads no node (issue 41). Before, the
//! call that made a table of 917,504 keys grow rehashed every key through the slab: 414-480 ms
//! in the component, and past the guest's time bound on a loaded machine; it is 9 ms now. The
//! slab is a `Vec`, whose doublings still copy every node once, in the call that crosses a
//! power of two (docs/performance.md, "Growth of the key table", has the figures, and why a
//! slab in segments was not kept).

use std::borrow::Borrow;
use std::cell::Cell;
use std::hash::{BuildHasher, Hash};

use foldhash::fast::FixedState;
use hashbrown::HashTable;

/// No entry: the end of a list, or no free slot.
const NIL: u32 = u32::MAX;

/// An index entry: an entry's slot, and its key's 32-bit hash, so that a resize of the index
/// rehashes from the index alone (it reads no node and hashes no key).
#[derive(Clone, Copy)]
struct Slot {
    node: u32,
    hash: u32,
}

/// The index's hash from a key's 32 bits: they fill both halves, so that the bits hashbrown
/// takes (the low ones for the bucket, the top seven for the tag) are the key's on 32- and
/// 64-bit targets alike.
#[inline]
fn spread(h: u32) -> u64 {
    (u64::from(h) << 32) | u64::from(h)
}

#[derive(Clone, Debug)]
struct Node<K, V> {
    /// The entry, or `None` for a free slot (then `next` links the free list).
    entry: Option<(K, V)>,
    prev: u32,
    next: u32,
    /// Which list the entry is on.
    list: u8,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Ends {
    front: u32,
    back: u32,
}

const EMPTY: Ends = Ends { front: NIL, back: NIL };

/// A hash-indexed slab whose entries each sit on one of `L` ordered lists.
#[derive(Clone)]
pub(crate) struct Table<K, V, const L: usize> {
    index: HashTable<Slot>,
    nodes: Vec<Node<K, V>>,
    free: u32,
    ends: [Ends; L],
    lens: [usize; L],
    hasher: FixedState,
    /// The index `find_recent` answered last: a hint, trusted only once the slot is seen to
    /// hold the key asked for (a slot freed or reused since simply misses).
    recent: Cell<u32>,
}

impl<K, V, const L: usize> std::fmt::Debug for Table<K, V, L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Table").field("len", &self.lens.iter().sum::<usize>()).finish_non_exhaustive()
    }
}

impl<K: Hash + Eq, V, const L: usize> Table<K, V, L> {
    /// An empty table whose hasher is seeded with `seed`.
    pub(crate) fn with_seed(seed: u64) -> Self {
        Table {
            index: HashTable::new(),
            nodes: Vec::new(),
            free: NIL,
            ends: [EMPTY; L],
            lens: [0; L],
            hasher: FixedState::with_seed(seed),
            recent: Cell::new(NIL),
        }
    }

    /// A key's 32-bit hash.
    #[inline]
    fn hash32<Q: Hash + ?Sized>(&self, key: &Q) -> u32 {
        let h = self.hasher.hash_one(key);
        (h ^ (h >> 32)) as u32
    }

    /// Entries in the table.
    pub(crate) fn len(&self) -> usize {
        self.lens.iter().sum()
    }

    /// Entries on one list.
    pub(crate) fn list_len(&self, list: usize) -> usize {
        self.lens.get(list).copied().unwrap_or(0)
    }

    fn node(&self, i: u32) -> Option<&Node<K, V>> {
        self.nodes.get(i as usize)
    }

    fn node_mut(&mut self, i: u32) -> Option<&mut Node<K, V>> {
        self.nodes.get_mut(i as usize)
    }

    /// The index of `key`'s entry.
    pub(crate) fn find<Q: Hash + Eq + ?Sized>(&self, key: &Q) -> Option<u32>
    where
        K: Borrow<Q>,
    {
        let h = self.hash32(key);
        let nodes = &self.nodes;
        self.index
            .find(spread(h), |s| {
                s.hash == h && nodes.get(s.node as usize).and_then(|n| n.entry.as_ref()).is_some_and(|(k, _)| k.borrow() == key)
            })
            .map(|s| s.node)
    }

    /// The index of `key`'s entry, as `find`, trying the entry found last before hashing:
    /// consecutive calls on one key (an unkeyed policy, a hot client) compare one name
    /// instead of hashing it and probing. The answer is `find`'s whatever the hint holds.
    #[inline]
    pub(crate) fn find_recent<Q: Hash + Eq + ?Sized>(&self, key: &Q) -> Option<u32>
    where
        K: Borrow<Q>,
    {
        let r = self.recent.get();
        if self.get(r).is_some_and(|(k, _)| k.borrow() == key) {
            return Some(r);
        }
        let found = self.find(key)?;
        self.recent.set(found);
        Some(found)
    }

    /// The entry at an index.
    #[inline]
    pub(crate) fn get(&self, i: u32) -> Option<(&K, &V)> {
        self.node(i)?.entry.as_ref().map(|(k, v)| (k, v))
    }

    /// The entry at an index, its value mutable.
    #[inline]
    pub(crate) fn get_mut(&mut self, i: u32) -> Option<(&K, &mut V)> {
        self.node_mut(i)?.entry.as_mut().map(|(k, v)| (&*k, v))
    }

    /// The values of two different entries at once (`None` when `a == b` or either is free).
    pub(crate) fn get2_mut(&mut self, a: u32, b: u32) -> Option<(&mut V, &mut V)> {
        if a == b {
            return None;
        }
        let (lo, hi) = (a.min(b) as usize, a.max(b) as usize);
        let (left, right) = self.nodes.split_at_mut(hi);
        let x = left.get_mut(lo)?.entry.as_mut().map(|(_, v)| v)?;
        let y = right.first_mut()?.entry.as_mut().map(|(_, v)| v)?;
        Some(if a < b { (x, y) } else { (y, x) })
    }

    /// The list an entry is on, and its value: one read of the node.
    #[inline]
    pub(crate) fn get_on_list(&self, i: u32) -> Option<(usize, &V)> {
        let n = self.node(i)?;
        n.entry.as_ref().map(|(_, v)| (usize::from(n.list), v))
    }

    /// The list an entry is on.
    pub(crate) fn list_of(&self, i: u32) -> Option<usize> {
        let n = self.node(i)?;
        n.entry.as_ref().map(|_| usize::from(n.list))
    }

    /// The oldest entry of a list (its front).
    pub(crate) fn front(&self, list: usize) -> Option<u32> {
        self.ends.get(list).map(|e| e.front).filter(|&f| f != NIL)
    }

    /// The entry after `i` on its list (towards the back).
    pub(crate) fn next(&self, i: u32) -> Option<u32> {
        self.node(i).filter(|n| n.entry.is_some()).map(|n| n.next).filter(|&n| n != NIL)
    }

    /// Insert `key` (which must be absent) at the back of `list`; returns its index.
    #[inline(always)]
    pub(crate) fn insert(&mut self, key: K, value: V, list: usize) -> u32 {
        debug_assert!(list < L);
        let i = if self.free != NIL {
            let i = self.free;
            if let Some(n) = self.node_mut(i) {
                let next_free = n.next;
                n.entry = Some((key, value));
                self.free = next_free;
            }
            i
        } else {
            let i = self.nodes.len() as u32;
            self.nodes.push(Node { entry: Some((key, value)), prev: NIL, next: NIL, list: 0 });
            i
        };
        self.index(i);
        self.link_back(i, list);
        i
    }

    /// Index the entry at `i` under its key's hash.
    fn index(&mut self, i: u32) {
        let Some((key, _)) = self.get(i) else { return };
        let h = self.hash32(key);
        self.index.insert_unique(spread(h), Slot { node: i, hash: h }, |s| spread(s.hash));
    }

    /// Take the entry at `i` out of the index (its slot keeps it); `None` for a free slot.
    fn unindex(&mut self, i: u32) -> Option<()> {
        let h = self.hash32(self.get(i)?.0);
        if let Ok(found) = self.index.find_entry(spread(h), |s| s.node == i) {
            found.remove();
        }
        Some(())
    }

    /// Remove the entry at an index, answering it.
    #[cfg(test)]
    pub(crate) fn remove(&mut self, i: u32) -> Option<(K, V)> {
        self.detach(i)?.entry.take()
    }

    /// Remove the entry at an index, dropping it where it lies (the engine never needs the
    /// removed value back, and moving a live call's ~200 bytes out only to drop them was a
    /// copy on every report); false for a free slot.
    pub(crate) fn delete(&mut self, i: u32) -> bool {
        match self.detach(i) {
            Some(n) => {
                n.entry = None;
                true
            }
            None => false,
        }
    }

    /// Take the entry at `i` out of the index and its list and put its slot on the free
    /// list; the node, still holding the entry, is the caller's to empty.
    fn detach(&mut self, i: u32) -> Option<&mut Node<K, V>> {
        self.unindex(i)?;
        self.unlink(i);
        let free = self.free;
        self.free = i;
        let n = self.node_mut(i)?;
        n.next = free;
        n.prev = NIL;
        Some(n)
    }

    /// Give the entry at `i` a new `key` (which must be absent) and put it at the back of
    /// `list`, answering the key it had. The value stays in its slot for the caller to reset:
    /// making a key by evicting another reuses the evicted entry in place (its slot and its
    /// allocations), where a remove and an insert would move the value out and back in.
    pub(crate) fn rekey(&mut self, i: u32, key: K, list: usize) -> Option<K> {
        self.unindex(i)?;
        let (k, _) = self.node_mut(i)?.entry.as_mut()?;
        let old = std::mem::replace(k, key);
        self.index(i);
        self.move_to_back(i, list);
        Some(old)
    }

    /// Move an entry to the back of `list` (its most recent end).
    #[inline]
    pub(crate) fn move_to_back(&mut self, i: u32, list: usize) {
        let Some(n) = self.node(i) else { return };
        if n.entry.is_none() || (usize::from(n.list) == list && n.next == NIL) {
            return; // already there
        }
        self.unlink(i);
        self.link_back(i, list);
    }

    fn link_back(&mut self, i: u32, list: usize) {
        let Some(ends) = self.ends.get(list).copied() else { return };
        if let Some(n) = self.node_mut(i) {
            n.prev = ends.back;
            n.next = NIL;
            n.list = list as u8;
        }
        match self.node_mut(ends.back) {
            Some(back) => back.next = i,
            None => {
                if let Some(e) = self.ends.get_mut(list) {
                    e.front = i;
                }
            }
        }
        if let Some(e) = self.ends.get_mut(list) {
            e.back = i;
        }
        if let Some(len) = self.lens.get_mut(list) {
            *len += 1;
        }
    }

    fn unlink(&mut self, i: u32) {
        let Some(n) = self.node(i) else { return };
        let (prev, next, list) = (n.prev, n.next, usize::from(n.list));
        match self.node_mut(prev) {
            Some(p) => p.next = next,
            None => {
                if let Some(e) = self.ends.get_mut(list) {
                    e.front = next;
                }
            }
        }
        match self.node_mut(next) {
            Some(nx) => nx.prev = prev,
            None => {
                if let Some(e) = self.ends.get_mut(list) {
                    e.back = prev;
                }
            }
        }
        if let Some(len) = self.lens.get_mut(list) {
            *len = len.saturating_sub(1);
        }
    }

    /// Every entry, in slab order (which depends on the operations made, never on hashes;
    /// callers that emit the entries sort them).
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, &K, &V)> {
        self.nodes.iter().enumerate().filter_map(|(i, n)| n.entry.as_ref().map(|(k, v)| (i as u32, k, v)))
    }

    /// The entries of one list, front (oldest) to back.
    #[cfg(test)]
    pub(crate) fn list(&self, list: usize) -> Vec<u32> {
        let mut out = Vec::new();
        let mut at = self.front(list);
        while let Some(i) = at {
            out.push(i);
            at = self.next(i);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    /// The model: a `BTreeMap` of values and an explicit order per list.
    #[derive(Default)]
    struct Model {
        values: BTreeMap<u16, (u32, usize)>,
        order: [Vec<u16>; 2],
    }

    impl Model {
        fn unlink(&mut self, k: u16) {
            for l in &mut self.order {
                l.retain(|x| *x != k);
            }
        }
    }

    #[derive(Clone, Debug)]
    enum Op {
        Insert(u16, u32, usize),
        Remove(u16),
        Touch(u16, usize),
        PopFront(usize),
        /// The front of list .0 (if any) takes key .1 (if absent), keeps its value, goes to the back of list .2.
        Rekey(usize, u16, usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u16..64, any::<u32>(), 0usize..2).prop_map(|(k, v, l)| Op::Insert(k, v, l)),
            (0u16..64).prop_map(Op::Remove),
            (0u16..64, 0usize..2).prop_map(|(k, l)| Op::Touch(k, l)),
            (0usize..2).prop_map(Op::PopFront),
            (0usize..2, 0u16..64, 0usize..2).prop_map(|(f, k, l)| Op::Rekey(f, k, l)),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        /// Any sequence of operations leaves the table equal to the model: the same entries,
        /// the same values, and the same order on every list.
        #[test]
        fn behaves_like_a_btreemap_with_an_lru_order(ops in proptest::collection::vec(op(), 0..400), seed in any::<u64>()) {
            let mut t: Table<u16, u32, 2> = Table::with_seed(seed);
            let mut m = Model::default();
            for op in ops {
                match op {
                    Op::Insert(k, v, l) => {
                        if let Some(i) = t.find(&k) {
                            if let Some((_, val)) = t.get_mut(i) { *val = v; }
                            t.move_to_back(i, l);
                        } else {
                            t.insert(k, v, l);
                        }
                        m.unlink(k);
                        m.values.insert(k, (v, l));
                        m.order[l].push(k);
                    }
                    Op::Remove(k) => {
                        // even keys are taken out with their value, odd ones dropped in place
                        let got = if k % 2 == 0 {
                            t.find(&k).and_then(|i| t.remove(i)).map(|(_, v)| v)
                        } else {
                            t.find(&k).filter(|&i| t.delete(i)).map(|_| 0)
                        };
                        let want = m.values.remove(&k).map(|(v, _)| if k % 2 == 0 { v } else { 0 });
                        m.unlink(k);
                        prop_assert_eq!(got, want);
                    }
                    Op::Touch(k, l) => {
                        if let Some(i) = t.find_recent(&k) {
                            t.move_to_back(i, l);
                        }
                        if let Some(e) = m.values.get_mut(&k) {
                            e.1 = l;
                            m.unlink(k);
                            m.order[l].push(k);
                        }
                    }
                    Op::Rekey(f, k, l) => {
                        if t.find(&k).is_none() {
                            let got = t.front(f).and_then(|i| t.rekey(i, k, l));
                            let want = m.order[f].first().copied();
                            if let Some(old) = want {
                                m.unlink(old);
                                let (v, _) = m.values.remove(&old).unwrap_or((0, 0));
                                m.values.insert(k, (v, l));
                                m.order[l].push(k);
                            }
                            prop_assert_eq!(got, want);
                        }
                    }
                    Op::PopFront(l) => {
                        let got = t.front(l).and_then(|i| t.remove(i)).map(|(k, _)| k);
                        let want = m.order[l].first().copied();
                        if let Some(k) = want {
                            m.unlink(k);
                            m.values.remove(&k);
                        }
                        prop_assert_eq!(got, want);
                    }
                }
                prop_assert_eq!(t.len(), m.values.len());
                prop_assert_eq!(t.index.len(), m.values.len(), "one index entry per entry");
                for k in 0u16..64 {
                    // the hint of find_recent never changes an answer, whatever slot it holds
                    prop_assert_eq!(t.find_recent(&k), t.find(&k));
                }
                for l in 0..2 {
                    let keys: Vec<u16> = t.list(l).iter().filter_map(|&i| t.get(i).map(|(k, _)| *k)).collect();
                    prop_assert_eq!(&keys, &m.order[l]);
                    prop_assert_eq!(t.list_len(l), m.order[l].len());
                }
                for (k, (v, l)) in &m.values {
                    let i = t.find(k);
                    prop_assert!(i.is_some());
                    let i = i.unwrap_or(NIL);
                    prop_assert_eq!(t.get(i).map(|(_, v)| *v), Some(*v));
                    prop_assert_eq!(t.list_of(i), Some(*l));
                }
            }
        }
    }

    /// A key whose hashing is counted.
    #[derive(PartialEq, Eq)]
    struct Counted(u64);

    thread_local! {
        static HASHED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    impl Hash for Counted {
        fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
            HASHED.with(|h| h.set(h.get() + 1));
            self.0.hash(state);
        }
    }

    /// Growing the index hashes no key (issue 41): a key is hashed when it is inserted, looked
    /// up or taken out, never again because the table grew (a resize rehashed every key, in the
    /// one call that made it grow: 414 ms at 917,504 keys in the component).
    #[test]
    fn growth_hashes_no_key() {
        let n = 20_000u64;
        let mut t: Table<Counted, u64, 1> = Table::with_seed(3);
        HASHED.with(|h| h.set(0));
        for i in 0..n {
            t.insert(Counted(i), i, 0);
        }
        assert_eq!(HASHED.with(std::cell::Cell::get), n as usize, "one hash per insert, none for the resizes");
        for i in (0..n).step_by(3) {
            let at = t.find(&Counted(i));
            assert!(at.is_some_and(|at| t.delete(at)));
        }
        for i in 0..n {
            let found = t.find(&Counted(i)).and_then(|at| t.get(at)).map(|(_, v)| *v);
            assert_eq!(found, (i % 3 != 0).then_some(i), "key {i}");
        }
    }

    #[test]
    fn slots_are_reused_and_lookups_miss_removed_keys() {
        let mut t: Table<u64, (), 1> = Table::with_seed(7);
        let a = t.insert(1, (), 0);
        let b = t.insert(2, (), 0);
        assert_eq!(t.remove(a), Some((1, ())));
        assert_eq!(t.find(&1), None);
        let c = t.insert(3, (), 0);
        assert_eq!(c, a, "the freed slot is reused");
        assert_eq!(t.front(0), Some(b), "order follows insertion, not slots");
        assert_eq!(t.len(), 2);
    }
}
