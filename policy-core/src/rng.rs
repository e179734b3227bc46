//! The engine's pseudo-random number generator: fixed, documented, the same everywhere.
//!
//! **Algorithm**: xoshiro256** (Blackman and Vigna, 2018), seeded by expanding the engine's
//! `u64` seed with SplitMix64 into the four state words. A uniform `f64` in `[0, 1)` is
//! `(next() >> 11) * 2^-53`. A uniform integer in `[lo, hi]` is
//! `lo + floor(u * (hi - lo + 1))` computed in `f64` and clamped to `hi`; every step is an
//! IEEE-754 operation with one rounding, so the result is bit-identical on every platform.
//!
//! Draws are consumed only where jitter is applied, in the order the engine makes decisions.

/// xoshiro256** state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rng {
    s: [u64; 4],
}

/// One step of SplitMix64 (used to seed xoshiro256**).
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Rng {
    /// Seed the generator.
    pub fn new(seed: u64) -> Self {
        let mut sm = seed;
        let s = [splitmix64(&mut sm), splitmix64(&mut sm), splitmix64(&mut sm), splitmix64(&mut sm)];
        Rng { s }
    }

    /// Restore a generator from its four state words (state import).
    pub fn from_state(s: [u64; 4]) -> Self {
        if s == [0; 4] {
            // The all-zero state is a fixed point of xoshiro; never enter it.
            return Rng::new(0);
        }
        Rng { s }
    }

    /// The four state words (state export).
    pub fn state(&self) -> [u64; 4] {
        self.s
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let [s0, s1, s2, s3] = self.s;
        let result = s1.wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s1 << 17;
        let mut n = [s0, s1, s2 ^ s0, s3 ^ s1];
        n[1] ^= n[2];
        n[0] ^= n[3];
        n[2] ^= t;
        n[3] = n[3].rotate_left(45);
        self.s = n;
        result
    }

    /// Uniform `f64` in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform integer in `[lo, hi]` (returns `lo` when `hi <= lo`).
    pub fn between(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        let span = (hi - lo) as f64 + 1.0;
        let offset = (self.next_f64() * span) as u64;
        lo.saturating_add(offset).min(hi)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_reference_values() {
        // Reference: SplitMix64 with seed 1234567 (Vigna's splitmix64.c).
        let mut s = 1_234_567u64;
        assert_eq!(splitmix64(&mut s), 6_457_827_717_110_365_317);
        assert_eq!(splitmix64(&mut s), 3_203_168_211_198_807_973);
    }

    #[test]
    fn same_seed_same_stream_and_bounds() {
        let mut a = Rng::new(42);
        let mut b = Rng::new(42);
        for _ in 0..1000 {
            let x = a.between(10, 20);
            assert_eq!(x, b.between(10, 20));
            assert!((10..=20).contains(&x));
            let f = a.next_f64();
            assert_eq!(f.to_bits(), b.next_f64().to_bits());
            assert!((0.0..1.0).contains(&f));
        }
        assert_eq!(Rng::new(7).between(5, 5), 5);
        assert!(Rng::new(7).between(u64::MAX - 1, u64::MAX) >= u64::MAX - 1);
    }

    #[test]
    fn zero_state_is_never_entered() {
        let mut r = Rng::from_state([0; 4]);
        assert_ne!(r.next_u64(), 0);
    }
}
