/*
 * main.c - kvdemo's command line and the parent process (make demo).
 *
 *   kvdemo [--requests N] [--seed S] [--transport tcp|rdma|shm|auto] [--local] [--fault]
 *          [--timeout S]
 *   kvdemo decode --port P [--port-fd FD] [--report-fd FD] [options]
 *   kvdemo prefill --port P [--report-fd FD] [options]
 *
 * With no role, kvdemo starts two processes (fork + exec of itself): a
 * decode process listening on 127.0.0.1 (port 0; it tells the parent its
 * port through a pipe, --port-fd) and a prefill process that connects to it
 * (decode_role.c, prefill_role.c). Each writes its report on a pipe of its
 * own (--report-fd); the parent merges them and prints the final table
 * (report.c). --local runs both sides in this process instead (local.c).
 * The parent kills both after --timeout seconds (a role stopped or hung
 * would otherwise hold it forever); a role whose parent dies is killed by
 * the kernel (PR_SET_PDEATHSIG), not left to run out its own waits.
 * kvdemo.h has the map of the parts.
 *
 * Exit status: 0 when every check passed; 1 when a check failed (the first
 * one is named) or the library refused a call; 2 for a usage error.
 */
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvdemo.h"

/* ---- the command line ------------------------------------------------------------------------ */

enum { DEFAULT_TIMEOUT_S = 600 }; /* --timeout: far past any run's length */

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvdemo [--requests N] [--seed S] [--transport tcp|rdma|shm|auto] [--local]\n"
            "       kvdemo decode --port P [--port-fd FD] [--report-fd FD] [options]\n"
            "       kvdemo prefill --port P [--report-fd FD] [options]\n"
            "\n"
            "A disaggregated prefill -> decode run on loopback: %d-layer model, %d KV heads,\n"
            "head dim %d, bf16; requests of 1..%d tokens, every third sharing a prefix;\n"
            "then the first %d again as an MLA latent cache (K only, D %d, fp8 e4m3).\n"
            "  --requests N     requests in the batch (1..%d; default 24)\n"
            "  --seed S         the batch and the generated K/V (default 1)\n"
            "  --transport K    tcp (default), rdma (needs an RDMA device) or shm (same host:\n"
            "                   shared-memory rings, a Unix socket named for 127.0.0.1:P)\n"
            "                   or auto (TCP addresses; shm when proved same-host, else tcp)\n"
            "  --local          one process: the transfer as kv_plan_copy (no transport)\n"
            "  --fault          flip one bit of one request in decode after its transfer\n"
            "                   (the run must then fail, naming that check)\n"
            "  --timeout S      kill both processes and fail after S seconds (1..86400;\n"
            "                   default %d)\n"
            "  --port P         decode: listen on 127.0.0.1:P (0: any); prefill: connect to it\n"
            "  --help, -h       this text\n"
            "Both roles must get the same --requests and --seed.\n"
            "Exit status: 0 every check passed; 1 a check failed or a call was refused;\n"
            "2 usage error.\n",
            L_LAYERS, H_KV, D_HEAD, MAX_TOKENS, MLA_REQS, MLA_D, MAX_REQUESTS, DEFAULT_TIMEOUT_S);
}

enum {
    OPT_REQUESTS = 256, /* above every short option */
    OPT_SEED,
    OPT_TRANSPORT,
    OPT_LOCAL,
    OPT_FAULT,
    OPT_PORT,
    OPT_PORT_FD,
    OPT_REPORT_FD,
    OPT_TIMEOUT,
};


static const struct option long_opts[] = {
    {"requests", required_argument, NULL, OPT_REQUESTS},
    {"seed", required_argument, NULL, OPT_SEED},
    {"transport", required_argument, NULL, OPT_TRANSPORT},
    {"local", no_argument, NULL, OPT_LOCAL},
    {"fault", no_argument, NULL, OPT_FAULT},
    {"port", required_argument, NULL, OPT_PORT},
    {"port-fd", required_argument, NULL, OPT_PORT_FD},
    {"report-fd", required_argument, NULL, OPT_REPORT_FD},
    {"timeout", required_argument, NULL, OPT_TIMEOUT},
    {"help", no_argument, NULL, 'h'},
    {NULL, 0, NULL, 0},
};

