/*
 * cli.h - what the parts of the `kvcache` command-line tool share: exit
 * statuses, strict parsing of option values, usage errors, reading a
 * command's options, the commands.
 *
 * The map: one file per part.
 *
 *   main.c   the command line: dispatch to a command, the overall usage
 *   cli.c    strict parsing (whole string, range checked), usage errors, a
 *            command's options read by getopt_long (cli_next, cli_value)
 *   view.c   kvcache view: a view over zeroed storage, then ops one by one
 *   cache.c  kvcache cache: a model's KV cache, a few prompts and a fork
 *            through its page table, the kernel exports
 *
 * Exit status, the same for every command:
 *   0  success
 *   1  the library refused an operation (the message says which and why)
 *   2  usage error: unknown option, missing/repeated option, bad value or op
 */
#ifndef KVCACHE_CLI_H
#define KVCACHE_CLI_H

#include <getopt.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <kvcache/kv.h>

#define EXIT_REFUSED 1
#define EXIT_USAGE 2

#define ERR_CAP 512 /* one error message */

/* Print "kvcache CMD: MESSAGE" and a pointer to the help; returns EXIT_USAGE. */
int usage_error(const char *cmd, const char *fmt, ...) KV_PRINTF(2, 3);

/* s[0..len) for quoting in a message: as is up to 60 characters, else its
 * first 40, "...", and its length, so a long argument never pushes the
 * reason out of a fixed-size message. buf holds ABBREV_CAP bytes. */
#define ABBREV_CAP 80
const char *abbrev(char *buf, const char *s, size_t len);

/* Parse s[0..len) as one whole base-10 integer in lo..hi into *out. s[len]
 * must not be a digit (it is a separator or the end). On failure writes
 * "WHAT 'TEXT' is not an integer|not a number in range (allowed: ...)" to err. */
int parse_int(const char *s, size_t len, const char *what, int64_t lo, int64_t hi, int64_t *out,
              char *err, size_t cap);

/* Parse s[0..len) = "A,B,.." (1..KV_MAX_DIMS integers in lo..hi) into out[],
 * *n. With allow_none, `scalar` or an empty string is the empty list. */
int parse_list(const char *s, size_t len, const char *what, bool allow_none, int64_t lo, int64_t hi,
               int64_t *out, int *n, char *err, size_t cap);

/* A command's options, read with getopt_long as this tool has always read
 * them: each option spelled out in full ("--shape", not a prefix "--sha"),
 * its value the next word or after '=' ("--shape 2,3", "--shape=2,3"), -h
 * the one short option (for --help); the first word that is not an option
 * (or "--") is an unknown option. Messages go to stderr and name the word.
 *
 *     struct cli_opts o = {.cmd = "view", .longopts = view_opts, .usage = usage_view};
 *     optind = 1;  (argv[0] is the command's name)
 *     while ((c = cli_next(&o, argc, argv)) > 0)
 *         ... c is the option's val; cli_value(&o) its value ...
 *     if (c == CLI_BAD)
 *         return EXIT_USAGE;
 */
struct cli_opts {
    const char *cmd;               /* "view": messages start "kvcache view: " */
    const struct option *longopts; /* getopt_long's table: val > 0, {NULL} last */
    void (*usage)(FILE *f);        /* printed after "unknown option" */
    /* The option cli_next returned last: */
    char name[48];     /* as spelled in the usage: "--shape", "-h" */
    const char *value; /* its value; NULL when it takes none or it is missing */
    bool joined;       /* given as --NAME=VALUE */
};

#define CLI_END 0    /* cli_next: no options left */
#define CLI_BAD (-1) /* cli_next: an unknown option, said so with the usage */

/* The val of the next option in argv (from optind on), CLI_END, or CLI_BAD.
 * An option whose value is missing (the last word) is returned too, with
 * value NULL: the command decides what it checks first. */
int cli_next(struct cli_opts *o, int argc, char **argv);

/* The value of the option cli_next returned, or NULL after saying it is
 * missing: at the end of the line, or when the next word is an option
 * ("--shape --op": a value given as --shape=--x is taken as is). */
const char *cli_value(const struct cli_opts *o);

/* The commands: argv[0] is the command's name, then its arguments. Each
 * returns the exit status. */
int cmd_view(int argc, char **argv);
int cmd_cache(int argc, char **argv);

/* Each command's usage (kvcache CMD --help). */
void usage_view(FILE *f);
void usage_cache(FILE *f);

#endif /* KVCACHE_CLI_H */
