/* The one sequential part of reading a capture: each record's (pcap) or block's (pcapng)
 * offset depends on the length of the one before. Everything else is numpy.
 * Both walkers fill `offs` with up to `cap` offsets starting at `*pos`, leave `*pos` at
 * the first offset not yet walked, and stop at a record cut short by the file's end. */
#include <stdint.h>
#include <string.h>

static uint32_t u32(const uint8_t *p, int swap) {
    uint32_t v;
    memcpy(&v, p, 4);
    return swap ? __builtin_bswap32(v) : v;
}

/* pcap: 16-byte record headers, incl_len at +8. */
long pcap_walk(const uint8_t *buf, long len, int swap, long *pos, int64_t *offs, long cap) {
    long n = *pos, k = 0;
    while (k < cap && n + 16 <= len) {
        long next = n + 16 + (long)u32(buf + n + 8, swap);
        if (next > len)
            break;
        offs[k++] = n;
        n = next;
    }
    *pos = n;
    return k;
}

/* pcapng: every block has its total length at +4; a section header (0x0A0D0D0A) sets the
 * byte order of the blocks after it from its byte-order magic. */
long pcapng_walk(const uint8_t *buf, long len, int *swap, long *pos, int64_t *offs, long cap) {
    long n = *pos, k = 0;
    while (k < cap && n + 12 <= len) {
        uint32_t type;
        memcpy(&type, buf + n, 4);
        if (type == 0x0A0D0D0A)
            *swap = buf[n + 8] == 0x1A;  /* 1A2B3C4D stored big-endian: swap on this host */
        uint32_t blen = u32(buf + n + 4, *swap);
        if (blen < 12 || n + (long)blen > len)
            break;
        offs[k++] = n;
        n += blen;
    }
    *pos = n;
    return k;
}
