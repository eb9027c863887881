/*
 * cli.h - what the parts of the `kvcache` command-line tool share: exit
 * statuses, strict parsing of option values, usage errors, the commands.
 *
 * The map: one file per part.
 *
 *   main.c   the command line: dispatch to a command, the overall usage
 *   cli.c    strict parsing (whole string, range checked) and usage errors
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

/* The value of option argv[*i] (advancing *i), or NULL after saying it is
 * missing: at the end of the line, or when the next word is an option. */
const char *option_value(const char *cmd, int argc, char **argv, int *i);

/* The commands: argv holds the command's own arguments (after its name).
 * Each returns the exit status. */
int cmd_view(int argc, char **argv);
int cmd_cache(int argc, char **argv);

/* Each command's usage (kvcache CMD --help). */
void usage_view(FILE *f);
void usage_cache(FILE *f);

#endif /* KVCACHE_CLI_H */
