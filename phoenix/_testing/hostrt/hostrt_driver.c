/* The host reference runtime (a TEST DOUBLE), vendor-runtime side: the driver API.
 *
 * Test side (a vendor runtime's test double, outside the C core): only in emulators
 * built with PHXRT_DRIVER_PREFIX (cu: cuInit, cuPointerGetAttribute, ...); empty in
 * libphxhostrt.so and in emulators without it. It answers from the runtime's state
 * (hostrt.c's devices, hostrt_mem.c's ranges).
 */
#define _GNU_SOURCE
#include "hostrt_internal.h"

/* -- the driver API of emulators built with PHXRT_DRIVER_PREFIX (cu*) ------------------- */

#ifdef PHXRT_DRIVER_PREFIX
#define DRIVER_STR STR(PHXRT_DRIVER_PREFIX)
enum { CU_NOT_INITIALIZED = 3, CU_NOT_SUPPORTED = 801, CU_MEMORYTYPE_HOST = 1, CU_MEMORYTYPE_DEVICE = 2 };

static int g_driver_initialized;

static const struct err_entry g_cu_errors[] = {
    {PHXRT_SUCCESS, "CUDA_SUCCESS", "no error"},
    {PHXRT_ERR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CU_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error (" DRIVER_STR "Init was not called)"},
    {PHXRT_ERR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {PHXRT_ERR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CU_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported (by the emulated driver)"},
};

#define ENSURE_DRIVER()                                                                            \
    do {                                                                                           \
        if (!__atomic_load_n(&g_driver_initialized, __ATOMIC_ACQUIRE))                             \
            return CU_NOT_INITIALIZED;                                                             \
    } while (0)

int DRV(Init)(unsigned flags)
{
    if (flags)
        return PHXRT_ERR_INVALID_VALUE;
    pthread_once(&g_once, init_once);
    if (g.status != PHXRT_SUCCESS)
        return g.status;
    __atomic_store_n(&g_driver_initialized, 1, __ATOMIC_RELEASE);
    return PHXRT_SUCCESS;
}

int DRV(DriverGetVersion)(int *version)
{
    if (!version)
        return PHXRT_ERR_INVALID_VALUE;
    *version = PHXRT_VERSION; /* answered before Init, as the real one is */
    return PHXRT_SUCCESS;
}

int DRV(DeviceGetCount)(int *count)
{
    ENSURE_DRIVER();
    if (!count)
        return PHXRT_ERR_INVALID_VALUE;
    *count = g.ndev;
    return PHXRT_SUCCESS;
}

int DRV(DeviceGetName)(char *buf, int len, int device)
{
    ENSURE_DRIVER();
    if (device < 0 || device >= g.ndev)
        return PHXRT_ERR_INVALID_DEVICE;
    if (!buf || len <= 0)
        return PHXRT_ERR_INVALID_VALUE;
    snprintf(buf, (size_t)len, "%s", DEVICE_NAME); /* truncates, as cuDeviceGetName does */
    return PHXRT_SUCCESS;
}

int DRV(PointerGetAttribute)(void *data, int attribute, unsigned long long ptr)
{
    ENSURE_DRIVER();
    if (!data)
        return PHXRT_ERR_INVALID_VALUE;
    pthread_mutex_lock(&g_mem);
    struct range *r = ranges_find((uintptr_t)ptr);
    struct range copy = r ? *r : (struct range){0};
    pthread_mutex_unlock(&g_mem);
    if (!r)
        return PHXRT_ERR_INVALID_VALUE; /* memory the driver does not know: cuPointerGetAttribute's answer */
    switch (attribute) {
    case PHXRT_CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
        *(unsigned *)data = copy.type == R_DEVICE ? CU_MEMORYTYPE_DEVICE : CU_MEMORYTYPE_HOST;
        break;
    case PHXRT_CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
    case PHXRT_CU_POINTER_ATTRIBUTE_HOST_POINTER:
        if (attribute == PHXRT_CU_POINTER_ATTRIBUTE_HOST_POINTER && copy.type == R_DEVICE)
            return PHXRT_ERR_INVALID_VALUE;
        *(unsigned long long *)data = ptr;
        break;
    case PHXRT_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
        *(int *)data = copy.device;
        break;
    case PHXRT_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
        *(unsigned long long *)data = copy.base;
        break;
    case PHXRT_CU_POINTER_ATTRIBUTE_RANGE_SIZE:
        *(size_t *)data = copy.size;
        break;
    default:
        return CU_NOT_SUPPORTED;
    }
    return PHXRT_SUCCESS;
}

int DRV(GetErrorName)(int error, const char **name)
{
    if (!name)
        return PHXRT_ERR_INVALID_VALUE;
    const struct err_entry *e = err_find(g_cu_errors, sizeof g_cu_errors / sizeof g_cu_errors[0], error);
    *name = e ? e->name : NULL;
    return e ? PHXRT_SUCCESS : PHXRT_ERR_INVALID_VALUE;
}

int DRV(GetErrorString)(int error, const char **message)
{
    if (!message)
        return PHXRT_ERR_INVALID_VALUE;
    const struct err_entry *e = err_find(g_cu_errors, sizeof g_cu_errors / sizeof g_cu_errors[0], error);
    *message = e ? e->message : NULL;
    return e ? PHXRT_SUCCESS : PHXRT_ERR_INVALID_VALUE;
}
#endif /* PHXRT_DRIVER_PREFIX */
