/* When a polling worker looks at its copies again: a prediction of a batch's completion.
 *
 * Core side, data path; pure arithmetic on one worker's state (no clock read, no vendor
 * call, no lock), so tests build it alone and run it against a model of streams and of
 * the worker's loop (tests/test_copy_est.py).
 *
 * A worker that learns its staged copies are done by polling an event (io_copy.c) pays a
 * ring enter and a timer for every look. For staged writes (each chunk's file write waits
 * for its device -> slot copy: looks in steps doubled from IO_POLL_NS cost a write of 8
 * MiB four or more), it predicts when the first pending batch of each device ends and
 * sleeps until the earliest: a batch's copy starts when it was queued or when the batch
 * before it on its device's stream ended, and takes bytes x ns_b, the time per byte
 * learnt. Read batches are queued with 0 bytes: not predicted, the steps as before (a
 * load waits for them; a model of loads found predictions from the looks that reads in
 * flight allow later than the steps).
 *
 * Learning. What the looks teach is an interval. The batch before ended after its last
 * look that found it not done and before the look that found it done; so a batch's copy
 * took at most (the look that found it done - its earliest start) and at least (its last
 * look that found it not done - its latest start).
 *   - An upper bound below the estimate is taken as it is (copies are at least that fast).
 *   - A lower bound at or above it (a look at the predicted end found the copy not done),
 *     for the second batch in a row, raises it to the interval's middle, by an eighth at
 *     most; never from a batch that also waited for the caller's stream (fenced): one slow
 *     copy does not make the next ones wait.
 *   - Other looks (woken by file I/O, by a backstop) teach nothing: a late look is not a
 *     slow copy.
 * The estimate starts from the first batch seen in progress and then done with its time
 * known within a factor of 4 (poll_ns steps give that; a batch queued behind others does
 * not: its start is not known); predictions start after a second batch, also looked at in
 * steps, so a slow first copy (a cold start) is corrected before anything waits on it.
 * Only batches of at least IO_POLL_LEARN_BYTES are predicted and teach (a small copy's
 * time is its fixed cost), and copies predicted shorter than IO_POLL_SHORT_NS are left to
 * poll_ns's first step, which sees them as soon.
 *
 * Looks, for a batch: the nearest ahead of its predicted end from its earliest start, from
 * its likely start (the batch before's predicted end, within what is known) and from its
 * latest, each also an eighth and a quarter of its time later (a copy a little slower);
 * when all are past, poll_ns steps (a copy much slower, or one that waited for the
 * caller's stream). A batch queued after the one before was seen done has one start, so
 * one look. Probes: after IO_POLL_PROBE_EVERY batches seen, and after a batch that lowered
 * the estimate, the next batch whose probe look is still ahead is also looked at at 7/8 of
 * its time from its earliest start (a copy faster than the estimate is seen there, and the
 * estimate falls), at 1/2 after one that halved the estimate or more: the search for a
 * much faster copy takes a few batches, not dozens.
 */
#ifndef PHX_IO_COPY_EST_H
#define PHX_IO_COPY_EST_H

#include <math.h>
#include <stdint.h>

#define IO_POLL_LEARN_BYTES (256ull << 10)
#define IO_POLL_MIN_NS (5ll * 1000)        /* the shortest sleep for a prediction */
#define IO_POLL_SHORT_NS (20ll * 1000)     /* copies predicted shorter: poll_ns steps (IO_POLL_NS) */
#define IO_POLL_DUE_MAX_NS (1000ll * 1000) /* a farther prediction is looked at then */
#define IO_POLL_PROBE_EVERY 4              /* batches seen per probe */
#define IO_POLL_NS_B_MAX 1000.0            /* the estimate's cap: a copy at 1 MB/s */
#define IO_COPY_EST_DEVICES 64             /* devices tracked (IO_MAX_DEVICES) */

/* One batch of copies on one device's stream, whose completion the worker polls. */
struct copy_batch {
    uint64_t bytes;
    int64_t queued_ns;
    int64_t miss_ns; /* the last look that found it not done (0: none) */
    int dev;
    int probe;  /* a probe look was planned for it (copy_est_due): 1 at 7/8, 2 at 1/2 */
    int fenced; /* its copies also waited for the caller's stream */
};

