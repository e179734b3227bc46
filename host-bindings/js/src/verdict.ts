// Decoding of the packed u64 verdicts of the hot path (see `wit/levee.wit`, "Packed verdicts").
//
// | bits  | meaning |
// | 0-3   | kind: 0 attempt, 1 wait, 2 done, 3 retry, 4 fallback, 5 fail, 6 invalid |
// | 4     | events pending |
// | 8-15  | detail: attempt number, a `reason`, or an invalid code |
// | 16-63 | payload: nanoseconds (or the fallback index), saturating at 2^48-1 |
//
// jco maps `u64` to BigInt. BigInt arithmetic allocates, so the hot path converts the verdict to a
// double once and splits it with float arithmetic when it is below 2^53 (every verdict whose payload
// is below 2^37 ns, about 137 s); larger verdicts take the exact BigInt path.

import type { Reason } from '../wasm/interfaces/levee-policy-types.js';
import { REASONS as GENERATED_REASONS, VERDICT_KINDS } from './constants.js';

export { KIND_ATTEMPT, KIND_WAIT, KIND_DONE, KIND_RETRY, KIND_FALLBACK, KIND_FAIL, KIND_INVALID } from './constants.js';

/** The verdict kinds, by code. */
export const KIND_NAMES = VERDICT_KINDS;
export type VerdictKind = (typeof KIND_NAMES)[number];

/** The `reason` enum in declaration order: the detail byte of a verdict indexes it. */
export const REASONS: readonly Reason[] = GENERATED_REASONS;

/** A verdict split into its fields. */
export interface Verdict {
  kind: VerdictKind;
  kindCode: number;
  eventsPending: boolean;
  detail: number;
  /** Nanoseconds (or the fallback index), exact: at most 2^48-1. */
  payload: number;
}

const TWO_53 = 9007199254740992;

/** Split a packed verdict (exact for every u64). */
export function decodeVerdict(v: bigint): Verdict {
  const n = Number(v);
  let low: number;
  let payload: number;
  if (n < TWO_53) {
    low = n % 65536;
    payload = (n - low) / 65536;
  } else {
    low = Number(v & 0xffffn);
    payload = Number(v >> 16n);
  }
  const kindCode = low & 0xf;
  return {
    kind: KIND_NAMES[kindCode] ?? 'invalid',
    kindCode,
    eventsPending: (low & 0x10) !== 0,
    detail: low >>> 8,
    payload,
  };
}

/** Pack verdict fields (used by the conformance runner to rebuild expected verdicts exactly). */
export function encodeVerdict(
  kindCode: number,
  detail: number,
  payload: number | bigint,
  eventsPending: boolean,
): bigint {
  return (
    (BigInt(payload) << 16n) | (BigInt(detail & 0xff) << 8n) | (eventsPending ? 0x10n : 0n) | BigInt(kindCode & 0xf)
  );
}
