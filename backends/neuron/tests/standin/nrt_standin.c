/*
 * Stand-in Neuron runtime for kvpush's tests: the libnrt calls the Neuron
 * backend makes, with the signatures and status codes of the Neuron runtime
 * headers (nrt/nrt.h, nrt/nrt_async.h), implemented over host memory.
 *
 * It is not libnrt: "device" tensors are page-aligned host allocations, so
 * NIXL over UCX can move them as DRAM. What it keeps from the real API is
 * what the backend depends on: nrt_init before use (NRT_UNINITIALIZED
 * otherwise, NRT_CLOSED after nrt_close), opaque tensor handles, VAs only
 * through nrt_tensor_get_va, bounds-checked reads/writes/copies, device
 * copies only within one Neuron core, and nrt_get_attached_efa_bdf answering
 * only for device memory. Written from the documented API; no SDK code.
 *
 * Two extras, prefixed kvpush_standin_, exist only here and are used only by
 * tests: a delayed write that models a prefill still running on the device
 * (completion reported through nrta_is_completed), and a live-tensor count.
 *
 * Build: cc -shared -fPIC -O2 -pthread -o libnrt.so.1 nrt_standin.c
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef enum {
    NRT_SUCCESS = 0,
    NRT_FAILURE = 1,
    NRT_INVALID = 2,
    NRT_INVALID_HANDLE = 3,
    NRT_RESOURCE = 4,
    NRT_UNINITIALIZED = 13,
    NRT_CLOSED = 14,
} NRT_STATUS;

typedef enum {
    NRT_TENSOR_PLACEMENT_DEVICE,
    NRT_TENSOR_PLACEMENT_HOST,
    NRT_TENSOR_PLACEMENT_VIRTUAL,
} nrt_tensor_placement_t;

typedef uint64_t nrta_seq_t;

#define STANDIN_MAGIC 0x6b767075736e7274ull /* "kvpusnrt" */
#define STANDIN_BDF "0000:10:1c.0"
#define STANDIN_VNCS 4
#define STANDIN_MAX_SEQ 4096
#define NRTA_XU_TENSOR_WRITE 1ull

typedef struct nrt_tensor {
    uint64_t magic;
    unsigned char *mem;
    size_t size;
    int vnc;
    int placement;
    struct nrt_tensor *next;
} nrt_tensor_t;

enum { STATE_START = 0, STATE_INIT = 1, STATE_CLOSED = 3 };

static int g_state = STATE_START;
static nrt_tensor_t *g_live = NULL;
static size_t g_live_count = 0;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_uchar g_done[STANDIN_MAX_SEQ];
static atomic_uint_fast64_t g_next_seq = 1;
static atomic_int g_pending = 0;

static NRT_STATUS state_gate(void) {
    if (g_state == STATE_INIT) return NRT_SUCCESS;
    return g_state == STATE_CLOSED ? NRT_CLOSED : NRT_UNINITIALIZED;
}

/* Whether t is a live tensor handed out by nrt_tensor_allocate; caller holds g_lock. */
static bool is_live(const nrt_tensor_t *t) {
    for (const nrt_tensor_t *p = g_live; p; p = p->next)
        if (p == t) return p->magic == STANDIN_MAGIC;
    return false;
}

static NRT_STATUS check_tensor(const nrt_tensor_t *t, size_t offset, size_t size) {
    NRT_STATUS st = state_gate();
    if (st != NRT_SUCCESS) return st;
    if (!t) return NRT_INVALID;
    pthread_mutex_lock(&g_lock);
    bool ok = is_live(t);
    pthread_mutex_unlock(&g_lock);
    if (!ok) return NRT_INVALID_HANDLE;
    if (offset > t->size || size > t->size - offset) return NRT_INVALID;
    return NRT_SUCCESS;
}

NRT_STATUS nrt_init(int framework, const char *fw_version, const char *fal_version) {
    (void)fw_version;
    (void)fal_version;
    if (framework <= 0) return NRT_INVALID;
    if (g_state == STATE_INIT) return NRT_SUCCESS;
    if (g_state == STATE_CLOSED) return NRT_CLOSED;
    g_state = STATE_INIT;
    return NRT_SUCCESS;
}

