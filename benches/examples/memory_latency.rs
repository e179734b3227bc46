//! The machine's floor for a call on one of a million keys: the time of one dependent load at a
//! random place in a table of a given size (docs/performance.md, "The core at production load").
//!
//! A random cycle through one `u32` per cache line of `MB` megabytes (default 256, about the
//! size of a million keys' entries); each load's address is the value the previous one read, so
//! no two overlap. `cargo run --release -p levee-benches --example memory_latency -- 256`, and
//! with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` for transparent huge pages.
#![allow(clippy::indexing_slicing)]

use std::time::Instant;

fn main() {
    let mb: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(256).max(1);
    const PER_LINE: usize = 64 / 4;
    let lines = mb * 1024 * 1024 / 64;
    // A random permutation (Fisher-Yates on xorshift64): the order the lines are visited in.
    let mut order: Vec<u32> = (0..lines as u32).collect();
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for i in (1..lines).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % (i as u64 + 1)) as usize);
    }
    let mut next = vec![0u32; lines * PER_LINE];
    for w in 0..lines {
        next[order[w] as usize * PER_LINE] = order[(w + 1) % lines] * PER_LINE as u32;
    }
    let steps = 20_000_000usize;
    let mut at = 0u32;
    let t = Instant::now();
    for _ in 0..steps {
        at = next[at as usize];
    }
    let ns = t.elapsed().as_nanos() as f64 / steps as f64;
    println!("{mb} MB: {ns:.1} ns per dependent load (ended at {at})");
}
