/* The gradient receiver's per-batch work, one pass over a recvmmsg batch (trimlab.agents.rx).
 *
 * tl_rx_route: per datagram, the sender's peer index, the trimlab header's fields (big
 * endian on the wire) and the node's checks (known source, a trimlab header, this job).
 * tl_rx_place: a collector's share of a batch: the sender's rank row, the bucket's checks
 * (wire.screen's, in its order), duplicates (the first copy of a slot wins), and each
 * accepted body copied into its slot.
 *
 * agents/rx.py holds the numpy reference of both; tests/unit/test_rx.py checks that the
 * two leave identical state, statuses and counters. */
#include <stdint.h>
#include <string.h>

#define HEADER_LEN 24
#define MAGIC 0xA
#define VERSION 1

/* header columns (int64), in this order */
enum { F_MAGIC, F_VERSION, F_CODEC, F_FLAGS, F_PLANES, F_PACKET, F_JOB, F_STEP, F_RANK, F_BUCKET,
       F_SPAN, F_COORDS, F_LENGTH, NFIELDS };

/* statuses: 0 is accepted; the node's first, then the collector's (rx.py's REASONS) */
enum { OK, UNKNOWN_SOURCE, NOT_TRIMLAB, OTHER_JOB, RANK_MISMATCH, OTHER_CODEC, OTHER_STREAM,
       BAD_LAYOUT, BAD_LENGTH, DUPLICATE, NREASONS };

static inline int64_t be16(const uint8_t *p) { return (int64_t)p[0] << 8 | p[1]; }
static inline int64_t be32(const uint8_t *p) {
    return (int64_t)p[0] << 24 | (int64_t)p[1] << 16 | (int64_t)p[2] << 8 | p[3];
}

int64_t tl_rx_nfields(void) { return NFIELDS; }

/* Returns how many datagrams passed; counts[status] += 1 for the others. */
int64_t tl_rx_route(const uint8_t *data, int64_t stride, const int64_t *length, const uint8_t *truncated,
                    const uint8_t *addr, int64_t n, const uint8_t *peers, int64_t npeers, int64_t job,
                    int64_t *peer, int64_t *cols, float *scale, int8_t *status, int64_t *counts) {
    int64_t passed = 0;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *h = data + i * stride;
        int64_t *c = cols + i * NFIELDS;
        int64_t p = -1;
        for (int64_t k = 0; k < npeers; k++)
            if (!memcmp(addr + 16 * i, peers + 16 * k, 16)) { p = k; break; }
        peer[i] = p;
        c[F_MAGIC] = h[0] >> 4; c[F_VERSION] = h[0] & 0xF;
        c[F_CODEC] = h[1] >> 4; c[F_FLAGS] = h[1] & 0xF;
        c[F_PLANES] = h[2]; c[F_PACKET] = h[3];
        c[F_JOB] = be16(h + 4); c[F_STEP] = be32(h + 6); c[F_RANK] = be16(h + 10);
        c[F_BUCKET] = be16(h + 12); c[F_SPAN] = be16(h + 14); c[F_COORDS] = be16(h + 16);
        c[F_LENGTH] = be16(h + 18);
        uint32_t s = (uint32_t)be32(h + 20);
        memcpy(scale + i, &s, 4);
        int8_t st = OK;
        if (p < 0) st = UNKNOWN_SOURCE;
        else if (length[i] < HEADER_LEN || truncated[i] || c[F_MAGIC] != MAGIC || c[F_VERSION] != VERSION)
            st = NOT_TRIMLAB;
        else if (c[F_JOB] != job) st = OTHER_JOB;
        status[i] = st;
        if (st) counts[st]++;
        else passed++;
    }
    return passed;
}

/* A collector: its bucket's identity and layout, and the arrays it fills. */
typedef struct {
    int64_t job, step, bucket, codec, flags, planes, body_per32;
    int64_t nranks, expected, width, nblocks;
    const int64_t *ranks, *rank_peer; /* sorted ranks; each one's peer index */
    const int64_t *blocks; /* per block: first span, spans, first packet index, packets per span, coords */
    uint8_t *body;         /* (nranks, expected, width) */
    int64_t *got, *sent, *received;
    float *scale;
} collector_t;

int64_t tl_rx_collector_size(void) { return sizeof(collector_t); }

static int64_t slot_of(const collector_t *k, int64_t span, int64_t packet, int64_t *coords) {
    int64_t first = 0;
    for (int64_t b = 0; b < k->nblocks; b++) {
        const int64_t *B = k->blocks + 5 * b;
        if (span >= B[0] && span < B[0] + B[1] && packet >= B[2] && packet < B[2] + B[3]) {
            *coords = B[4];
            return first + (span - B[0]) * B[3] + packet - B[2];
        }
        first += B[1] * B[3];
    }
    *coords = 0;
    return -1;
}

/* The datagrams `rows` (n of them; NULL: the first n) of a routed batch into collector k,
 * whose rows are `stride` bytes apart and hold `avail` bytes. status[j] gets the j-th's
 * outcome, key[j] its slot (rank row × expected + slot) if accepted, else -1;
 * counts[status] += 1 for the rejected. Returns how many were accepted. */
int64_t tl_rx_place(const collector_t *k, const uint8_t *data, int64_t stride, int64_t avail,
                    const int64_t *length, const int64_t *peer, const int64_t *cols, const float *scale,
                    const int64_t *rows, int64_t n, int8_t *status, int64_t *key, int64_t *counts) {
    int64_t accepted = 0, expected = k->expected > 1 ? k->expected : 1;
    size_t copy = (size_t)(avail - HEADER_LEN < k->width ? avail - HEADER_LEN : k->width);
    for (int64_t j = 0; j < n; j++) {
        int64_t i = rows ? rows[j] : j;
        const int64_t *c = cols + i * NFIELDS;
        key[j] = -1;
        int64_t r = 0; /* the rank's row: the first rank >= it (searchsorted), kept in range */
        while (r < k->nranks - 1 && k->ranks[r] < c[F_RANK]) r++;
        int8_t st = OK;
        int64_t coords, slot = slot_of(k, c[F_SPAN], c[F_PACKET], &coords);
        if (!k->nranks || k->ranks[r] != c[F_RANK] || k->rank_peer[r] != peer[i]) st = RANK_MISMATCH;
        else if (c[F_MAGIC] != MAGIC || c[F_VERSION] != VERSION) st = NOT_TRIMLAB;
        else if (c[F_JOB] != k->job) st = OTHER_JOB;
        else if (c[F_CODEC] != k->codec || c[F_FLAGS] != k->flags || c[F_PLANES] != k->planes) st = OTHER_CODEC;
        else if (c[F_STEP] != k->step || c[F_BUCKET] != k->bucket) st = OTHER_STREAM;
        else if (slot < 0 || coords != c[F_COORDS]) st = BAD_LAYOUT;
        else if (c[F_LENGTH] != HEADER_LEN + k->body_per32 * c[F_COORDS] / 32 || length[i] > c[F_LENGTH])
            st = BAD_LENGTH;
        else if (k->got[r * k->expected + slot] >= 0) st = DUPLICATE;
        status[j] = st;
        if (st) {
            counts[st]++;
            continue;
        }
        int64_t at = r * k->expected + slot;
        memcpy(k->body + at * k->width, data + i * stride + HEADER_LEN, copy);
        k->got[at] = length[i] - HEADER_LEN;
        k->scale[at] = scale[i];
        k->sent[at] = c[F_LENGTH];
        k->received[r]++;
        key[j] = r * expected + slot;
        accepted++;
    }
    return accepted;
}