void nrt_close(void) {
    while (atomic_load(&g_pending) > 0) usleep(100);
    if (g_state == STATE_INIT) g_state = STATE_CLOSED;
}

NRT_STATUS nrt_get_visible_vnc_count(uint32_t *vnc_count) {
    if (!vnc_count) return NRT_INVALID;
    *vnc_count = STANDIN_VNCS;
    return NRT_SUCCESS;
}

NRT_STATUS nrt_tensor_allocate(nrt_tensor_placement_t placement, int vnc, size_t size, const char *name,
                               nrt_tensor_t **tensor) {
    (void)name;
    NRT_STATUS st = state_gate();
    if (st != NRT_SUCCESS) return st;
    if (!tensor || size == 0) return NRT_INVALID;
    if (placement == NRT_TENSOR_PLACEMENT_DEVICE && (vnc < 0 || vnc >= STANDIN_VNCS)) return NRT_INVALID;
    if (placement != NRT_TENSOR_PLACEMENT_DEVICE && placement != NRT_TENSOR_PLACEMENT_HOST) return NRT_INVALID;
    nrt_tensor_t *t = calloc(1, sizeof(*t));
    if (!t) return NRT_RESOURCE;
    size_t rounded = (size + 4095) & ~(size_t)4095;
    if (posix_memalign((void **)&t->mem, 4096, rounded) != 0) {
        free(t);
        return NRT_RESOURCE;
    }
    memset(t->mem, 0, rounded);
    t->magic = STANDIN_MAGIC;
    t->size = size;
    t->vnc = placement == NRT_TENSOR_PLACEMENT_DEVICE ? vnc : -1;
    t->placement = placement;
    pthread_mutex_lock(&g_lock);
    t->next = g_live;
    g_live = t;
    g_live_count++;
    pthread_mutex_unlock(&g_lock);
    *tensor = t;
    return NRT_SUCCESS;
}

void nrt_tensor_free(nrt_tensor_t **tensor) {
    if (!tensor || !*tensor) return;
    nrt_tensor_t *t = *tensor;
    pthread_mutex_lock(&g_lock);
    nrt_tensor_t **pp = &g_live;
    while (*pp && *pp != t) pp = &(*pp)->next;
    bool found = *pp != NULL;
    if (found) {
        *pp = t->next;
        g_live_count--;
    }
    pthread_mutex_unlock(&g_lock);
    if (found) {
        t->magic = 0;
        free(t->mem);
        free(t);
    }
    *tensor = NULL;
}

void *nrt_tensor_get_va(const nrt_tensor_t *tensor) {
    if (check_tensor(tensor, 0, 0) != NRT_SUCCESS) return NULL;
    return tensor->mem;
}

size_t nrt_tensor_get_size(const nrt_tensor_t *tensor) {
    if (check_tensor(tensor, 0, 0) != NRT_SUCCESS) return 0;
    return tensor->size;
}

NRT_STATUS nrt_tensor_read(const nrt_tensor_t *tensor, void *buf, size_t offset, size_t size) {
    NRT_STATUS st = check_tensor(tensor, offset, size);
    if (st != NRT_SUCCESS) return st;
    if (!buf) return NRT_INVALID;
    memcpy(buf, tensor->mem + offset, size);
    return NRT_SUCCESS;
}

NRT_STATUS nrt_tensor_write(nrt_tensor_t *tensor, const void *buf, size_t offset, size_t size) {
    NRT_STATUS st = check_tensor(tensor, offset, size);
    if (st != NRT_SUCCESS) return st;
    if (!buf) return NRT_INVALID;
    memcpy(tensor->mem + offset, buf, size);
    return NRT_SUCCESS;
}

