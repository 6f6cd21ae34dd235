/* CRC-32 (zlib's polynomial) of every record: its Python twin is
 * zlib.crc32, as record/tracefile.py and record/reader.py call it. */

/* -- CRC-32 (zlib's polynomial), slicing by 8 ----------------------------- */

static uint32_t crc_table[8][256];
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define CRC_FOLDS 1
static int crc_clmul; /* the CPU multiplies without carries (crc_folded) */
#endif

static void crc_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int t = 1; t < 8; t++)
            crc_table[t][n] = crc_table[0][crc_table[t - 1][n] & 0xFF] ^ (crc_table[t - 1][n] >> 8);
#ifdef CRC_FOLDS
    __builtin_cpu_init();
    crc_clmul = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
#endif
}

/* Where the CPU multiplies without carries (x86-64's PCLMULQDQ), the bulk of
 * a record is folded 64 bytes a step with the constants of zlib's polynomial
 * (x^k mod P for the fold distances, and Barrett's reduction at the end), as
 * in Intel's "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ";
 * a level-3 record (several hundred bytes) then costs tens of nanoseconds,
 * not a third of the call. The register is zlib's, uninverted, in and out. */
#ifdef CRC_FOLDS
#include <immintrin.h>

__attribute__((target("pclmul,sse4.1"))) static inline __m128i crc_fold16(__m128i x, __m128i k, __m128i data) {
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), data);
}

/* n: at least 64, a multiple of 16. */
__attribute__((target("pclmul,sse4.1"))) static uint32_t crc_folded(uint32_t c, const unsigned char *p, size_t n) {
    const __m128i by64 = _mm_set_epi64x(0x1c6e41596, 0x154442bd4), by16 = _mm_set_epi64x(0x0ccaa009e, 0x1751997d0);
    const __m128i by4 = _mm_set_epi64x(0, 0x163cd6124), barrett = _mm_set_epi64x(0x1f7011641, 0x1db710641);
    const __m128i low32 = _mm_set_epi32(0, 0, 0, -1);
    __m128i x1 = _mm_xor_si128(_mm_loadu_si128((const __m128i *)p), _mm_cvtsi32_si128((int)c));
    __m128i x2 = _mm_loadu_si128((const __m128i *)(p + 16)), x3 = _mm_loadu_si128((const __m128i *)(p + 32)),
            x4 = _mm_loadu_si128((const __m128i *)(p + 48));
    for (p += 64, n -= 64; n >= 64; p += 64, n -= 64) {
        x1 = crc_fold16(x1, by64, _mm_loadu_si128((const __m128i *)p));
        x2 = crc_fold16(x2, by64, _mm_loadu_si128((const __m128i *)(p + 16)));
        x3 = crc_fold16(x3, by64, _mm_loadu_si128((const __m128i *)(p + 32)));
        x4 = crc_fold16(x4, by64, _mm_loadu_si128((const __m128i *)(p + 48)));
    }
    x1 = crc_fold16(crc_fold16(crc_fold16(x1, by16, x2), by16, x3), by16, x4);
    for (; n >= 16; p += 16, n -= 16)
        x1 = crc_fold16(x1, by16, _mm_loadu_si128((const __m128i *)p));
    /* 128 bits to 64, to 32, then Barrett's reduction to the remainder */
    x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), _mm_clmulepi64_si128(x1, by16, 0x10));
    x1 = _mm_xor_si128(_mm_srli_si128(x1, 4), _mm_clmulepi64_si128(_mm_and_si128(x1, low32), by4, 0x00));
    __m128i t = _mm_clmulepi64_si128(_mm_and_si128(x1, low32), barrett, 0x10);
    t = _mm_clmulepi64_si128(_mm_and_si128(t, low32), barrett, 0x00);
    return (uint32_t)_mm_extract_epi32(_mm_xor_si128(x1, t), 1);
}
#endif

static uint32_t crc32_of(const unsigned char *p, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
#ifdef CRC_FOLDS
    if (crc_clmul && n >= 64) {
        c = crc_folded(c, p, n & ~(size_t)15);
        p += n & ~(size_t)15;
        n &= 15;
    }
#endif
    while (n >= 8) {
        uint32_t one, two;
        memcpy(&one, p, 4);
        memcpy(&two, p + 4, 4);
        one ^= c;
        c = crc_table[7][one & 0xFF] ^ crc_table[6][(one >> 8) & 0xFF] ^ crc_table[5][(one >> 16) & 0xFF] ^
            crc_table[4][one >> 24] ^ crc_table[3][two & 0xFF] ^ crc_table[2][(two >> 8) & 0xFF] ^
            crc_table[1][(two >> 16) & 0xFF] ^ crc_table[0][two >> 24];
        p += 8;
        n -= 8;
    }
    while (n--)
        c = crc_table[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

static PyObject *crc32_py(PyObject *module, PyObject *arg) {
    Py_buffer data;
    if (PyObject_GetBuffer(arg, &data, PyBUF_SIMPLE) < 0)
        return NULL;
    uint32_t crc = crc32_of(data.buf, (size_t)data.len);
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLong(crc);
}
