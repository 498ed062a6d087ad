/* When a polling worker looks at its copies again: a prediction of a batch's completion.
 *
 * Core side, data path; pure arithmetic on one worker's state (no clock read, no vendor
 * call, no lock), so tests build it alone and run it against a model of a stream
 * (tests/test_copy_est.py).
 *
 * A worker that learns its staged copies are done by polling an event (io_copy.c) pays a
 * ring enter and a timer for every look. Instead of looking in steps doubled from
 * IO_POLL_NS, it predicts when the oldest batch ends: the copy starts when the batch was
 * queued or when the one before it was seen done (one stream runs them in order) and
 * takes bytes x ns_b, the time per byte the copies took so far. It looks there (most are
 * done), then in poll_ns steps. A probe batch (every IO_POLL_PROBE_EVERY-th, and every
 * one while they find copies faster than the estimate) is also looked at at 7/8 of it.
 *
 * What a look sees is an upper bound of the copy's time (it ended before the look, or it
 * waited for the caller's stream first). One below the estimate is taken as it is (the
 * copies are at least that fast); one above raises the estimate by an eighth of the
 * difference, and by an eighth of itself at most (a long wait for the caller's stream is
 * not a slow copy). Only batches of at least IO_POLL_LEARN_BYTES teach it (a copy's fixed
 * cost is not per byte).
 */
#ifndef PHX_IO_COPY_EST_H
#define PHX_IO_COPY_EST_H

#include <stdint.h>

#define IO_POLL_LEARN_BYTES (256ull << 10)
#define IO_POLL_MIN_NS (5ll * 1000)        /* a prediction nearer than this is not waited for */
#define IO_POLL_DUE_MAX_NS (1000ll * 1000) /* ... one farther is looked at then */
#define IO_POLL_PROBE_EVERY 4              /* batches per one looked at early too */
#define IO_POLL_NS_B_MAX 1000.0            /* the estimate's cap: a copy at 1 MB/s */

struct copy_est {
    double ns_b;      /* a copy's time per byte (0: nothing learnt yet) */
    int64_t seen_ns;  /* when the last batch was seen done (the next one's start) */
    unsigned batches; /* batches queued so far */
    int chain;        /* the last look that taught something found a faster copy: probe */
};

/* A batch is queued: is it a probe? */
static inline int copy_est_queued(struct copy_est *c)
{
    return c->batches++ % IO_POLL_PROBE_EVERY == 0 || c->chain;
}

static inline int64_t copy_est_start(const struct copy_est *c, int64_t queued_ns)
{
    return queued_ns > c->seen_ns ? queued_ns : c->seen_ns;
}

/* A batch of `bytes` queued at queued_ns was seen done at now. learn = 0: not the first
 * batch this look saw done (its start is not known), only the look's time is kept. */
static inline void copy_est_seen(struct copy_est *c, uint64_t bytes, int64_t queued_ns, int64_t now, int learn)
{
    int64_t start = copy_est_start(c, queued_ns);
    if (learn && bytes >= IO_POLL_LEARN_BYTES && now > start) {
        double ns_b = (double)(now - start) / (double)bytes;
        if (ns_b > IO_POLL_NS_B_MAX)
            ns_b = IO_POLL_NS_B_MAX;
        c->chain = 0;
        if (c->ns_b <= 0) {
            c->ns_b = ns_b;
        } else if (ns_b < c->ns_b) {
            c->ns_b = ns_b;
            c->chain = 1;
        } else if (ns_b > 2 * c->ns_b) {
            c->ns_b += c->ns_b / 8;
        } else {
            c->ns_b += (ns_b - c->ns_b) / 8;
        }
        if (c->ns_b > IO_POLL_NS_B_MAX)
            c->ns_b = IO_POLL_NS_B_MAX;
    }
    if (now > c->seen_ns)
        c->seen_ns = now;
}

/* How long to sleep before looking at the oldest batch (bytes, queued_ns, probe) again:
 * in [IO_POLL_MIN_NS, IO_POLL_DUE_MAX_NS], or 0 when nothing is predicted (nothing learnt
 * yet, or the predicted end is past or nearer than IO_POLL_MIN_NS: poll_ns decides). */
static inline int64_t copy_est_due(const struct copy_est *c, uint64_t bytes, int64_t queued_ns, int probe, int64_t now)
{
    if (c->ns_b <= 0)
        return 0;
    int64_t start = copy_est_start(c, queued_ns);
    double span = (double)bytes * c->ns_b; /* at most 2^64 x 1000 ns: no overflow in double */
    double looks[2] = {(double)start + span * 7 / 8, (double)start + span};
    for (int i = probe ? 0 : 1; i < 2; i++) {
        double left = looks[i] - (double)now;
        if (left >= (double)IO_POLL_MIN_NS)
            return left < (double)IO_POLL_DUE_MAX_NS ? (int64_t)left : IO_POLL_DUE_MAX_NS;
    }
    return 0;
}

#endif