/* A decimal number, or hexadecimal after 0x, in [lo, hi]: digits only
 * (strtoull alone would skip spaces, take a sign and read 010 as octal). */
static bool parse_u64(const char *s, uint64_t lo, uint64_t hi, uint64_t *out)
{
    if (!s)
        return false;
    const bool hex = s[0] == '0' && (s[1] == 'x' || s[1] == 'X');
    const char *digits = hex ? s + 2 : s;
    if (!(hex ? isxdigit((unsigned char)*digits) : isdigit((unsigned char)*digits)))
        return false;
    errno = 0;
    char *end = NULL;
    const unsigned long long v = strtoull(digits, &end, hex ? 16 : 10);
    if (errno || *end || v < lo || v > hi)
        return false;
    *out = v;
    return true;
}

/* Refuse option c's value val (NULL: none given), naming both. */
static int bad_value(int c, const char *val)
{
    const char *name = "?";
    for (const struct option *lo = long_opts; lo->name; lo++)
        if (lo->val == c)
            name = lo->name;
    fprintf(stderr, "kvdemo: --%s needs %s, got '%s' (kvdemo --help)\n", name,
            c == OPT_TRANSPORT  ? "tcp, rdma, shm or auto"
            : c == OPT_REQUESTS ? "1..256"
            : c == OPT_PORT     ? "a port 0..65535"
            : c == OPT_SEED     ? "an unsigned integer (decimal, or hexadecimal after 0x)"
            : c == OPT_TIMEOUT  ? "seconds, 1..86400"
                                : "a file descriptor open for writing, >= 3",
            val ? val : "(nothing)");
    return EXIT_USAGE;
}

/* The options from argv[first] on into *o: 0, or EXIT_USAGE with the
 * offending option named. --help prints the usage and exits 0. */
static int parse_opts(int argc, char **argv, int first, struct opts *o)
{
    opterr = 0; /* the messages below name the option themselves */
    optind = first;
    int c;
    /* "+": stop at the first non-option; ":": a missing value returns ':' */
    while ((c = getopt_long(argc, argv, "+:h", long_opts, NULL)) != -1) {
        uint64_t v = 0;
        switch (c) {
        case 'h':
            usage(stdout);
            exit(0);
        case OPT_LOCAL:
            o->local = true;
            break;
        case OPT_FAULT:
            o->fault = true;
            break;
        case OPT_REQUESTS:
            if (!parse_u64(optarg, 1, MAX_REQUESTS, &v))
                return bad_value(c, optarg);
            o->requests = (uint32_t)v;
            break;
        case OPT_SEED:
            if (!parse_u64(optarg, 0, UINT64_MAX, &v))
                return bad_value(c, optarg);
            o->seed = v;
            break;
        case OPT_TRANSPORT:
            if (!strcmp(optarg, "tcp"))
                o->kind = KV_XPORT_TCP;
            else if (!strcmp(optarg, "rdma"))
                o->kind = KV_XPORT_RDMA;
            else if (!strcmp(optarg, "shm"))
                o->kind = KV_XPORT_SHM;
            else if (!strcmp(optarg, "auto"))
                o->kind = KV_XPORT_AUTO;
            else
                return bad_value(c, optarg);
            break;
        case OPT_TIMEOUT:
            if (!parse_u64(optarg, 1, 86400, &v))
                return bad_value(c, optarg);
            o->timeout_s = (uint32_t)v;
            break;
        case OPT_PORT:
            if (!parse_u64(optarg, 0, 65535, &v))
                return bad_value(c, optarg);
            o->port = (int)v;
            break;
        case OPT_PORT_FD:
        case OPT_REPORT_FD:
            if (!parse_u64(optarg, 3, INT_MAX, &v) || fcntl((int)v, F_GETFD) < 0 ||
                (fcntl((int)v, F_GETFL) & O_ACCMODE) == O_RDONLY)
                return bad_value(c, optarg);
            *(c == OPT_PORT_FD ? &o->port_fd : &o->report_fd) = (int)v;
            break;
        case ':': /* the last option, with its value missing */
            return bad_value(optopt, NULL);
        default:             /* '?': unknown, or a value given to an option that takes none */
            if (optopt == 0) /* a long option: getopt_long has stepped past it */
                fprintf(stderr, "kvdemo: unknown option '%s' (kvdemo --help)\n", argv[optind - 1]);
            else if (optopt == 'h' || optopt >= OPT_REQUESTS)
                fprintf(stderr, "kvdemo: option '%s' takes no value (kvdemo --help)\n",
                        argv[optind - 1]);
            else
                fprintf(stderr, "kvdemo: unknown option '-%c' (kvdemo --help)\n", optopt);
            return EXIT_USAGE;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "kvdemo: unexpected argument '%s' (kvdemo --help)\n", argv[optind]);
        return EXIT_USAGE;
    }
    return 0;
}

