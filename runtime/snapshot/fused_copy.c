/* phalanx fused copy: copy a tensor's bytes into a snapshot slot and return their
 * XXH3-128 digest, reading each byte from memory once.
 *
 * Each 32 KiB piece is hashed from the source first (which pulls it into L1), then copied
 * from that hot source to the slot with non-temporal stores: memory sees one read of the
 * source and one write of the slot, no read-for-ownership of the slot's lines, so on the
 * 2-core CI machine copy + hash outrun a plain memcpy (runtime/snapshot/fused_copy.py).
 *
 * The XXH3 functions are python-xxhash's own (passed in as pointers), so this file needs
 * no header beyond the C library and the one digest is the one the Python path computes.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

typedef struct { uint64_t low64, high64; } xxh128;
typedef struct {
    void *(*create)(void);
    int (*release)(void *);
    int (*reset)(void *);
    int (*update)(void *, const void *, size_t);
    xxh128 (*digest)(const void *);
} xxh_api;

enum { PIECE = 32 * 1024 };

static void stream_copy(unsigned char *dst, const unsigned char *src, size_t n) {
#if defined(__SSE2__)
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head; src += head; n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
#else
    memcpy(dst, src, n);
#endif
}

static void fence(void) {
#if defined(__SSE2__)
    _mm_sfence();   /* streamed stores visible before the caller hands the slot on */
#endif
}

static void put_be64(unsigned char *p, uint64_t v) {
    for (int i = 7; i >= 0; i--) { p[i] = (unsigned char)v; v >>= 8; }
}

/* Copy src[0:n) to dst[0:n) and write the canonical (big-endian) XXH3-128 of those bytes
 * to out[0:16). Returns 0, or -1 when the hash state cannot be allocated. */
int phalanx_copy_digest(const xxh_api *api, unsigned char *dst, const unsigned char *src,
                        size_t n, unsigned char *out) {
    void *state = api->create();
    if (state == NULL) return -1;
    api->reset(state);
    for (size_t off = 0; off < n; off += PIECE) {
        size_t len = n - off < PIECE ? n - off : PIECE;
        api->update(state, src + off, len);
        stream_copy(dst + off, src + off, len);
    }
    fence();
    xxh128 h = api->digest(state);
    api->release(state);
    put_be64(out, h.high64);
    put_be64(out + 8, h.low64);
    return 0;
}

/* The copy alone, with the same stores (the bench's streaming-copy limit). */
void phalanx_stream_copy(unsigned char *dst, const unsigned char *src, size_t n) {
    stream_copy(dst, src, n);
    fence();
}
