/* The core's counters: one process-wide set, read by phx_io_get_stats.
 *
 * Core side: written on the data path (STAT_ADD: relaxed atomics), read on the control
 * plane (phoenix.io.stats, phx info, the leak checks of the tests).
 */
#include "io_common.h"

struct io_counters io_stats;

void phx_io_get_stats(struct phx_io_stats *o)
{
#define S(x) o->x = atomic_load(&io_stats.x)
    S(contexts); S(threads); S(files); S(requests); S(stream_ops); S(registrations); S(worker_streams);
    S(bounce_bytes); S(bounce_in_use); S(bytes_read); S(bytes_written);
    S(chunks_user); S(chunks_staged); S(chunks_staged_cpu);
    S(io_direct); S(io_buffered); S(reissues); S(direct_fallbacks); S(uring_enters);
    S(cache_hit_bytes); S(cache_misses);
    S(fmap_windows); S(fmap_bytes); S(fmap_hits); S(fmap_misses);
    S(pool_waits); S(copy_flushes);
#undef S
}