/* ---- the two role processes ------------------------------------------------------------------ */

/* Start `kvdemo ROLE --port P ...` with the report on a pipe; *rd its
 * read end. */
static pid_t spawn(const char *self, const char *role, const struct opts *o, int port, int extra_fd,
                   int *rd)
{
    int pr[2];
    if (pipe(pr) != 0)
        return -1;
    fflush(NULL);
    const pid_t parent = getpid();
    const pid_t pid = fork();
    if (pid < 0) {
        close(pr[0]);
        close(pr[1]);
        return -1;
    }
    if (pid == 0) {
        /* killed with the parent (kept across exec); a parent already gone
         * before this line is caught by getppid */
        if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent)
            _exit(127);
        close(pr[0]);
        char req[16], seed[24], portb[8], rfd[12], pfd[12];
        snprintf(req, sizeof(req), "%u", o->requests);
        snprintf(seed, sizeof(seed), "%" PRIu64, o->seed);
        snprintf(portb, sizeof(portb), "%d", port);
        snprintf(rfd, sizeof(rfd), "%d", pr[1]);
        snprintf(pfd, sizeof(pfd), "%d", extra_fd);
        char *args[16];
        int n = 0;
        args[n++] = (char *)self;
        args[n++] = (char *)role;
        args[n++] = "--port";
        args[n++] = portb;
        args[n++] = "--requests";
        args[n++] = req;
        args[n++] = "--seed";
        args[n++] = seed;
        args[n++] = "--transport";
        args[n++] = (char *)kv_xport_kind_name(o->kind);
        args[n++] = "--report-fd";
        args[n++] = rfd;
        if (extra_fd >= 0) {
            args[n++] = "--port-fd";
            args[n++] = pfd;
        }
        if (o->fault)
            args[n++] = "--fault";
        args[n] = NULL;
        execv("/proc/self/exe", args);
        fprintf(stderr, "kvdemo: exec of %s %s failed: %s\n", self, role, strerror(errno));
        _exit(127);
    }
    close(pr[1]);
    *rd = pr[0];
    return pid;
}

/* The parent's watchdog: SIGALRM after --timeout kills the roles still
 * running. A pid leaves g_child (with SIGALRM blocked) before it is
 * reaped, so the handler never kills a pid reused by another process. */
static volatile sig_atomic_t g_child[2];
static volatile sig_atomic_t g_timed_out;

static void on_alarm(int sig)
{
    (void)sig;
    g_timed_out = 1;
    for (int i = 0; i < 2; i++)
        if (g_child[i] > 0)
            kill((pid_t)g_child[i], SIGKILL);
}

/* Record child i (its pid, or -1): killed at once if the deadline has
 * already passed. */
static void watch_child(int i, pid_t pid)
{
    g_child[i] = pid;
    if (g_timed_out && pid > 0)
        kill(pid, SIGKILL);
}

