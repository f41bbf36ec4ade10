/* eaglenest's row-invariant bf16 matrix-vector kernel; gemv.py builds, checks and loads it, and says why. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static inline uint16_t to_bf16(float f) {  /* round to nearest even, as torch does */
  uint32_t b; memcpy(&b, &f, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((b >> 16) | 0x40);  /* quiet NaN */
  b += 0x7fffu + ((b >> 16) & 1u);
  return (uint16_t)(b >> 16);
}

static inline float from_bf16(uint16_t h) { uint32_t b = (uint32_t)h << 16; float f; memcpy(&f, &b, 4); return f; }

/* y[m, n] from its fp32 sum over K: + bias, rounded once to bf16 (both builds) */
static inline void put(uint16_t *y, const uint16_t *bias, int m, int n, int N, float s) {
  if (bias) s += from_bf16(bias[n]);
  y[(size_t)m * N + n] = to_bf16(s);
}

#ifdef __AVX512BF16__
#define MMAX 4
/* y[m0:m0+MM, n0:n0+NN] over all of K.  MM and NN are constants at every call site (registers). */
static inline __attribute__((always_inline)) void tile(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
    uint16_t *y, int m0, int n0, int N, int K, const int MM, const int NN) {
  __m512 acc[4][4];
  int kfull = K / 32 * 32;
  __mmask32 tail = (__mmask32)((K > kfull) ? ((1u << (K - kfull)) - 1u) : 0u);
#pragma GCC unroll 4
  for (int i = 0; i < MM; i++)
#pragma GCC unroll 4
    for (int j = 0; j < NN; j++) acc[i][j] = _mm512_setzero_ps();
  for (int k = 0; k < K; k += 32) {
    __mmask32 msk = k < kfull ? (__mmask32)0xffffffffu : tail;
    __m512bh wv[4], xv[4];
    /* the next block's rows at the same k: the hardware prefetchers alone left this at ~half the
       DRAM read rate (x86 prefetches never fault; the last block re-touches its own rows) */
#pragma GCC unroll 4
    for (int j = 0; j < NN; j++) {
      int r = n0 + j + 4 < N ? n0 + j + 4 : n0 + j;
      _mm_prefetch((const char *)(w + (size_t)r * K + k), _MM_HINT_T0);
    }
#pragma GCC unroll 4
    for (int j = 0; j < NN; j++) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(msk, w + (size_t)(n0 + j) * K + k);
#pragma GCC unroll 4
    for (int i = 0; i < MM; i++) xv[i] = (__m512bh)_mm512_maskz_loadu_epi16(msk, x + (size_t)(m0 + i) * K + k);
#pragma GCC unroll 4
    for (int i = 0; i < MM; i++)
#pragma GCC unroll 4
      for (int j = 0; j < NN; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv[i], wv[j]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < MM; i++)
#pragma GCC unroll 4
    for (int j = 0; j < NN; j++) put(y, bias, m0 + i, n0 + j, N, _mm512_reduce_add_ps(acc[i][j]));
}
#else
/* AVX2 + FMA: 8 bf16 widened to 8 fp32 (exact), fused multiply-add per lane (the product of two bf16 is
   exact in fp32), one fixed reduction of the 8 lanes.  16 ymm registers: at most 2 rows x 4 weight rows,
   or 1 row x 8 weight rows (one-row calls: 8 independent FMA chains hide the FMA's latency, which 4 do
   not; each output's own chain is the same in every tile, so the results are too). */
#define MMAX 2
#define NWIDE 8
static inline __m256 ld8(const uint16_t *p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline __attribute__((always_inline)) void tile(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
    uint16_t *y, int m0, int n0, int N, int K, const int MM, const int NN) {
  __m256 acc[2][NWIDE];
  int kfull = K / 8 * 8;
#pragma GCC unroll 2
  for (int i = 0; i < MM; i++)
#pragma GCC unroll 8
    for (int j = 0; j < NN; j++) acc[i][j] = _mm256_setzero_ps();
  for (int k = 0; k < kfull; k += 8) {
    __m256 wv[NWIDE], xv[2];
    if ((k & 31) == 0) {  /* once per 64-byte line: the next block's rows (see the AVX512 tile) */
#pragma GCC unroll 8
      for (int j = 0; j < NN; j++) {
        int r = n0 + j + NN < N ? n0 + j + NN : n0 + j;
        _mm_prefetch((const char *)(w + (size_t)r * K + k), _MM_HINT_T0);
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < NN; j++) wv[j] = ld8(w + (size_t)(n0 + j) * K + k);
#pragma GCC unroll 2
    for (int i = 0; i < MM; i++) xv[i] = ld8(x + (size_t)(m0 + i) * K + k);
#pragma GCC unroll 2
    for (int i = 0; i < MM; i++)
#pragma GCC unroll 8
      for (int j = 0; j < NN; j++) acc[i][j] = _mm256_fmadd_ps(xv[i], wv[j], acc[i][j]);
  }
  if (K > kfull) {  /* the tail, zero-padded to 8 (adding 0 * 0 leaves every lane as it was) */
    uint16_t wt[NWIDE][8] = {{0}}, xt[2][8] = {{0}};
    for (int j = 0; j < NN; j++) memcpy(wt[j], w + (size_t)(n0 + j) * K + kfull, (size_t)(K - kfull) * 2);
    for (int i = 0; i < MM; i++) memcpy(xt[i], x + (size_t)(m0 + i) * K + kfull, (size_t)(K - kfull) * 2);
    for (int i = 0; i < MM; i++)
      for (int j = 0; j < NN; j++) acc[i][j] = _mm256_fmadd_ps(ld8(xt[i]), ld8(wt[j]), acc[i][j]);
  }
#pragma GCC unroll 2
  for (int i = 0; i < MM; i++)
#pragma GCC unroll 8
    for (int j = 0; j < NN; j++) put(y, bias, m0 + i, n0 + j, N, hsum8(acc[i][j]));
}
#endif

#define T(MM, NN) tile(x, w, bias, y, m0, n, N, K, MM, NN)
static void block(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int m0, int mm, int n0, int nn,
                  int N, int K) {
  if (nn == 4) {
    int n = n0;
#if MMAX == 4
    switch (mm) { case 4: T(4, 4); break; case 3: T(3, 4); break; case 2: T(2, 4); break; default: T(1, 4); }
#else
    switch (mm) { case 2: T(2, 4); break; default: T(1, 4); }
#endif
  } else {
    for (int n = n0; n < n0 + nn; n++)
#if MMAX == 4
      switch (mm) { case 4: T(4, 1); break; case 3: T(3, 1); break; case 2: T(2, 1); break; default: T(1, 1); }
#else
      switch (mm) { case 2: T(2, 1); break; default: T(1, 1); }
#endif
  }
}

/* y[M, N] = x[M, K] w[N, K]^T (+ bias[N]); bf16 in and out, fp32 accumulation.  Contiguous rows. */
void eaglenest_gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int M, int N, int K,
                         int threads) {
#ifdef NWIDE
  if (M == 1) {  /* one row, NWIDE weight rows a tile; the rest of N as in any call */
    int wide = N / NWIDE;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int b = 0; b <= wide; b++) {
      int m0 = 0, n = b * NWIDE;
      if (b < wide) T(1, NWIDE);
      else for (; n < N; n += 4) block(x, w, bias, y, 0, 1, n, N - n < 4 ? N - n : 4, N, K);
    }
    return;
  }
#endif
  int blocks = (N + 3) / 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int b = 0; b < blocks; b++) {
    int n0 = b * 4, nn = N - n0 < 4 ? N - n0 : 4;
    for (int m0 = 0; m0 < M; m0 += MMAX) block(x, w, bias, y, m0, M - m0 < MMAX ? M - m0 : MMAX, n0, nn, N, K);
  }
}
