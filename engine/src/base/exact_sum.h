// The exact sum of squares of floats, for the gradient check: the value does not depend on how the
// elements are ordered, split across threads, blocks or ranks, or merged, so the global grad norm is the
// same bits for any world size and any split of the gradients.
//
// Why it can be exact. A finite float is x = M * 2^e with an integer M < 2^24 and e >= -149, so
// x * x = M^2 * 2^(2e): an integer multiple of 2^-298, below 2^256 (FLT_MAX^2 < 2^256). A sum of up to
// 2^64 such squares is an integer multiple of 2^-298 below 2^320: it fits a fixed-point number of
// 640 bits whose lowest bit weighs 2^-320.
//
// ExactSumSq holds that number as kDigits = 20 digits of 32 bits: value = sum_i digit[i] * 2^(32 i - 320).
// Each digit sits in a signed 64-bit word, so additions accumulate without carrying (a word has room
// for 2^30 additions of pieces below 2^33) and Normalize() propagates the carries only when `pending`
// says the room could run out, or before a result is read. Normalised, digits 0..18 are in [0, 2^32)
// and the top digit holds the rest; for the value of a sum of squares (>= 0, < 2^320) it is in [0, 2^32)
// as well, so the normalised form of a value is unique: two sums of the same elements have the same
// bytes, whatever the order. Words are signed because the per-thread fast path below produces negative
// error terms in passing; every value that is read is a sum of squares and so >= 0.
//
// Accumulating, three ways, all exact:
//   - ExactSumSq::AddSquare(x): one square straight into the digits (the square M^2 < 2^48 shifted to
//     its bit offset 2 max(E, 1) + 20, E the float's biased exponent, spans at most 3 digits). A dozen
//     integer operations; for single values and tests.
//   - ExactSquareBuckets (the CPU's bulk path): one uint64 per float exponent E (256 buckets). An
//     element costs a bit extraction, one 32x32->64 multiply M * M and one add to bucket[E], with no
//     branch; kCapacity = 2^16 squares (each < 2^48) fit a bucket, after which FoldInto() adds every
//     bucket to the digits at its offset (256 shifted adds: noise next to 2^16 elements). bf16 and f16
//     grads go through the same code as floats (their conversion to float is exact). Bucket 255 (Inf,
//     NaN) is never folded into the digits: its being non-zero is the found-inf flag.
//   - ExactSquareExpansion (the GPU's per-thread fast path, where 2 KB of buckets per thread do not
//     fit): kTerms = 2 doubles updated by error-free transformations. x * x is exact in double (48
//     significant bits); Fast2Sum / TwoSum return s = fl(a + b) and the exact error a + b - s, so the
//     terms plus everything spilled always equal the exact sum. Only when the last error is non-zero
//     (a square below the reach of the running sum's second term, roughly 2^-100 of the sum) does that
//     error go to an ExactSumSq ("spill", AddDouble: rare for gradients, frequent only for data spread
//     over a hundred binades, and exact either way). Every term is a multiple of 2^-298 below 2^320
//     (sums and exact errors of such numbers are), so it converts to digits exactly. About 14 double
//     operations per element; exactness needs round-to-nearest and no contraction of a * b + c into an
//     FMA, which the build guarantees on both sides (-ffp-contract=off, --fmad=false).
//
// Reading: ToDouble() rounds the exact value once to the nearest double (ties to even). Exchanging:
// ToExchange() writes the kExchangeDoubles normalised digits as doubles (integers < 2^32, exact); the
// element-wise sum of those arrays over up to 2^20 ranks stays below 2^52, so an all-reduce of doubles
// (any order, any algorithm) is exact, and FromExchange() turns the summed array back into the total.
//
// Plain arithmetic with no dependencies, compiled for the host and by nvcc for the device
// (FERRY_ADAM_HD); trivially copyable, so it can live in device memory and travel by memcpy.
#ifndef FERRY_BASE_EXACT_SUM_H_
#define FERRY_BASE_EXACT_SUM_H_

#include <cstdint>
#include <cstring>

