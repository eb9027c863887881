/*
 * kv_xport_rdma_pci_verbs.c - how far a GPU is from each rail's device on
 * the PCIe tree, for the automatic rail of a device-memory region
 * (docs/connector.md, "Where a region lives"; NCCL's PIX / PXB / PHB /
 * SYS ranks, counted as hops). Everything comes from sysfs:
 *
 *   a rail's device   realpath("<root>/class/infiniband/<dev>/device")
 *   the GPU           realpath("<root>/bus/pci/devices/<bus id>"), the bus
 *                     id CUDA names (kv__rd_gpu_busid), normalised
 *
 * both directories of the one device tree:
 *
 *   <root>/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0
 *                  '-- root --' '- root port' '- switch up' '- switch down' '- GPU
 *
 * The distance of two devices is the hops from each up to their deepest
 * common directory, which must lie at or below one root complex
 * ("pciDDDD:BB"): two functions behind one switch port are 4 apart (up
 * to the switch's downstream ports' parent and down again). Under
 * different root complexes (or anything not found) there is no distance:
 * -1, and the NUMA nodes decide. Nothing here is an error: a lookup that
 * fails answers "not known".
 */
#include <ctype.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv_xport_cuda_int.h"
#include "kv_xport_rdma_int.h"

int (*kv__rd_gpu_busid)(const void *ptr, char *busid, size_t cap) = kv__xport_cuda_busid;

/* 1 to max hex digits at *p, their value in *v; the pointer past them, or
 * NULL. */
static const char *hex_field(const char *p, int max, unsigned long *v)
{
    int n = 0;
    *v = 0;
    while (n < max && isxdigit((unsigned char)p[n])) {
        const int c = tolower((unsigned char)p[n]);
        *v = *v * 16 + (unsigned long)(c <= '9' ? c - '0' : c - 'a' + 10);
        n++;
    }
    return n == 0 || isxdigit((unsigned char)p[n]) ? NULL : p + n;
}

bool kv__rd_pci_busid_norm(const char *in, char *out, size_t cap)
{
    static const int digits[4] = {8, 2, 2, 1};
    static const char after[4] = {':', ':', '.', '\0'};
    unsigned long v[4];
    const char *p = in;
    if (cap)
        out[0] = '\0';
    if (!in)
        return false;
    for (int k = 0; k < 4; k++) {
        p = hex_field(p, digits[k], &v[k]);
        if (!p || *p != after[k])
            return false;
        p++;
    }
    if (v[2] > 0x1f || v[3] > 7) /* device 0..31, function 0..7 */
        return false;
    const int n = snprintf(out, cap, "%04lx:%02lx:%02lx.%lx", v[0], v[1], v[2], v[3]);
    if (n < 0 || (size_t)n >= cap) {
        if (cap)
            out[0] = '\0';
        return false;
    }
    return true;
}

bool kv__rd_sysfs_pci(const char *root, const char *rel, char *out, size_t cap)
{
    char path[PATH_MAX], real[PATH_MAX];
    if (cap)
        out[0] = '\0';
    const int n = snprintf(path, sizeof(path), "%s/%s", root, rel);
    if (n < 0 || (size_t)n >= sizeof(path) || !realpath(path, real) || strlen(real) >= cap)
        return false;
    memcpy(out, real, strlen(real) + 1);
    return true;
}

#define PCI_MAX_DEPTH 64

/* The '/'-separated components of p (empty ones skipped) into c[] / len[]:
 * how many, or -1 past PCI_MAX_DEPTH. */
static int components(const char *p, const char **c, size_t *len)
{
    int n = 0;
    while (*p) {
        while (*p == '/')
            p++;
        if (!*p)
            break;
        if (n == PCI_MAX_DEPTH)
            return -1;
        c[n] = p;
        while (*p && *p != '/')
            p++;
        len[n] = (size_t)(p - c[n]);
        n++;
    }
    return n;
}

/* A root complex's directory: "pci", a domain of 4 to 8 hex digits, ':',
 * a bus of 2 ("pci0000:00", "pci10000:3a"). */
static bool is_root(const char *c, size_t len)
{
    if (len < 10 || len > 14 || memcmp(c, "pci", 3) != 0 || c[len - 3] != ':')
        return false;
    for (size_t i = 3; i < len; i++)
        if (i != len - 3 && !isxdigit((unsigned char)c[i]))
            return false;
    return true;
}

int kv__rd_pci_hops(const char *a, const char *b)
{
    const char *ca[PCI_MAX_DEPTH], *cb[PCI_MAX_DEPTH];
    size_t la[PCI_MAX_DEPTH], lb[PCI_MAX_DEPTH];
    if (!a || !b)
        return -1;
    const int na = components(a, ca, la), nb = components(b, cb, lb);
    if (na < 0 || nb < 0)
        return -1;
    int root = -1; /* a's root complex, the first one on its path */
    for (int i = 0; i < na && root < 0; i++)
        if (is_root(ca[i], la[i]))
            root = i;
    if (root < 0 || root + 1 >= na || root + 1 >= nb) /* a device lies below its root */
        return -1;
    int k = 0; /* common leading components */
    while (k < na && k < nb && la[k] == lb[k] && memcmp(ca[k], cb[k], la[k]) == 0)
        k++;
    if (k <= root) /* another root complex (or another tree) */
        return -1;
    return (na - k) + (nb - k);
}