NRT_STATUS nrt_tensor_copy(const nrt_tensor_t *src, size_t src_offset, nrt_tensor_t *dst, size_t dst_offset,
                           size_t size) {
    NRT_STATUS st = check_tensor(src, src_offset, size);
    if (st == NRT_SUCCESS) st = check_tensor(dst, dst_offset, size);
    if (st != NRT_SUCCESS) return st;
    /* The documented restriction: device-to-device copies stay on one Neuron core. */
    if (src->placement == NRT_TENSOR_PLACEMENT_DEVICE && dst->placement == NRT_TENSOR_PLACEMENT_DEVICE &&
        src->vnc != dst->vnc)
        return NRT_INVALID;
    memmove(dst->mem + dst_offset, src->mem + src_offset, size);
    return NRT_SUCCESS;
}

NRT_STATUS nrt_get_attached_efa_bdf(const void *va, char *efa_bdf, size_t *len) {
    if (!va || !efa_bdf || !len) return NRT_INVALID;
    const unsigned char *a = va;
    bool device = false;
    pthread_mutex_lock(&g_lock);
    for (const nrt_tensor_t *p = g_live; p; p = p->next)
        if (p->placement == NRT_TENSOR_PLACEMENT_DEVICE && a >= p->mem && a < p->mem + p->size) {
            device = true;
            break;
        }
    pthread_mutex_unlock(&g_lock);
    if (!device) return NRT_FAILURE;
    size_t need = strlen(STANDIN_BDF);
    if (*len < need + 1) return NRT_RESOURCE;
    memcpy(efa_bdf, STANDIN_BDF, need + 1);
    *len = need;
    return NRT_SUCCESS;
}

NRT_STATUS nrta_is_completed(nrta_seq_t seq, bool *is_completed) {
    uint64_t n = seq & ((1ull << 48) - 1);
    if (!is_completed || (seq >> 48) != NRTA_XU_TENSOR_WRITE || n == 0 || n >= atomic_load(&g_next_seq) ||
        n >= STANDIN_MAX_SEQ)
        return NRT_INVALID;
    *is_completed = atomic_load(&g_done[n]) != 0;
    return NRT_SUCCESS;
}

/* ---- stand-in only ------------------------------------------------------ */

struct delayed {
    nrt_tensor_t *tensor;
    unsigned char *data;
    size_t offset, size;
    unsigned delay_us;
    uint64_t n;
};

static void *delayed_main(void *arg) {
    struct delayed *d = arg;
    usleep(d->delay_us);
    memcpy(d->tensor->mem + d->offset, d->data, d->size);
    atomic_store(&g_done[d->n], 1);
    atomic_fetch_sub(&g_pending, 1);
    free(d->data);
    free(d);
    return NULL;
}

/* Write host bytes into a tensor after delay_us, like device work still in flight; *seq completes then. */
NRT_STATUS kvpush_standin_write_delayed(nrt_tensor_t *tensor, const void *buf, uint64_t offset, uint64_t size,
                                        uint32_t delay_us, nrta_seq_t *seq) {
    NRT_STATUS st = check_tensor(tensor, offset, size);
    if (st != NRT_SUCCESS) return st;
    if (!buf || !seq) return NRT_INVALID;
    uint64_t n = atomic_fetch_add(&g_next_seq, 1);
    if (n >= STANDIN_MAX_SEQ) return NRT_RESOURCE;
    struct delayed *d = calloc(1, sizeof(*d));
    if (!d) return NRT_RESOURCE;
    d->data = malloc(size ? size : 1);
    if (!d->data) {
        free(d);
        return NRT_RESOURCE;
    }
    memcpy(d->data, buf, size);
    d->tensor = tensor;
    d->offset = offset;
    d->size = size;
    d->delay_us = delay_us;
    d->n = n;
    atomic_fetch_add(&g_pending, 1);
    pthread_t th;
    if (pthread_create(&th, NULL, delayed_main, d) != 0) {
        atomic_fetch_sub(&g_pending, 1);
        free(d->data);
        free(d);
        return NRT_RESOURCE;
    }
    pthread_detach(th);
    *seq = (NRTA_XU_TENSOR_WRITE << 48) | n;
    return NRT_SUCCESS;
}

size_t kvpush_standin_live_tensors(void) {
    pthread_mutex_lock(&g_lock);
    size_t n = g_live_count;
    pthread_mutex_unlock(&g_lock);
    return n;
}