struct copy_est {
    double ns_b;  /* a copy's time per byte (0: nothing learnt yet) */
    int chain;    /* after a lowered estimate: the next probe (1 at 7/8, 2 at 1/2), now */
    int since;    /* batches seen since the last probe */
    int samples;  /* batches it learnt from (up to 2: predictions start at 2) */
    int slow;     /* batches in a row seen not done at their predicted ends */
    /* per device: the last batch seen done ended before seen_ns and after ended_ns, at
     * likely_ns by the estimate (within the two) */
    int64_t seen_ns[IO_COPY_EST_DEVICES];
    int64_t ended_ns[IO_COPY_EST_DEVICES];
    int64_t likely_ns[IO_COPY_EST_DEVICES];
};

/* A batch is queued on device dev's stream at now. */
static inline void copy_est_queue(struct copy_batch *b, int dev, uint64_t bytes, int64_t now, int fenced)
{
    b->bytes = bytes;
    b->queued_ns = now;
    b->miss_ns = 0;
    b->dev = dev >= 0 && dev < IO_COPY_EST_DEVICES ? dev : 0;
    b->probe = 0;
    b->fenced = fenced;
}

static inline int64_t copy_est_max(int64_t a, int64_t b)
{
    return a > b ? a : b;
}

/* When a batch's copy can have started: queued, or after the batch before it on its device
 * ended, at the earliest (ended_ns), by the estimate (likely_ns), at the latest (seen_ns). */
struct copy_starts {
    int64_t lo, likely, hi;
};

static inline struct copy_starts copy_est_starts(const struct copy_est *c, const struct copy_batch *b)
{
    int d = b->dev;
    return (struct copy_starts){copy_est_max(b->queued_ns, c->ended_ns[d]), copy_est_max(b->queued_ns, c->likely_ns[d]),
                                copy_est_max(b->queued_ns, c->seen_ns[d])};
}

/* A look at now found the batch not done. */
static inline void copy_est_missed(struct copy_batch *b, int64_t now)
{
    b->miss_ns = copy_est_max(b->miss_ns, now);
}

static inline double copy_est_ns_b(int64_t ns, uint64_t bytes)
{
    double v = (double)ns / (double)bytes;
    return v < IO_POLL_NS_B_MAX ? v : IO_POLL_NS_B_MAX;
}

/* Learn from a batch seen done (its copy took between least and most per byte). */
static inline void copy_est_learn(struct copy_est *c, const struct copy_batch *b, double least, double most)
{
    if (c->ns_b <= 0) {
        /* seen in progress, then done, within a factor of 4: the interval's geometric middle */
        if (least > 0 && least >= most / 4 && !b->fenced) {
            c->ns_b = sqrt(least * most);
            c->samples = 1;
            c->chain = 1; /* and probe: is it faster? */
        }
        return;
    }
    if (!b->fenced && c->samples < 2)
        c->samples++;
    if (most < c->ns_b) {
        c->chain = most <= c->ns_b * 9 / 16 ? 2 : 1; /* about halved: search on at 1/2 */
        c->ns_b = most;
        c->slow = 0;
    } else if (b->probe == 2 && least > 0 && least < c->ns_b) {
        c->ns_b = (least + c->ns_b) / 2; /* the search down overshot: between the two */
        c->chain = 1;
        c->slow = 0;
    } else if (least >= c->ns_b * 63 / 64 && !b->fenced) { /* not done at about its end */
        c->chain = 0;
        if (++c->slow >= 2) {
            double mid = (least + most) / 2, cap = c->ns_b * 9 / 8;
            c->ns_b = mid < cap ? mid : cap;
        }
    } else {
        if (b->probe)
            c->chain = 0; /* a probe found it not done: the search down ends */
        c->slow = 0;
    }
}

/* A look at now found the batch done. learn = 0: an earlier batch of its device was seen
 * done by the same look (this one's start is not known): only the times are kept. Call
 * it for the batches of a device in their stream's order. */
