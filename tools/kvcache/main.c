/*
 * main.c - the `kvcache` command line: dispatch to a command, the overall
 * usage.
 *
 *   kvcache view --dtype bf16 --shape 2,3,4 --op "transpose 0 2" --op "slice 1 0 3 2"
 *   kvcache cache --seqs 37,70,37
 *   kvcache version
 *
 * Every option value and op argument is parsed strictly (whole string, range
 * checked) before anything runs; the exit statuses are in cli.h.
 */
#include <stdio.h>
#include <string.h>

#include "cli.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: kvcache view ...   strided views, op by op\n"
               "       kvcache cache ...  a KV cache, its page table and kernel exports\n"
               "       kvcache version\n"
               "       kvcache [view|cache] --help\n\n");
    usage_view(f);
    fprintf(f, "\n");
    usage_cache(f);
    fprintf(f, "\nexit status: 0 success, 1 an operation was refused (the message says why),\n"
               "2 usage error (unknown, missing or repeated option, bad value or op)\n");
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return EXIT_USAGE;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(argv[1], "view"))
        return cmd_view(argc - 1, argv + 1);
    if (!strcmp(argv[1], "cache"))
        return cmd_cache(argc - 1, argv + 1);
    if (!strcmp(argv[1], "version")) {
        if (argc > 2 && (!strcmp(argv[2], "--help") || !strcmp(argv[2], "-h"))) {
            printf("usage: kvcache version   the library version and host memory backend\n");
            return 0;
        }
        if (argc > 2)
            return usage_error("version", "takes no arguments, got '%s'", argv[2]);
        printf("%s\n", kv_build_info());
        return 0;
    }
    fprintf(stderr, "kvcache: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return EXIT_USAGE;
}
