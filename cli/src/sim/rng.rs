//! The simulator's own seeded generator (splitmix64): the dependency's randomness and the
//! arrivals. The engine keeps its own PRNG for jitter, seeded separately.

/// A small deterministic generator.
#[derive(Clone, Debug)]
pub struct SimRng(u64);

impl SimRng {
    /// Seeded.
    pub fn new(seed: u64) -> Self {
        SimRng(seed ^ 0x5EED_1E7E_E000_0001)
    }
    /// Next 64 bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in [lo, hi].
    pub fn between(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        lo + self.next_u64() % (hi - lo + 1)
    }
    /// Exponentially distributed with the given mean (for Poisson arrivals).
    pub fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.unit()).ln()
    }
}
