//! Sorting for the core's cold paths, through one instantiation of the standard sort.
//!
//! The standard library's sorts are fast and large: every element type and comparator they
//! are instantiated for adds 2-9 KB of code to the component. The core sorted in seven places
//! (duplicate keys of a document, the entries a state import keeps, a snapshot's key names,
//! fleet budget slots, percentiles, gRPC codes), which came to 36 KB, more than the durable
//! executor needs. None of those is on a call's path, so they all go through [`permutation`]:
//! it sorts indices with a comparator behind a reference, one instantiation for all, and
//! [`sort_by`] puts a vector in that order in place (a second copy of a million state entries
//! would not fit the guest; the indices are 4 bytes each).

use core::cmp::Ordering;

/// The indices `0..n` in the order `cmp` gives them, ties in index order (a stable sort).
pub(crate) fn permutation(n: usize, cmp: &dyn Fn(usize, usize) -> Ordering) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_unstable_by(|&a, &b| cmp(a, b).then(a.cmp(&b)));
    order
}

/// Sort `items` by `cmp`, stable, in place.
pub(crate) fn sort_by<T>(items: &mut [T], cmp: impl Fn(&T, &T) -> Ordering) {
    let order = permutation(items.len(), &|a, b| match (items.get(a), items.get(b)) {
        (Some(x), Some(y)) => cmp(x, y),
        _ => Ordering::Equal,
    });
    apply(items, order);
}

/// Sort `items` by their own order, stable, in place.
pub(crate) fn sort<T: Ord>(items: &mut [T]) {
    sort_by(items, T::cmp);
}

/// Rearrange `items` so that position `i` holds what was at `order[i]`, one cycle of the
/// permutation at a time (each element moves once; a finished position is marked by pointing
/// at itself).
pub(crate) fn apply<T>(items: &mut [T], mut order: Vec<usize>) {
    for start in 0..order.len() {
        let mut at = start;
        while let Some(slot) = order.get_mut(at) {
            let from = std::mem::replace(slot, at);
            if from == start || from == at || from >= items.len() {
                break;
            }
            items.swap(at, from);
            at = from;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sorts_stably_in_place() {
        let mut v = vec![(3, 'a'), (1, 'b'), (3, 'c'), (0, 'd'), (1, 'e'), (2, 'f')];
        sort_by(&mut v, |a, b| a.0.cmp(&b.0));
        assert_eq!(v, vec![(0, 'd'), (1, 'b'), (1, 'e'), (2, 'f'), (3, 'a'), (3, 'c')]);
    }

    #[test]
    fn agrees_with_the_standard_sort() {
        // Every permutation shape: pseudo-random inputs of many lengths with many ties.
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for n in 0..200 {
            let mut v: Vec<(u64, usize)> = (0..n)
                .map(|i| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % 7, i)
                })
                .collect();
            let mut want = v.clone();
            want.sort_by_key(|e| e.0);
            sort_by(&mut v, |a, b| a.0.cmp(&b.0));
            assert_eq!(v, want, "n = {n}");
            let mut w: Vec<u64> = v.iter().map(|e| e.0 * 31 % 11).collect();
            let mut want_w = w.clone();
            want_w.sort();
            sort(&mut w);
            assert_eq!(w, want_w);
        }
    }
}