static int wait_child(int i, pid_t pid, const char *role)
{
    siginfo_t si;
    /* wait without reaping (the pid stays this child's), forget it, then
     * reap */
    while (waitid(P_PID, (id_t)pid, &si, WEXITED | WNOWAIT) < 0 && errno == EINTR)
        ;
    sigset_t alrm, old;
    sigemptyset(&alrm);
    sigaddset(&alrm, SIGALRM);
    sigprocmask(SIG_BLOCK, &alrm, &old);
    g_child[i] = -1;
    sigprocmask(SIG_SETMASK, &old, NULL);
    int ws = 0;
    while (waitpid(pid, &ws, 0) < 0 && errno == EINTR)
        ;
    if (WIFEXITED(ws))
        return WEXITSTATUS(ws);
    fprintf(stderr, "kvdemo: the %s process died (signal %d)\n", role,
            WIFSIGNALED(ws) ? WTERMSIG(ws) : 0);
    return EXIT_FAILED;
}

static int run_parent(const char *self, const struct opts *o)
{
    if (!xport_probe(o)) {
        fprintf(stderr,
                "kvdemo: cannot run over %s (see above); `kvdemo --local` runs the same "
                "plans in one process\n",
                kv_xport_kind_name(o->kind));
        return EXIT_FAILED;
    }
    int pp[2];
    if (pipe(pp) != 0) {
        perror("kvdemo: pipe");
        return EXIT_FAILED;
    }
    /* no SA_RESTART: a read or wait in progress returns at the deadline */
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_alarm;
    sigemptyset(&sa.sa_mask);
    g_child[0] = g_child[1] = -1;
    g_timed_out = 0;
    if (sigaction(SIGALRM, &sa, NULL) != 0) {
        perror("kvdemo: sigaction");
        close(pp[0]);
        close(pp[1]);
        return EXIT_FAILED;
    }
    alarm(o->timeout_s);
    int drd = -1, prd = -1;
    const pid_t dpid = spawn(self, "decode", o, 0, pp[1], &drd);
    watch_child(0, dpid);
    close(pp[1]);
    if (dpid < 0) {
        perror("kvdemo: starting decode");
        close(pp[0]);
        return EXIT_FAILED;
    }
    char line[32] = {0};
    ssize_t got = 0, n;
    while (got < (ssize_t)sizeof(line) - 1 &&
           (n = read(pp[0], line + got, sizeof(line) - 1 - (size_t)got)) > 0)
        got += n;
    close(pp[0]);
    uint64_t port = 0;
    line[strcspn(line, "\n")] = 0;
    pid_t ppid = -1;
    if (parse_u64(line, 1, 65535, &port)) {
        printf("kvdemo: decode listens on 127.0.0.1:%" PRIu64 ", starting prefill\n", port);
        ppid = spawn(self, "prefill", o, (int)port, -1, &prd);
        watch_child(1, ppid);
        if (ppid < 0)
            perror("kvdemo: starting prefill");
    } else {
        fprintf(stderr, "kvdemo: decode did not report a port\n");
    }
    const uint64_t t0 = now_ns();
    struct report rep;
    memset(&rep, 0, sizeof(rep));
    const bool dseen = report_read(drd, &rep, true);
    const bool pseen = prd >= 0 && report_read(prd, &rep, false);
    int rc = wait_child(0, dpid, "decode");
    if (ppid >= 0 && wait_child(1, ppid, "prefill") != 0 && rc == 0)
        rc = EXIT_FAILED;
    alarm(0);
    if (g_timed_out) {
        fprintf(stderr,
                "kvdemo: the run did not finish within %" PRIu32
                " s (--timeout): its processes were killed\n",
                o->timeout_s);
        rc = EXIT_FAILED;
    }
    char title[80];
    snprintf(title, sizeof(title), "prefill and decode processes over %s",
             o->kind == KV_XPORT_SHM    ? "shared memory"
             : o->kind == KV_XPORT_RDMA ? "rdma"
             : o->kind == KV_XPORT_AUTO ? "auto (its choice above)"
                                        : "tcp loopback");
    print_table(&rep, title, (double)(now_ns() - t0) / 1e9);
    if (!dseen || !pseen) {
        printf("  FAILED: the %s process ended without its report\n",
               !dseen ? "decode" : "prefill");
        return EXIT_FAILED;
    }
    if (rc == 0 && (rep.passed != rep.checks || rep.requests_ok != rep.requests))
        rc = EXIT_FAILED;
    return rc;
}

