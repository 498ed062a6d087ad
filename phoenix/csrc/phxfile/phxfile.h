/* The phxFile C ABI (frozen; what LMCache's `phx` GDS backend loads with ctypes).
 *
 * Every call returns 0 or a negative errno. The async calls are stream ordered: after
 * the stream is synchronized, *bytes_done holds the byte count or a negative errno;
 * submission errors are returned at once (and also stored into *bytes_done). Parameter
 * order is hipFile's (file offset before buffer offset).
 */
#ifndef PHXFILE_H
#define PHXFILE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

int phxFileDriverOpen(void);
int phxFileDriverClose(void);
int phxFileBufRegister(const void *addr, size_t length);
int phxFileBufDeregister(const void *addr);
int phxFileHandleRegister(void **fh, int fd);
int phxFileHandleDeregister(void *fh);
int phxFileStreamRegister(void *stream);
int phxFileStreamDeregister(void *stream);
int phxFileReadAsync(void *fh, void *buf_base, size_t *nbytes, int64_t *file_offset, int64_t *buf_offset,
                     int64_t *bytes_done, void *stream);
int phxFileWriteAsync(void *fh, void *buf_base, size_t *nbytes, int64_t *file_offset, int64_t *buf_offset,
                      int64_t *bytes_done, void *stream);

#ifdef __cplusplus
}
#endif

#endif
