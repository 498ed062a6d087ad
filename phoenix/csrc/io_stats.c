/* The core's counters: one process-wide set, read by phx_io_get_stats.
 *
 * Core side: written on the data path (STAT_ADD: relaxed atomics), read on the control
 * plane (phoenix.io.stats, phx info, the leak checks of the tests).
 */
#include "io_common.h"

struct io_counters io_stats;

void phx_io_get_stats(struct phx_io_stats *o)
{
#define S(name) o->name = atomic_load(&io_stats.name);
    PHX_IO_STATS(S)
#undef S
}