/* ---- main ------------------------------------------------------------------------------------ */

int main(int argc, char **argv)
{
    g_tty = isatty(STDOUT_FILENO);
    struct opts o = {24, 1, KV_XPORT_TCP, false, false, -1, -1, -1, 0};
    const char *role = argc > 1 && argv[1][0] != '-' ? argv[1] : NULL;
    if (role && strcmp(role, "decode") && strcmp(role, "prefill")) {
        fprintf(stderr, "kvdemo: unknown role '%s': decode or prefill (kvdemo --help)\n", role);
        return EXIT_USAGE;
    }
    const int prc = parse_opts(argc, argv, role ? 2 : 1, &o);
    if (prc)
        return prc;
    if (role && (o.port < 0 || o.local)) {
        fprintf(stderr, "kvdemo %s: needs --port (and no --local)\n", role);
        return EXIT_USAGE;
    }
    if ((role || o.local) && o.timeout_s) {
        fprintf(stderr, "kvdemo: --timeout is for the two-process run (a role's waits have "
                        "their own deadlines; --local runs no process)\n");
        return EXIT_USAGE;
    }
    if (!o.timeout_s)
        o.timeout_s = DEFAULT_TIMEOUT_S;
    if (!role && (o.port >= 0 || o.port_fd >= 0 || o.report_fd >= 0)) {
        fprintf(stderr, "kvdemo: --port, --port-fd and --report-fd are for the roles\n");
        return EXIT_USAGE;
    }
    if (!strcmp(role ? role : "", "prefill") && o.port == 0) {
        fprintf(stderr, "kvdemo prefill: --port must be decode's port (1..65535)\n");
        return EXIT_USAGE;
    }
    if (o.report_fd >= 0)
        g_tty = false;
    if (o.local && o.kind != KV_XPORT_TCP) {
        fprintf(stderr, "kvdemo: --local uses no transport; drop --transport\n");
        return EXIT_USAGE;
    }
    struct request reqs[MAX_REQUESTS];
    make_requests(o.seed, o.requests, reqs);
    if (!role && !o.local)
        return run_parent(argv[0], &o);
    int rc;
    const uint64_t t0 = now_ns();
    if (o.local) {
        printf("kvdemo: %u requests, seed %" PRIu64 ", one process (kv_plan_copy)\n", o.requests,
               o.seed);
        rc = run_local(o.seed, o.fault, reqs, o.requests);
    } else {
        /* two processes share the machine: each kernel gets half of what
         * the library's default would use (the cores this process may run
         * on, capped by the cgroup CPU quota) */
        const int cores = kv_threads();
        if (!ok_call(kv_set_threads(cores > 1 ? cores / 2 : 1), "kv_set_threads"))
            return EXIT_FAILED;
        rc = !strcmp(role, "decode") ? run_decode(&o, reqs) : run_prefill(&o, reqs);
    }
    if (o.report_fd >= 0) {
        /* the report is this role's verdict: one not written is a failure */
        if (!report_write(o.report_fd, &g_rep)) {
            fprintf(stderr, "kvdemo %s: the report to fd %d was not written: %s\n", role,
                    o.report_fd, strerror(errno));
            if (rc == 0)
                rc = EXIT_FAILED;
        }
    } else {
        print_table(&g_rep, o.local ? "one process, transfers by kv_plan_copy" : role,
                    (double)(now_ns() - t0) / 1e9);
        if (rc == 0 && (g_rep.passed != g_rep.checks || g_rep.requests_ok != g_rep.requests))
            rc = EXIT_FAILED;
    }
    return rc;
}
