/*
 * cli.c - strict parsing of option values and op arguments (whole string,
 * range checked), and the usage errors every command prints.
 */
#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

int usage_error(const char *cmd, const char *fmt, ...)
{
    va_list ap;

    fprintf(stderr, "kvcache %s: ", cmd);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n(kvcache %s --help lists the options)\n", cmd);
    return EXIT_USAGE;
}

static void range_text(int64_t lo, int64_t hi, char *buf, size_t cap)
{
    if (lo == INT64_MIN && hi == INT64_MAX)
        snprintf(buf, cap, "%" PRId64 "..%" PRId64 " (int64)", lo, hi);
    else if (lo == INT_MIN && hi == INT_MAX)
        snprintf(buf, cap, "%d..%d (int)", INT_MIN, INT_MAX);
    else if (hi == INT64_MAX)
        snprintf(buf, cap, ">= %" PRId64, lo);
    else
        snprintf(buf, cap, "%" PRId64 "..%" PRId64, lo, hi);
}

const char *abbrev(char *buf, const char *s, size_t len)
{
    if (len <= 60)
        snprintf(buf, ABBREV_CAP, "%.*s", (int)len, s);
    else
        snprintf(buf, ABBREV_CAP, "%.40s... (%zu chars)", s, len);
    return buf;
}

int parse_int(const char *s, size_t len, const char *what, int64_t lo, int64_t hi, int64_t *out,
              char *err, size_t cap)
{
    char range[64], q[ABBREV_CAP];
    long long v = 0;
    bool whole = false; /* strtoll consumed exactly s[0..len) */

    range_text(lo, hi, range, sizeof(range));
    errno = 0;
    if (len && !isspace((unsigned char)s[0])) { /* strtoll would skip spaces */
        char *end;
        v = strtoll(s, &end, 10);
        whole = end == s + len;
    }
    if (!whole) {
        snprintf(err, cap, "%s '%s' is not an integer (allowed: %s)", what, abbrev(q, s, len),
                 range);
        return -1;
    }
    if (errno == ERANGE || v < lo || v > hi) {
        snprintf(err, cap, "%s '%s' is not a number in range (allowed: %s)", what,
                 abbrev(q, s, len), range);
        return -1;
    }
    *out = v;
    return 0;
}

int parse_list(const char *s, size_t len, const char *what, bool allow_none, int64_t lo, int64_t hi,
               int64_t *out, int *n, char *err, size_t cap)
{
    const char *p = s, *stop = s + len;
    char q1[ABBREV_CAP], q2[ABBREV_CAP];

    *n = 0;
    if (allow_none && (len == 0 || (len == 6 && !strncmp(s, "scalar", 6))))
        return 0;
    if (len == 0) {
        snprintf(err, cap, "%s is empty (expected 1..%d comma-separated integers)", what,
                 KV_MAX_DIMS);
        return -1;
    }
    for (;;) {
        const char *q = memchr(p, ',', (size_t)(stop - p));
        char entry[256];

        if (!q)
            q = stop;
        if (*n == KV_MAX_DIMS) {
            snprintf(err, cap, "%s '%s' has more than %d entries (entry %d is '%s')", what,
                     abbrev(q1, s, len), KV_MAX_DIMS, *n + 1, abbrev(q2, p, (size_t)(q - p)));
            return -1;
        }
        if (q == p) {
            snprintf(err, cap, "%s '%s': entry %d is empty (expected an integer)", what,
                     abbrev(q1, s, len), *n + 1);
            return -1;
        }
        snprintf(entry, sizeof(entry), "%s '%s': entry %d", what, abbrev(q1, s, len), *n + 1);
        if (parse_int(p, (size_t)(q - p), entry, lo, hi, &out[*n], err, cap))
            return -1;
        (*n)++;
        if (q == stop)
            return 0;
        p = q + 1;
    }
}

/* "unknown option 'WORD'" and the command's usage, on stderr. */
static int cli_unknown(const struct cli_opts *o, const char *word)
{
    fprintf(stderr, "kvcache %s: unknown option '%s'\nusage: ", o->cmd, word);
    o->usage(stderr);
    return CLI_BAD;
}

/* Whether word spells out the option getopt_long took it for: "--NAME" or
 * "--NAME=VALUE" (getopt_long alone also takes a unique prefix, "--sha"),
 * or exactly "-h" (not "-hx", a cluster). */
static bool cli_spelled_out(const char *word, const struct option *lo)
{
    size_t n;

    if (!lo)
        return !strcmp(word, "-h");
    n = strlen(lo->name);
    return !strncmp(word, "--", 2) && !strncmp(word + 2, lo->name, n) &&
           (word[2 + n] == '\0' || word[2 + n] == '=');
}

int cli_next(struct cli_opts *o, int argc, char **argv)
{
    const char *word = optind < argc ? argv[optind] : NULL; /* the word read next */
    const char *shorts = "+:";
    const struct option *lo = NULL;
    bool missing = false;
    int c, idx = -1;

    for (const struct option *k = o->longopts; k->name; k++)
        if (k->val == 'h')
            shorts = "+:h"; /* -h, where the command has --help */
    o->name[0] = '\0';
    o->value = NULL;
    o->joined = false;
    opterr = 0; /* the messages name the word as given, getopt_long's would not */
    /* "+": stop at the first word that is not an option; ":": a missing value returns ':' */
    c = getopt_long(argc, argv, shorts, o->longopts, &idx);
    if (c == -1)
        return word ? cli_unknown(o, word) : CLI_END; /* a word not an option, or "--" */
    if (c == '?') /* unknown, ambiguous, or a value given to an option that takes none */
        return cli_unknown(o, word);
    if (c == ':') { /* the last word, an option without its value: optopt says which */
        missing = true;
        c = optopt;
        for (idx = 0; o->longopts[idx].name && o->longopts[idx].val != c; idx++)
            ;
    }
    if (idx >= 0 && o->longopts[idx].name)
        lo = &o->longopts[idx];
    if (!cli_spelled_out(word, lo))
        return cli_unknown(o, word);
    if (!lo) {
        snprintf(o->name, sizeof(o->name), "-h");
        return c;
    }
    snprintf(o->name, sizeof(o->name), "--%s", lo->name);
    if (lo->has_arg != no_argument && !missing) {
        o->value = optarg;
        o->joined = word[2 + strlen(lo->name)] == '=';
    }
    return c;
}

const char *cli_value(const struct cli_opts *o)
{
    if (!o->value)
        usage_error(o->cmd, "%s needs a value", o->name);
    else if (!o->joined && !strncmp(o->value, "--", 2))
        usage_error(o->cmd, "%s needs a value (got the option '%s')", o->name, o->value);
    else
        return o->value;
    return NULL;
}