#ifndef FERRY_ADAM_HD
#if defined(__CUDACC__)
#define FERRY_ADAM_HD __host__ __device__ __forceinline__
#else
#define FERRY_ADAM_HD inline
#endif
#endif

namespace ferry {

namespace exact_sum_internal {

FERRY_ADAM_HD uint32_t FloatBits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

FERRY_ADAM_HD uint64_t DoubleBits(double x) {
  uint64_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

FERRY_ADAM_HD double DoubleFromBits(uint64_t u) {
  double x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

// Leading zero bits of v. REQUIRES: v != 0.
FERRY_ADAM_HD int Clz32(uint32_t v) {
#if defined(__CUDA_ARCH__)
  return __clz(static_cast<int>(v));
#else
  return __builtin_clz(v);
#endif
}

// Whether float bits are Inf or NaN.
FERRY_ADAM_HD bool NonFiniteBits(uint32_t bits) { return (bits & 0x7F800000u) == 0x7F800000u; }

}  // namespace exact_sum_internal

// The exact sum of squares of finite floats (see the top of the file). Zero-initialise it
// (`ExactSumSq s{};`) or Clear() it before use. Not thread-safe: one thread at a time per object;
// combine per-thread objects with Add.
struct ExactSumSq {
  static constexpr int kDigits = 20;
  static constexpr int kDigitBits = 32;
  static constexpr int kLsbExponent = -320;  // digit[i] weighs 2^(32 i + kLsbExponent)
  static constexpr int kExchangeDoubles = kDigits;
  // Normalize when `pending` reaches this: words then stay below 2^62 in magnitude.
  static constexpr int64_t kPendingLimit = int64_t{1} << 30;
  static constexpr uint64_t kDigitMask = 0xFFFFFFFFull;

  int64_t digit[kDigits];
  // Additions since the last Normalize, in units of "one piece below 2^32 per word": every word's
  // magnitude is at most (pending + 1) * 2^32.
  int64_t pending;

  FERRY_ADAM_HD void Clear() {
    for (int i = 0; i < kDigits; ++i) digit[i] = 0;
    pending = 0;
  }

  // Adds (negative: subtracts) v * 2^(bit + kLsbExponent). REQUIRES: bit >= 0; the bits of v * 2^bit at
  // or above 32 * kDigits are zero (they are dropped).
  FERRY_ADAM_HD void AddShifted(uint64_t v, int bit, bool negative = false) {
    const int d = bit >> 5;
    const int s = bit & 31;
    const uint64_t lo = (v & kDigitMask) << s;  // < 2^63
    const uint64_t hi = (v >> 32) << s;         // < 2^63
    const int64_t p0 = static_cast<int64_t>(lo & kDigitMask);
    const int64_t p1 = static_cast<int64_t>((lo >> 32) + (hi & kDigitMask));  // < 2^33
    const int64_t p2 = static_cast<int64_t>(hi >> 32);
    if (negative) {
      digit[d] -= p0;
      if (d + 1 < kDigits) digit[d + 1] -= p1;
      if (d + 2 < kDigits) digit[d + 2] -= p2;
    } else {
      digit[d] += p0;
      if (d + 1 < kDigits) digit[d + 1] += p1;
      if (d + 2 < kDigits) digit[d + 2] += p2;
    }
    pending += 2;
    if (pending >= kPendingLimit) Normalize();
  }

  // Adds x * x. REQUIRES: x finite.
  FERRY_ADAM_HD void AddSquare(float x) {
    const uint32_t bits = exact_sum_internal::FloatBits(x);
    const uint32_t e = (bits >> 23) & 0xFFu;
    const uint64_t m = (bits & 0x7FFFFFu) | (e != 0 ? 0x800000u : 0u);
    if (m != 0) AddShifted(m * m, 2 * static_cast<int>(e != 0 ? e : 1u) + 20);
  }

  // Adds d exactly. REQUIRES: d is an integer multiple of 2^kLsbExponent with |d| < 2^320 (true of
  // every sum and every TwoSum error of squares of floats).
  FERRY_ADAM_HD void AddDouble(double d) {
    const uint64_t bits = exact_sum_internal::DoubleBits(d);
    const int e = static_cast<int>((bits >> 52) & 0x7FFu);
    uint64_t m = (bits & ((uint64_t{1} << 52) - 1)) | (e != 0 ? uint64_t{1} << 52 : 0);
    if (m == 0) return;
    // d = m * 2^(max(e, 1) - 1075); its bit offset on our grid is that exponent + 320.
    int bit = (e != 0 ? e : 1) - 1075 - kLsbExponent;
    if (bit < 0) {  // the low bits of m are zero (d is a multiple of the grid)
      m >>= -bit;
      bit = 0;
    }
    AddShifted(m, bit, (bits >> 63) != 0);
  }

  // Adds another sum.
  FERRY_ADAM_HD void Add(const ExactSumSq& other) {
    for (int i = 0; i < kDigits; ++i) digit[i] += other.digit[i];
    pending += other.pending + 1;
    if (pending >= kPendingLimit) Normalize();
  }

  // Propagates the carries: digits 0 .. kDigits-2 in [0, 2^32), the top digit the rest; pending = 0.
  // The same value always gives the same bytes.
  FERRY_ADAM_HD void Normalize() {
    int64_t carry = 0;
    for (int i = 0; i < kDigits - 1; ++i) {
      const int64_t t = digit[i] + carry;
      digit[i] = static_cast<int64_t>(static_cast<uint64_t>(t) & kDigitMask);
      carry = t >> 32;  // arithmetic: floor(t / 2^32)
    }
    digit[kDigits - 1] += carry;
    pending = 0;
  }

  // The value rounded to the nearest double, ties to even. REQUIRES: the value is >= 0 and < 2^320
  // (any sum of at most 2^64 squares).
  FERRY_ADAM_HD double ToDouble() const {
    ExactSumSq n = *this;
    n.Normalize();
    int t = kDigits - 1;
    while (t >= 0 && n.digit[t] == 0) --t;
    if (t < 0) return 0.0;
    const uint64_t top = static_cast<uint64_t>(n.digit[t]);  // in [1, 2^32)
    const uint64_t next = t >= 1 ? static_cast<uint64_t>(n.digit[t - 1]) : 0;
    const uint64_t low = t >= 2 ? static_cast<uint64_t>(n.digit[t - 2]) : 0;
    bool sticky = false;
    for (int i = 0; i < t - 2; ++i) sticky = sticky || n.digit[i] != 0;
    const int lz = exact_sum_internal::Clz32(static_cast<uint32_t>(top));
    // The 64 bits from the leading one down, and whether anything below them is set.
    const uint64_t hi = (top << 32) | next;
    uint64_t window = hi;
    if (lz > 0) {
      window = (hi << lz) | (low >> (32 - lz));
      sticky = sticky || ((low << lz) & kDigitMask) != 0;
    } else {
      sticky = sticky || low != 0;
    }
    // The leading one is bit p of the grid: the value is in [2^(p + kLsbExponent), twice that).
    const int p = 32 * t + 31 - lz;
    uint64_t mantissa = window >> 11;  // 53 bits
    const uint64_t rest = window & 0x7FFu;
    if (rest > 0x400u || (rest == 0x400u && (sticky || (mantissa & 1u) != 0))) ++mantissa;
    int exponent = p + kLsbExponent;
    if (mantissa == (uint64_t{1} << 53)) {
      mantissa >>= 1;
      ++exponent;
    }
    return exact_sum_internal::DoubleFromBits((static_cast<uint64_t>(exponent + 1023) << 52) |
                                              (mantissa & ((uint64_t{1} << 52) - 1)));
  }

  // Writes the normalised digits to out[0 .. kExchangeDoubles): integers in [0, 2^32), exact in double.
  // REQUIRES: the value is >= 0 and < 2^320.
  FERRY_ADAM_HD void ToExchange(double* out) const {
    ExactSumSq n = *this;
    n.Normalize();
    for (int i = 0; i < kDigits; ++i) out[i] = static_cast<double>(n.digit[i]);
  }

  // The sum whose exchange form is in[0 .. kExchangeDoubles), or the total of several sums when `in` is
  // the element-wise sum of their exchange forms (up to 2^20 of them). Normalised.
  // REQUIRES: every in[i] an integer in [0, 2^53); the total < 2^320.
  FERRY_ADAM_HD static ExactSumSq FromExchange(const double* in) {
    ExactSumSq s;
    for (int i = 0; i < kDigits; ++i) s.digit[i] = static_cast<int64_t>(in[i]);
    s.Normalize();
    return s;
  }
};

// The CPU's bulk accumulator: the squares of floats summed exactly per exponent (see the top of the
// file). Clear() it first; after at most kCapacity AddBits, FoldInto an ExactSumSq. One thread at a time.
struct ExactSquareBuckets {
  static constexpr int kBuckets = 256;
  static constexpr int64_t kCapacity = int64_t{1} << 16;  // squares < 2^48 per bucket: < 2^64

  uint64_t sum[kBuckets];

  FERRY_ADAM_HD void Clear() {
    for (int i = 0; i < kBuckets; ++i) sum[i] = 0;
  }

  // Adds the square of the float with these bits (Inf and NaN go to bucket 255, never folded).
  FERRY_ADAM_HD void AddBits(uint32_t bits) {
    const uint32_t e = (bits >> 23) & 0xFFu;
    const uint64_t m = (bits & 0x7FFFFFu) | (e != 0 ? 0x800000u : 0u);
    sum[e] += m * m;
  }

  // Adds the finite squares to `out` and clears the buckets; returns whether an Inf or NaN was added
  // since the last Clear or FoldInto.
  FERRY_ADAM_HD bool FoldInto(ExactSumSq& out) {
    for (int e = 0; e < kBuckets - 1; ++e) {
      if (sum[e] != 0) out.AddShifted(sum[e], 2 * (e != 0 ? e : 1) + 20);
      sum[e] = 0;
    }
    const bool non_finite = sum[kBuckets - 1] != 0;
    sum[kBuckets - 1] = 0;
    return non_finite;
  }
};

// The GPU's per-thread accumulator: an expansion of kTerms doubles updated by error-free TwoSum steps,
// spilling the rare residual into an ExactSumSq (see the top of the file). Clear() it first. One thread
// at a time.
struct ExactSquareExpansion {
  // Two terms: a square spills only when it lies ~2^-100 below the running sum (for normally
  // distributed gradients, about one element in a million); wide data spills more, exactly all the same.
  static constexpr int kTerms = 2;

  double term[kTerms];

  FERRY_ADAM_HD void Clear() {
    for (int k = 0; k < kTerms; ++k) term[k] = 0.0;
  }

  // Adds x * x; a residual the terms cannot hold goes to `spill`. REQUIRES: x finite.
  FERRY_ADAM_HD void AddSquare(float x, ExactSumSq& spill) {
    const double d = static_cast<double>(x);
    const double sq = d * d;  // exact: 48 significant bits at most
    // term[0] and sq are >= 0: Fast2Sum (Dekker) on the larger and the smaller, s + err exactly.
    const double a = term[0];
    const double big = a >= sq ? a : sq;
    const double small = a >= sq ? sq : a;
    const double s = a + sq;
    double carry = small - (s - big);
    term[0] = s;
    for (int k = 1; k < kTerms; ++k) {
      // TwoSum (Knuth): s + err == term[k] + carry exactly, whatever their signs and magnitudes.
      const double b = term[k];
      const double t = b + carry;
      const double bb = t - b;
      const double err = (b - (t - bb)) + (carry - bb);
      term[k] = t;
      carry = err;
    }
    if (carry != 0.0) spill.AddDouble(carry);
  }

  // Adds the terms to `out` and clears them.
  FERRY_ADAM_HD void FlushInto(ExactSumSq& out) {
    for (int k = 0; k < kTerms; ++k) {
      out.AddDouble(term[k]);
      term[k] = 0.0;
    }
  }
};

}  // namespace ferry

#endif  // FERRY_BASE_EXACT_SUM_H_
