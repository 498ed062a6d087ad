/* Test hooks of the host test-double library (libphxhostrt.so), not of the C core.
 *
 * Test side, data path: phx_testing_hostfn is a plain C stream host callback that
 * tests and the conformance suite queue with any vendor's launch_host_func (the host
 * runtime's, an emulator's, CUDA's on hardware) between stream I/O and copies, so that
 * ordering is observed without any Python on the stream. It calls no accelerator
 * runtime, so it runs in any process; phoenix/_testing/__init__.py mirrors the struct.
 */
#ifndef PHX_TESTING_H
#define PHX_TESTING_H

#include <stdint.h>

/* kind 0 copies size bytes src -> dst (a snapshot of a buffer at that point of the
 * stream), kind 1 preads size bytes of fd at offset into dst (a snapshot of the file);
 * kind 2 holds the stream until the int64 at src is non-zero (a gate), kind 3 holds
 * it for size microseconds; all then take a ticket from *counter into seq (the
 * callback's place in time) and store the outcome (bytes or -errno) into result. */
struct phx_testing_hostfn {
    int32_t kind, fd;
    uint64_t dst, src, size;
    int64_t offset;
    int64_t *counter;
    int64_t seq, result;
};
void phx_testing_hostfn(void *arg);

#endif
