// The policy every JS benchmark runs, and cockatiel's equivalent is built to match: three
// attempts with exponential backoff, a consecutive-failure breaker.
export const BENCH_POLICY = `
policies:
  bench:
    attempts: 3
    backoff: { kind: exponential, base: 100ms, cap: 10s, jitter: full }
    retry-on: ["error:*"]
    breaker:
      window: { kind: count, size: 5 }
      minimum-calls: 5
      failure-rate: 100
      open-duration: 10s
      failure-on: ["error:*"]
`;