static inline void copy_est_seen(struct copy_est *c, const struct copy_batch *b, int64_t now, int learn)
{
    int d = b->dev;
    struct copy_starts st = copy_est_starts(c, b);
    if (learn && b->bytes >= IO_POLL_LEARN_BYTES && now > st.lo) {
        double most = copy_est_ns_b(now - st.lo, b->bytes);
        double least = b->miss_ns > st.hi ? copy_est_ns_b(b->miss_ns - st.hi, b->bytes) : 0;
        copy_est_learn(c, b, least, most);
    }
    if (b->probe)
        c->since = 0;
    else if (c->since < IO_POLL_PROBE_EVERY)
        c->since++;
    int64_t ended = copy_est_max(b->miss_ns, st.lo);
    /* its predicted end, within [ended, now] (in double: no overflow) */
    double end = (double)st.likely + (double)b->bytes * c->ns_b;
    int64_t likely = c->ns_b <= 0 || end <= (double)ended ? ended : end >= (double)now ? now : (int64_t)end;
    c->ended_ns[d] = copy_est_max(c->ended_ns[d], ended);
    c->likely_ns[d] = copy_est_max(c->likely_ns[d], likely);
    c->seen_ns[d] = copy_est_max(c->seen_ns[d], now);
}

/* How long to sleep before the next look at a batch (the first pending of its device):
 * in [IO_POLL_MIN_NS, IO_POLL_DUE_MAX_NS], or 0 when nothing is predicted (too little
 * learnt, a small batch or a short copy, or its last predicted end past: poll_ns steps).
 * Plans a probe look for it (b->probe) if one is due and still ahead; *probing: the sleep
 * ends at that look (the worker then wakes for it even where completions would wake it). */
static inline int64_t copy_est_due(const struct copy_est *c, struct copy_batch *b, int64_t now, int *probing)
{
    *probing = 0;
    if (c->samples < 2 || b->bytes < IO_POLL_LEARN_BYTES)
        return 0;
    double span = (double)b->bytes * c->ns_b; /* at most 2^64 x 1000 ns: no overflow in double */
    if (span < (double)IO_POLL_SHORT_NS)
        return 0;
    struct copy_starts st = copy_est_starts(c, b);
    double lo = (double)st.lo, likely = (double)st.likely, hi = (double)st.hi;
    int probe = b->probe ? b->probe : c->chain ? c->chain : c->since >= IO_POLL_PROBE_EVERY;
    double probe_at = lo + (probe == 2 ? span / 2 : span * 7 / 8);
    if (!b->probe && probe && probe_at - (double)now > 0)
        b->probe = probe; /* planned: this batch is the probe */
    double looks[8] = {b->probe ? probe_at : -1.0,
                       lo + span,
                       likely + span,
                       likely + span * 9 / 8,
                       likely + span * 5 / 4,
                       hi + span,
                       hi + span * 9 / 8,
                       hi + span * 5 / 4};
    double left = -1; /* the nearest look still ahead */
    for (int i = 0; i < 8; i++) {
        double l = looks[i] - (double)now;
        if (l > 0 && (left < 0 || l < left)) {
            left = l;
            *probing = i == 0;
        }
    }
    if (left < 0)
        return 0;
    return left < (double)IO_POLL_MIN_NS      ? IO_POLL_MIN_NS
           : left < (double)IO_POLL_DUE_MAX_NS ? (int64_t)left + 1
                                               : IO_POLL_DUE_MAX_NS;
}

/* The sleep before the next look at a worker's pending batches, heads[0..n) the first
 * pending batch of each device: the earliest of their dues, 0 if any has none; *probing:
 * that earliest is a probe look. */
static inline int64_t copy_est_due_heads(const struct copy_est *c, struct copy_batch *const *heads, int n, int64_t now,
                                         int *probing)
{
    int64_t best = 0;
    *probing = 0;
    for (int i = 0; i < n; i++) {
        int p = 0;
        int64_t d = copy_est_due(c, heads[i], now, &p);
        if (!d) {
            *probing = 0;
            return 0;
        }
        if (!best || d < best) {
            best = d;
            *probing = p;
        }
    }
    return best;
}

#endif
